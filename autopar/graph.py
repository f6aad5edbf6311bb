"""The graph IR that every planning pass reads.

`capture` turns a model into a :class:`Graph`: a topologically ordered list of
:class:`OpNode` s, one per tensor-producing operation of one training step's forward
pass (the loss included), each annotated with the shapes, dtypes, forward FLOPs and
bytes, the parameters it reads, its module path and the repeated layer it belongs to.

Parameters and model inputs are nodes too (``kind`` "param" / "input"), so every
tensor a node reads is named by a producer node in ``OpNode.inputs``.

The IR is plain data: it holds no torch tensors, so it pickles and hashes cheaply;
the FX graph it came from is kept on ``Graph.fx`` for passes that need it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor (dtype as torch names it, without ``torch.``)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def is_float(self) -> bool:
        """True for floating-point dtypes (the ones that carry gradients)."""
        return self.dtype.startswith(("float", "bfloat", "complex"))


@dataclass
class OpNode:
    """One node of the captured graph.

    Attributes:
        name: unique node name (the FX node's name).
        kind: "param" (a parameter or buffer), "input" (a model input or target),
            "op" (a computation) or "output".
        target: operator name, e.g. "aten.linear.default", "getitem"; for params the
            parameter's fully qualified name; for inputs the input's name.
        inputs: names of the nodes whose tensors this node reads, in argument order.
        args: the non-tensor arguments, JSON-friendly (ints, floats, strs, lists, None);
            tensor arguments appear as the string "%<node name>".
        out: metadata of the output tensor (the first one for multi-output ops);
            None for nodes with no tensor output.
        outs: metadata of every tensor output, for multi-output ops (split, ...).
        flops: forward floating-point operations (a multiply-add counts 2).
        bytes: forward bytes read and written, counting every tensor once.
        params: fully qualified names of the parameters this node reads.
        module_path: the innermost module that called the op ("" for the root),
            without the capture wrapper's prefix.
        module_type: class name of that module ("Linear", "LayerNorm", ...).
        layer: index into ``Graph.layers`` of the repeated layer holding this node,
            or None.
        requires_grad: True when a gradient flows to this node's output.
    """

    name: str
    kind: str
    target: str
    inputs: list[str] = field(default_factory=list)
    args: list[Any] = field(default_factory=list)
    out: TensorMeta | None = None
    outs: list[TensorMeta] = field(default_factory=list)
    flops: float = 0.0
    bytes: float = 0.0
    params: list[str] = field(default_factory=list)
    module_path: str = ""
    module_type: str = ""
    layer: int | None = None
    requires_grad: bool = False


@dataclass
class ParamInfo:
    """One parameter (or buffer) of the model.

    ``aliases`` lists the other names of a tied parameter (e.g. a tied output head);
    ``trainable`` is False for buffers and frozen parameters; ``buffer`` is True for
    buffers (which are never placed: each rank keeps its own copy).
    """

    name: str
    meta: TensorMeta
    module_path: str
    trainable: bool = True
    aliases: list[str] = field(default_factory=list)
    buffer: bool = False


@dataclass
class Layer:
    """One instance of a repeated block (e.g. ``blocks.3``).

    ``signature`` is equal for structurally identical layers (same ops, shapes,
    dtypes and parameter shapes, in the same order); ``nodes`` are its node names in
    graph order; ``index`` is its position in the model's block sequence.
    """

    path: str
    index: int
    signature: str
    nodes: list[str] = field(default_factory=list)


@dataclass
class Graph:
    """A captured, annotated training-step graph.

    ``nodes`` are in topological order. ``layers`` are the repeated blocks in order;
    ``canonical`` maps every node of a layer to the node at the same position in the
    first layer with the same signature (identity for nodes outside layers), so
    passes solve one representative per distinct layer. ``batch_size`` and
    ``seq_len`` are read off the example inputs (seq_len is None for non-sequence
    models); ``loss`` names the scalar loss node.
    """

    nodes: list[OpNode]
    params: dict[str, ParamInfo]
    layers: list[Layer]
    canonical: dict[str, str]
    inputs: list[str]
    loss: str
    batch_size: int
    seq_len: int | None = None
    model_name: str = ""
    fx: Any = field(default=None, repr=False, compare=False)
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    """Facts passes derive from the graph alone, kept by the pass that derives them
    (under its own key) so that a search works them out once."""

    def node(self, name: str) -> OpNode:
        """The node called ``name``."""
        return self._index()[name]

    def _index(self) -> dict[str, OpNode]:
        idx = self.__dict__.get("_by_name")
        if idx is None or len(idx) != len(self.nodes):
            idx = {n.name: n for n in self.nodes}
            self.__dict__["_by_name"] = idx
        return idx

    def users(self, name: str) -> list[OpNode]:
        """Nodes that read the output of ``name``, in graph order."""
        users = self.__dict__.get("_users")
        if users is None:
            users = {n.name: [] for n in self.nodes}
            for n in self.nodes:
                for i in dict.fromkeys(n.inputs):
                    users[i].append(n)
            self.__dict__["_users"] = users
        return users[name]

    @property
    def forward_flops(self) -> float:
        """Forward FLOPs of one step over the whole example batch."""
        return sum(n.flops for n in self.nodes)

    @property
    def num_params(self) -> int:
        """Number of distinct trainable parameter elements."""
        return sum(p.meta.numel for p in self.params.values() if p.trainable)

    def fingerprint(self) -> str:
        """A stable hash of the graph's structure, shapes and parameters (hex)."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(repr((n.kind, n.target, n.inputs, n.args, n.out, n.params)).encode())
        return h.hexdigest()[:16]
