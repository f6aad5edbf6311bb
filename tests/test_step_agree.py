"""A failure on one rank while training is raised on every rank within seconds, naming
that rank (:mod:`autopar.runtime.failure_watch`), and no rank waits out the collective
timeout.

On 2 gloo ranks under a dp=2 plan (FSDP2): an error raised on rank 1 in ``step()``'s
loss, in a backward hook during ``step()``, in ``pm(x)`` and inside a checkpoint save
reaches rank 0, which was waiting in a collective for rank 1, as the same exception with
a note naming rank 1, in seconds. In-process: the watch's thread sees a failure posted
by another rank and the rank's next guarded call raises it; only accepted connections
on listening ports other than the store's are cut.
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.runtime.agree import describe
from autopar.runtime.connections import accepted_sockets, job_store
from autopar.runtime.failure_watch import POLL_S, FailureWatch, Posted
from tests.dist_utils import RankPool, free_port
from tests.handmade_plans import megatron_plan
from tests.test_agree import outcome, same_everywhere, tiny

WORLD = 2
FAULT = "injected fault on rank 1"
STEP_NOTE = ("raised on rank 1 of 2 while running a training step (ParallelModel.step); "
             "every rank of the job raises it")


def trained() -> tuple[autopar.ParallelModel, torch.Tensor]:
    """The tiny GPT under dp=2 (FSDP2), after one good step (its connections made)."""
    model, x = tiny()
    pm = autopar.parallelize(model, plan=megatron_plan(model, dp=2))
    pm.step(x, x)
    return pm, x


def on_rank_1(patch: Callable[[], Any]) -> contextlib.AbstractContextManager:
    """``patch()`` on rank 1, nothing on rank 0."""
    return patch() if dist.get_rank() == 1 else contextlib.nullcontext()


def fresh_world() -> None:
    """A new default process group over a new store: the failure before cut the old
    group's connections, but its store still answers, and carries rank 0's new port."""
    old, rank = job_store(), dist.get_rank()
    n = old.add(f"tests/fresh-world/rank-{rank}", 1)
    if rank == 0:
        old.set(f"tests/fresh-world/{n}", str(free_port()))
    port = int(old.get(f"tests/fresh-world/{n}"))
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)


def loss_fails_in_step(root: str) -> list[dict[str, Any]]:
    """Rank 1's loss raises after the forward; rank 0 goes on into the backward's
    reduce-scatter, which waits for rank 1. Then a second step on rank 0."""
    pm, x = trained()
    with on_rank_1(lambda: mock.patch.object(pm, "_loss", side_effect=RuntimeError(FAULT))):
        first = outcome(lambda: pm.step(x, x))
    return [first, outcome(lambda: pm.step(x, x)) if dist.get_rank() == 0 else first]


def backward_hook_fails_in_step(root: str) -> dict[str, Any]:
    """A backward hook of rank 1's second block raises during step()'s backward."""
    pm, x = trained()

    def hook(*args: Any) -> None:
        raise RuntimeError(FAULT)

    block = pm.module.blocks[1]
    with on_rank_1(lambda: block.register_full_backward_hook(hook)):
        return outcome(lambda: pm.step(x, x))


def forward_fails(root: str) -> dict[str, Any]:
    """Rank 1's ``pm(x)`` raises in its first block; rank 0's forward needs no
    collective (ZeRO-0) and its guarded backward waits in the gradient all-reduce."""
    pm, x = trained()
    half = x[:4]

    def train() -> None:
        out = pm(half)
        with pm.guarded("running the backward of pm(x)"):
            out.float().mean().backward()

    with on_rank_1(lambda: mock.patch.object(pm.module.blocks[0], "forward",
                                             side_effect=RuntimeError(FAULT))):
        return outcome(train)


def save_fails(root: str) -> dict[str, Any]:
    """Rank 1 cannot write its shards; rank 0 waits in the save's collectives."""
    pm, _ = trained()
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    with on_rank_1(lambda: mock.patch("autopar.runtime.checkpoint.save_state",
                                      side_effect=OSError(FAULT))):
        return outcome(lambda: autopar.save(f"{root}/step-1", pm, opt, step=1))


SCENARIOS = {"step": loss_fails_in_step, "backward hook": backward_hook_fails_in_step,
             "forward": forward_fails, "save": save_fails}


def every_failure(root: str) -> dict[str, Any]:
    """Each scenario on a fresh process group; their outcomes by name."""
    out = {}
    for name, scenario in SCENARIOS.items():
        fresh_world()
        out[name] = scenario(root)
    return out


@pytest.fixture(scope="module")
def outcomes(rank_pool: RankPool, tmp_path_factory) -> tuple[list[dict[str, Any]], str]:
    """Every scenario's outcome on each of 2 ranks, and the checkpoint root; the pool's
    group of 2 is ended afterwards (its default group is the last scenario's)."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    try:
        yield rank_pool.run(WORLD, every_failure, root, timeout_s=120), root
    finally:
        rank_pool.discard(WORLD)


@pytest.mark.multirank
def test_a_failure_in_step_reaches_the_waiting_rank(outcomes) -> None:
    results = [r["step"] for r in outcomes[0]]
    got = same_everywhere([r[0] for r in results])
    assert (got["type"], got["message"], got["notes"]) == ("RuntimeError", FAULT, [STEP_NOTE])
    assert results[1][0]["remote"] is None  # rank 1 raises its own exception object
    assert "the traceback on rank 1" in results[0][0]["remote"]
    again = results[0][1]  # rank 0's next step raises it at once, without a collective
    assert (again["type"], again["message"], again["notes"]) == ("RuntimeError", FAULT,
                                                                 [STEP_NOTE])
    assert again["seconds"] < 1


@pytest.mark.multirank
def test_a_failing_backward_hook_reaches_the_waiting_rank(outcomes) -> None:
    got = same_everywhere([r["backward hook"] for r in outcomes[0]])
    assert (got["type"], got["message"], got["notes"]) == ("RuntimeError", FAULT, [STEP_NOTE])


@pytest.mark.multirank
def test_a_failure_in_pm_x_reaches_a_guarded_backward(outcomes) -> None:
    got = same_everywhere([r["forward"] for r in outcomes[0]])
    assert (got["type"], got["message"], got["notes"]) == (
        "RuntimeError", FAULT, ["raised on rank 1 of 2 while running the forward "
                                "(ParallelModel.forward); every rank of the job raises it"])


@pytest.mark.multirank
def test_a_failure_in_a_save_reaches_the_waiting_rank(outcomes) -> None:
    results, root = outcomes
    got = same_everywhere([r["save"] for r in results])
    assert (got["type"], got["message"], got["notes"]) == (
        "OSError", FAULT, [f"raised on rank 1 of 2 while saving the checkpoint "
                           f"{root}/step-1; every rank of the job raises it"])


def test_a_watch_raises_the_failure_another_rank_posted(monkeypatch) -> None:
    """Rank 1's guarded call fails; rank 0's thread sees it within a few polls and
    rank 0's guarded call raises it, once its own block is done, and its next at once."""
    cuts: list[int] = []
    monkeypatch.setattr("autopar.runtime.failure_watch.break_connections",
                        lambda groups, port: cuts.append(port))
    store = dist.HashStore()
    one, zero = (FailureWatch(dist.PrefixStore("w/", store), r, WORLD, [], 7) for r in (1, 0))
    with pytest.raises(KeyError) as own:
        with one.guard("reading the data"):
            raise KeyError("no such shard")
    assert own.value.__notes__ == ["raised on rank 1 of 2 while reading the data; every rank "
                                   "of the job raises it"]
    with pytest.raises(KeyError) as shared:
        with zero.guard("running a training step"):
            time.sleep(4 * POLL_S)
    assert (str(shared.value), shared.value.__notes__) == (str(own.value), own.value.__notes__)
    assert "the traceback on rank 1" in str(shared.value.__cause__)
    with pytest.raises(KeyError):
        with zero.guard("running a training step"):
            pytest.fail("the block runs after another rank failed")
    assert cuts == [7, 7]  # each rank cut its connections once
    zero.close()
    one.close()


def test_the_first_failure_posted_is_the_one_raised() -> None:
    store = dist.PrefixStore("w/", dist.HashStore())
    watch = FailureWatch(store, 0, WORLD, [], None)
    first = Posted("saving", describe(ValueError("first"), 1))
    assert watch._post(first) == first
    assert watch._post(Posted("saving", describe(ValueError("later"), 0))) == first


def test_only_accepted_connections_are_cut() -> None:
    """The process's end of connections accepted on its listening ports, not the ones
    it opened, nor those on the ports it keeps (the store's)."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    port = server.getsockname()[1]
    try:
        assert accepted.fileno() in accepted_sockets(set())
        assert client.fileno() not in accepted_sockets(set())
        assert server.fileno() not in accepted_sockets(set())
        assert accepted.fileno() not in accepted_sockets({port})
    finally:
        for s in (client, accepted, server):
            s.close()
