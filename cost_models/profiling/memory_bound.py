"""Memory-bound points of ``autopar profile``: achieved bytes/s of pointwise ops,
normalizations, softmax, embedding and cross-entropy, forward and backward
(:func:`pointwise_tasks`, :func:`row_tasks`, :func:`embedding_tasks`,
:func:`cross_entropy_tasks`).

Bytes are the fewest each op must move through device memory (each input read once,
each output written once); the count per op and pass: docs/profiling.md.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from autopar.cost_models.profiling.timing import DTYPES, Task, Timer, row

Forward = Callable[[list[torch.Tensor]], torch.Tensor]


def _task(op: str, shape: tuple[int, ...], dtype: str, pass_: str, nbytes: float,
          make: Callable[[], list[torch.Tensor]], forward: Forward,
          grad_of: tuple[int, ...] = ()) -> Task:
    """A point that times ``forward(inputs)`` or the gradient of its output with
    respect to ``inputs[i] for i in grad_of`` (``pass_`` = ``"bwd"``)."""

    def run(timer: Timer) -> dict:
        inputs = make()
        if pass_ == "fwd":
            with torch.no_grad():
                meas = timer.measure(lambda: forward(inputs))
        else:
            for i in grad_of:
                inputs[i].requires_grad_(True)
            out = forward(inputs)
            g = torch.randn_like(out)
            wrt = [inputs[i] for i in grad_of]
            meas = timer.measure(lambda: torch.autograd.grad(out, wrt, g, retain_graph=True))
        return row(meas, nbytes=float(nbytes))

    params = {"op": op, "shape": list(shape), "dtype": dtype, "pass": pass_}
    key = f"{op}:{'x'.join(map(str, shape))}:{dtype}:{pass_}"
    return Task("memory_bound", key, params, run)


def pointwise_tasks(numel: int, dtype: str, device: torch.device) -> list[Task]:
    """copy, add, mul, gelu, silu over ``numel`` elements (forward; backward where
    autograd runs a kernel)."""
    e = torch.empty((), dtype=DTYPES[dtype]).element_size()
    shape = (numel,)

    def one() -> list[torch.Tensor]:
        return [torch.randn(numel, device=device, dtype=DTYPES[dtype])]

    def two() -> list[torch.Tensor]:
        return one() + one()

    def copy(t: list[torch.Tensor]) -> torch.Tensor:
        return t[1].copy_(t[0])

    n = numel
    return [
        _task("copy", shape, dtype, "fwd", 2 * n * e, two, copy),
        _task("add", shape, dtype, "fwd", 3 * n * e, two, lambda t: t[0] + t[1]),
        _task("mul", shape, dtype, "fwd", 3 * n * e, two, lambda t: t[0] * t[1]),
        _task("mul", shape, dtype, "bwd", 5 * n * e, two, lambda t: t[0] * t[1], (0, 1)),
        _task("gelu", shape, dtype, "fwd", 2 * n * e, one, lambda t: F.gelu(t[0])),
        _task("gelu", shape, dtype, "bwd", 3 * n * e, one, lambda t: F.gelu(t[0]), (0,)),
        _task("silu", shape, dtype, "fwd", 2 * n * e, one, lambda t: F.silu(t[0])),
        _task("silu", shape, dtype, "bwd", 3 * n * e, one, lambda t: F.silu(t[0]), (0,)),
    ]


def row_tasks(rows: int, hidden: int, dtype: str, device: torch.device) -> list[Task]:
    """layer_norm, rms_norm (with weights) and softmax over the last dim of a
    (rows, hidden) activation, forward and backward."""
    dt = DTYPES[dtype]
    e = torch.empty((), dtype=dt).element_size()
    n = rows * hidden
    shape = (rows, hidden)

    def make() -> list[torch.Tensor]:
        return [torch.randn(rows, hidden, device=device, dtype=dt),
                torch.ones(hidden, device=device, dtype=dt)]

    def ln(t: list[torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(t[0], (hidden,), t[1])

    def rms(t: list[torch.Tensor]) -> torch.Tensor:
        return F.rms_norm(t[0], (hidden,), t[1])

    def sm(t: list[torch.Tensor]) -> torch.Tensor:
        return torch.softmax(t[0], dim=-1)

    out = []
    for name, fn, grads in (("layer_norm", ln, (0, 1)), ("rms_norm", rms, (0, 1)),
                            ("softmax", sm, (0,))):
        out.append(_task(name, shape, dtype, "fwd", 2 * n * e, make, fn))
        out.append(_task(name, shape, dtype, "bwd", 3 * n * e, make, fn, grads))
    return out


def embedding_tasks(tokens: int, vocab: int, hidden: int, dtype: str,
                    device: torch.device) -> list[Task]:
    """Embedding lookup of ``tokens`` ids in a (vocab, hidden) table, forward and the
    backward to the table."""
    dt = DTYPES[dtype]
    e = torch.empty((), dtype=dt).element_size()
    shape = (tokens, vocab, hidden)

    def make() -> list[torch.Tensor]:
        return [torch.randint(0, vocab, (tokens,), device=device),
                torch.randn(vocab, hidden, device=device, dtype=dt)]

    def emb(t: list[torch.Tensor]) -> torch.Tensor:
        return F.embedding(t[0], t[1])

    fwd_bytes = 2 * tokens * hidden * e + 8 * tokens
    bwd_bytes = tokens * hidden * e + vocab * hidden * e
    return [_task("embedding", shape, dtype, "fwd", fwd_bytes, make, emb),
            _task("embedding", shape, dtype, "bwd", bwd_bytes, make, emb, (1,))]


def cross_entropy_tasks(tokens: int, vocab: int, dtype: str,
                        device: torch.device) -> list[Task]:
    """F.cross_entropy on (tokens, vocab) logits in ``dtype``, mean reduction,
    forward and backward to the logits."""
    dt = DTYPES[dtype]
    e = torch.empty((), dtype=dt).element_size()
    shape = (tokens, vocab)

    def make() -> list[torch.Tensor]:
        return [torch.randn(tokens, vocab, device=device, dtype=dt),
                torch.randint(0, vocab, (tokens,), device=device)]

    def ce(t: list[torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(t[0], t[1])

    return [_task("cross_entropy", shape, dtype, "fwd", tokens * vocab * e, make, ce),
            _task("cross_entropy", shape, dtype, "bwd", 2 * tokens * vocab * e, make, ce,
                  (0,))]
