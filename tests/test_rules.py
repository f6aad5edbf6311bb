"""Every sharding rule is checked against real execution: for each legal split of a
label over two simulated devices, running the op on the local shards and combining
the results (concatenate a Shard, sum a Partial) gives the unsplit op's output."""

import torch

from autopar.graph import OpNode, TensorMeta
from autopar.strategies.rules import rule_for, view_rule

N = 2  # simulated devices along one mesh axis


def meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch."))


def local(t: torch.Tensor, labels, lab, rank: int) -> torch.Tensor:
    if labels is None or lab not in labels:
        return t
    d = labels.index(lab)
    return t.chunk(N, dim=d)[rank]


def fill(args, it):
    """Substitute tensors for "%" markers, also inside lists."""
    return [fill(a, it) if isinstance(a, list) and "%" in a else (next(it) if a == "%" else a)
            for a in args]


def local_shape_args(args, rule, lab):
    """Shape arguments (views, expands) as a device sees them: the split dim divided."""
    out = []
    for a in args:
        if isinstance(a, list) and a and all(isinstance(x, int) for x in a) and \
                len(a) == len(rule.out) and lab in rule.out:
            d = rule.out.index(lab)
            a = [x // N if i == d and x > 0 else x for i, x in enumerate(a)]
        out.append(a)
    return out


def check(target: str, tensors: list[torch.Tensor], args: list, labels_to_check=None,
          skip=()):
    """Run the op whole and per shard for every splittable label; compare."""
    op = eval("torch.ops." + target)  # e.g. torch.ops.aten.linear.default
    full = op(*fill(args, iter(tensors)))
    node = OpNode("n", "op", target, inputs=[f"t{i}" for i in range(len(tensors))],
                  args=[f"%t{i}" if a == "%" else a for i, a in enumerate(args)], out=meta(full))
    # fix tensor names in args to the running index
    k = 0
    for i, a in enumerate(args):
        if a == "%":
            node.args[i] = f"%t{k}"
            k += 1
    rule = rule_for(node, [meta(t) for t in tensors])
    labels = sorted({lab for labs in rule.ins if labs for lab in labs} - rule.forbid)
    labels = [lab for lab in labels if lab in rule.out or lab in rule.reduce]
    checked = 0
    for lab in labels:
        if lab in skip:
            continue
        dims_ok = all(t.shape[labs.index(lab)] % N == 0
                      for t, labs in zip(tensors + [full], rule.ins + (rule.out,))
                      if labs and lab in labs)
        if not dims_ok:
            continue
        outs = []
        for rk in range(N):
            shards = [local(t, labs, lab, rk) for t, labs in zip(tensors, rule.ins)]
            if lab in rule.reduce and rk > 0 and rule.kind == "matmul":
                # a bias (an input without the contracted label) is added once, not N times
                shards = [t if labs and lab in labs else torch.zeros_like(t)
                          for t, labs in zip(shards, rule.ins)]
            largs = local_shape_args(args, rule, lab) if target.startswith(
                ("aten.view", "aten.expand", "aten.reshape")) else args
            outs.append(op(*fill(largs, iter(shards))))
        if lab in rule.out:
            got = torch.cat(outs, dim=rule.out.index(lab))
        else:
            assert lab in rule.reduce
            got = sum(outs)
            if target.startswith(("aten.mean", "aten.cross_entropy_loss")):
                got = got / N
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5, msg=f"{target} label {lab}")
        checked += 1
    if labels_to_check is not None:
        assert checked >= labels_to_check, (target, labels, checked)
    return rule


def r(*shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    return torch.randn(*shape, generator=g, dtype=dtype)


def test_linear_all_labels():
    rule = check("aten.linear.default", [r(2, 4, 6), r(8, 6), r(8)], ["%", "%", "%"], 3)
    assert rule.reduce == {"k"}


def test_linear_contraction_is_partial():
    rule = check("aten.linear.default", [r(4, 6), r(8, 6)], ["%", "%"], 3)
    assert "k" in rule.reduce and "k" not in rule.out


def test_matmul_einsum_bmm_mm():
    check("aten.matmul.default", [r(2, 4, 6), r(6, 8)], ["%", "%"], 3)
    check("aten.matmul.default", [r(2, 3, 4, 6), r(2, 3, 6, 8)], ["%", "%"], 4)
    check("aten.bmm.default", [r(2, 4, 6), r(2, 6, 8)], ["%", "%"], 4)
    check("aten.mm.default", [r(4, 6), r(6, 8)], ["%", "%"], 3)
    check("aten.einsum.default", [r(2, 4, 6), r(2, 8, 6)], ["bsh,bth->bst", ["%", "%"]], 0)


def test_embedding_vocab_split_is_partial_after_masking():
    w, idx = r(8, 6), torch.tensor([[0, 7, 3, 2], [4, 4, 1, 6]])
    node = OpNode("n", "op", "aten.embedding.default", ["w", "i"], ["%w", "%i"],
                  out=TensorMeta((2, 4, 6), "float32"))
    rule = rule_for(node, [meta(w), meta(idx)])
    assert rule.reduce == {"v"} and rule.out[-1] == "h"
    # masked local lookups sum to the full lookup (what vocab-parallel embeddings do)
    full = torch.nn.functional.embedding(idx, w)
    parts = []
    for rk in range(N):
        lo, hi = rk * 4, rk * 4 + 4
        mask = (idx >= lo) & (idx < hi)
        out = torch.nn.functional.embedding((idx - lo).clamp(0, 3), w[lo:hi])
        parts.append(out * mask[..., None])
    torch.testing.assert_close(sum(parts), full)
    check("aten.embedding.default", [w, idx], ["%", "%"], 3, skip=("v",))


def test_norms_softmax_pointwise_reductions():
    rule = check("aten.layer_norm.default", [r(2, 4, 6), r(6), r(6)], ["%", [6], "%", "%"], 2)
    assert "d2" in rule.forbid
    check("aten.rms_norm.default", [r(2, 4, 6), r(6)], ["%", [6], "%", 1e-5], 2)
    check("aten._softmax.default", [r(2, 4, 6)], ["%", -1, False], 2)
    check("aten.add.Tensor", [r(2, 4, 6), r(4, 6)], ["%", "%"], 3)
    check("aten.mul.Tensor", [r(2, 4, 6), r(1, 4, 1)], ["%", "%"], 3)
    check("aten.gelu.default", [r(2, 4, 6)], ["%"], 3)
    check("aten.sum.dim_IntList", [r(2, 4, 6)], ["%", [-1]], 3)
    check("aten.mean.dim", [r(2, 4, 6)], ["%", [1], True], 3)


def test_attention_splits_batch_and_heads_not_causal_queries():
    q, k, v = r(2, 4, 6, 8), r(2, 4, 6, 8), r(2, 4, 6, 8)
    rule = check("aten.scaled_dot_product_attention.default", [q, k, v],
                 ["%", "%", "%", None, 0.0, True], 3)
    assert {"L", "S", "E"} <= rule.forbid


def test_views_and_transposes():
    check("aten.view.default", [r(2, 4, 12)], ["%", [2, 4, 4, 3]], 3)
    check("aten.view.default", [r(2, 4, 4, 3)], ["%", [2, 4, 12]], 3)
    check("aten.flatten.using_ints", [r(2, 4, 6)], ["%", 0, -2], 2)
    check("aten.transpose.int", [r(2, 4, 6)], ["%", 1, 2], 3)
    check("aten.permute.default", [r(2, 4, 6)], ["%", [2, 0, 1]], 3)
    check("aten.unsqueeze.default", [r(2, 4)], ["%", 1], 2)
    check("aten.expand.default", [r(2, 1, 4)], ["%", [2, 6, 4]], 2)
    check("aten.slice.Tensor", [r(2, 4, 6)], ["%", 2, 0, 6, 2], 2)
    check("aten.select.int", [r(2, 4, 6)], ["%", 1, 0], 2)


def test_cross_entropy_splits_rows_only():
    logits, tgt = r(8, 6), torch.randint(0, 6, (8,))
    rule = check("aten.cross_entropy_loss.default", [logits, tgt], ["%", "%"], 1)
    assert "c" in rule.forbid


def test_view_rule_groups_split_and_merged_dims():
    rule = view_rule((2, 8, 12), (16, 3, 4), _fresh())
    ins, out = rule.ins[0], rule.out
    assert out[0] == ins[0]          # (2, 8) -> 16 keeps the leading dim's split
    assert out[1] == ins[2]          # 12 -> (3, 4) keeps the leading split
    assert ins[1] not in out and out[2] not in ins


def _fresh():
    from autopar.strategies.rules import _Fresh
    return _Fresh()
