"""Hardware profiles: the measured or documented speeds of one kind of device.

A profile is a JSON file in which every number is ``{"value": ..., "source": "..."}``
so that a reviewer sees where it came from. Shipped profiles live in ``profiles/``;
``Cluster(profile="path.json")`` loads a user's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from autopar.errors import ConfigError, PlanFormatError

ALIASES = {"h100": "h100-sxm", "h100-80g": "h100-sxm", "a100": "a100-80g",
           "a100-sxm": "a100-80g"}


@dataclass(frozen=True)
class LinkSpec:
    """One link level: ``bandwidth`` in bytes/s per device and direction, ``latency``
    (α) in seconds per message step."""

    bandwidth: float
    latency: float


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
            hw = replace(hw, intra_node=replace(hw.intra_node, bandwidth=intra_node_bandwidth * 1e9))
            src["intra_node.bandwidth"] = "overridden by Cluster(intra_node_bandwidth=...)"
        if inter_node_bandwidth is not None:
            hw = replace(hw, inter_node=replace(hw.inter_node, bandwidth=inter_node_bandwidth * 1e9))
            src["inter_node.bandwidth"] = "overridden by Cluster(inter_node_bandwidth=...)"
        if memory_gb is not None:
            hw = replace(hw, memory_bytes=memory_gb * 1e9)
            src["memory_bytes"] = "overridden by Cluster(memory_gb=...)"
        return replace(hw, sources=src)


def available_profiles() -> list[str]:
    """Names of the shipped profiles."""
    folder = resources.files("autopar.cost_models") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """Load a shipped profile by name (or alias) or a profile JSON file by path."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ConfigError(f"GPU/profile {name_or_path!r} must be a non-empty string")
    if name_or_path.endswith(".json") or "/" in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"hardware profile file {name_or_path!r} does not exist")
        text, origin = path.read_text(), str(path)
    else:
        key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
        known = available_profiles()
        if key not in known:
            raise ConfigError(f"unknown GPU {name_or_path!r}; known profiles: "
                              f"{', '.join(known)} (or pass the path of a profile JSON file)")
        text = (resources.files("autopar.cost_models") / "profiles" / f"{key}.json").read_text()
        origin = f"{key}.json"
    return parse_profile(text, origin)


def _num(data: dict, key: str, origin: str, sources: dict[str, str], prefix: str = "") -> float:
    entry = data.get(key)
    if isinstance(entry, dict):
        value = entry.get("value")
        sources[prefix + key] = str(entry.get("source", ""))
    else:
        value = entry
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise PlanFormatError(f"hardware profile {origin}: field '{prefix}{key}' must be a "
                              f"non-negative number (as {{\"value\": ..., \"source\": ...}}), "
                              f"got {entry!r}")
    return float(value)


def _table(data: dict, key: str, origin: str, sources: dict[str, str]) -> dict[str, float]:
    t = data.get(key)
    if not isinstance(t, dict) or not t:
        raise PlanFormatError(f"hardware profile {origin}: field '{key}' must map dtypes to numbers")
    return {k: _num(t, k, origin, sources, f"{key}.") for k in t}


def _link(data: dict, key: str, origin: str, sources: dict[str, str]) -> LinkSpec:
    t = data.get(key)
    if not isinstance(t, dict):
        raise PlanFormatError(f"hardware profile {origin}: field '{key}' must hold "
                              "'bandwidth' and 'latency'")
    return LinkSpec(_num(t, "bandwidth", origin, sources, f"{key}."),
                    _num(t, "latency", origin, sources, f"{key}."))


def parse_profile(text: str, origin: str = "<text>") -> HardwareProfile:
    """Parse profile JSON text; raises PlanFormatError naming the bad field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"hardware profile {origin} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PlanFormatError(f"hardware profile {origin} must be a JSON object")
    src: dict[str, str] = {}
    try:
        return HardwareProfile(
            name=str(data["name"]), device_name=str(data.get("device_name", data["name"])),
            memory_bytes=_num(data, "memory_bytes", origin, src),
            memory_reserve_bytes=_num(data, "memory_reserve_bytes", origin, src),
            matmul_flops=_table(data, "matmul_flops", origin, src),
            vector_flops=_table(data, "vector_flops", origin, src),
            matmul_efficiency=_table(data, "matmul_efficiency", origin, src),
            memory_bandwidth=_num(data, "memory_bandwidth", origin, src),
            memory_efficiency=_num(data, "memory_efficiency", origin, src),
            kernel_overhead_s=_num(data, "kernel_overhead_s", origin, src),
            gpus_per_node=int(_num(data, "gpus_per_node", origin, src)),
            intra_node=_link(data, "intra_node", origin, src),
            inter_node=_link(data, "inter_node", origin, src),
            host_link=_link(data, "host_link", origin, src),
            sources=src, provenance=dict(data.get("provenance", {})))
    except KeyError as e:
        raise PlanFormatError(f"hardware profile {origin} is missing the field {e}") from None
