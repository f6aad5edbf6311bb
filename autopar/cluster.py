"""The cluster a plan is made for: GPU kind, node count and interconnect."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autopar.errors import ConfigError


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster of ``nodes`` x ``gpus_per_node`` devices.

    Args:
        gpu: a shipped hardware profile name (``"h100-sxm"``, ``"a100-80g"``, ``"cpu"``)
            — see ``autopar.cost_models.hardware.available_profiles()``.
        nodes: number of nodes.
        gpus_per_node: devices per node (processes per node on CPU).
        intra_node_bandwidth: GB/s per GPU inside a node; overrides the profile.
        inter_node_bandwidth: GB/s per GPU across nodes; overrides the profile.
        profile: path of a hardware profile JSON, used instead of the shipped profile
            named by ``gpu``. A file written by ``autopar profile`` is taken as
            measured (compute tables, GEMM peak, copy bandwidth, launch overhead,
            collective α-β fits) and completed from ``gpu``'s profile (``cpu`` for a
            CPU measurement) for what it did not measure, such as the interconnect.
        memory_gb: device memory in GB (1e9 bytes); overrides the profile.
    """

    gpu: str = "h100-sxm"
    nodes: int = 1
    gpus_per_node: int = 8
    intra_node_bandwidth: float | None = None
    inter_node_bandwidth: float | None = None
    profile: str | None = None
    memory_gb: float | None = None

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"Cluster({name}={v!r}): expected a positive integer")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth", "memory_gb"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                                  or not math.isfinite(v) or v <= 0):
                unit = "GB of device memory" if name == "memory_gb" else "GB/s per GPU"
                raise ConfigError(f"Cluster({name}={v!r}): expected a positive, finite number "
                                  f"({unit}), or None for the profile's own figure")
        self.hardware()  # validates the GPU name / profile path early, with a clear message

    @property
    def world_size(self) -> int:
        """Total number of devices."""
        return self.nodes * self.gpus_per_node

    def hardware(self):  # -> autopar.cost_models.hardware.HardwareProfile
        """The hardware profile with this cluster's overrides applied."""
        from autopar.cost_models.hardware import load_profile

        hw = load_profile(self.profile, base=self.gpu) if self.profile else load_profile(self.gpu)
        return hw.for_processes(self.gpus_per_node).with_overrides(
            intra_node_bandwidth=self.intra_node_bandwidth,
            inter_node_bandwidth=self.inter_node_bandwidth,
            memory_gb=self.memory_gb,
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly description, stored in plans: the options above, the
        profile's ``accuracy`` record, its ``device_name`` and ``device_type`` (``"cpu"``
        or ``"gpu"``), which the plan's summary shows."""
        hw = self.hardware()
        return {
            "gpu": self.gpu, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "profile": self.profile, "memory_gb": self.memory_gb,
            "accuracy": hw.accuracy, "device_name": hw.device_name,
            "device_type": "cpu" if hw.is_cpu else "gpu",
        }

    @classmethod
    def from_description(cls, d: dict[str, Any]) -> "Cluster":
        """Inverse of :meth:`describe`."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
