"""The outer search's space: a :class:`Candidate` per factorization of the world into
pp x dp x tp (with cp, ep), micro-batch size, ZeRO stage, schedule and offload
(:func:`candidates`), the order it is tried in (:func:`tiers`), and each candidate's
:class:`~autopar.strategies.settings.Settings` (:func:`candidate_settings`); searched by
:mod:`autopar.solvers.outer_search`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.errors import ConfigError
from autopar.sharding import Mesh, folded_ep_axis
from autopar.memory_choices import RECOMPUTE
from autopar.solvers.schedule_sim import needs_a_microbatch_per_stage, validate
from autopar.strategies.settings import Settings


@dataclass(frozen=True)
class Candidate:
    """One point of the outer search space (``pp`` = 1: no pipeline)."""

    dp: int
    tp: int
    microbatch_size: int
    num_microbatches: int
    zero: int
    pp: int = 1
    schedule: str = ""
    virtual_stages: int = 1
    offload: bool = False
    ep: int = 1  # the ep mesh axis: experts split over ep of the dp ranks (ep divides dp)
    fold_experts: bool = False  # routed experts split over ep x tp, whole on each rank
    split_experts: bool = False  # every expert module split over ep (ep asked for)
    expert_imbalance: float = 1.0  # busiest ep rank's routed tokens over the mean
    cp: int = 1  # context parallelism: every sequence split over cp ranks
    cp_variant: str = ""  # how its attention brings the keys (context_parallel.VARIANTS)

    @property
    def expert_ranks(self) -> int:
        """The ranks each expert module's experts are split over: the ``ep`` axis, times
        ``tp`` where the experts fold over it (Megatron-Core's expert tensor parallelism
        1 under tp > 1)."""
        return self.ep * self.tp if self.fold_experts else self.ep

    def label(self) -> str:
        """Short readable description."""
        pipe = f"pp={self.pp} {self.schedule}" + (
            f" v={self.virtual_stages}" if self.virtual_stages > 1 else "") + " " \
            if self.pp > 1 else ""
        ep = f" ep={self.expert_ranks}" if self.ep > 1 else ""
        ep += f" (ep={self.ep} x tp)" if self.fold_experts else ""
        cp = f" cp={self.cp} {self.cp_variant}" if self.cp > 1 else ""
        return (f"{pipe}dp={self.dp}{ep}{cp} tp={self.tp} mb={self.microbatch_size}x"
                f"{self.num_microbatches} zero={self.zero}" + (" offload" if self.offload else ""))


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


AUTO_SCHEDULES = (("1f1b", 1), *((s, v) for s in ("interleaved_1f1b", "interleaved_zero_bubble")
                                  for v in (2, 3, 4)), ("zbv", 2))
"""Schedules the search tries by itself, with their virtual stages per rank: the
interleaved ones with 2 to 4 chunks per rank (Megatron-LM's published runs use 2 and 3,
benchmarks/reference_configs.json; each more chunk shrinks the bubble and adds a stage
boundary to cross per micro-batch, and the stage split needs pp x v blocks), ZBV with its 2.
GPipe is left out: it takes the time of 1F1B with more activation memory (Narayanan et
al., SC'21 §2.2), so it never wins; ask for it with ``schedule="gpipe"``."""


def candidates(world: int, global_batch: int, *, dp: int | None = None, tp: int | None = None,
               pp: int | None = None, microbatch_size: int | None = None,
               zero: int | None = None, schedule: str | None = None,
               virtual_stages: int | None = None, num_units: int = 0,
               heads: int | None = None, ep: int | None = None,
               experts: int = 0, expert_imbalance: float = 1.0, cp: int | None = None,
               seq_len: int = 0, cp_variants: tuple[str, ...] = (),
               cp_variant: str | None = None, cp_with_pp: bool = True,
               fold: bool | None = False) -> list[Candidate]:
    """Every candidate allowed by the fixed degrees (None = free). ``num_units`` (the
    model's pipeline units) bounds the pipeline: each stage needs one unit. A free
    ``tp`` must divide ``heads`` (the attention heads; None = any), since attention
    cannot split otherwise; a free micro-batch size must leave a pipeline at least
    ``pp`` micro-batches (fewer leave ranks idle for most of the step). ``ep`` counts
    the ranks the experts are split over: an ``ep`` axis of the dp ranks, or, folded
    (``fold`` True: always, None: also, False: never; :func:`_expert_degrees`), that
    axis times ``tp``. A free ``ep`` is each degree that divides ``experts`` (the
    experts of every expert module; 0 = the model has none, so ep is 1); every
    candidate carries ``expert_imbalance``,
    the load imbalance its pricing assumes for routed experts. A free ``cp`` is each
    degree whose head-tail chunks divide ``seq_len`` (2·cp of them), each with every
    variant of ``cp_variants`` that can split the heads left by tp (or ``cp_variant``
    alone); no ``cp_variants`` (a model context parallelism cannot split): cp is 1;
    ``cp_with_pp`` False: not both cp and pp above 1."""
    out = []
    for p in divisors(world):
        if (pp is not None and p != pp) or (pp is None and p > 1 and p * 2 > num_units):
            continue
        for t, c, variant in _model_degrees(world // p, tp, cp, heads, seq_len, cp_variants,
                                            cp_variant):
            d = world // p // t // c
            if (tp is not None and t != tp) or (dp is not None and d != dp):
                continue
            if p > 1 and c > 1 and not cp_with_pp:
                continue
            if global_batch % d:
                continue
            local = global_batch // d
            mbs = [microbatch_size] if microbatch_size is not None else divisors(local)
            for mb in mbs:
                if local % mb or (microbatch_size is None and local // mb < p):
                    continue
                m = local // mb
                r = d * c  # the ranks holding each parameter: ZeRO shards over them
                zs = [zero] if zero is not None else ([0, 2, 3] if r > 1 and p == 1 else
                                                      [0, 2] if r > 1 else [0])
                for z in zs:
                    for sched, v in _schedules(p, m, schedule, virtual_stages, num_units):
                        for e, f in _expert_degrees(d, t if c == 1 else 1, ep, experts, fold):
                            out.append(Candidate(d, t, mb, m, z, p, sched, v, ep=e,
                                                 fold_experts=f,
                                                 split_experts=ep is not None and e > 1,
                                                 expert_imbalance=expert_imbalance,
                                                 cp=c, cp_variant=variant))
    if not out:
        raise ConfigError(
            f"no pipeline x data x{' context x' if cp_variants else ''} tensor parallel "
            f"layout of {world} devices divides the global batch of {global_batch} under the "
            f"requested degrees (pp={pp}, dp={dp}, {f'cp={cp}, ' if cp_variants else ''}"
            f"tp={tp}, microbatch={microbatch_size}); choose a global batch divisible by "
            f"the data-parallel degree, or fewer pipeline stages than the model has blocks")
    return out


def _model_degrees(n: int, tp: int | None, cp: int | None, heads: int | None, seq_len: int,
                   variants: tuple[str, ...], variant: str | None
                   ) -> list[tuple[int, int, str]]:
    """The (tp, cp, cp variant) triples to try on ``n`` devices of a stage
    (:func:`candidates`): tp dividing ``heads`` when free; cp 1, or, when the model
    allows it (``variants``), each degree whose 2·cp head-tail chunks divide
    ``seq_len``, with each variant that splits the heads tp leaves (Ulysses: cp
    divides them)."""
    out = []
    for t in divisors(n):
        if (tp is not None and t != tp) or (tp is None and heads is not None and heads % t):
            continue
        for c in divisors(n // t):
            if (cp is not None and c != cp) or (cp is None and c > 1 and not variants):
                continue
            if c == 1:
                out.append((t, 1, ""))
                continue
            if not seq_len or seq_len % (2 * c):
                continue
            for v in ((variant,) if variant else variants):
                if v == "ulysses" and (heads is None or (heads // t) % c):
                    continue
                out.append((t, c, v))
    return out


def _expert_degrees(dp: int, tp: int, ep: int | None, experts: int,
                    fold: bool | None) -> list[tuple[int, bool]]:
    """The (ep axis, folded) pairs to try with ``dp`` data-parallel and ``tp``
    tensor-parallel ranks: unfolded (``fold`` not True), an ``ep`` axis that divides
    ``dp``; folded over tp (``fold`` not False, tp > 1), an axis of ``ep / tp`` ranks,
    above 1, dividing ``dp``. ``ep`` (the ranks the experts are split over) asked for:
    those giving it; free: those whose ranks divide ``experts``."""
    out: list[tuple[int, bool]] = []
    if fold is not True or tp == 1:
        if ep is not None:
            out += [(ep, False)] if dp % ep == 0 else []
        else:
            out += [(e, False) for e in divisors(dp) if experts and experts % e == 0] or \
                [(1, False)]
    if fold is not False and tp > 1:
        if ep is not None:
            axis = folded_ep_axis(ep, tp, dp)
            out += [(axis, True)] if axis is not None else []
        else:
            out += [(e, True) for e in divisors(dp)
                    if e > 1 and experts and experts % (e * tp) == 0]
    return out


def _schedules(pp: int, m: int, schedule: str | None, virtual_stages: int | None,
               num_units: int) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) pairs to try for ``pp`` stages and ``m``
    micro-batches: none without a pipeline, the requested one (a schedule asked for
    without its virtual stages: each count AUTO_SCHEDULES tries it with, else 1), or
    AUTO_SCHEDULES; those
    torch runs (:func:`~autopar.solvers.schedule_sim.validate`) and autopar's runtime
    lowers (:func:`~autopar.solvers.schedule_sim.needs_a_microbatch_per_stage`)."""
    if pp == 1:
        return [("", 1)]
    def runs(pairs: list[tuple[str, int]]) -> list[tuple[str, int]]:
        return [(sc, v) for sc, v in pairs if pp * v <= num_units and
                validate(sc, pp, m, v) is None and
                not (needs_a_microbatch_per_stage(sc) and m < pp * v)]

    if schedule is None:
        return runs(list(AUTO_SCHEDULES))
    if virtual_stages is not None:
        return runs([(schedule, virtual_stages)])
    # an interleaved schedule asked for without its chunks: the counts AUTO tries it with
    return runs([(sc, v) for sc, v in AUTO_SCHEDULES if sc == schedule]) or \
        runs([(schedule, 2 if schedule == "zbv" else 1)])


def offload_candidates(cands: list[Candidate]) -> list[Candidate]:
    """The ZeRO-3 candidates without a pipeline, with CPU offload (for when nothing else
    fits)."""
    out = []
    for c in cands:
        if c.pp == 1 and c.zero == 3 and not c.offload:
            out.append(replace(c, offload=True))
    return out


def tiers(cands: list[Candidate], gpus_per_node: int,
          offload: bool | None) -> list[list[Candidate]]:
    """``cands`` in the order the search tries them, each list only when none of the
    earlier ones has a plan that fits: tensor and expert parallelism within a node
    without context parallelism first (all of ``cands`` when none is), then the rest:
    context parallelism, tensor parallelism wider than a node and (``offload`` None)
    CPU offload together, each a way to fit at a price in time. ``offload=True``: only
    the offload variants (:func:`offload_candidates`), in the same order."""
    local = [c for c in cands if c.tp * c.ep <= gpus_per_node]  # folded: ep x tp ranks
    wide = [c for c in cands if c.tp * c.ep > gpus_per_node]
    if not local:  # every candidate is wider than a node: the caller asked for that tp
        local, wide = wide, []
    first = [c for c in local if c.cp == 1] or local  # cp asked for: every one has it
    split = [c for c in local if c.cp > 1 and first is not local]
    if offload:
        out = [offload_candidates(first + split), offload_candidates(wide)]
    elif offload is None:
        out = [first, split + wide + offload_candidates(cands)]
    else:
        out = [first, split + wide]
    return [t for t in out if t]


def candidate_settings(c: Candidate, *, hw, gpus_per_node: int, precision: str,
                       optimizer: str, memory_budget: float,
                       sequence_parallel: bool | None = None,
                       recompute: tuple[str, ...] | None = None,
                       loss_parallel: bool | None = None,
                       split_weights: bool = False, compile_blocks: bool = False) -> Settings:
    """The intra-op problem settings of candidate ``c`` (its dp × tp stage mesh, or
    dp/ep × ep × tp with expert parallelism); ``compile_blocks``: its blocks compiled
    where it has no pipeline (the runtime compiles only those)."""
    names, sizes = ["dp", "tp"], [c.dp, c.tp]
    if c.ep > 1:
        names, sizes = ["dp", "ep", "tp"], [c.dp // c.ep, c.ep, c.tp]
    if c.cp > 1:
        names.insert(-1, "cp")
        sizes.insert(-1, c.cp)
    return Settings(Mesh(tuple(names), tuple(sizes)), c.microbatch_size, c.num_microbatches,
                    c.zero, precision, optimizer, memory_budget, hw, gpus_per_node,
                    sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                    split_weights=split_weights, offload=c.offload,
                    split_experts=c.split_experts, expert_imbalance=c.expert_imbalance,
                    fold_experts=c.fold_experts,
                    recompute_modes=recompute or RECOMPUTE,
                    cp_variant=c.cp_variant or "allgather", pipelined=c.pp > 1,
                    compiled=compile_blocks and c.pp == 1)


def problem_key(c: Candidate) -> tuple:
    """What a candidate's intra-op problem depends on (pipelined or not)."""
    return (c.dp, c.tp, c.microbatch_size, c.num_microbatches, c.zero, c.offload, c.ep,
            c.split_experts, c.expert_imbalance, c.cp, c.cp_variant, c.fold_experts)


@dataclass
class Outcome:
    """What one candidate gave: a step time, or why it was dropped."""

    candidate: Candidate
    step_time_s: float | None
    memory_bytes: float | None
    reason: str = ""
