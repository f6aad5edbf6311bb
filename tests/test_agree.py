"""An error on one rank reaches every rank as the same exception, and no rank hangs.

On 2 gloo ranks: rank 0's planning raising an exception of any type (autopar's own
or not), and materialization failing on rank 1 only, make ``autopar.parallelize``
raise the same type and message on both ranks, with a note naming the rank, in
seconds; an exception that cannot be pickled arrives as a RankError; a rank that dies
is reported, not waited on. In-process: which failure counts as the first, what can
travel, and the collective timeout of the group ``parallelize`` starts.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import threading
import time
from typing import Any, Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.api import _join_torchrun_job
from autopar.errors import ConfigError, NoFeasiblePlanError, RankError
from autopar.examples.gpt import GPT, GPTConfig
from autopar.runtime.agree import (COLLECTIVE_TIMEOUT_S, SIMULTANEOUS_S, TIMEOUT_ENV, Failure,
                                   RankTraceback, agreed, collective_timeout, describe,
                                   first_failure)
from tests.dist_utils import RankFailure, RankPool
from tests.handmade_plans import megatron_plan

WORLD = 2
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


class SolverCrash(RuntimeError):
    """An exception autopar does not define, raised by a broken planner."""


class HoldsALock(Exception):
    """An exception that cannot be pickled: it holds a lock."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class Renamed(Exception):
    """Pickles, but comes back with another message: its ``__init__`` rewrites its
    argument, which is what pickling passes back."""

    def __init__(self, count: int | str) -> None:
        super().__init__(f"{count} experts left")


def tiny() -> tuple[GPT, torch.Tensor]:
    """A 2-block GPT and one global batch of 8 sequences of 16 tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4))
    return model, torch.randint(0, 128, (8, 16))


def outcome(step: Callable[[], Any]) -> dict[str, Any]:
    """What ``step`` raised on this rank: its type, message, notes, the traceback it
    carries from another rank (None when raised here), and the seconds it took."""
    start = time.monotonic()
    try:
        step()
    except Exception as e:  # noqa: BLE001 - what is raised is the point
        cause = e.__cause__
        return {"type": type(e).__qualname__, "message": str(e),
                "notes": getattr(e, "__notes__", []), "seconds": time.monotonic() - start,
                "remote": str(cause) if isinstance(cause, RankTraceback) else None,
                "least_bytes": getattr(e, "least_bytes", None)}
    return {"type": None, "seconds": time.monotonic() - start}


def planner_crashes() -> dict[str, Any]:
    """parallelize with a planner that raises SolverCrash (it runs on rank 0 only)."""
    model, x = tiny()

    def crash(*args: Any, **kwargs: Any) -> None:
        raise SolverCrash("the solver fell over")

    with mock.patch("autopar.planner.make_plan", crash):
        return outcome(lambda: autopar.parallelize(model, (x,), precision="fp32"))


def materialization_fails_on_rank_1() -> dict[str, Any]:
    """parallelize a meta GPT under a dp=2 plan; rank 1 runs out of memory while
    materializing its shards, after every collective of the lowering."""
    with torch.device("meta"):
        model, _ = tiny()
    plan = megatron_plan(model, dp=2)
    fail = mock.patch("autopar.runtime.lower.materialize",
                      side_effect=torch.OutOfMemoryError(OOM))
    with fail if dist.get_rank() == 1 else contextlib.nullcontext():
        return outcome(lambda: autopar.parallelize(model, plan=plan))


def nothing_fits() -> dict[str, Any]:
    """parallelize with a memory budget of 1 kB: rank 0's planner finds no plan."""
    model, x = tiny()
    return outcome(lambda: autopar.parallelize(model, (x,), precision="fp32",
                                               memory_budget=1024))


def rank_1_raises_unpicklable() -> dict[str, Any]:
    """Rank 1 raises HoldsALock inside :func:`agreed`; rank 0's block succeeds."""
    def step() -> None:
        with agreed("testing"):
            if dist.get_rank() == 1:
                raise HoldsALock("stuck")

    return outcome(step)


def every_rank_raises() -> dict[str, Any]:
    """Each rank raises its own ConfigError inside :func:`agreed` at the same time
    (after a barrier: a pooled rank may start a task a second after another)."""
    def step() -> None:
        dist.barrier()
        with agreed("testing"):
            raise ConfigError(f"rank {dist.get_rank()} is unhappy")

    return outcome(step)


def rank_1_dies() -> None:
    """Rank 1 exits inside :func:`agreed`; rank 0 raises what it learns of it."""
    with agreed("testing"):
        if dist.get_rank() == 1:
            os._exit(3)


def same_everywhere(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The outcome every rank had (asserting they are one, seconds aside); it took
    every rank under 10 s."""
    assert all(r["seconds"] < 10 for r in results), [r["seconds"] for r in results]
    fields = [{k: v for k, v in r.items() if k not in ("seconds", "remote")} for r in results]
    assert all(f == fields[0] for f in fields), fields
    return fields[0]


@pytest.mark.multirank
def test_a_non_autopar_error_in_planning_reaches_every_rank(rank_pool: RankPool) -> None:
    results = rank_pool.run(WORLD, planner_crashes, timeout_s=60)
    got = same_everywhere(results)
    assert got["type"] == "SolverCrash" and got["message"] == "the solver fell over"
    assert got["notes"] == ["raised on rank 0 of 2 while planning in autopar.parallelize; "
                            "every rank of the job raises it"]
    assert results[0]["remote"] is None  # rank 0 raises its own exception object
    assert "the traceback on rank 0" in results[1]["remote"]
    assert "crash" in results[1]["remote"]  # the planner's frame, from rank 0


@pytest.mark.multirank
def test_a_failure_in_apply_plan_on_one_rank_reaches_every_rank(rank_pool: RankPool) -> None:
    results = rank_pool.run(WORLD, materialization_fails_on_rank_1, timeout_s=60)
    got = same_everywhere(results)
    assert got["type"] == "OutOfMemoryError" and got["message"] == OOM
    assert got["notes"] == ["raised on rank 1 of 2 while applying the plan in "
                            "autopar.parallelize; every rank of the job raises it"]
    assert results[1]["remote"] is None
    assert "the traceback on rank 1" in results[0]["remote"]


@pytest.mark.multirank
def test_an_autopar_error_in_planning_keeps_its_type(rank_pool: RankPool) -> None:
    got = same_everywhere(rank_pool.run(WORLD, nothing_fits, timeout_s=60))
    assert got["type"] == "NoFeasiblePlanError"
    assert got["message"].startswith("no plan fits in 1.02 kB per device")
    assert got["least_bytes"] is not None and got["least_bytes"] > 1024
    assert "rank 0 of 2" in got["notes"][0]


@pytest.mark.multirank
def test_an_unpicklable_error_arrives_as_a_rank_error(rank_pool: RankPool) -> None:
    results = rank_pool.run(WORLD, rank_1_raises_unpicklable, timeout_s=60)
    got = same_everywhere(results)
    assert got["type"] == "RankError"
    assert got["message"].startswith(f"rank 1 of 2 raised {__name__}.HoldsALock while "
                                     f"testing: stuck (the exception does not survive")
    assert "the traceback on rank 1" in results[0]["remote"]


@pytest.mark.multirank
def test_the_first_of_several_failing_ranks_is_raised_everywhere(rank_pool: RankPool) -> None:
    got = same_everywhere(rank_pool.run(WORLD, every_rank_raises, timeout_s=60))
    assert got["type"] == "ConfigError" and got["message"] == "rank 0 is unhappy"
    assert got["notes"] == ["raised on rank 0 of 2 while testing; every rank of the job "
                            "raises it (ranks 0, 1 failed; this is the first failure)"]


@pytest.mark.multirank
def test_a_dead_rank_is_reported_not_waited_on(rank_pool: RankPool) -> None:
    """Runs last: rank 1's death ends the pool's group of 2 (the next use starts one)."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        rank_pool.run(WORLD, rank_1_dies, timeout_s=60)
    assert time.monotonic() - start < 30
    assert "rank 0 of 2" in str(caught.value)
    assert "RankError: rank 0 of 2 finished testing, but could not learn whether the " \
           "other ranks did: a rank died" in str(caught.value)


def failure(rank: int, at: float) -> Failure:
    """A failure of ``rank`` at time ``at``."""
    return Failure(rank, at, "builtins.ValueError", f"from {rank}", "", None)


def test_the_first_failure_is_the_earliest_then_the_lowest_rank() -> None:
    assert first_failure([None, None]) is None
    late_timeout, cause = failure(0, 1000.0), failure(1, 700.0)
    assert first_failure([late_timeout, cause]) is cause
    together = [None, failure(1, 5.0), failure(2, 5.0 + SIMULTANEOUS_S / 2)]
    assert first_failure(together) is together[1]
    assert first_failure([failure(0, 5.0 + SIMULTANEOUS_S / 2), failure(1, 5.0)]).rank == 0


def test_only_an_error_that_comes_back_the_same_travels() -> None:
    err = NoFeasiblePlanError("no plan fits")
    err.least_bytes = 5.0
    assert describe(err, 0).pickled is not None
    assert describe(HoldsALock("x"), 0).pickled is None
    assert describe(Renamed(3), 0).pickled is None
    d = describe(SolverCrash("boom"), 3)
    assert (d.rank, d.kind, d.message) == (3, f"{__name__}.SolverCrash", "boom")


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """torchrun's environment without a process group; the keywords each
    ``init_process_group`` call would have got."""
    calls: list[dict[str, Any]] = []
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append({"backend": backend, **kw}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return calls


def test_the_group_parallelize_starts_times_out(torchrun_env, monkeypatch) -> None:
    _join_torchrun_job()
    assert torchrun_env[-1] == {"backend": "gloo",
                                "timeout": datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)}
    monkeypatch.setenv(TIMEOUT_ENV, "42")
    _join_torchrun_job()
    assert torchrun_env[-1]["timeout"] == datetime.timedelta(seconds=42)
    _join_torchrun_job(7.5)  # the keyword wins over the environment
    assert torchrun_env[-1]["timeout"] == datetime.timedelta(seconds=7.5)


@pytest.mark.parametrize("env,keyword,source", [
    ("soon", None, f"{TIMEOUT_ENV}='soon'"), ("-1", None, f"{TIMEOUT_ENV}=-1.0"),
    (None, math.nan, "collective_timeout_s=nan"), (None, 0, "collective_timeout_s=0"),
    (None, True, "collective_timeout_s=True")])
def test_a_bad_timeout_is_refused(monkeypatch, env, keyword, source) -> None:
    if env is None:
        monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(TIMEOUT_ENV, env)
    with pytest.raises(ConfigError, match=f"^{re.escape(source)}: expected a finite positive"):
        collective_timeout(keyword)


def test_rank_error_is_exported() -> None:
    assert autopar.RankError is RankError
