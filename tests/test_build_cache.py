"""A problem repriced from the build cache equals one built from scratch."""

from __future__ import annotations

import pytest

from autopar.capture import capture
from autopar.cluster import Cluster
from autopar.examples import zoo
from autopar.sharding import Mesh
from autopar.strategies.analysis import analyze
from autopar.strategies.build import Settings, build_problem


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
