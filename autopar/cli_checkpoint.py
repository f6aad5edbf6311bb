"""``autopar checkpoint``: convert a checkpoint folder to one ``torch.save`` file of
the plain model's state dict, and back (:mod:`autopar.runtime.checkpoint`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from autopar.errors import CheckpointError

__all__ = ["add_checkpoint_parser", "cmd_checkpoint"]


def add_checkpoint_parser(sub: argparse._SubParsersAction) -> None:
    """The ``checkpoint convert SRC DST`` subcommand."""
    p = sub.add_parser("checkpoint", help="convert checkpoints to and from a plain state dict")
    verbs = p.add_subparsers(dest="verb", required=True)
    c = verbs.add_parser(
        "convert", help="a checkpoint folder -> one torch.save file (or back)",
        description="Convert a checkpoint folder (autopar.save, Checkpointer, or an emitted "
                    "program's --save) to one torch.save file of full tensors that the plain "
                    "model's load_state_dict takes; or, given such a file, write a checkpoint "
                    "folder that autopar.load reads under any plan (step 0, no optimizer "
                    "state).")
    c.add_argument("src", help="a checkpoint folder, or a .pt file of a state dict")
    c.add_argument("dst", help="the file (from a folder) or folder (from a file) to write")
    c.add_argument("--model", default="", help="the model's name to record (file -> folder)")


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """``autopar checkpoint convert``: the direction follows what SRC is."""
    from autopar.runtime.checkpoint import from_torch_file, to_torch_file

    src, dst = Path(args.src), Path(args.dst)
    if not src.exists():
        raise CheckpointError(f"{src} does not exist; give a checkpoint folder or a .pt file")
    if dst.exists() and dst.is_dir() != (not src.is_dir()):
        kind = "folder" if dst.is_dir() else "file"
        raise CheckpointError(f"{dst} exists and is a {kind}; converting {src} writes a "
                              f"{'file' if src.is_dir() else 'folder'}: choose another name")
    if src.is_dir():
        names = to_torch_file(src, dst)
        print(f"wrote {dst}: {len(names)} tensors (torch.load it, then "
              "model.load_state_dict)")
    else:
        names = from_torch_file(src, dst, model=args.model)
        print(f"wrote {dst}: {len(names)} tensors (autopar.load it under any plan)")
    return 0
