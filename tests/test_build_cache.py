"""A problem repriced from the build cache equals one built from scratch."""

from __future__ import annotations

import pytest

from autopar.capture import capture
from autopar.cluster import Cluster
from autopar.examples import zoo
from autopar.sharding import Mesh
from autopar.solvers.problem_build import build_problem
from autopar.strategies.analysis import analyze
from autopar.strategies.settings import Settings


@pytest.fixture(scope="module")
def analysis():
    model, inputs = zoo.get("tiny-gpt", batch_size=8)
    return analyze(capture(model, inputs))


@pytest.mark.parametrize("zero,micro,offload,optimizer", [
    (0, 1, False, "adamw"), (2, 4, False, "adamw"), (3, 2, False, "sgd"), (3, 1, True, "adam")])
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_repriced_problem_equals_fresh_build(analysis, zero, micro, offload, optimizer, dp):
    hw = Cluster("a100-80g", 1, 8).hardware()

    def settings(d: int, z: int, m: int, off: bool, opt: str) -> Settings:
        return Settings(Mesh(("dp", "tp"), (d, 2)), 2, m, z, "bf16", opt, 5e9, hw, 8,
                        offload=off)

    cache: dict = {}
    build_problem(analysis, settings(4, 1, 3, False, "adamw"), cache)  # fills the cache
    repriced = build_problem(analysis, settings(dp, zero, micro, offload, optimizer), cache)
    fresh = build_problem(analysis, settings(dp, zero, micro, offload, optimizer))
    assert repriced is not fresh and sum(isinstance(k, tuple) for k in cache) == 1
    assert repriced.problem == fresh.problem
    assert repriced.strategies == fresh.strategies
    assert repriced.names == fresh.names


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_repriced_partial_gradients_follow_the_micro_batch_count(analysis, micro):
    """Without FSDP2 (fp32, dp = 1) a gradient partial over tp is reduced once per step,
    priced per micro-batch as its share of the step: a problem repriced for another
    micro-batch count equals a fresh build (recomputation groups included, which re-run
    the output's conversion but not that reduction)."""
    hw = Cluster("cpu", 1, 2).hardware()

    def settings(m: int) -> Settings:
        return Settings(Mesh(("dp", "tp"), (1, 2)), 2, m, 0, "fp32", "adamw", 5e9, hw, 2,
                        sequence_parallel=True)

    cache: dict = {}
    build_problem(analysis, settings(3), cache)  # fills the cache
    repriced = build_problem(analysis, settings(micro), cache)
    fresh = build_problem(analysis, settings(micro))
    assert repriced.problem == fresh.problem


def test_every_settings_field_is_in_the_key_or_repriced(analysis):
    """A field that changes layouts or op prices must be in the layout key, else a
    cached build would be reused with stale prices: every field outside
    REPRICED_SETTINGS changes the key; each repriced one, changed (pipelined and the
    memory budget too), gives the problem a fresh build gives."""
    from dataclasses import fields, replace

    from autopar.solvers.problem_build import REPRICED_SETTINGS, layout_key

    hw = Cluster("h100-sxm", 1, 8).hardware()
    base = Settings(Mesh(("dp", "tp"), (4, 2)), 2, 2, 1, "bf16", "adamw", 5e9, hw, 8)
    other = {"mesh": Mesh(("dp", "tp"), (2, 4)), "microbatch_size": 1, "precision": "fp32",
             "hw": Cluster("a100-80g", 1, 8).hardware(), "gpus_per_node": 4,
             "sequence_parallel": True, "loss_parallel": True, "split_weights": True,
             "recompute_modes": ("full",), "split_experts": True, "expert_imbalance": 1.5,
             "cp_variant": "ring", "compiled": True, "fold_experts": True}
    keyed = {f.name for f in fields(Settings)} - REPRICED_SETTINGS
    assert set(other) == keyed
    for name, value in other.items():
        assert layout_key(replace(base, **{name: value})) != layout_key(base), name
    changes = {"num_microbatches": 4, "zero": 3, "offload": True, "optimizer": "sgd",
               "memory_budget": 7e9, "pipelined": True}
    assert set(changes) == REPRICED_SETTINGS
    for name, value in changes.items():
        st = replace(base, **{name: value}, **({"zero": 3} if name == "offload" else {}))
        assert layout_key(st) == layout_key(base), name
        cache: dict = {}
        build_problem(analysis, base, cache)
        fresh = build_problem(analysis, st).problem
        assert build_problem(analysis, st, cache).problem == fresh, name
