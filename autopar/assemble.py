"""Turn a solved problem into a :class:`~autopar.plan.Plan`: placements of every
parameter and activation, one ModulePlan per module for the lowering, the predicted
step time with its breakdown (the solver's own
:class:`~autopar.solvers.cost_terms.StepTerms`), memory by category, throughput and
MFU."""

from __future__ import annotations

from autopar.cost_models.compiled import compile_time_s
from autopar.cost_models.expert_dispatch import expert_group
from autopar.cost_models.strategy_price import StrategyPricer
from autopar.graph import Graph
from autopar.plans import ContextPlan, ExpertPlan, ModulePlan, PipelinePlan, Plan, StagePlan
from autopar.sharding import DATA_AXES, shard_dim
from autopar.solvers.cost_terms import PieceCost
from autopar.solvers.intra_op_ilp import Solution
from autopar.solvers.pipelined_candidate import PipelineOutcome, pipeline_terms
from autopar.solvers.problem import evaluate
from autopar.solvers.problem_build import Built
from autopar.solvers.schedule_sim import stage_ranks
from autopar.solvers.units import recompute_transient
from autopar.strategies.analysis import GraphAnalysis
from autopar.strategies.enumeration import NodeStrategy
from autopar.strategies.rules import loss_reduction
from autopar.strategies.settings import Settings
from autopar.summary_words import term_differences


def chosen_strategies(g: Graph, built: Built, sol: Solution | list[int]) -> dict[str, NodeStrategy]:
    """The strategy of every op/input node (instances share their canonical node's)
    under solution ``sol`` (or its list of strategy indices)."""
    choice = sol if isinstance(sol, list) else sol.choice
    by_canon = {name: built.strategies[k][choice[k]] for k, name in enumerate(built.names)}
    return {n.name: by_canon[g.canonical.get(n.name, n.name)]
            for n in g.nodes if g.canonical.get(n.name, n.name) in by_canon}


def _tp(pl: tuple[str, ...] | list[str], axis: int | None) -> str:
    return "R" if axis is None else pl[axis]


def module_ops(g: Graph) -> dict[str, list]:
    """Module path -> its op nodes (``getitem`` left out), in the order the forward
    first runs the modules."""
    ops_by_module: dict[str, list] = {}
    for n in g.nodes:
        if n.kind == "op":
            ops_by_module.setdefault(n.module_path, []).append(n)
    return {path: [o for o in ops if o.target != "getitem"]
            for path, ops in ops_by_module.items()}


def param_owners(g: Graph) -> dict[str, list[str]]:
    """Module path -> the local names of the parameters it owns (aliases included)."""
    owners: dict[str, list[str]] = {}
    for fqn, info in g.params.items():
        for name in [fqn] + list(info.aliases):
            path, _, local = name.rpartition(".")
            owners.setdefault(path, []).append(local)
    return owners


def module_plans(an: GraphAnalysis, chosen: dict[str, NodeStrategy], axis: int | None,
                 params: dict[str, list[str]], times: dict[str, float]) -> dict[str, ModulePlan]:
    """One ModulePlan per module that owns parameters (its style on the tp axis), in
    the order the forward first runs them (a tied head after the blocks)."""
    ops_by_module = module_ops(an.graph)
    owners = param_owners(an.graph)
    first_run = {path: k for k, path in enumerate(ops_by_module)}
    result: dict[str, ModulePlan] = {}
    for path in sorted(owners, key=lambda p: first_run.get(p, len(first_run))):
        ops = ops_by_module.get(path, [])
        if ops:
            result[path] = module_plan(an, path, ops, owners[path], chosen, axis, params,
                                       sum(times.get(o.name, 0.0) for o in ops))
    return result


def module_plan(an: GraphAnalysis, path: str, ops: list, locals_: list[str],
                chosen: dict[str, NodeStrategy], axis: int | None,
                params: dict[str, list[str]], time_s: float) -> ModulePlan:
    """The ModulePlan of module ``path`` whose op nodes are ``ops`` (in order) and whose
    parameters are ``locals_``, under the strategies ``chosen``."""
    g = an.graph
    first, last = ops[0], ops[-1]
    s_first, s_last = chosen[first.name], chosen[last.name]
    act_pos = next((k for k, i in enumerate(first.inputs) if g.node(i).kind != "param"), 0)
    producer = first.inputs[act_pos] if first.inputs else None
    in_layout = _tp(chosen[producer].out, axis) if producer in chosen else "R"
    desired = _tp(s_first.ins[act_pos], axis) if s_first.ins else "R"
    output = _tp(s_last.out, axis)
    mtype = first.module_type
    pl = {loc: params[f"{path}.{loc}" if path else loc] for loc in locals_
          if (f"{path}.{loc}" if path else loc) in params}
    return ModulePlan(path, mtype, _style(mtype, pl, desired, output), in_layout, desired,
                      output, pl, time_s)


def _style(mtype: str, params: dict[str, list[str]], desired: str, output: str) -> str:
    """Name the tensor-parallel style the placements amount to (a weight split
    piecewise, ``S(d)/k``, is split along dim d all the same)."""
    w = params.get("weight")
    dim = shard_dim(w[-1]) if w else None
    if mtype == "Linear" and dim in (0, 1):
        return "colwise" if dim == 0 else "rowwise"
    if mtype == "Embedding" and dim in (0, 1):
        return "rowwise" if dim == 0 else "colwise"
    if mtype == "Conv1D" and dim in (0, 1):  # Hugging Face's (in, out) weight
        return "rowwise" if dim == 0 else "colwise"
    if desired.startswith("S("):
        return "sequence_parallel"
    return "replicate"


def assemble(an: GraphAnalysis, built: Built, sol: Solution, *, cluster_desc: dict,
             global_batch: int, peak_flops: float) -> Plan:
    """Build the Plan for solution ``sol`` of ``built``."""
    g = an.graph
    st = built.settings
    mesh = st.mesh
    chosen = chosen_strategies(g, built, sol)
    tp_axis = mesh.names.index("tp") if "tp" in mesh.names else None
    experts = expert_plans(an, chosen, mesh, node_legs(an, chosen, st), st.fold_experts)
    params = param_placements(an, chosen, st, experts)
    acts = {name: list(s.out) for name, s in chosen.items()}
    ev = evaluate(built.problem, sol.choice, sol.modes)
    times = {}
    for k, name in enumerate(built.names):
        sc = built.problem.nodes[k].strategies[sol.choice[k]]
        times[name] = sc.total.device_s + sc.total.comm_s
    per_node = {n.name: times.get(g.canonical.get(n.name, n.name), 0.0) for n in g.nodes}
    modules = module_plans(an, chosen, tp_axis, params, per_node)
    memory = memory_breakdown(built, sol)
    memory["total"] = ev.memory_bytes
    model_flops = 3.0 * g.forward_flops * global_batch / g.batch_size
    world = mesh.size
    mfu = model_flops / (ev.step_time_s * world * peak_flops) if ev.step_time_s > 0 else 0.0
    sp = any(m.style == "sequence_parallel" for m in modules.values()
             if m.module_type.lower().endswith("norm"))
    blocks = sorted({lay.path for lay in g.layers}, key=lambda p: [
        int(t) if t.isdigit() else t for t in p.split(".")])
    breakdown = ev.terms.as_dict()
    recompute = recompute_of_blocks(built, sol, blocks)
    return Plan(
        model=g.model_name, graph_hash=g.fingerprint(), cluster=cluster_desc,
        mesh=mesh.as_dict(), global_batch=global_batch, microbatch_size=st.microbatch_size,
        num_microbatches=st.num_microbatches, zero=st.zero, sequence_parallel=sp,
        precision=st.precision, optimizer=st.optimizer, params=params, activations=acts,
        modules=modules, blocks=blocks, step_time_s=ev.step_time_s, breakdown=breakdown,
        memory=memory, throughput=global_batch / ev.step_time_s if ev.step_time_s else 0.0,
        mfu=mfu, solver=dict(sol.stats), notes=[], recompute=recompute, offload=st.offload,
        loss_reduction=loss_reduction(g), experts=experts,
        context=context_plan(an, st, per_node), loss_parallel=splits_classes(an, chosen),
        compile_blocks=st.compiled,
        compile_s=compile_time_s(sum(1 for n in g.nodes if n.kind == "op" and n.layer == 0))
        if st.compiled else 0.0)


def param_placements(an: GraphAnalysis, chosen: dict[str, NodeStrategy], st,
                     experts: dict[str, ExpertPlan]) -> dict[str, list[str]]:
    """Parameter FQN (aliases too) -> its placements per mesh axis under the strategies
    ``chosen`` and settings ``st``: its owner's input placement, split along dim 0 over
    the data axes under ZeRO-3 and over ``ep`` for the experts ``experts`` split (and
    over ``tp`` too where they fold over it)."""
    g, mesh = an.graph, st.mesh
    split = {f"{path}.{local}" for path, ep in experts.items() for local in ep.params}
    routed = {f"{path}.{local}": d for path, ep in experts.items() if ep.kind == "routed"
              for local, d in ep.params.items()}
    folded = {f"{path}.{local}" for path, ep in experts.items() if ep.folded
              for local in ep.params}
    params: dict[str, list[str]] = {}
    owned = {g.node(pnode).target: list(chosen[op].ins[pos])
             for pnode, (op, pos) in an.param_owner.items()}
    unread = {fqn: ["R"] * len(mesh.names) for fqn in g.params if fqn not in owned}
    for fqn, pl in {**owned, **unread}.items():  # unread: a layer whose output goes unused
        if fqn in g.params and g.params[fqn].buffer:
            continue  # buffers are not placed: each rank keeps its own copy
        for a, name in enumerate(mesh.names):
            if (name in DATA_AXES or name == "cp") and st.zero == 3 and mesh.sizes[a] > 1 and \
                    not (name == "ep" and fqn in split):
                pl[a] = "S(0)"
            if (name == "ep" and fqn in routed) or (name == "tp" and fqn in folded):
                pl[a] = f"S({routed[fqn]})"
        params[fqn] = pl
        for alias in g.params[fqn].aliases if fqn in g.params else []:
            params[alias] = list(pl)
    return params


def splits_classes(an: GraphAnalysis, chosen: dict[str, NodeStrategy]) -> bool:
    """Whether a chosen strategy computes a loss on logits split along their classes
    (an op's ``allreduced`` label split over a model-parallel axis)."""
    return any(lab is not None and lab in an.rules[name].allreduced
               for name, s in chosen.items() if name in an.rules for lab in s.labels)


def context_plan(an: GraphAnalysis, st, per_node: dict[str, float]) -> ContextPlan | None:
    """The plan's :class:`ContextPlan` under settings ``st`` (None without a ``cp``
    axis), its attention time from ``per_node`` (seconds per micro-batch by node)."""
    mesh = st.mesh
    if mesh.degree("cp") == 1:
        return None
    seq = an.sequence
    inputs = [seq.inputs.get(name) for name in an.graph.inputs]
    by_node = {name: per_node.get(name, 0.0) * st.num_microbatches for name in seq.attention}
    cx = ContextPlan(st.cp_variant, seq.length, inputs, all(seq.attention.values()),
                     sum(by_node.values()))
    cx._attention_by_node = by_node  # not a field: for add_pipeline's per-rank share
    return cx


def _rank_attention(cx: ContextPlan, po: PipelineOutcome, ranks: list[int], rank: int) -> float:
    """Seconds per step of attention on pipeline rank ``rank``: that of the attention
    calls in its stages' units (``cx.attention_s`` counts every stage's)."""
    by_node = getattr(cx, "_attention_by_node", None)
    if by_node is None:
        return cx.attention_s
    return sum(by_node.get(name, 0.0) for (a, b), r in zip(po.split.bounds, ranks)
               if r == rank for u in po.units[a:b] for name in u.nodes)


def expert_plans(an: GraphAnalysis, chosen: dict[str, NodeStrategy], mesh,
                 legs: dict[str, int] | None = None, fold: bool = False
                 ) -> dict[str, ExpertPlan]:
    """The expert modules whose experts the chosen strategies split over ``ep``; a
    routed one's exchange in two legs with ``legs[path]`` members per node where given
    (:func:`node_legs`), its experts split over ep x tp where they ``fold``."""
    if mesh.degree("ep") == 1:
        return {}
    a = mesh.names.index("ep")
    out = {}
    legs = legs or {}
    for path, em in an.experts.items():
        params = {fqn.rpartition(".")[2]: d for fqn, d in em.params.items()}
        if em.kind == "routed":  # split whenever the mesh has ep
            out[path] = ExpertPlan(path, em.experts, -1, -1, 0, params, kind="routed",
                                   node_ranks=legs.get(path, 1), folded=fold)
            continue
        raw = chosen[em.output].raw_out[a] if em.output in chosen else "R"
        batch = an.batch_dim.get(em.output) or 0
        if em.kind == "gathered":  # split by expert, the output op sums a rank's experts
            if raw == "P":
                gate = max(em.entries.values())
                out[path] = ExpertPlan(path, em.experts, gate, -1, batch, params,
                                       kind="gathered")
            continue
        if not raw.startswith("S(") or shard_dim(raw) != em.out_dim:
            continue
        entry = next(iter(em.entries))
        out[path] = ExpertPlan(path, em.experts, em.entries[entry], em.out_dim, batch, params)
    return out


def node_legs(an: GraphAnalysis, chosen: dict[str, NodeStrategy],
              st: Settings) -> dict[str, int]:
    """Routed module path -> the ``node_ranks`` of the exchange its price chose
    (:meth:`~autopar.cost_models.strategy_price.StrategyPricer.token_exchange`), for
    the modules whose ``ep`` group spans nodes with several members on each (the only
    ones with a choice)."""
    routed = {p: em for p, em in an.experts.items() if em.kind == "routed" and em.output in chosen}
    if not routed or st.mesh.degree("ep") == 1:
        return {}
    ranks, link = expert_group(st.mesh, st.fold_experts, st.gpus_per_node, st.hw)
    if not 1 < link.node_ranks < ranks:
        return {}
    pricer = StrategyPricer(an, st)
    out = {}
    for path, em in routed.items():
        found = pricer.token_exchange(an.graph.node(em.output), chosen[em.output])
        if found is not None and found.node_ranks > 1:
            out[path] = found.node_ranks
    return out


def memory_breakdown(built: Built, sol: Solution) -> dict[str, float]:
    """Bytes per device by category for solution ``sol`` (no pipeline): params, grads,
    optimizer, gathered (parameter copies live in forward and backward, ZeRO-3's
    gathered blocks included), activations (after recomputation) and
    backward_transient (the larger of the logits' gradient at the start of backward and
    the block being recomputed)."""
    memory = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "gathered": 0.0,
              "activations": 0.0}
    for k, node in enumerate(built.problem.nodes):
        s = built.strategies[k][sol.choice[k]]
        for cat, v in s.memory.items():
            memory[cat] = memory.get(cat, 0.0) + node.multiplicity * v
        memory["gathered"] += node.gather_multiplicity * \
            node.strategies[sol.choice[k]].total.gather_bytes
    modes = sol.modes or [0] * len(built.problem.recompute)
    for grp, r in zip(built.problem.recompute, modes):
        for k, v in enumerate(grp.nodes):
            i, m = sol.choice[v], built.problem.nodes[v].multiplicity
            memory["activations"] += grp.activation_scale * m * grp.act_delta[k][i][r]
    memory["backward_transient"] = recompute_transient(built.problem, sol.choice, modes)
    return memory


def recompute_of_blocks(built: Built, sol: Solution, blocks: list[str]) -> dict[str, str]:
    """Block path -> the recomputation mode its layer group got (every block listed)."""
    out = {b: "none" for b in blocks}
    modes = sol.modes or [0] * len(built.problem.recompute)
    for grp, r in zip(built.problem.recompute, modes):
        for path in grp.name.split(","):
            out[path] = grp.modes[r]
    return out


def add_pipeline(plan: Plan, po: PipelineOutcome, *, pp: int, schedule: str,
                 virtual_stages: int, model_flops: float, peak_flops: float) -> None:
    """Turn ``plan`` (made from the stage mesh's intra-op solution) into the pipelined
    plan of ``po``: the ``pp`` mesh axis, the stages, and the pipeline's time and
    memory (those of the busiest / fullest rank)."""
    ranks = stage_ranks(schedule, pp, virtual_stages)
    extra = po.rank_extra_bytes or [po.transient_bytes] * pp
    stages = []
    for k, ((a, b), r) in enumerate(zip(po.split.bounds, ranks)):
        units = [m for u in po.units[a:b] for m in u.modules]
        c = PieceCost.total(po.units[a:b])
        stages.append(StagePlan(k, r, units, c.forward_s, c.backward_s,
                                po.split.estimate.peak_memory_bytes[r] + extra[r],
                                backward_weight_s=c.backward_weight_s,
                                recompute_s=c.recompute_s, comm_s=c.comm_s + c.param_comm_s,
                                static_bytes=c.static_bytes,
                                activation_bytes=c.activation_bytes))
    est = po.split.estimate
    plan.pipeline = PipelinePlan(schedule, virtual_stages, stages, est.bubble_fraction, po.p2p_s)
    plan.mesh = {"pp": pp, **plan.mesh}
    worst = max(range(pp), key=lambda r: est.peak_memory_bytes[r] + extra[r])
    static = sum(u.static_bytes for (a, b), r in zip(po.split.bounds, ranks) if r == worst
                 for u in po.units[a:b])
    plan.memory = {"static": static, "activations": est.peak_memory_bytes[worst] - static,
                   "backward_transient": extra[worst],
                   "total": est.peak_memory_bytes[worst] + extra[worst]}
    plan.breakdown = pipeline_terms(po, pp=pp, schedule=schedule, virtual_stages=virtual_stages,
                                    num_microbatches=plan.num_microbatches).as_dict()
    if plan.context is not None:  # the busiest rank's attention, as the step terms are
        busiest = max(range(pp), key=lambda r: est.busy_s[r])
        plan.context.attention_s = _rank_attention(plan.context, po, ranks, busiest)
    plan.step_time_s = po.step_time_s
    plan.throughput = plan.global_batch / po.step_time_s if po.step_time_s else 0.0
    world = plan.world_size
    plan.mfu = model_flops / (po.step_time_s * world * peak_flops) if po.step_time_s else 0.0


def runner_up(best: Plan, other: Plan) -> dict:
    """``other`` (a plan the search kept besides ``best``) as an entry of
    :attr:`Plan.runners_up`: its configuration, prediction and why it lost."""
    pipe = other.pipeline
    return {"mesh": dict(other.mesh), "microbatch_size": other.microbatch_size,
            "num_microbatches": other.num_microbatches, "zero": other.zero,
            "offload": other.offload, "sequence_parallel": other.sequence_parallel,
            "schedule": pipe.schedule if pipe else None,
            "virtual_stages": pipe.virtual_stages if pipe else 1,
            "recompute": sorted(set(other.recompute.values())) or ["none"],
            "step_time_s": other.step_time_s, "memory_bytes": other.memory_per_device_bytes,
            "mfu": other.mfu, "breakdown": dict(other.breakdown),
            "why": term_differences(best, other, of_loser=True).removeprefix(": "),
            "tp_splits_nothing": other.splits_nothing("tp")}
