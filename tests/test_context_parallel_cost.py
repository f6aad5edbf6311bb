"""Context parallelism's attention variants priced against hand-computed cases: a
datasheet profile (roofline attention) and a plain α-β link, so every figure below is
arithmetic on the formulas of docs/cost_models.md."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_models.context_parallel import (MASKED_SLOWDOWN, AttentionShape,
                                                  attention_call_s, cp_attention, local_calls)
from autopar.cost_models.hardware import LinkSpec
from autopar.errors import ConfigError

HW = autopar.Cluster("a100-80g", 1, 8).hardware()
LINK = LinkSpec(bandwidth=100e9, latency=10e-6)
A = AttentionShape(batch=1, seq=32768, heads=32, kv_heads=8, head_dim=128)
E = 2 * 128  # bytes per token and head of q, k or v (bf16, head_dim 128)


def roofline(pairs: float, heads: int) -> float:
    """Forward+backward seconds of attention over ``pairs`` (query, key) pairs on the
    profile's bf16 matrix rate (compute-bound at these sizes)."""
    rate = HW.matmul_flops["bf16"] * HW.matmul_efficiency["bf16"]
    return 3.5 * 4 * heads * 128 * pairs / rate


def test_one_call_is_its_attended_pairs_at_the_matrix_rate():
    f, b = attention_call_s(HW, 1, 32, 8, 32768, 32768, 128, True, "bf16")
    assert f + b == pytest.approx(roofline(32768 ** 2 / 2, 32))
    assert b == pytest.approx(2.5 * f)
    f, b = attention_call_s(HW, 1, 32, 8, 4096, 32768, 128, False, "bf16")
    assert f + b == pytest.approx(roofline(4096 * 32768, 32))


def test_a_chunk_masked_from_the_keys_end_runs_the_slower_kernel():
    f, b = attention_call_s(HW, 1, 32, 8, 4096, 32768, 128, True, "bf16")
    pairs = 4096 * 32768 - 4096 ** 2 / 2  # the chunk ends where the keys end
    assert f + b == pytest.approx(MASKED_SLOWDOWN * roofline(pairs, 32))
    assert b == pytest.approx(2.5 * f)


def test_every_variant_does_a_cp_th_of_the_causal_work():
    whole = roofline(32768 ** 2 / 2, 32)
    for variant in ("allgather", "ring", "ulysses"):
        for cp in (2, 4, 8):
            calls = local_calls(variant, cp, A)
            pairs = sum(q * k - (q * q / 2 if causal else 0) for q, k, _, _, causal in calls)
            heads = 32 // cp if variant == "ulysses" else 32
            assert roofline(pairs, heads) == pytest.approx(whole / cp), (variant, cp)
            masked = sum(q * k - q * q / 2 for q, k, _, _, causal in calls
                         if causal and q < k)  # the all-gather's chunk on its key prefix
            priced = whole / cp + (MASKED_SLOWDOWN - 1) * roofline(masked, heads)
            assert cp_attention(variant, cp, A, HW, LINK).compute_s == pytest.approx(priced)
            assert (masked > 0) == (variant == "allgather")


def test_allgather_gathers_k_and_v_and_reduce_scatters_their_gradients():
    c = cp_attention("allgather", 4, A, HW, LINK)
    kv = 2 * E * 8 * 32768  # k and v of the whole sequence: 128 MiB
    one = 3 * 10e-6 + 3 / 4 * kv / 100e9  # ring of 4: 3 steps, 3/4 of the buffer
    assert c.comm_s == pytest.approx(2 * one) and c.exposed_s == c.comm_s
    assert c.kv_bytes == pytest.approx(3 / 4 * kv)


def test_ring_hides_each_block_behind_its_attention_step():
    c = cp_attention("ring", 4, A, HW, LINK)
    block = 2 * E * 8 * 8192  # one rank's k and v
    fwd_step = 10e-6 + block / 100e9
    bwd_step = 10e-6 + 2 * block / 100e9
    assert c.comm_s == pytest.approx(3 * (fwd_step + bwd_step))
    step = roofline(8192 * 4096, 32)  # 2c = 8192 queries on c = 4096 keys
    fwd, bwd = step / 3.5, step * 2.5 / 3.5
    assert c.exposed_s == pytest.approx(3 * (max(0, fwd_step - fwd) + max(0, bwd_step - bwd)))
    assert c.exposed_s == 0.0  # 32 MiB at 100 GB/s (0.34 ms) under 1.5 ms of attention


def test_ulysses_moves_q_k_v_and_the_output_by_all_to_all():
    c = cp_attention("ulysses", 4, A, HW, LINK)
    local = 32768 // 4
    a2a = [3 * 10e-6 + 3 / 4 * E * local * h / 100e9 for h in (32, 32, 8, 8)]
    assert c.comm_s == pytest.approx(2 * sum(a2a)) and c.exposed_s == c.comm_s
    # 8 kv heads over cp 8: one each, nothing repeated beyond the own share
    c8 = cp_attention("ulysses", 8, A, HW, LINK)
    assert c8.kv_bytes == 0.0


def test_shapes_a_variant_cannot_split_are_refused():
    with pytest.raises(ConfigError, match="does not divide them"):
        cp_attention("ulysses", 3, AttentionShape(1, 6144, 32, 8, 128), HW, LINK)
    with pytest.raises(ConfigError, match="divisible by 16"):
        cp_attention("ring", 8, AttentionShape(1, 1000, 32, 8, 128), HW, LINK)
    with pytest.raises(ConfigError, match="unknown context-parallel variant"):
        local_calls("zigzag", 2, A)
