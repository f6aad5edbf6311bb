"""The emitted program trains the weights the user's factory makes: built on the CPU
under the program's seed whenever whole copies fit in memory, so that it equals one
process from the first loss whichever way the model initializes itself (in
``__init__``, in ``_init_weights``, in ``reset_parameters()``), pipelined or not; on
meta only where asked or where the copies do not fit, saying which initialization
runs (:func:`autopar.runtime.materialize.choose_build`). Also ``autopar codegen``
with a factory that cannot run on meta, with a zoo name, and with ``--build``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.cli import main as cli_main
from autopar.demo import sgd_losses
from autopar.runtime.materialize import choose_build, meta_start_note, tensor_bytes
from tests import foreign_models
from tests.dist_utils import RankPool
from tests.test_codegen import printed_losses, pyflakes, torchrun_outputs

MODELS = Path(foreign_models.__file__)
STEPS, LR, SEED, TOL = 3, 0.1, 5, 1e-6
CASES = [  # (factory, search space): the init in __init__, _init_weights, reset_parameters
    ("init_in_init", {"dp": 2, "tp": 2, "zero": 3}),
    ("seeded_nano", {"pp": 2, "dp": 2}),
    ("example_gpt", {"dp": 2, "tp": 2, "sequence_parallel": True}),
]
META_NOTE = ("the model starts on meta: each rank initializes its own shards with each "
             "module's reset_parameters(), not with the weights the model's code makes")


def one_process(factory: str) -> list[float]:
    """The factory's model built under the seed and trained alone (SGD, cross-entropy)."""
    torch.manual_seed(SEED)
    model, (x,), y = getattr(foreign_models, factory)()

    def step() -> torch.Tensor:
        loss = foreign_models.lm_loss(model(x), y)
        loss.backward()
        return loss.detach()

    return sgd_losses(model.parameters(), step, STEPS, LR)


def make_plan(factory: str, space: dict):
    """The planner's plan for 4 CPU processes within ``space``."""
    import autopar

    model, (x,), y = getattr(foreign_models, factory)()
    return autopar.plan(model, (x,), cluster=autopar.Cluster(gpu="cpu", gpus_per_node=4),
                        example_targets=y, precision="fp32", **space)


def on_meta(text: str) -> list[float]:
    """apply_plan on the example GPT started on meta under the seed, as a program
    started on meta trains it."""
    from autopar.plans import Plan
    from autopar.runtime import apply_plan

    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = foreign_models.example_gpt()[0]
    x, y = foreign_models.example_batch()
    pm = apply_plan(model, Plan.from_json(text))
    return sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)


def emit(tmp: Path, name: str, factory: str, plan) -> Path:
    """Write ``plan``'s program for ``factory`` with ``autopar codegen``."""
    plan_file = tmp / f"{name}.json"
    plan_file.write_text(plan.to_json())
    program = tmp / f"{name}.py"
    assert cli_main(["codegen", str(plan_file), "--model", f"{MODELS}:{factory}",
                     "-o", str(program)]) == 0
    return program


def train_args(data: Path, *extra: str) -> list[str]:
    """The command line that trains a program as :func:`one_process` trains the model."""
    return ["--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR), "--seed", str(SEED),
            "--data", str(data), *extra]


@pytest.mark.multirank
def test_default_program_equals_one_process(rank_pool: RankPool, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    """Each initialization, under dp2 x tp2 ZeRO-3, pp2 x dp2 and dp2 x tp2 with SP, from
    the first loss; and a program whose copies do not fit (--host-memory) starts on
    meta, says so, and trains as the runtime does on meta. (The four programs run on 4
    processes under one torchrun job, each in processes of its own.)"""
    x, y = foreign_models.example_batch()
    data = tmp_path / "batch.pt"
    torch.save({"inputs": x, "targets": y}, data)
    plans = {factory: make_plan(factory, space) for factory, space in CASES}
    capsys.readouterr()
    runs = []
    for factory, space in CASES:
        program = emit(tmp_path, factory, factory, plans[factory])
        note = capsys.readouterr().err
        assert ("read the model from a CPU build instead" in note) == \
            (factory == "init_in_init"), note
        runs.append((program, train_args(data)))
    runs.append((tmp_path / "example_gpt.py", train_args(data, "--host-memory", "1e-6")))
    *outs, out = torchrun_outputs(runs, tmp_path / "runs")
    for (factory, _), got in zip(CASES, outs):
        assert META_NOTE not in got
        assert printed_losses(got) == pytest.approx(one_process(factory), abs=TOL), factory
    gpt = plans["example_gpt"]
    want = rank_pool.run(4, on_meta, gpt.to_json())[0]
    size = tensor_bytes(foreign_models.example_gpt()[0]) / 1e9
    assert (f"{META_NOTE}, since 4 whole copies of {size:.3g} GB need more than the host's "
            "1e-06 GB (--build cpu builds it anyway)") in out
    assert printed_losses(out) == pytest.approx(want, abs=TOL)
    assert printed_losses(out)[0] != pytest.approx(one_process("example_gpt")[0], abs=1e-3)


def test_choose_build() -> None:
    """Where the program builds the model, and what it says, for each --build."""
    with torch.device("meta"):
        gpt = foreign_models.example_gpt()[0]
        nano = foreign_models.seeded_nano()[0]
    size = tensor_bytes(gpt)
    assert size == sum(p.numel() * 4 for p in gpt.parameters()) + \
        sum(b.numel() * b.element_size() for b in gpt.buffers())
    assert choose_build("cpu", None, "", 8, 0, 0) == (False, "")
    assert choose_build("auto", gpt, "", 4, 4 * size, None) == (False, "")
    assert choose_build("auto", gpt, "", 4, 4 * size, size - 1)[0] is True
    assert choose_build("auto", None, "NotImplementedError: no data", 4, 0, None) == (
        False, "the factory cannot run on the meta device (NotImplementedError: no data): "
               "building the model on the CPU")
    assert choose_build("meta", gpt, "", 4, 10**12, None) == (True, META_NOTE)
    assert choose_build("meta", nano, "", 4, 10**12, None) == (
        True, META_NOTE + " (module 'the root module' (SeededNanoGPT) defines "
                          "_init_weights(), which does not run)")
    with pytest.raises(ValueError, match=r"^--build meta: the factory cannot run on the meta "
                                         r"device \(E: x\); use --build cpu$"):
        choose_build("meta", None, "E: x", 4, 0, None)

    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(1000))

    with torch.device("meta"):
        bare = Bare()
    with pytest.raises(ValueError, match=r"^the model cannot be built whole \(2 whole copies "
                                         r"of 4e-06 GB need more than the host's 1e-09 GB\) "
                                         r"and module 'the root module' \(Bare\) has no "
                                         r"reset_parameters\(\) to start on meta"):
        choose_build("auto", bare, "", 2, 1, None)
    assert meta_start_note(gpt) == META_NOTE


def test_apply_plan_says_which_initialization_runs_on_meta() -> None:
    """apply_plan's materialization of a meta model warns with the same note."""
    from autopar.runtime.materialize import check_materializable

    with torch.device("meta"):
        nano = foreign_models.seeded_nano()[0]
    with pytest.warns(UserWarning) as seen:
        check_materializable(nano)
    assert str(seen[0].message) == (
        META_NOTE + " (module 'the root module' (SeededNanoGPT) defines _init_weights(), "
        "which does not run); build the model on the CPU before apply_plan to train those "
        "weights")


def test_codegen_takes_zoo_names_and_build(tmp_path: Path) -> None:
    """`autopar codegen --model tiny-gpt` writes the zoo model beside the program, which
    then needs torch alone; --build sets the program's default."""
    plan_file = tmp_path / "plan.json"
    assert cli_main(["plan", "tiny-gpt", "--gpu", "cpu", "--gpus-per-node", "2",
                     "--global-batch", "4", "--json", str(plan_file)]) == 0
    out = tmp_path / "prog" / "train.py"
    out.parent.mkdir()
    assert cli_main(["codegen", str(plan_file), "--model", "tiny-gpt", "-o", str(out),
                     "--build", "meta"]) == 0
    model_file = out.parent / "train_model.py"
    assert pyflakes(model_file) == "" and pyflakes(out) == ""
    assert not re.search(r"^\s*(import|from) autopar", model_file.read_text(), re.M)
    assert 'MODEL_FILE = "train_model.py"' in out.read_text()
    assert 'choices=["auto", "meta", "cpu"], default="meta"' in out.read_text()
    from autopar.examples import zoo
    from autopar.loader import load_callable

    built, (x,) = load_callable(f"{model_file}:build")()
    zoo_model, (zx,) = zoo.get("tiny-gpt", device="cpu")
    assert [(n, p.shape) for n, p in built.named_parameters()] == \
        [(n, p.shape) for n, p in zoo_model.named_parameters()]
    assert x.shape[1:] == zx.shape[1:] and x.dtype == zx.dtype
