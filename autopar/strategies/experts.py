"""Find the experts of a mixture-of-experts layer in a captured graph: the modules whose
parameters stack one weight per expert and whose every op runs per expert.

An *expert label* is a dim label an op shares between a parameter, an activation it
reads and its output without contracting it — the ``e`` of ``einsum("becd,edf->becf",
x, w)`` or of ``bmm`` over stacked weights — and that is not the batch label. A
module is an *expert module* (:class:`ExpertModule`) when every op in it carries one
such label from its inputs to its output, so that splitting it over the ``ep`` mesh
axis runs each expert on the ranks holding it: the tokens come in by an all-to-all at
the module's entry ops and go back by one after its output op
(:mod:`autopar.strategies.enumeration`, :mod:`autopar.strategies.edges`). A
*gathered* one runs every expert on every token, a gate combining them at its output
op: the ep group's tokens are all-gathered in, the output reduce-scattered
(docs/strategies.md, section ``autopar.strategies.experts``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from autopar.graph import Graph, OpNode
from autopar.strategies.rules import OpRule


@dataclass(frozen=True)
class ExpertModule:
    """One module that runs per expert.

    Attributes:
        path: the module's path, e.g. ``"layers.1.ffn.experts"``.
        labels: op name -> the op's expert label.
        entries: the ops that read an activation from outside the module; each reads
            it with its expert dim at ``entries[op]``.
        output: the op making the module's output.
        out_dim: the expert dim of that output.
        params: parameter fqn -> its expert dim.
        experts: how many experts (the size of the expert dim).
        kind: "stacked" (the above: ops split by expert), "gathered" (every expert on
            every token, combined by a gate at the output op, which sums the experts:
            ``entries`` gives -1 for an op reading the tokens, ``out_dim`` is -1) or
            "routed" (:func:`_routed`: a dropless module fed (tokens, expert indices,
            weights), whose ops stay split by token; ``labels`` and ``entries`` are
            then empty).
        tokens: for a routed module, the node of the tokens it is fed (tokens, dim).
        top_k: for a routed module, the experts each token goes to.
        members: for a routed module, its ops and its submodules' (their work runs on
            the tokens its rank receives).
    """

    path: str
    labels: dict[str, str]
    entries: dict[str, int]
    output: str
    out_dim: int
    params: dict[str, int]
    experts: int
    kind: str = "stacked"
    tokens: str = ""
    top_k: int = 1
    members: tuple[str, ...] = ()


def _param_expert_label(n: OpNode, rule: OpRule, kinds: dict[str, str],
                        batch: str | None) -> str | None:
    """The label op ``n`` shares between a parameter, an activation and its output
    (an expert label), or None."""
    outs = set(rule.out)
    acts: set[str] = set()
    params: set[str] = set()
    for i, labs in zip(n.inputs, rule.ins):
        if labs is None:
            continue
        (params if kinds[i] == "param" else acts).update(labs)
    common = sorted((outs & acts & params) - rule.reduce - rule.forbid - {batch})
    return common[0] if len(common) == 1 else None


def _introduced_labels(n: OpNode, rule: OpRule, kinds: dict[str, str],
                       batch: str | None) -> list[str]:
    """The labels op ``n`` takes from a parameter into its output that no activation it
    reads carries (an expert label the tokens lack is one: the ``e`` of
    ``einsum("th,ehf->etf", tokens, w)``; the ``f`` there is another)."""
    acts: set[str] = set()
    params: set[str] = set()
    for i, labs in zip(n.inputs, rule.ins):
        if labs is not None:
            (params if kinds[i] == "param" else acts).update(labs)
    if not acts:
        return []
    return sorted((set(rule.out) & params) - acts - rule.reduce - rule.forbid - {batch})


def _module(g: Graph, path: str, ops: list[OpNode], rules: dict[str, OpRule],
            batch_label: dict[str, str | None], outputs: set[str],
            kinds: dict[str, str]) -> ExpertModule | None:
    """The :class:`ExpertModule` of module ``path`` (its ops ``ops`` in graph order;
    ``kinds``: every node's kind), or None where some op does not run per expert. An op
    that reads no other op of the module and shares no label between a parameter and an
    activation may bring the expert label in from its parameters; each of its
    candidates (:func:`_introduced_labels`) is tried, at most :data:`_TRIES` ways."""
    inside = {o.name for o in ops}
    options: dict[str, list[str]] = {}
    for n in ops:
        rule, batch = rules[n.name], batch_label.get(n.name)
        if not any(i in inside for i in n.inputs) and \
                _param_expert_label(n, rule, kinds, batch) is None:
            options[n.name] = _introduced_labels(n, rule, kinds, batch)
    tries = list(itertools.islice(itertools.product(*options.values()), _TRIES))
    for pick in tries or [()]:
        em = _walk(g, path, ops, rules, batch_label, outputs, kinds,
                   dict(zip(options, pick)))
        if em is not None:
            return em
    return None


_TRIES = 16
"""How many ways of bringing the expert label in :func:`_module` tries (a module's
projections that read the tokens each offer their weights' labels but the one they
contract: two for an expert MLP's)."""


def _walk(g: Graph, path: str, ops: list[OpNode], rules: dict[str, OpRule],
          batch_label: dict[str, str | None], outputs: set[str], kinds: dict[str, str],
          introduce: dict[str, str]) -> ExpertModule | None:
    """:func:`_module` with the expert label the ops of ``introduce`` bring in (op ->
    label) chosen."""
    dim: dict[str, int] = {}     # tensor -> its expert dim, inside the module
    labels: dict[str, str] = {}
    entries: dict[str, int] = {}
    params: dict[str, int] = {}
    inside = {o.name for o in ops}
    out = [o.name for o in ops if o.name in outputs]
    combined = False  # the output op sums the experts (a gathered module)
    for n in ops:
        rule = rules[n.name]
        batch = batch_label.get(n.name)
        lab = _param_expert_label(n, rule, kinds, batch)
        introduced = None
        if lab is None:
            known = [rule.ins[p][dim[i]] for p, i in enumerate(n.inputs)
                     if i in dim and rule.ins[p] is not None]
            lab = known[0] if known and all(k == known[0] for k in known) else None
        if lab is None:
            lab = introduced = introduce.get(n.name)
        if lab is None or lab == batch:
            return None
        if lab not in rule.out:
            if not (out and n.name == out[0] and lab in rule.reduce):
                return None
            combined = True
        for p, i in enumerate(n.inputs):
            labs = rule.ins[p]
            if kinds[i] == "param":
                if labs is None or lab not in labs:
                    return None
                params[g.node(i).target] = labs.index(lab)
            elif i in inside:
                if labs is None or lab not in labs or dim.get(i) != labs.index(lab):
                    return None
            elif kinds[i] in ("op", "input"):
                if labs is not None and lab in labs:
                    entries[n.name] = labs.index(lab)
                elif introduced is not None:
                    entries[n.name] = -1  # the tokens, gathered whole over ep
                else:
                    return None
        labels[n.name] = lab
        if not combined:
            dim[n.name] = rule.out.index(lab)
    gathered = -1 in entries.values()
    if not out or not entries or not params or gathered != combined:
        return None
    sizes = {g.params[f].meta.shape[d] for f, d in params.items() if f in g.params}
    if len(sizes) != 1:
        return None
    return ExpertModule(path, labels, entries, out[0], dim.get(out[0], -1), params,
                        sizes.pop(), kind="gathered" if gathered else "stacked")


def gathered_problem(g: Graph, em: ExpertModule, batch_dim: dict[str, int | None]) -> str:
    """Why the lowering cannot gather gathered module ``em``'s tokens ('' where it can):
    they, its gate and its output must share one batch dim (all-gathered, exchanged and
    reduce-scattered along it), a gate must be read, and no token tensor may hold as
    many elements as there are experts along the gate's expert dim (the lowering tells
    the gate by that dim)."""
    gate = max(em.entries.values())
    if gate < 0:
        return ("its output sums the experts without a gate read from outside the module "
                "(each token's weights, shaped (tokens, experts))")
    dims = {batch_dim.get(em.output)}
    for op, d in em.entries.items():
        for i in g.node(op).inputs:
            node = g.node(i)
            if node.kind not in ("op", "input") or i in em.labels:
                continue
            dims.add(batch_dim.get(i))
            shape = node.out.shape if node.out is not None else ()
            if d < 0 and len(shape) > gate and shape[gate] == em.experts:
                return (f"its tokens hold {em.experts} elements along dim {gate}, as many as "
                        f"the gate has experts there, which is how the lowering tells the "
                        f"gate from the tokens")
    if len(dims) != 1 or None in dims:
        return "its tokens, gate and output do not share one batch dim"
    return ""


def _scan(g: Graph, rules: dict[str, OpRule], batch_label: dict[str, str | None],
          outputs: set[str], batch_dim: dict[str, int | None]
          ) -> tuple[dict[str, ExpertModule], dict[str, str]]:
    """The expert modules of ``g`` by path, and the gathered ones the lowering cannot
    run by path, with why (:func:`gathered_problem`)."""
    by_module: dict[str, list[OpNode]] = {}
    for n in g.nodes:
        if n.kind == "op" and n.target != "getitem" and n.module_path:
            by_module.setdefault(n.module_path, []).append(n)
    found, refused = {}, {}
    kinds = {n.name: n.kind for n in g.nodes}
    for path, ops in by_module.items():
        if not any(n.params for n in ops):
            continue
        em = _module(g, path, ops, rules, batch_label, outputs, kinds) or \
            _routed(g, path, ops, outputs, kinds)
        why = gathered_problem(g, em, batch_dim) if em is not None and \
            em.kind == "gathered" else ""
        if why:
            refused[path] = why
        elif em is not None:
            found[path] = em
    return found, refused


def expert_modules(g: Graph, rules: dict[str, OpRule], batch_label: dict[str, str | None],
                   outputs: set[str], batch_dim: dict[str, int | None] | None = None
                   ) -> dict[str, ExpertModule]:
    """Every expert module of ``g`` by path (module docstring); ``outputs`` are the
    ops making each module's output (:func:`~autopar.strategies.analysis.module_outputs`);
    ``batch_dim``, each node's batch dim, which a gathered module must keep one of
    (:func:`gathered_problem`; without it, no gathered module is found)."""
    return _scan(g, rules, batch_label, outputs, batch_dim or {})[0]


def refused_gathered(g: Graph, rules: dict[str, OpRule], batch_label: dict[str, str | None],
                     outputs: set[str], batch_dim: dict[str, int | None]) -> dict[str, str]:
    """The modules that run every expert on every token, a gate combining them, but that
    the lowering cannot gather (module path -> why; :func:`gathered_problem`)."""
    return _scan(g, rules, batch_label, outputs, batch_dim)[1]


def _routed(g: Graph, path: str, ops: list[OpNode], outputs: set[str],
            kinds: dict[str, str]) -> ExpertModule | None:
    """The routed :class:`ExpertModule` of module ``path``, or None: its parameters all
    stack E >= 2 experts along dim 0, matrices and at most per-expert biases (Hugging
    Face's ``MixtralExperts``, ``gate_up_proj`` (E, 2F, D) and ``down_proj`` (E, D, F);
    ``GptOssExperts`` adds ``gate_up_proj_bias`` (E, 2F)); it reads from outside exactly
    tokens (T, D), float, expert indices (T, k), integer, and their weights (T, k),
    float; and its output op makes a tensor shaped like the tokens. What it does with
    them inside (sorting, grouped GEMMs, loops) is its own: expert parallelism moves the
    tokens to their experts' ranks around it and runs it unchanged."""
    fqns = sorted({p for n in ops for p in n.params})
    shapes = [g.params[f].meta.shape for f in fqns if f in g.params]
    if not shapes or len(shapes) != len(fqns) or any(len(s) not in (2, 3) for s in shapes) or \
            all(len(s) == 2 for s in shapes) or len({s[0] for s in shapes}) != 1 or \
            shapes[0][0] < 2:
        return None
    members = [n for n in g.nodes if n.kind == "op" and
               (n.module_path == path or n.module_path.startswith(path + "."))]
    inside = {n.name for n in members}
    read = []
    for n in members:
        for i in n.inputs:
            if i not in inside and kinds[i] in ("op", "input") and i not in read:
                read.append(i)
    metas = [g.node(i).out for i in read]
    if len(metas) != 3 or any(m is None or len(m.shape) != 2 for m in metas):
        return None
    index = [i for i, m in zip(read, metas) if not m.is_float]
    if len(index) != 1:
        return None
    k = g.node(index[0]).out.shape[1]
    floats = [i for i in read if i != index[0]]
    weights = [i for i in floats if g.node(i).out.shape[1] == k]
    hidden = [i for i in floats if i not in weights[:1]]
    if len(weights) < 1 or len(hidden) != 1:
        return None
    hidden = hidden[0]
    t = g.node(hidden).out.shape[0]
    if any(m.shape[0] != t for m in metas):
        return None
    out = [o for o in ops if o.name in outputs and o.out is not None and
           o.out.shape == g.node(hidden).out.shape]
    if not out:
        return None
    return ExpertModule(path, {}, {}, out[-1].name, -1, {f: 0 for f in fqns}, shapes[0][0],
                        kind="routed", tokens=hidden, top_k=k,
                        members=tuple(n.name for n in members))


def expert_lists(g: Graph) -> dict[str, int]:
    """Experts written as a list of modules (``nn.ModuleList`` run one by one in the
    forward): module path of the list -> its length. A list qualifies when its members
    (children named 0, 1, ...) hold parameters of the same names and shapes and no
    member reads another's output (a list of repeated blocks is chained; experts all
    read the layer's tokens). Expert parallelism cannot split such a list: its loop
    sits in the parent's forward, where no module boundary lets tokens be exchanged."""
    members: dict[str, dict[int, dict[str, tuple[int, ...]]]] = {}
    for fqn, p in g.params.items():
        parts = fqn.split(".")
        for i in range(1, len(parts) - 1):
            if parts[i].isdigit():
                parent, rest = ".".join(parts[:i]), ".".join(parts[i + 1:])
                members.setdefault(parent, {}).setdefault(int(parts[i]), {})[rest] = \
                    tuple(p.meta.shape)
    found = {}
    for parent, by_index in members.items():
        shapes = list(by_index.values())
        if len(shapes) < 2 or any(s != shapes[0] for s in shapes):
            continue
        owner: dict[str, int] = {}
        for n in g.nodes:
            if n.kind == "op" and n.module_path.startswith(parent + "."):
                head = n.module_path[len(parent) + 1:].split(".")[0]
                if head.isdigit():
                    owner[n.name] = int(head)
        chained = any(owner.get(i, owner[op]) != owner[op]
                      for op in owner for i in g.node(op).inputs)
        if not chained:
            found[parent] = len(by_index)
    return found
