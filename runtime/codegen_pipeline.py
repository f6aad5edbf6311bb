"""The pipeline parts of an emitted program (see :mod:`autopar.runtime.codegen`).

For a plan with a pipeline, the program cuts the model into the plan's stages with the
runtime's own cut of its exported program (copied in), gives each stage its own copy
of a parameter several stages use, lays out (tensor parallelism, recomputation,
FSDP2) and materializes only this rank's stages, and runs the plan's ``torch.distributed.pipelining`` schedule, as
:func:`autopar.runtime.lower.lower_pipeline` does in process. This module computes
the values that fill :mod:`autopar.runtime.codegen_pipeline_templates`.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch

from autopar.plans import Plan
from autopar.runtime import codegen_pipeline_templates as PT
from autopar.runtime import codegen_templates as T
from autopar.runtime.codegen_facts import sample_shape
from autopar.runtime.pipeline import (SCHEDULE_CLASSES, SINGLE_STAGE_SCHEDULES,
                                      check_pipeline, split_for_plan, stage_blocks)
from autopar.solvers.schedule_sim import ZERO_BUBBLE

if TYPE_CHECKING:
    from autopar.runtime.codegen_facts import ModelFacts

__all__ = ["PipelineText", "pipeline_text"]


@dataclass(frozen=True)
class PipelineText:
    """The pipeline's share of a program's text.

    Attributes:
        constants: the STAGE_BLOCKS, STAGE_RANKS, PP and TIED constants.
        sections: top-level definitions (helpers, splitter, tied copies, schedule).
        step: the ``train_step`` definition.
        step_args: the arguments ``main`` passes to ``train_step``.
        build: the start of ``main``, up to the optimizer.
    """

    constants: str
    sections: list[str]
    step: str
    step_args: str
    build: str


def _constants(plan: Plan, tied: list[list[tuple[int, str]]]) -> str:
    """STAGE_BLOCKS (a comment per stage with its other units and predicted cost),
    STAGE_RANKS, PP, TIED."""
    assert plan.pipeline is not None
    lines = ["STAGE_BLOCKS = [  # the blocks of each pipeline stage, in pipeline order; the first",
             "    # stage also runs what comes before the blocks, the last what comes after"]
    for st, blocks in zip(plan.pipeline.stages, stage_blocks(plan)):
        lines.append("    [" + ", ".join(f'"{b}"' for b in blocks) + "],")
        note = f"stage {st.index} on pp rank {st.rank}"
        others = [u if u else "root" for u in st.units if u not in blocks]
        if others:
            note += f", with {', '.join(others)}"
        if st.forward_s > 0 or st.backward_s > 0:
            note += f": {(st.forward_s + st.backward_s) * 1e3:.3g} ms fwd+bwd per micro-batch"
        lines[-1] = _with_comment(lines[-1], note)
    lines.append("]")
    ranks = [st.rank for st in plan.pipeline.stages]
    lines.append(f"STAGE_RANKS = {ranks}  # the pp rank of each stage")
    lines.append(f"PP = {plan.degree('pp')}  # pipeline ranks")
    bubble = plan.pipeline.bubble_fraction
    if bubble > 0:
        lines[-1] += f"; ranks predicted idle {bubble:.1%} of a step on average"
    if tied:
        lines.append("TIED = [  # a parameter several stages use: (stage, name) of each copy")
        lines += ["    [" + ", ".join(f'({i}, "{n}")' for i, n in group) + "],"
                  for group in tied]
        lines.append("]")
    return "\n" + "\n".join(lines)


def _with_comment(line: str, comment: str) -> str:
    """``line  # comment``, or the comment on a line of its own above a long line."""
    if len(line) + len(comment) + 4 <= 99:
        return f"{line}  # {comment}"
    return f"    # {comment}\n{line}"


def _schedule(plan: Plan) -> str:
    """``build_schedule`` with the plan's schedule class."""
    assert plan.pipeline is not None
    name = plan.pipeline.schedule
    cls = SCHEDULE_CLASSES[name].__name__
    single = name in SINGLE_STAGE_SCHEDULES
    n, v = len(plan.pipeline.stages), plan.pipeline.virtual_stages
    detail = f"{n} stages, {v} per pp rank"
    loss = "whole_loss" if plan.loss_parallel else "loss_fn"
    text = PT.SCHEDULE.substitute(cls=cls, schedule=name, detail=detail,
                                  plural="" if single else "s",
                                  stage_arg="stages[0]" if single else "stages", loss_fn=loss)
    return PT.WHOLE_LOSS.template + "\n\n\n" + text if plan.loss_parallel else text


def pipeline_text(plan: Plan, facts: ModelFacts, layout: list[str], partial_grads: bool,
                  dp_mean: str) -> PipelineText:
    """The pipeline's text for ``plan`` and the model of ``facts`` (a fresh meta
    instance, which is cut here, as the program will cut it, to check the pipeline
    and find tied parameters): ``layout`` are the calls that lay out one stage
    (``apply_tp(stage, ...)``), ``partial_grads`` whether a step reduces partial
    gradients (tensor parallelism without FSDP), ``dp_mean`` the lines averaging the
    loss over dp. Checks the pipeline against the model (LoweringError)."""
    check_pipeline(facts.model, plan)
    dtype = torch.long if facts.input_is_tokens else torch.float32
    example = torch.zeros((plan.global_batch, *sample_shape(plan, facts)), dtype=dtype,
                          device="meta")
    _, copies = split_for_plan(facts.model, plan, example)
    tied = [list(group.names) for group in copies]
    tp = plan.degree("tp") > 1
    own = tp and plan.pipeline is not None and plan.pipeline.schedule in ZERO_BUBBLE
    split = PT.SPLIT_STAGES.template
    if plan.degree("cp") > 1:  # exported at a cp rank's share of each sequence
        at = split.index("    blocks = [block for stage")
        split = split[:at] + PT.CP_STAGE_SHAPES + split[at:]
    sections = [PT.LOCAL_MODULES.template, split]
    if tied:
        sections.append(PT.TIED.template)
    if own:
        sections.append(PT.OWN_OUTPUTS.template)
        layout = layout + ["stage.register_forward_hook(_own_outputs)"]
    sections += [PT.MATERIALIZE_STAGE.template, _schedule(plan)]
    after = ""
    if partial_grads:
        after += "    for stage in stages.values():\n        reduce_partial_gradients(stage)\n"
    if tied:
        after += "    sync_tied(stages, tied, grads=True)  # copies get the sum of their grads\n"
    tied_arg = "\n" + " " * 15 + "tied: list[dist.ProcessGroup | None]," if tied else ""
    call = PT.STEP_CALL_TP.substitute(T.LOSS_MODES[plan.loss_parallel]) if tp else PT.STEP_CALL
    if plan.degree("cp") > 1:
        call = PT.STEP_CALL_CP.substitute(
            wrap="    with plain_as_replicated():  # tensors a stage makes meet DTensors\n"
            if tp else "", indent="    " if tp else "")
    step = PT.PIPELINE_STEP.substitute(tied_arg=tied_arg, after=after, dp_mean=dp_mean,
                                       step_call=call)
    build = PT.BUILD.substitute(
        untie="    untie_across_stages(graphs)\n" if tied else "",
        layout="".join(f"            {line}\n" for line in layout),
        groups="    tied = tied_process_groups(dist.get_world_size() // PP)\n" if tied else "",
        sync="    sync_tied(stages, tied, grads=False)  # copies start equal\n" if tied else "")
    args = "schedule, stages, " + ("tied, " if tied else "") + \
        "mesh, input_names, inputs, targets,\n" + " " * 26 + "device"
    return PipelineText(constants=_constants(plan, tied), sections=sections, step=step,
                        step_args=args, build=build)
