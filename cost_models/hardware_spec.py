"""The numbers of a hardware profile (:class:`HardwareProfile`, its links
:class:`LinkSpec` and their NCCL algorithms :class:`CollectiveAlgorithm`); read from JSON by
:mod:`autopar.cost_models.hardware_parse`, loaded by name or path with
:func:`autopar.cost_models.hardware.load_profile`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from autopar.cost_models.tables import ComputeTables

CPU_PROFILE_NOTE = ("a CPU profile plans CPU runs, gloo processes on CPU cores as in the "
                    "tests and the demo; it says nothing about a GPU")
"""What a plan on a CPU profile is good for, said where such a profile is made or used."""


@dataclass(frozen=True)
class CollectiveAlgorithm:
    """One way NCCL runs a collective on a link (an algorithm with a protocol: ring with
    LL, LL128 or Simple; NVLink SHARP), priced as NCCL's own tuning model prices it
    (``src/graph/tuning.cc``): ``base_latency + steps · step_latency + bytes / rate``.
    ``bandwidth`` is the achieved bus bandwidth (bytes/s) where ``bus`` is true, so the
    bytes are the collective's ring traffic (``2(n-1)/n · B`` for an all-reduce), else
    the achieved algorithm bandwidth (bytes of the buffer per second: NVLink SHARP,
    whose traffic per GPU does not grow with the group). ``kinds`` names the
    collectives it serves (empty: every kind)."""

    name: str
    base_latency: float
    step_latency: float
    bandwidth: float
    bus: bool = True
    kinds: tuple[str, ...] = ()


@dataclass(frozen=True)
class LinkSpec:
    """One link level: ``bandwidth`` in bytes/s per device and direction, ``latency``
    (α) in seconds per message step. ``kinds`` optionally holds separate measured fits
    ``(kind, bandwidth, latency)`` for collectives whose implementation differs (gloo's
    all-gather and reduce-scatter on a CPU); other kinds use the link's own figures.
    ``algorithms``, where given, price collectives in place of the α-β figures: NCCL's
    algorithms and protocols with their achieved bandwidths, the fastest one for each
    size (:func:`autopar.cost_models.comm.collective_time`). ``node_ranks``: on a group
    that spans nodes (:func:`autopar.cost_models.comm.group_link`), how many of its
    members share each node; an all-to-all sends only its other nodes' share over this
    link (the rest goes over NVLink at the same time)."""

    bandwidth: float
    latency: float
    kinds: tuple[tuple[str, float, float], ...] = ()
    algorithms: tuple[CollectiveAlgorithm, ...] = ()
    node_ranks: int = 1

    def scaled(self, bandwidth: float) -> "LinkSpec":
        """This link with its line rate set to ``bandwidth``, its algorithms' achieved
        bandwidths scaled by the same ratio."""
        r = bandwidth / self.bandwidth if self.bandwidth else 1.0
        return replace(self, bandwidth=bandwidth, algorithms=tuple(
            replace(a, bandwidth=a.bandwidth * r) for a in self.algorithms))

    def for_kind(self, kind: str) -> "LinkSpec":
        """The α-β figures of collective ``kind`` on this link."""
        for k, bw, lat in self.kinds:
            if k == kind:
                return LinkSpec(bw, lat)
        return LinkSpec(self.bandwidth, self.latency) if self.kinds else self


@dataclass(frozen=True)
class HardwareProfile:
    """Speeds of one device kind and its interconnect (seconds, bytes, FLOP/s)."""

    name: str
    device_name: str
    memory_bytes: float
    memory_reserve_bytes: float
    matmul_flops: dict[str, float]
    vector_flops: dict[str, float]
    matmul_efficiency: dict[str, float]
    memory_bandwidth: float
    memory_efficiency: float
    kernel_overhead_s: float
    gpus_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    host_link: LinkSpec
    sources: dict[str, str] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    tables: ComputeTables | None = None
    per_process: dict[int, dict[str, Any]] = field(default_factory=dict)
    comm_overlap: float = 1.0
    """The share of compute that gradient synchronization and ZeRO traffic may hide
    behind: 1.0 where collectives run on their own engines (NCCL on a GPU's copy and
    SM resources, beside the compute stream); a CPU profile measures it per process
    count (gloo moves data on the same cores that compute)."""

    accuracy: dict[str, Any] = field(default_factory=dict)
    """How well this profile's predictions held where they were checked on its GPU:
    ``step_error_pct`` (worst one-GPU training step), ``layer_mape_pct`` and
    ``term_mape_pct`` (per term: gemm, attention, memory) of
    ``benchmarks/layer_accuracy.py``, with ``date``, ``source`` and optionally
    ``scope`` (which cases the figures cover); ``published_runs``: the median and max
    |error| (``median_abs_pct``, ``max_abs_pct``) of the prices of ``runs`` published
    multi-GPU runs from ``sources`` sources on this GPU (``benchmarks/calibrate.py``);
    empty for a profile never checked (:func:`accuracy_text`)."""

    host_overhead_s: dict[str, float] = field(default_factory=dict)
    """Host seconds the parallel wrappers add (:mod:`autopar.cost_models.profiling.host_wrappers`):
    DTensor per call of a tensor-parallel Linear and of a sequence-parallel norm
    (``linear_fwd``, ``linear_bwd``, ``norm_fwd``, ``norm_bwd``) and FSDP2 per
    parameter of a ``fully_shard`` unit per micro-batch (``fsdp_param_fwd``,
    ``fsdp_param_bwd``); empty where not measured. A CPU profile measures them per
    process count."""

    @property
    def oversubscription(self) -> float:
        """Processes per core of a CPU profile selected for more processes than the
        machine has cores (:meth:`for_processes`; ``provenance["cpus"]`` cores); 1.0
        for every other profile. With s > 1 the rates of ``per_process[N]`` are those
        of N busy processes taking turns; a process that waits (a pipeline bubble)
        gives its turn to the others."""
        n = self.provenance.get("processes_per_node")
        cores = self.provenance.get("cpus")
        if not self.per_process or not n or not cores:
            return 1.0
        return max(1.0, float(n) / float(cores))

    def for_processes(self, n: int) -> "HardwareProfile":
        """This profile as each of ``n`` processes per node sees it.

        A CPU profile measures its rates with N one-thread processes sharing the
        machine (``per_process``, keyed by N; see :mod:`autopar.cost_models.profiling.cpu`):
        GEMM rate, copy bandwidth, per-op time and the collectives' α-β fits. The entry
        for ``n`` replaces the top-level figures (every dtype's matrix and vector rate
        scaled by the measured fp32 GEMM rate over the top-level one); without an entry
        for ``n``, the largest measured N below ``n`` is used and ``provenance`` says so.
        Fields an entry lacks keep the top-level figure.
        A profile without ``per_process`` (every GPU profile: one process per device)
        is returned unchanged."""
        keys = sorted(k for k in self.per_process if k <= n)
        if not keys:
            return self
        k = keys[-1]
        e = self.per_process[k]
        src = {**self.sources, **{f"{name}": f"per_process[{k}]: {text}"
                                  for name, text in e.get("sources", {}).items()}}
        gemm = e.get("matmul_flops", self.matmul_flops.get("fp32", 1.0))
        ratio = gemm / self.matmul_flops.get("fp32", gemm)
        hw = replace(self, matmul_flops={d: v * ratio for d, v in self.matmul_flops.items()},
                     vector_flops={d: v * ratio for d, v in self.vector_flops.items()},
                     memory_bandwidth=e.get("memory_bandwidth", self.memory_bandwidth),
                     kernel_overhead_s=e.get("kernel_overhead_s", self.kernel_overhead_s),
                     comm_overlap=e.get("comm_overlap", self.comm_overlap),
                     host_overhead_s=e.get("host_overhead_s", self.host_overhead_s),
                     provenance={**self.provenance, "processes_per_node": n,
                                 "per_process_entry": k})
        link = e.get("link")
        if link is not None:
            hw = replace(hw, intra_node=link, inter_node=link)
        return replace(hw, sources=src)

    @property
    def is_cpu(self) -> bool:
        """True for a CPU profile (the shipped ``cpu`` one, measured per process count,
        or one ``autopar profile`` measured on a CPU): it prices gloo processes on this
        kind of CPU, see :data:`CPU_PROFILE_NOTE`."""
        return bool(self.per_process) or self.provenance.get("device_type") == "cpu"

    @property
    def host_runs_ahead(self) -> bool:
        """True where the host issues work for a separate device (a GPU): the host's
        time then overlaps the device's, and a step takes the longer of the two
        (:mod:`autopar.cost_models.host`). False for a CPU profile, where the host is
        the device and host overheads add to the op times."""
        return not self.per_process and self.provenance.get("device_type") != "cpu"

    @property
    def achieved_memory_bandwidth(self) -> float:
        """Bytes/s a memory-bound kernel moves (read + write):
        ``memory_bandwidth · memory_efficiency``."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def usable_memory_bytes(self) -> float:
        """Device memory a plan may use: total less the stated reserve."""
        return self.memory_bytes - self.memory_reserve_bytes

    def with_overrides(self, *, intra_node_bandwidth: float | None = None,
                       inter_node_bandwidth: float | None = None,
                       memory_gb: float | None = None) -> "HardwareProfile":
        """A copy with bandwidths (GB/s per device) or memory (GB) replaced."""
        hw, src = self, dict(self.sources)
        if intra_node_bandwidth is not None:
            hw = replace(hw, intra_node=hw.intra_node.scaled(intra_node_bandwidth * 1e9))
            src["intra_node.bandwidth"] = "overridden by Cluster(intra_node_bandwidth=...)"
        if inter_node_bandwidth is not None:
            hw = replace(hw, inter_node=hw.inter_node.scaled(inter_node_bandwidth * 1e9))
            src["inter_node.bandwidth"] = "overridden by Cluster(inter_node_bandwidth=...)"
        if memory_gb is not None:
            hw = replace(hw, memory_bytes=memory_gb * 1e9)
            src["memory_bytes"] = "overridden by Cluster(memory_gb=...)"
        return replace(hw, sources=src)
