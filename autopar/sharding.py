"""Sharding vocabulary: placements on a named device mesh (:class:`Mesh`).

A tensor's layout on a mesh is one placement per mesh axis, as
``torch.distributed.tensor``'s ``Shard(d)``, ``Replicate()`` and ``Partial()``. Plans
write placements as short strings (``"S(0)"``, ``"R"``, ``"P"`` and ``"S(d)/k"``: dim
``d`` cut into ``k`` equal pieces, each split over the axis) and name strategies the
Colossal-AI way (``S0RS1 = S0RR x S1R``). :func:`shard_placement`,
:func:`check_placement`, :func:`shard_dim`, :func:`shard_pieces` and
:func:`layout_name` write and read them; the grammar in full: docs/capture.md,
section ``autopar.sharding``.

The planner works on the strings alone and never imports ``torch.distributed``; the
runtime turns them into placement objects
(:func:`autopar.runtime.tensor_parallel.parse_placement`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from autopar.errors import ConfigError, PlanFormatError

__all__ = ["DATA_AXES", "data_parallel_degree", "replica_degree", "Mesh", "layout_name", "check_placement", "shard_dim", "shard_pieces",
           "shard_placement", "folded_ep_axis"]


@dataclass(frozen=True)
class Mesh:
    """A named device mesh: axis names and sizes, outermost first.

    Ranks are laid out row-major (the last axis varies fastest), so the innermost
    axis groups neighbouring ranks — inside one node when it fits.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes):
            raise ConfigError(f"mesh names {self.names} and sizes {self.sizes} differ in length")
        if any(s < 1 for s in self.sizes):
            raise ConfigError(f"mesh sizes must be positive, got {self.sizes}")

    @classmethod
    def from_dict(cls, axes: dict[str, int]) -> "Mesh":
        """Build from an ordered ``{name: size}`` mapping."""
        return cls(tuple(axes), tuple(int(v) for v in axes.values()))

    def as_dict(self) -> dict[str, int]:
        """The ordered ``{name: size}`` mapping."""
        return dict(zip(self.names, self.sizes))

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.sizes)

    @property
    def size(self) -> int:
        """Number of devices."""
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def axis(self, name: str) -> int:
        """Index of the axis called ``name``."""
        return self.names.index(name)

    def degree(self, name: str) -> int:
        """Size of the axis called ``name`` (1 when the mesh has no such axis)."""
        return self.sizes[self.names.index(name)] if name in self.names else 1

    def stride(self, axis: int) -> int:
        """Rank distance between neighbours along ``axis`` (row-major layout)."""
        st = 1
        for s in self.sizes[axis + 1:]:
            st *= s
        return st


DATA_AXES = ("dp", "ep")
"""The mesh axes that split the batch: ``dp``, and ``ep``, which splits the experts of
an expert module instead (:mod:`autopar.strategies.experts`)."""


def data_parallel_degree(mesh: Mesh) -> int:
    """How many ways the batch is split: the product of the sizes of the data axes."""
    n = 1
    for name, size in zip(mesh.names, mesh.sizes):
        n *= size if name in DATA_AXES else 1
    return n


def replica_degree(mesh: Mesh) -> int:
    """How many ranks hold a replica of a (non-expert) parameter: the data axes' and
    the context-parallel axis's (``cp`` runs the same parameters on other tokens)."""
    return data_parallel_degree(mesh) * mesh.degree("cp")


def folded_ep_axis(ep: int, tp: int, dp: int | None = None) -> int | None:
    """The ``ep`` mesh axis when ``ep`` expert ranks fold over ``tp`` (Megatron-Core's
    expert tensor parallelism 1): ``ep / tp`` ranks of dp, where tp > 1 divides ep and
    the quotient is above 1 and divides ``dp`` (None: any); else None."""
    if tp <= 1 or ep % tp or ep <= tp:
        return None
    axis = ep // tp
    return axis if dp is None or dp % axis == 0 else None


def shard_placement(dim: int, pieces: int = 1) -> str:
    """The string of a split of tensor dim ``dim``: ``"S(d)"``, or ``"S(d)/k"`` when
    the dim is cut into ``pieces`` = k equal pieces each split over the axis."""
    return f"S({dim})" if pieces == 1 else f"S({dim})/{pieces}"


def shard_dim(text: str) -> int | None:
    """The tensor dim a placement string splits (``"S(2)"`` and ``"S(2)/3"`` -> 2), or
    None for ``"R"`` and ``"P"``."""
    if not text.startswith("S("):
        return None
    return int(text[2:text.index(")")])


def shard_pieces(text: str) -> int:
    """How many equal pieces a placement string splits piecewise: ``"S(2)/3"`` -> 3,
    any other placement -> 1."""
    _, slash, k = text.partition(")/")
    return int(k) if slash else 1


_PLACEMENT = re.compile(r"R|P|S\(-?\d+\)(/([2-9]|[1-9]\d+))?")


@lru_cache(maxsize=None)
def check_placement(text: str) -> str:
    """Validate a placement string (``"R"``, ``"P"``, ``"S(d)"`` or ``"S(d)/k"`` with
    k >= 2) and return it."""
    if isinstance(text, str) and _PLACEMENT.fullmatch(text):
        return text
    raise PlanFormatError(f"placement {text!r} is not one of 'R', 'P', 'S(<dim>)' or "
                          f"'S(<dim>)/<pieces>'")


def shard_count(placements: tuple[str, ...] | list[str], sizes: tuple[int, ...]) -> int:
    """How many pieces a tensor with these placements is cut into on a mesh of axis
    ``sizes`` (the product of the sizes of the axes that shard it)."""
    n = 1
    for p, size in zip(placements, sizes):
        n *= size if p.startswith("S(") else 1
    return n


def layout_name(placements: tuple[str, ...] | list[str], ndim: int) -> str:
    """Colossal-style name of a tensor layout, e.g. ``("S(0)", "S(2)") -> "S0RS1"``.

    One group per tensor dim: ``R`` when no mesh axis splits it, else ``S`` followed
    by the splitting mesh axes (and ``/k`` for a dim split piecewise in k pieces);
    ``P<axes>`` is appended for partial sums.
    """
    dims = ["" for _ in range(ndim)]
    pieces = [""] * ndim
    partial = ""
    for axis, p in enumerate(placements):
        if p == "P":
            partial += str(axis)
        elif p.startswith("S("):
            d = shard_dim(p) % max(ndim, 1)  # type: ignore[operator]
            dims[d] += str(axis)
            if shard_pieces(p) > 1:
                pieces[d] = f"/{shard_pieces(p)}"
    body = "".join(f"S{a}{k}" if a else "R" for a, k in zip(dims, pieces)) or "scalar"
    return body + (f"P{partial}" if partial else "")
