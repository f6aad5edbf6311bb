"""The pipeline parts of an emitted program (see :mod:`autopar.runtime.codegen`).

For a plan with a pipeline, the program cuts the model into the plan's stages with a
small fx splitter, gives each stage its own copy of a parameter several stages use,
lays out (tensor parallelism, recomputation, FSDP2) and materializes only this rank's
stages, and runs the plan's ``torch.distributed.pipelining`` schedule, as
:func:`autopar.runtime.lower.lower_pipeline` does in process. This module computes
the values that fill :mod:`autopar.runtime.codegen_pipeline_templates`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autopar.plans import Plan
from autopar.runtime import codegen_pipeline_templates as PT
from autopar.runtime.pipeline import (SCHEDULE_CLASSES, SINGLE_STAGE_SCHEDULES, check_pipeline,
                                      split_for_plan)

__all__ = ["PipelineText", "pipeline_text"]


@dataclass(frozen=True)
class PipelineText:
    """The pipeline's share of a program's text.

    Attributes:
        constants: the STAGE_UNITS, STAGE_RANKS, PP and TIED constants.
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
    """STAGE_UNITS (a comment per stage with its predicted cost), STAGE_RANKS, PP, TIED."""
    assert plan.pipeline is not None
    lines = ["STAGE_UNITS = [  # the model's units each pipeline stage runs, in pipeline order"]
    for st in plan.pipeline.stages:
        units = "[" + ", ".join(f'"{u}"' for u in st.units) + "],"
        cost = f"  # stage {st.index} on pp rank {st.rank}"
        if st.forward_s > 0 or st.backward_s > 0:
            cost += (f": {(st.forward_s + st.backward_s) * 1e3:.3g} ms fwd+bwd per "
                     "micro-batch")
        lines.append(f"    {units}{cost}")
    lines.append("]")
    ranks = [st.rank for st in plan.pipeline.stages]
    lines.append(f"STAGE_RANKS = {ranks}  # the pp rank of each stage")
    lines.append(f"PP = {plan.degree('pp')}  # pipeline ranks")
    bubble = plan.pipeline.bubble_fraction
    if bubble > 0:
        lines[-1] += f"; predicted bubble {bubble:.1%} of a step"
    if tied:
        lines.append("TIED = [  # a parameter several stages use: (stage, name) of each copy")
        lines += ["    [" + ", ".join(f'({i}, "{n}")' for i, n in group) + "],"
                  for group in tied]
        lines.append("]")
    return "\n" + "\n".join(lines)


def _schedule(plan: Plan) -> str:
    """``build_schedule`` with the plan's schedule class."""
    assert plan.pipeline is not None
    name = plan.pipeline.schedule
    cls = SCHEDULE_CLASSES[name].__name__
    single = name in SINGLE_STAGE_SCHEDULES
    n, v = len(plan.pipeline.stages), plan.pipeline.virtual_stages
    detail = f"{n} stages, {v} per pp rank"
    return PT.SCHEDULE.substitute(cls=cls, schedule=name, detail=detail,
                                  plural="" if single else "s",
                                  stage_arg="stages[0]" if single else "stages")


def pipeline_text(plan: Plan, model: nn.Module, layout: list[str], partial_grads: bool,
                  dp_mean: str) -> PipelineText:
    """The pipeline's text for ``plan`` and ``model`` (a fresh meta instance, which is
    cut here to check the pipeline and find tied parameters): ``layout`` are the calls that lay out one stage
    (``apply_tp(stage, ...)``), ``partial_grads`` whether a step reduces partial
    gradients (tensor parallelism without FSDP), ``dp_mean`` the lines averaging the
    loss over dp. Checks the pipeline against the model (LoweringError)."""
    check_pipeline(model, plan)
    _, copies = split_for_plan(model, plan)
    tied = [list(group.names) for group in copies]
    sections = [PT.LOCAL_MODULES.template]
    if plan.degree("tp") > 1:
        sections.append(PT.LOCAL_PLAN.template)
    sections.append(PT.SPLIT_STAGES.template)
    if tied:
        sections.append(PT.TIED.template)
    sections += [PT.MATERIALIZE_STAGE.template, _schedule(plan)]
    after = ""
    if partial_grads:
        after += "    for stage in stages.values():\n        reduce_partial_gradients(stage)\n"
    if tied:
        after += "    sync_tied(stages, tied, grads=True)  # copies get the sum of their grads\n"
    tied_arg = "\n" + " " * 15 + "tied: list[dist.ProcessGroup | None]," if tied else ""
    step = PT.PIPELINE_STEP.substitute(tied_arg=tied_arg, after=after, dp_mean=dp_mean)
    build = PT.BUILD.substitute(
        untie="    untie_across_stages(graphs)\n" if tied else "",
        layout="".join(f"            {line}\n" for line in layout),
        groups="    tied = tied_process_groups(dist.get_world_size() // PP)\n" if tied else "",
        sync="    sync_tied(stages, tied, grads=False)  # copies start equal\n" if tied else "")
    args = "schedule, stages, " + ("tied, " if tied else "") + \
        "mesh, input_names, inputs, targets,\n" + " " * 26 + "device"
    return PipelineText(constants=_constants(plan, tied), sections=sections, step=step,
                        step_args=args, build=build)
