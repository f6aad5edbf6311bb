"""Rules of the ops real models add to the zoo's: GQA's key/value heads
(``repeat_interleave``, ``expand`` + ``reshape``), ``numpy_T``, MoE routing (top-k,
sort, cumsum, one-hot, gather / scatter / index, histograms), batch and group norms,
and the fallback of an op with no rule. Each split is checked against real execution
as in :mod:`tests.test_rules`."""

from __future__ import annotations

import torch

from autopar.graph import OpNode, TensorMeta
from autopar.strategies.rules import has_rule, rule_for
from tests.test_rules import N, check, fill, local, meta, r


def test_repeat_interleave_splits_kv_heads_into_their_query_heads() -> None:
    # (batch, kv_heads, seq, head_dim) -> (batch, heads, seq, head_dim), 2 queries per kv head
    rule = check("aten.repeat_interleave.self_int", [r(2, 4, 6, 8)], ["%", 2, 1], 4)
    assert rule.ins[0][1] == rule.out[1] and not rule.forbid
    # a tensor of repeats: the repeated dim is not split; no dim: nothing is
    rule = rule_for(_node("aten.repeat_interleave.self_Tensor", (2, 4, 4), ["%", "%", 1]),
                    [TensorMeta((2, 2), "float32"), TensorMeta((2,), "int64")])
    assert rule.ins[0][1] in rule.forbid


def test_expand_reshape_gqa_keeps_the_kv_head_split() -> None:
    """Hugging Face's ``repeat_kv``: x[:, :, None].expand(b, kv, rep, s, d).reshape(b,
    kv·rep, s, d); the kv-head label reaches the query-head dim, and each rank's
    kv heads expand to exactly its query heads."""
    x = r(2, 4, 6, 8)
    u = check("aten.unsqueeze.default", [x], ["%", 2], 4)
    e = check("aten.expand.default", [x[:, :, None]], ["%", [2, 4, 3, 6, 8]], 4)
    v = check("aten.reshape.default", [x[:, :, None].expand(2, 4, 3, 6, 8)],
              ["%", [2, 12, 6, 8]], 3)
    head = u.out[1]
    assert e.ins[0][1] == e.out[1] and v.ins[0][1] == v.out[1]
    assert head == u.ins[0][1]
    full = x[:, :, None].expand(2, 4, 3, 6, 8).reshape(2, 12, 6, 8)
    parts = [t[:, :, None].expand(2, 2, 3, 6, 8).reshape(2, 6, 6, 8) for t in x.chunk(N, 1)]
    torch.testing.assert_close(torch.cat(parts, 1), full)


def test_numpy_T_and_mT_are_transposes() -> None:
    rule = check("aten.numpy_T.default", [r(4, 6)], ["%"], 2)
    assert rule.out == rule.ins[0][::-1]
    rule = check("aten.mT.default", [r(2, 4, 6)], ["%"], 3)
    assert rule.out == (rule.ins[0][0], rule.ins[0][2], rule.ins[0][1])


def check_outputs(target: str, tensors: list[torch.Tensor], args: list, labels: int) -> None:
    """As :func:`tests.test_rules.check` for an op with several outputs (each compared)."""
    op = eval("torch.ops." + target)
    full = op(*fill(args, iter(tensors)))
    node = _node(target, tuple(full[0].shape), args)
    node.outs = [meta(t) for t in full]
    rule = rule_for(node, [meta(t) for t in tensors])
    splittable = [lab for lab in sorted({x for labs in rule.ins if labs for x in labs}
                                        - rule.forbid) if lab in rule.out]
    for lab in splittable:
        outs = [op(*fill(args, iter([local(t, labs, lab, k) for t, labs in
                                     zip(tensors, rule.ins)]))) for k in range(N)]
        d = rule.out.index(lab)
        for i, whole in enumerate(full):
            torch.testing.assert_close(torch.cat([o[i] for o in outs], d), whole)
    assert len(splittable) >= labels, (target, rule)
    return rule


def test_topk_sort_cumsum_split_every_dim_but_the_scanned_one() -> None:
    for target, args in [("aten.topk.default", ["%", 2]), ("aten.sort.default", ["%"])]:
        rule = check_outputs(target, [r(4, 3, 8)], args, 2)
        scanned = rule.ins[0][2]
        assert scanned in rule.forbid and scanned in rule.per_rank
    rule = check("aten.cumsum.default", [r(4, 4, 8)], ["%", 0], 2)
    assert rule.per_rank == {rule.ins[0][0]}


def test_one_hot_gather_scatter_and_index_select() -> None:
    idx = torch.tensor([[0, 3, 1, 5], [2, 2, 0, 4], [1, 0, 3, 3], [3, 1, 2, 0]])
    check("aten.one_hot.default", [idx], ["%", 6], 2)
    check("aten.gather.default", [r(4, 6), idx], ["%", 1, "%"], 1)
    check("aten.scatter_add.default", [r(4, 6), idx, r(4, 4)], ["%", 1, "%", "%"], 1)
    rule = check("aten.index_select.default", [r(6, 6), idx[0]], ["%", 0, "%"], 2)
    assert rule.ins[0][0] in rule.forbid


def test_advanced_index_and_index_put() -> None:
    tokens = torch.tensor([3, 0, 2, 2, 1, 4])
    # x[tokens]: the index splits the output rows, x's feature dim passes through
    rule = check("aten.index.Tensor", [r(5, 8), tokens], ["%", ["%"]], 2)
    assert rule.ins[0][0] in rule.forbid
    rule = check("aten.index.Tensor", [r(2, 5, 8), tokens], ["%", [None, "%"]], 3)
    assert rule.out[0] == rule.ins[0][0] and rule.out[2] == rule.ins[0][2]
    # x[tokens] = values: x's feature dim and the values' split together
    rule = check("aten.index_put.default", [r(5, 8), torch.tensor([4, 0, 2]), r(3, 8)],
                 ["%", ["%"], "%", True], 1)
    assert rule.out[1] == rule.ins[0][1] == rule.ins[2][1]


def test_histograms_count_the_ranks_own_elements() -> None:
    for target, args in [("aten.histc.default", ["%", 4, 0, 3]),
                         ("aten.bincount.default", ["%"])]:
        x = torch.tensor([0, 3, 1, 1, 2, 3, 3, 0])
        x = x.float() if "histc" in target else x
        rule = check(target, [x], args, 0)
        assert rule.per_rank == rule.forbid == {rule.ins[0][0]}


def test_batch_norm_is_a_batch_statistic_group_norm_is_not() -> None:
    x, c = r(4, 6, 5), r(6)
    bn = check("aten.batch_norm.default", [x, c, c, torch.zeros(6), torch.ones(6)],
               ["%", "%", "%", "%", "%", True, 0.1, 1e-5, False], 1)
    assert bn.ins[0][0] in bn.forbid and bn.ins[0][1] not in bn.forbid
    gn = check("aten.group_norm.default", [x, c, c], ["%", 2, "%", "%", 1e-5, False], 1)
    assert gn.ins[0][0] not in gn.forbid and gn.ins[0][1] in gn.forbid


def test_an_op_without_a_rule_gets_the_replicated_fallback() -> None:
    node = _node("mylib.route.default", (4, 6), ["%", "%"])
    rule = rule_for(node, [TensorMeta((4, 6), "float32"), TensorMeta((6,), "float32")])
    assert rule.kind == "fallback" and not has_rule(node.target)
    assert rule.forbid == {lab for labs in rule.ins + (rule.out,) for lab in labs}
    assert has_rule("aten.topk.default") and has_rule("aten.add_.Tensor")


def _node(target: str, out: tuple[int, ...], args: list) -> OpNode:
    k = sum(1 for a in args if a == "%")
    return OpNode("n", "op", target, inputs=[f"t{i}" for i in range(k)], args=list(args),
                  out=TensorMeta(out, "float32"))
