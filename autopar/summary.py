"""A readable description of a Plan: the layout, the prediction and how it was found."""

from __future__ import annotations

from pathlib import PurePath
from types import MappingProxyType
from typing import TYPE_CHECKING

from autopar.cost_models.hardware import CPU_PROFILE_NOTE, accuracy_text
from autopar.explain_words import explanation_lines
from autopar.summary_words import (STEP_TERMS, fmt_rate, fmt_time, module_pattern, table,
                                   term_differences, term_label)
from autopar.units_text import count_text, fmt_bytes

if TYPE_CHECKING:  # the type alone: Plan.summary() imports this module
    from autopar.plans import Plan


ZERO_TEXT = {0: "replicated parameters, gradients all-reduced",
             1: "optimizer state sharded, gradients all-reduced",
             2: "optimizer state and gradients sharded",
             3: "parameters, gradients and optimizer state sharded"}


def _pipeline_lines(plan: Plan) -> list[str]:
    """The pipeline section: schedule, bubble and one row per stage."""
    pipe = plan.pipeline
    if pipe is None:
        return []
    v = f", {pipe.virtual_stages} virtual stages per rank" if pipe.virtual_stages > 1 else ""
    lines = [f"pipeline  pp={plan.degree('pp')}, schedule {pipe.schedule}{v}, "
             f"{plan.num_microbatches} micro-batches, p2p {fmt_time(pipe.p2p_s)} per transfer",
             f"          ranks idle {pipe.bubble_fraction * 100:.1f}% of the step on average "
             f"(fill, drain and transfers; the bubble term above is the busiest rank's "
             f"idle time)"]
    rows = [[str(st.index), str(st.rank), _units_text(st.units, plan.blocks),
             fmt_time(st.forward_s), fmt_time(st.backward_s), fmt_bytes(st.memory_bytes)]
            for st in pipe.stages]
    lines += table(rows, ["stage", "rank", "units", "forward", "backward", "rank memory"])
    return lines + [""]


def _units_text(units: list[str], blocks: list[str]) -> str:
    """Units with runs of consecutive blocks folded: ``tok_emb, blocks.0-11``."""
    out: list[str] = []
    run: list[str] = []
    for u in units + [""]:
        if u in blocks and (not run or blocks.index(u) == blocks.index(run[-1]) + 1):
            run.append(u)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else
                       f"{run[0]}-{run[-1].rsplit('.', 1)[-1]}")
        run = [u] if u in blocks else []
        if u and u not in blocks:
            out.append(u)
    return ", ".join(out)


def recompute_text(plan: Plan) -> str:
    """Blocks grouped by recomputation mode: ``selective blocks.0-11; none blocks.12-23``."""
    if not plan.blocks:
        return "none (no repeated blocks)"
    by_mode: dict[str, list[str]] = {}
    for b in plan.blocks:
        by_mode.setdefault(plan.recompute.get(b, "none"), []).append(b)
    return "; ".join(f"{mode} {_units_text(blocks, plan.blocks)}"
                     for mode, blocks in by_mode.items())


EXPOSED_COMM_PARTS = ("comm_s", "exposed_param_comm_s", "exposed_p2p_s")
"""The breakdown keys that add up to ``exposed_comm_s``
(:class:`~autopar.solvers.cost_terms.StepTerms`)."""

DETAIL_NOTES = MappingProxyType({
    "reshard_s": "resharding {}, part of the collectives",
    "all_to_all_s": "expert token exchange {}, part of the collectives",
    "param_comm_s": "parameter traffic {} in all, the rest hidden behind compute",
    "host_s": "host time {}, beside the device's (only the wait for it counts)",
    "p2p_s": "{} per stage-to-stage transfer",
})
"""How the summary reads the detail keys that are not added to the step again."""


def _breakdown_lines(b: dict[str, float]) -> list[str]:
    """The step time as the sum of its terms; exposed communication as the sum of its
    parts (where they add up); then the other keys, labelled as not added again."""
    terms = [k for k in STEP_TERMS if k in b and (b[k] or k in ("compute_s", "exposed_comm_s"))]
    lines = []
    if terms:
        lines.append("  = " + " + ".join(f"{term_label(k)} {fmt_time(b[k])}" for k in terms))
    parts = [k for k in EXPOSED_COMM_PARTS if b.get(k)]
    total = b.get("exposed_comm_s", 0.0)
    if parts and total and abs(sum(b[k] for k in parts) - total) <= 1e-6 * total:
        if len(parts) > 1:
            lines.append("    exposed communication = " + " + ".join(
                f"{term_label(k)} {fmt_time(b[k])}" for k in parts))
    else:
        parts = []
    rest = [k for k in b if k not in STEP_TERMS and k not in parts and b[k]]
    if rest:
        lines.append("    not added again: " + "; ".join(
            DETAIL_NOTES[k].format(fmt_time(b[k])) if k in DETAIL_NOTES
            else f"{term_label(k)} {fmt_time(b[k])}" for k in rest))
    return lines


LEGEND = ("layouts   R replicated, S(d) split along dim d (S(d)/k: k pieces, each split), "
          "P partial sums;\n"
          "          input a->b: received -> computed on; output: handed on; params: one "
          "placement per mesh axis")
"""The key to the placement notation of the module table."""


def _solver_line(s: dict) -> str:
    """The solver record in words, a line each: 'ilp-cbc solved the chosen layout to
    optimality, 2,223 variables and 669 constraints in 61.2 ms', 'the search scored 20
    configurations in 1.050 s', the memory budget (keys it does not know after)."""
    known = ("solver", "status", "variables", "constraints", "build_s", "time_s",
             "candidates", "search_s", "memory_budget_bytes", "lower_bound_s")
    words = []
    if "solver" in s or "status" in s:
        status = str(s.get("status", "?"))
        how = "to optimality" if status.lower() == "optimal" else \
            "without proving it best (stopped)" if status == "Stopped" else \
            f"with status {status}"
        if "lower_bound_s" in s:
            how += f", no layout of it faster than {fmt_time(float(s['lower_bound_s']))}"
        size = ""
        if "variables" in s and "constraints" in s:
            size = f", {s['variables']:,} variables and {s['constraints']:,} constraints"
        took = f" in {fmt_time(float(s.get('build_s', 0.0)) + float(s['time_s']))}" \
            if "time_s" in s else ""
        words.append(f"{s.get('solver', 'the solver')} solved the chosen layout {how}"
                     f"{size}{took}")
    if "candidates" in s:
        took = f" in {fmt_time(float(s['search_s']))}" if "search_s" in s else ""
        words.append(f"the search scored {s['candidates']:,} configurations{took}")
    if "memory_budget_bytes" in s:
        words.append(f"memory budget {fmt_bytes(float(s['memory_budget_bytes']))} per device")
    other = [f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
             for k, v in s.items() if k not in known]
    return "solver    " + ";\n          ".join(words + other)


def _device_text(c: dict) -> str:
    """The device of a cluster description: the profile's name (``h100-sxm``), or for
    a profile file the device it measured and the file (``AMD EPYC (CPU, profile
    my-cpu.json)``)."""
    gpu, path = str(c.get("gpu")), c.get("profile")
    if not path and (gpu.endswith(".json") or "/" in gpu):
        path = gpu
    if not path:
        return gpu
    kind = "CPU, " if c.get("device_type") == "cpu" else ""
    name = c.get("device_name") or "device"
    return f"{name} ({kind}profile {PurePath(str(path)).name})"


def idle_tp_text(plan: Plan) -> str:
    """For a plan whose tp splits nothing, what that means: ' splits nothing: every
    module replicated, so the 4 ranks of each tp group repeat one rank's work on the
    same samples, as 1 rank would' (else '')."""
    if not plan.splits_nothing("tp"):
        return ""
    t, fewer = plan.degree("tp"), count_text(plan.world_size // plan.degree("tp"), "rank")
    return (f" splits nothing: every module replicated, so the {t} ranks of each tp group "
            f"repeat one rank's work on the same samples, as {fewer} would")


def set_aside_note(plan: Plan, aside: Plan) -> str:
    """Why ``plan`` was chosen over the faster ``aside``, whose tp splits nothing
    (:mod:`autopar.solvers.idle_axis`), and what to do about it."""
    t, world = aside.degree("tp"), aside.world_size
    mesh = " x ".join(f"{k}={v}" for k, v in aside.mesh.items())
    return (f"{mesh} was predicted {fmt_time(aside.step_time_s)}, faster than this plan's "
            f"{fmt_time(plan.step_time_s)}, but its tp splits nothing: every module "
            f"replicated, the {t} ranks of each tp group repeating one rank's work on the "
            f"same samples. The planner prefers a layout that uses every rank; this one is "
            f"slower{term_differences(aside, plan, of_loser=True)}. The model runs at least "
            f"as fast on {count_text(world // t, 'device')} as on these {world}: plan and "
            f"train on fewer, or pass --tp {t} (tp={t}) for the replicated layout")



def batch_text(plan: Plan) -> str:
    """What the global batch holds and where it came from: '64 sequences x 8,192
    tokens = 524,288 tokens per step (as asked, --global-batch)' (samples,
    for a model that reads no token ids)."""
    seq = sequence_length(plan)
    size = (f"{plan.global_batch:,} sequences x {seq:,} tokens = "
            f"{plan.global_batch * seq:,} tokens per step" if seq else
            f"{plan.global_batch:,} samples per step")
    return size + (f" ({plan.batch_source})" if plan.batch_source else "")


def sequence_length(plan: Plan) -> int | None:
    """Tokens per sequence of the plan's inputs: the second dim of its first input
    when that is 2-D int64 token ids (None otherwise, or for a plan without inputs)."""
    first = plan.inputs[0] if plan.inputs else {}
    shape = first.get("shape", [])
    return int(shape[1]) if len(shape) == 2 and first.get("dtype") == "int64" else None


def plan_summary(plan: Plan) -> str:
    """The multi-line summary printed by ``autopar plan`` and ``Plan.summary()``."""
    c = plan.cluster
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh.items())
    if plan.degree("ep") > 1:
        legs = plan.ep_node_ranks
        over = (f"ep x tp = {plan.expert_ranks} ranks, whole experts on each (folded)"
                if plan.fold_experts else "ep")
        mesh += (f"  (data parallel over dp x ep = {plan.data_parallel}; "
                 f"experts split over {over} in {len(plan.experts)} module(s)"
                 + (f"; each token sent once per node of its experts, then inside it to "
                    f"their ranks ({legs} a node)" if legs > 1 else "") + ")")
    lines = [
        f"autopar plan for {plan.model}  (graph {plan.graph_hash})",
        f"cluster   {c.get('nodes')} node(s) x {c.get('gpus_per_node')} {_device_text(c)}"
        f"  = {plan.world_size} devices",
        f"mesh      {mesh}",
        f"batch     global {plan.global_batch} = dp {plan.data_parallel} x micro-batch "
        f"{plan.microbatch_size} x {plan.num_microbatches} "
        f"{'pipeline micro-batches' if plan.pipeline else 'accumulation step(s)'}",
        f"          {batch_text(plan)}",
        f"data par. ZeRO-{plan.zero} ({ZERO_TEXT.get(plan.zero, '')})"
        + (", CPU offload of parameters, gradients and optimizer state" if plan.offload
           else ""),
        f"recompute {recompute_text(plan)}"
        + (f", blocks compiled (torch.compile, ~{plan.compile_s:.0f} s once)"
           if plan.compile_blocks else ""),
        f"tensor p. {'tp=' + str(plan.degree('tp')) if plan.degree('tp') > 1 else 'none'}"
        f"{', sequence parallel' if plan.sequence_parallel else ''}"
        f"{', loss on vocabulary-split logits' if plan.loss_parallel else ''}"
        f"{idle_tp_text(plan)}",
        *_context_lines(plan),
        f"precision {plan.precision}, optimizer {plan.optimizer}",
        "",
        f"predicted step time  {fmt_time(plan.step_time_s)}   throughput "
        f"{fmt_rate(plan.throughput)} samples/s   MFU {plan.mfu * 100:.1f}%",
    ]
    lines += _breakdown_lines(plan.breakdown)
    if c.get("device_type") == "cpu":
        lines.append(f"  ({CPU_PROFILE_NOTE})")
    elif "accuracy" in c:  # plans made before the record existed have none
        lines.append(f"  ({accuracy_text(str(c.get('profile') or c.get('gpu')), c['accuracy'])})")
    m = plan.memory
    lines.append(f"memory per device    {fmt_bytes(m.get('total', 0.0))}   ("
                 + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in m.items() if k != "total" and v)
                 + ")")
    lines.append("")
    lines += _pipeline_lines(plan)
    groups: dict[tuple, list[str]] = {}
    for path, mp in plan.modules.items():
        key = (module_pattern(path, plan.blocks), mp.module_type, mp.style, mp.input_layout,
               mp.desired_input_layout, mp.output_layout,
               ", ".join(f"{k}={'/'.join(v)}" for k, v in mp.params.items()))
        groups.setdefault(key, []).append(path)
    rows = [[k[0], k[1], k[2], f"{k[3]}->{k[4]}", k[5], k[6], str(len(v))]
            for k, v in groups.items()]
    if rows:
        lines += table(rows, ["module", "type", "tp style", "input", "output",
                               "params (" + "/".join(plan.stage_mesh) + ")", "count"])
        lines += [LEGEND, ""]
    lines += explanation_lines(plan)
    lines += _runners_up_lines(plan)
    if plan.solver:
        lines.append(_solver_line({k: v for k, v in plan.solver.items()
                              if k != "lower_bound_s" or plan.degree("pp") == 1}))
    for note in plan.notes:
        lines.append(f"note      {note}")
    return "\n".join(lines)


CP_VARIANT_TEXT = {
    "allgather": "keys and values all-gathered before attention, their gradients "
                 "reduce-scattered",
    "ring": "key/value blocks passed around the ring, each behind the attention of the last",
    "ulysses": "all-to-all from sequence to head shards and back (Ulysses)",
}
"""How each context-parallel variant reaches the other ranks' keys, for the summary."""


def _context_lines(plan: Plan) -> list[str]:
    """The context-parallelism line: the degree, the variant, the tokens per rank."""
    cx, cp = plan.context, plan.degree("cp")
    if cx is None:
        return []
    return [f"context p. cp={cp}, {cx.variant}: {CP_VARIANT_TEXT.get(cx.variant, '')}",
            f"          each sequence of {cx.seq_len:,} tokens in {2 * cp} head-tail chunks, "
            f"{cx.seq_len // cp:,} per rank; attention {fmt_time(cx.attention_s)} of the step"]


def _runners_up_lines(plan: Plan) -> list[str]:
    """The runners-up table (``plan(..., top_k=N)``): configuration, step time against
    the plan's, memory, and the terms each loses on."""
    if not plan.runners_up:
        return []
    rows = []
    for k, r in enumerate(plan.runners_up, 2):
        mesh = " x ".join(f"{a}={v}" for a, v in r["mesh"].items())
        sched = f", {r['schedule']}" + (f" v={r['virtual_stages']}"
                                         if r["virtual_stages"] > 1 else "") \
            if r["schedule"] else ""
        config = (f"{mesh}, mb {r['microbatch_size']}x{r['num_microbatches']}, "
                  f"ZeRO-{r['zero']}{' offload' if r['offload'] else ''}"
                  f"{', sp' if r['sequence_parallel'] else ''}"
                  f"{', tp splits nothing' if r.get('tp_splits_nothing') else ''}{sched}, "
                  f"recompute {'/'.join(r['recompute'])}")
        slower = r["step_time_s"] / plan.step_time_s - 1 if plan.step_time_s else 0.0
        rows.append([str(k), config, f"{fmt_time(r['step_time_s'])} (+{slower * 100:.1f}%)",
                     fmt_bytes(r["memory_bytes"]), r["why"] or "the same predicted time (the plan was found first)"])
    return ["runners-up (why each is slower than the plan)"] + table(
        rows, ["#", "configuration", "step time", "memory", "slower on"]) + [""]
