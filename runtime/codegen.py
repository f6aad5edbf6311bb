"""Emit a plan as a standalone, readable distributed training program.

``emit_program(plan, "path/to/model.py:factory")`` returns the text of a ``torchrun``
script that needs torch alone: it builds the user's model, lays it out exactly as
:func:`autopar.runtime.apply_plan` does (so both train alike) and trains it
(``--steps --lr --optimizer --seed --data --save --load``).

All program text lives in :mod:`autopar.runtime.codegen_templates`; this module only
computes the values that fill it, with a comment per decision giving its predicted
cost; :mod:`autopar.runtime.codegen_pipeline` adds a pipelined plan's stage splitter,
tied copies and schedule. The program's steps in order: docs/runtime.md, section
``autopar.runtime.codegen``.
"""

from __future__ import annotations

import inspect
import json
import keyword
from pathlib import Path
from types import MappingProxyType
from typing import Callable

from torch import nn

from autopar.errors import ConfigError
from autopar.loader import load_callable
from autopar.plans import SELECTIVE_SAVE_OPS, ModulePlan, Plan
from autopar.runtime import codegen_pipeline_templates as PT
from autopar.runtime import codegen_templates as T
from autopar.runtime.codegen_facts import ModelFacts, model_facts, sample_shape
from autopar.runtime.codegen_imports import import_block
from autopar.runtime.codegen_pipeline import pipeline_text
from autopar.units_text import fmt_bytes
from autopar.runtime.lower import check_plan
from autopar.runtime.mesh import (expert_fsdp_axes, expert_legs_shape, expert_mesh_shape,
                                  needs_fsdp)
from autopar.runtime.dtensor_layout import any_index
from autopar.runtime.tensor_parallel import piecewise, tp_layout
from autopar.solvers.schedule_sim import ZERO_BUBBLE
from autopar.sharding import shard_dim, shard_pieces

__all__ = ["ModelFacts", "model_facts", "emit_program"]

_DEFAULT_LR = MappingProxyType({"sgd": 0.1, "adamw": 1e-3})


def _seconds(s: float) -> str:
    if s <= 0:
        return "n/a"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _bytes(b: float) -> str:
    if b <= 0:
        return "n/a"
    return fmt_bytes(b)


def _layout(p: str) -> str:
    if p == "R":
        return "Replicate()"
    if shard_pieces(p) > 1:  # a fused projection split per head
        return f"piecewise_shard({shard_dim(p)}, {shard_pieces(p)})"
    return f"Shard({shard_dim(p)})"


def _attr(path: str, root: str = "model") -> str:
    """``model.a.b`` for a path of identifiers, else ``model.get_submodule(...)``."""
    parts = path.split(".")
    if all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        return ".".join([root, *parts])
    owner, _, last = path.rpartition(".")
    return f'{root}.get_submodule("{owner}").{last}' if last.isidentifier() and owner else \
        f'{root}.get_submodule("{path}")'


def _blocks_expr(model: nn.Module, paths: list[str], pipelined: bool = False) -> str:
    """How the program iterates over ``paths``: a whole ModuleList, or by path; in a
    pipelined program, the ones the stage holds (``local_modules``)."""
    if pipelined:
        return "local_modules(model, " + _paths_tuple(paths) + ")"
    container = paths[0].rpartition(".")[0] if paths else ""
    try:
        owner = model.get_submodule(container) if container else None
    except AttributeError:
        owner = None
    if isinstance(owner, nn.ModuleList) and paths == [f"{container}.{i}"
                                                     for i in range(len(owner))]:
        return _attr(container)
    return "[model.get_submodule(p) for p in (" + ", ".join(f'"{p}"' for p in paths) + ",)]"




def _paths_tuple(paths: list[str]) -> str:
    """A tuple of names (module paths, mesh axes) as program text."""
    return "(" + ", ".join(f'"{p}"' for p in paths) + ("," if len(paths) == 1 else "") + ")"


def _arity(module: nn.Module, path: str) -> int:
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ConfigError(f"module '{path}' takes *args, so the program cannot list its inputs' "
                          "layouts; give it fixed positional inputs")
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               and p.default is p.empty)


def _placement_expr(p: str) -> str:
    """A placement as program text: ``Replicate()``, ``Shard(d)`` or ``Partial()``."""
    return "Partial()" if p == "P" else _layout(p)


def _per_block(table: dict[str, str], names: list[str]) -> dict[str, str]:
    """``table`` with the entries that hold alike for every block written once, under
    the name with ``*`` for the block index (:func:`~autopar.runtime.dtensor_layout.
    any_index`, which the program's ``lookup`` reads back); ``names`` are all the
    names of that kind the model has, in order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(any_index(name), []).append(name)
    out: dict[str, str] = {}
    for key, members in groups.items():
        values = {table.get(n) for n in members}
        if len(members) > 1 and len(values) == 1 and None not in values:
            out[key] = table[members[0]]
        else:
            out.update((n, table[n]) for n in members if n in table)
    return out


def _table(table: dict[str, str], comment: dict[str, str], indent: str,
           value: Callable[[str], str] = _placement_expr) -> str:
    """A dict literal, one ``"key": value,  # comment`` a line: placements
    (``Replicate()``, ...), or the program text ``value`` makes of each entry."""
    if not table:
        return "{}"
    lines = "\n".join(f'{indent}    "{k}": {value(v)},  # {comment[k]}'
                      for k, v in table.items())
    return "{\n" + lines + "\n" + indent + "}"


def _module_comment(mp: ModulePlan, model: nn.Module) -> str:
    """A module's planned style and predicted forward + backward time."""
    kind = type(model.get_submodule(mp.path)).__name__
    style = "" if mp.style == "replicate" else f"{mp.style} "
    return f"{style}{kind}, {_seconds(mp.time_s)}"


def _tp_section(plan: Plan, facts: ModelFacts, pipelined: bool) -> str:
    """``apply_tp``: the tables of :func:`~autopar.runtime.tensor_parallel.tp_layout`,
    written once for all blocks where they agree, applied by the runtime's own
    functions (:mod:`autopar.runtime.dtensor_layout`, copied into the program); in a
    ``pipelined`` program it lays out each stage, the last one's logits alone left
    split under loss parallelism."""
    model = facts.model
    layout = tp_layout(plan, model)
    params = _per_block(layout.params, [n for n, _ in model.named_parameters(
        remove_duplicate=False)])
    paths = [p for p, _ in model.named_modules(remove_duplicate=False)]
    inputs, outputs = _per_block(layout.inputs, paths), _per_block(layout.outputs, paths)
    regions = _per_block(layout.regions, paths)
    linears = _per_block(layout.local_linears, paths)
    generic = {any_index(p): mp for p, mp in reversed(layout.modules.items())}
    mp_of = {**generic, **layout.modules}

    def comment(key: str, module_key: str, prefix: str = "") -> str:
        mp = mp_of.get(module_key)
        return prefix + (_module_comment(mp, model) if mp else "")

    param_notes = {k: comment(k, k.rpartition(".")[0]) for k in params}
    input_notes = {k: comment(k, k, f"from {_placement_expr(mp_of[k].input_layout)}: ")
                   if k in mp_of else "a local-tensor region's input, laid out once"
                   for k in inputs}
    output_notes = {k: comment(k, k) for k in outputs}
    sp = " and sequence" if plan.sequence_parallel else ""
    pieces = ("\n    register_piecewise_sharding()  # fused projections split per head"
              if piecewise(layout) else "")
    gather, last_arg = ")", ""
    if plan.loss_parallel and pipelined:
        gather = ", gather=not last)  # the last stage's logits stay split"
        last_arg = ", last: bool"
    elif plan.loss_parallel:
        gather = ", gather=False)  # the logits stay split by vocabulary for the loss"
    return T.APPLY_TP.substitute(
        sp_text=sp, tp=plan.degree("tp"), piecewise=pieces, gather=gather, last_arg=last_arg,
        params=_table(params, param_notes, " " * 4), inputs=_table(inputs, input_notes, " " * 4),
        outputs=_table(outputs, output_notes, " " * 4),
        regions=_table(regions, {k: "its first input, then local tensors" for k in regions},
                       " " * 4),
        linears=_table(linears, {k: comment(k, k) for k in linears}, " " * 4, json.dumps))


def _ac_section(plan: Plan, facts: ModelFacts, pipelined: bool = False) -> str:
    """``apply_ac``: one loop per recomputation mode, then ``torch.compile`` of the
    blocks where the plan compiles them."""
    by_mode: dict[str, list[str]] = {}
    for block in plan.blocks:
        mode = plan.recompute.get(block, "none")
        if mode != "none":
            by_mode.setdefault(mode, []).append(block)
    lines = []
    if "selective" in by_mode:
        lines.append("    selective = functools.partial(create_selective_checkpoint_contexts, "
                     "selective_policy)")
    for mode, blocks in by_mode.items():
        extra = ", context_fn=selective" if mode == "selective" else ""
        lines.append(f"    for block in {_blocks_expr(facts.model, blocks, pipelined)}:  "
                     f"# {mode}\n"
                     f"        block.forward = functools.partial(\n"
                     f"            checkpoint, block.forward, use_reentrant=False{extra})")
    if plan.compile_blocks and plan.blocks:  # after recomputation, before FSDP2
        lines.append(f"    if torch.cuda.is_available():  # compiled as planned (on a CPU: "
                     f"eager)\n"
                     f"        for block in {_blocks_expr(facts.model, plan.blocks, pipelined)}:\n"
                     f"            block.compile()")
    mem = plan.memory
    cost = (f"predicted per device: activations {_bytes(mem.get('activations', 0.0))},\n"
            f"    recomputation buffers {_bytes(mem.get('recompute', 0.0))}")
    return T.APPLY_AC.substitute(ac_cost=cost, body="\n".join(lines))


def _zero_doc(plan: Plan) -> tuple[str, str]:
    """A title and a sentence for the plan's data parallelism."""
    dp, z = plan.data_parallel, plan.zero
    if dp == 1:
        return (f"{plan.precision} mixed precision",
                "FSDP2 on a dp mesh of size 1 shards nothing and only casts\n   ")
    if z == 0:
        return (f"Data parallelism over dp={dp}", "FSDP2 in hybrid mode on (dp, dp_shard=1) "
                "keeps full replicas\n    and all-reduces gradients")
    if z == 3:
        return (f"ZeRO-3 over dp={dp}", "Fully sharded: a block gathers its parameters for "
                "forward and\n    again for backward")
    return (f"ZeRO-{z} over dp={dp}", "Sharded at rest; parameters stay gathered from "
            "forward to backward\n   ")


def _fsdp_section(plan: Plan, facts: ModelFacts, pipelined: bool = False) -> str:
    """``apply_fsdp`` with the plan's ZeRO stage, precision and offload (on one stage
    when ``pipelined``; the zero-bubble schedules keep ZeRO-3 blocks gathered from
    forward to backward, as the runtime does)."""
    policies, kwargs = "", ""
    if plan.precision != "fp32":
        dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[plan.precision]
        policies += (f"    mp_policy = MixedPrecisionPolicy(param_dtype={dtype}, "
                     "reduce_dtype=torch.float32)\n")
        kwargs += ", mp_policy=mp_policy"
    if plan.offload:
        policies += '    offload_policy = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda")\n'
        kwargs += ", offload_policy=offload_policy"
    reshard = plan.zero == 3 and not (pipelined and plan.pipeline is not None and
                                      plan.pipeline.schedule in ZERO_BUBBLE)
    loop = T.FSDP_BLOCKS.substitute(blocks=_blocks_expr(facts.model, plan.blocks, pipelined),
                                    reshard=reshard, kwargs=kwargs) if plan.blocks else ""
    experts = T.FSDP_EXPERTS.substitute(paths=_paths_tuple(sorted(plan.experts)),
                                        reshard=reshard, kwargs=kwargs) if plan.experts else ""
    mem = plan.memory
    parts = [(k, mem.get(k, 0.0)) for k in ("params", "grads", "optimizer")]
    if not any(v > 0 for _, v in parts):  # a pipelined plan's memory has them as one
        parts = [("parameters, gradients and optimizer state", mem.get("static", 0.0))]
    cost = ", ".join(f"{k} {_bytes(v)}" for k, v in parts if v > 0)
    cost = f" (predicted per device: {cost})" if cost else ""
    title, doc = _zero_doc(plan)
    return T.APPLY_FSDP.substitute(
        zero_title=title, zero_doc=doc, fsdp_cost=cost, policies=policies, block_loop=loop,
        kwargs=kwargs, expert_loop=experts,
        expert_arg=", expert_mesh: DeviceMesh" if plan.experts else "",
        units="expert module and block" if plan.experts else "block")


def _ep_sections(plan: Plan) -> list[str]:
    """``build_expert_mesh`` and ``apply_ep`` of a plan with expert parallelism."""
    names, shape = expert_mesh_shape(plan)
    table = "{\n" + "".join(
        f'        "{path}": ({xp.batch_dim}, {xp.input_dim}, {xp.output_dim}, '
        f'{dict(xp.params)}, {xp.node_ranks}, {xp.folded}),\n'
        for path, xp in sorted(plan.experts.items())) + "    }"
    a2a = _seconds(plan.breakdown.get("all_to_all_s", 0.0))
    sections = [T.EXPERT_MESH.substitute(shape=shape, **_mesh_words(names, shape))]
    legs = expert_legs_shape(plan)
    if legs is not None:
        sections.append(T.EXPERT_LEGS.substitute(per_node=plan.ep_node_ranks, shape=legs[1],
                                                 **_mesh_words(*legs)))
    return sections + [T.EXPERT_PARALLEL.substitute(ep=plan.degree("ep"), table=table, a2a=a2a)]


def _mesh_words(names: tuple[str, ...], shape: tuple[int, ...]) -> dict[str, str]:
    """A mesh's axis names as a program tuple (``names``) and its ``comment``, "dp=2 x
    ep=4 x tp=1"."""
    return {"names": _paths_tuple(list(names)),
            "comment": " x ".join(f"{a}={n}" for a, n in zip(names, shape))}


def _comm_text(b: dict[str, float]) -> str:
    """'predicted communication per step: collectives 3 ms, parameters 2 ms; 1 ms
    exposed' from a plan's breakdown (activation collectives and resharding, ZeRO
    parameter traffic), with the parts it has ('' with none)."""
    parts = [(name, b.get(key) or 0.0) for name, key in (
        ("collectives", "comm_s"), ("parameters", "param_comm_s"))]
    parts = [(name, s) for name, s in parts if s > 0]
    exposed = b.get("exposed_comm_s", 0.0)
    if not parts:
        return f"predicted exposed communication {_seconds(exposed)} per step" \
            if exposed > 0 else ""
    return ("predicted communication per step: "
            + ", ".join(f"{name} {_seconds(s)}" for name, s in parts)
            + (f"; {_seconds(exposed)} exposed" if exposed > 0 else "; all hidden"))


def _mesh_section(plan: Plan) -> tuple[str, str]:
    """``build_mesh`` and the expression of the mesh FSDP runs on ('' without FSDP):
    ``data_mesh(mesh)`` with context parallelism (dp and cp flattened)."""
    pp, dp, tp, cp = plan.degree("pp"), plan.data_parallel, plan.degree("tp"), plan.degree("cp")
    outer: tuple[int, ...] = (pp,) if pp > 1 else ()
    mid: tuple[int, ...] = (cp,) if cp > 1 else ()
    mid_names: tuple[str, ...] = ("cp",) if cp > 1 else ()
    b = plan.breakdown
    comment = (f"{f'pp={pp} x ' if pp > 1 else ''}dp={dp} x {f'cp={cp} x ' if cp > 1 else ''}"
               f"tp={tp}" + (f"\n    # {_comm_text(b)}" if _comm_text(b) else ""))
    if dp * cp > 1 and plan.zero == 0:
        shape, names = (dp, *mid, 1, tp), ("dp", *mid_names, "dp_shard", "tp")
        fsdp = 'mesh["dp", "dp_shard"]'
        comment += (f"\n    # dp_shard=1: FSDP2 replicates over dp{' x cp' if cp > 1 else ''} "
                    f"(plain data parallelism)")
    else:
        shape, names = (dp, *mid, tp), ("dp", *mid_names, "tp")
        fsdp = 'mesh["dp"]' if needs_fsdp(plan) else ""
    if cp > 1 and fsdp:
        fsdp = "data_mesh(mesh)"
    shape, names = outer + shape, ("pp",) * len(outer) + names
    quoted = _paths_tuple(list(names))
    one_line = len(f"    return init_device_mesh(device_type, {shape}, mesh_dim_names={quoted})")
    sep = " " if one_line <= 99 else "\n" + " " * 28
    return T.BUILD_MESH.substitute(comment=comment, shape=shape, names=quoted, sep=sep), fsdp


def _cp_section(plan: Plan) -> tuple[str, str]:
    """The context-parallel section of the program and its constants."""
    cx, cp = plan.context, plan.degree("cp")
    assert cx is not None
    if plan.zero == 0:
        doc = ", each a full replica (dp_shard=1)"
        body = ("    mesh[\"dp\", \"cp\"]._flatten(\"dp_cp\")\n"
                "    with warnings.catch_warnings():  # slicing a flattened dim: deprecated, "
                "works to 2.13\n"
                "        warnings.simplefilter(\"ignore\", UserWarning)\n"
                "        return mesh[\"dp_cp\", \"dp_shard\"]")
    else:
        doc, body = "", "    return mesh[\"dp\", \"cp\"]._flatten(\"dp_cp\")"
    text = T.CONTEXT_PARALLEL.substitute(doc=doc, body=body)
    constants = (f"\nCP = {cp}  # each sequence split over cp ranks, head-tail chunks"
                 f"\nCP_VARIANT = \"{cx.variant}\"  # how attention reaches the other "
                 f"ranks' keys\nSEQ_LEN = {cx.seq_len}  # tokens per sequence"
                 f"\nSEQUENCE_DIMS = {list(cx.inputs)}  # the sequence dim of each input, "
                 f"then of the targets")
    return text, constants


def _save_ops() -> str:
    lines, cur = ["SAVE_OPS = {  # outputs selective recomputation keeps (aten op names)"], "   "
    for name in sorted(SELECTIVE_SAVE_OPS):
        item = f' "{name}",'
        if len(cur) + len(item) > 99:
            lines.append(cur)
            cur = "   "
        cur += item
    return "\n".join(lines + [cur, "}"])


def _cluster_text(plan: Plan) -> str:
    c = plan.cluster
    if not c.get("gpu"):
        return "no cluster recorded"
    return f"{c['gpu']}, {c.get('nodes', 1)} node(s) x {c.get('gpus_per_node', 1)}"


def _pipeline_title(plan: Plan) -> str:
    """", <schedule> pipeline of <n> stages" for a pipelined plan, else ''."""
    pipe = plan.pipeline
    if pipe is None or len(pipe.stages) < 2:
        return ""
    return f",\n{pipe.schedule} pipeline of {len(pipe.stages)} stages"


def _loss_section(plan: Plan, loss_spec: str | None,
                  loss_file: str | None) -> tuple[str, str]:
    """The program's ``loss_fn`` and the constants it reads: the user's function of
    ``loss_spec``, checked to exist now (scaled as the runtime scales a loss that sums
    over the batch: :func:`~autopar.runtime.parallel_model.loss_scale`), or the
    default cross-entropy."""
    if loss_spec is None:
        return T.LOSS.template, ""
    from autopar.runtime.parallel_model import loss_scale

    load_callable(loss_spec)
    path, _, name = loss_spec.rpartition(":")
    where = loss_file if loss_file is not None else path
    scale = loss_scale(plan)
    template = T.USER_SUM_LOSS if scale != 1.0 else T.USER_LOSS
    text = template.substitute(loss_name=name, loss_file=Path(path).name)
    constants = (f'\nLOSS_FILE = "{where}"  # a relative path is read from this program\'s '
                 f'folder\nLOSS_FUNCTION = "{name}"')
    if scale != 1.0:
        constants += (f"\nLOSS_SCALE = {scale:g}  # the loss sums over the batch: "
                      "micro-batches x dp")
    return text, constants


BUILDS = ("auto", "cpu", "meta")
"""Where an emitted program may build the model (its ``--build``; see
:func:`autopar.runtime.materialize.choose_build`)."""


def emit_program(plan: Plan, model_spec: str, *, model_file: str | None = None,
                 program_name: str = "train.py", loss_spec: str | None = None,
                 loss_file: str | None = None, build: str = "auto",
                 facts: ModelFacts | None = None) -> str:
    """The text of a standalone ``torchrun`` training program for ``plan`` and the model
    of ``model_spec`` (``path/to/file.py:factory``, built here on the meta device to
    check the plan and read what the program needs).

    ``model_file`` is the path written into the program (default: the spec's path; a
    relative one is read from the program's folder); ``program_name`` appears in the
    usage line. ``loss_spec`` (``path/to/file.py:function``, written into the program as
    ``loss_file``, default its path) is the loss ``function(output, targets)`` the
    program trains with; default: cross-entropy over the output's last dim, as
    :meth:`~autopar.runtime.ParallelModel.step` computes it without a ``loss_fn``.
    ``build`` is the default of the program's ``--build`` (one of :data:`BUILDS`);
    ``facts``, the model's :func:`model_facts` when the caller already read them.
    A pipelined plan's program cuts the model into its stages (see
    :mod:`autopar.runtime.codegen_pipeline`). Raises LoweringError when the plan does
    not fit the model.
    """
    if build not in BUILDS:
        raise ConfigError(f"build={build!r}: expected one of {', '.join(BUILDS)}")
    path, _, factory = model_spec.rpartition(":")
    facts = facts if facts is not None else model_facts(model_spec)
    check_plan(facts.model, plan)
    pipelined = plan.degree("pp") > 1 or (plan.pipeline is not None and
                                          len(plan.pipeline.stages) > 1)
    mesh_text, fsdp_mesh = _mesh_section(plan)
    sections = [T.BUILD_MODEL.substitute(model_file=Path(path).name, factory=factory), mesh_text]
    layout: list[str] = []
    extra = ""
    target = "stage" if pipelined else "model"
    if plan.experts:
        sections += _ep_sections(plan)
        legs = ", build_ep_legs(device_type)" if plan.ep_node_ranks > 1 else ""
        if plan.fold_experts:  # each tp rank's own tokens; weights laid out before tp
            legs = (legs or ", None") + ', mesh["tp"]'
        layout.append(f'apply_ep({target}, build_expert_mesh(device_type)["ep"]{legs})')
        if plan.fold_experts:
            layout.append(f'shard_experts({target}, build_expert_mesh(device_type), None)')
    if plan.degree("tp") > 1:
        sections += [T.DTENSOR_LAYOUT.template, _tp_section(plan, facts, pipelined)]
        if plan.loss_parallel:
            sections.insert(-1, T.LOSS_PARALLEL.template)
        if piecewise(tp_layout(plan, facts.model)):
            sections.insert(-1, T.PIECEWISE.template)
        last = ", index == len(graphs) - 1" if pipelined and plan.loss_parallel else ""
        layout.append(f'apply_tp({target}, mesh["tp"]{last})')
    if plan.experts and not plan.fold_experts:
        layout.append(f'shard_experts({target}, build_expert_mesh(device_type), mesh["tp"])')
    if any(m != "none" for m in plan.recompute.values()):
        if "selective" in plan.recompute.values():
            sections.append(T.SELECTIVE_POLICY.template)
            extra = "\n" + _save_ops()
        sections.append(_ac_section(plan, facts, pipelined))
        layout.append(f"apply_ac({target})")
    if fsdp_mesh:
        sections.append(_fsdp_section(plan, facts, pipelined))
        axes = ", ".join(f'"{a}"' for a in expert_fsdp_axes(plan))
        experts = f', build_expert_mesh(device_type)[{axes}]' if plan.experts else ""
        layout.append(f"apply_fsdp({target}, {fsdp_mesh}{experts})")
    sections.append(T.MATERIALIZE.template)
    partial = not fsdp_mesh and plan.degree("tp") > 1
    if partial:
        sections.append(T.PARTIAL_GRADS.template)
    dp_mean = ""
    if plan.data_parallel > 1:
        dp_mean = (f'    dist.all_reduce(total, group=mesh.get_group("dp"))\n'
                   f"    total /= {plan.data_parallel}  # the mean over dp\n")
    cp = plan.degree("cp")
    if cp > 1:
        cp_text, cp_constants = _cp_section(plan)
        sections.insert(2, cp_text)
        extra = cp_constants + extra
        dp_mean += (f'    dist.all_reduce(total, group=mesh.get_group("cp"))\n'
                    f"    total /= {cp}  # the mean over the shares of each sequence\n")
    what = "token ids" if facts.input_is_tokens else "features"
    optimizer = "sgd" if plan.optimizer == "sgd" else "adamw"
    loss_text, loss_constants = _loss_section(plan, loss_spec, loss_file)
    extra = loss_constants + extra
    sections += [T.DATA.substitute(synthetic_what=what), loss_text]
    if pipelined:
        pipe = pipeline_text(plan, facts, layout, partial, dp_mean)
        extra = pipe.constants + extra
        *split, materialize_stage, schedule = pipe.sections
        sections[2:2] = split  # the splitter first, as main runs it first
        at = sections.index(T.MATERIALIZE.template) + 1
        sections[at:at] = [materialize_stage]
        sections += [schedule, pipe.step]
        start, step_args = pipe.build, pipe.step_args
    else:
        after = ("    reduce_partial_gradients(model)\n" if partial else "") + dp_mean
        sync = ""
        if fsdp_mesh and plan.zero < 3 and plan.num_microbatches > 1:
            sync = ("        model.set_requires_gradient_sync(i == NUM_MICROBATCHES - 1)  "
                    "# reduce once\n"
                    "        model.set_reshard_after_backward(i == NUM_MICROBATCHES - 1)  "
                    "# gather once\n")
        tp = plan.degree("tp") > 1
        fb = (T.FORWARD_BACKWARD_CP_TP if tp else T.FORWARD_BACKWARD_CP) if cp > 1 else \
            T.FORWARD_BACKWARD_TP if tp else T.FORWARD_BACKWARD
        if tp:
            fb = fb.substitute(T.LOSS_MODES[plan.loss_parallel])
        before = ("    inputs, targets = split_sequences(inputs, targets, mesh)  "
                  "# this rank's tokens\n") if cp > 1 else ""
        sections.append(T.TRAIN_STEP.substitute(sync=sync, after=after, forward_backward=fb,
                                                before=before))
        start = T.BUILD.substitute(layout="".join(f"    {line}\n" for line in layout))
        step_args = "model, mesh, inputs, targets, device"
    state_modules = PT.STATE_MODULES.substitute(
        tied="TIED" if "\nTIED = [" in extra else "()") if pipelined else \
        T.STATE_MODULES.template
    mesh_literal = "{" + ", ".join(f'"{k}": {v}' for k, v in plan.mesh.items()) + "}"
    sections += [T.CHECKPOINT.substitute(state_modules=state_modules, mesh=mesh_literal,
                                         model=plan.model),
                 T.MAIN.substitute(lr=_DEFAULT_LR[optimizer], optimizer=optimizer, build=start,
                                   build_default=build,
                                   step_args=step_args, synthetic_what=what)]
    body = "\n\n\n".join(sections)
    constants = T.CONSTANTS.substitute(
        model_file=model_file if model_file is not None else path, factory=factory,
        global_batch=plan.global_batch, microbatch_size=plan.microbatch_size,
        num_microbatches=plan.num_microbatches, input_shape=sample_shape(plan, facts),
        input_is_tokens=facts.input_is_tokens, num_classes=facts.num_classes,
        step_s=repr(float(plan.step_time_s)), extra=extra)
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh.items())
    header = T.HEADER.substitute(
        model=plan.model, mesh_text=f"mesh {mesh}" + _pipeline_title(plan), zero_text=f"ZeRO-{plan.zero}",
        precision=plan.precision, cluster=_cluster_text(plan),
        step_time=_seconds(plan.step_time_s), memory=_bytes(plan.memory_per_device_bytes),
        throughput=f"{plan.throughput:.1f}", mfu=f"{plan.mfu:.1%}", world=plan.world_size,
        program=program_name, cuda_note="NCCL on GPUs, gloo on CPUs")
    return T.PROGRAM.substitute(header=header, imports=import_block(constants + "\n" + body),
                                constants=constants, sections=body)
