"""Memory-model accuracy: the planner's predicted peak bytes per rank against the peak
measured by :func:`autopar.runtime.memory_probe.measure_step_memory` for plans with
and without recomputation, every ZeRO stage, tensor parallelism and pipelines (under
GPipe the last rank is the fullest: it holds its own copy of the tied embedding).

One 4-rank gloo group (fp32 on CPU, AdamW) runs each plan on a tiny GPT whose
activations and training state are of the same size: one warm-up step (AdamW creates
its state in it), then one measured step ``step(); opt.step(); opt.zero_grad()``. The
prediction is ``plan.memory_per_device_bytes``; the measurement is the largest peak
over the ranks. Run ``python -m tests.test_memory_accuracy`` for the table.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import autopar
from autopar.examples.gpt import GPT, GPTConfig
from tests.dist_utils import RankPool, run_distributed

pytestmark = pytest.mark.multirank

WORLD, BATCH, SEQ, VOCAB = 4, 16, 64, 512
TOLERANCE = 0.10
PLANS = {  # name -> planning options (everything else fixed by the planner)
    "dp=4 zero=0": dict(dp=4, tp=1, pp=1, zero=0, recompute="none"),
    "dp=4 zero=1": dict(dp=4, tp=1, pp=1, zero=1, recompute="none"),
    "dp=4 zero=2 selective": dict(dp=4, tp=1, pp=1, zero=2, recompute="selective"),
    "dp=4 zero=3": dict(dp=4, tp=1, pp=1, zero=3, recompute="none"),
    "dp=4 zero=3 full": dict(dp=4, tp=1, pp=1, zero=3, recompute="full"),
    "dp=2 tp=2 selective": dict(dp=2, tp=2, pp=1, zero=0, recompute="selective"),
    "pp=2 dp=2 1f1b": dict(dp=2, tp=1, pp=2, zero=0, recompute="none", schedule="1f1b"),
    "pp=2 dp=2 1f1b full": dict(dp=2, tp=1, pp=2, zero=0, recompute="full", schedule="1f1b"),
    "pp=2 dp=2 gpipe zero=1": dict(dp=2, tp=1, pp=2, zero=1, recompute="none", schedule="gpipe"),
}


def _pipeline_tracker():
    """A ``MemTracker`` that follows a root module called once per micro-batch.

    ``MemTracker`` (private torch API, torch 2.5 to 2.13) takes a second forward of a
    root module for a second iteration and refuses it; a pipeline stage runs its
    forward once per micro-batch within one step. While such a call's pre-forward hook
    runs, a placeholder parent makes the stage look like a submodule, which the tracker
    follows (its bytes are tracked the same either way: storages, not modules)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PipelineMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            parents = self._mod_tracker.parents
            repeat = module in self.memory_tracking and not self._mod_tracker.is_bw
            if repeat:
                parents.add("<pipeline step>")
            try:
                super()._pre_fw_hook(module, inputs)
            finally:
                if repeat:
                    parents.discard("<pipeline step>")

    return PipelineMemTracker()


def make_model(device: str = "cpu") -> GPT:
    """The tiny GPT every plan runs (same seed on every rank)."""
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=64, n_layers=4, n_heads=4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch of token ids and next-token targets."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def make_plans() -> dict[str, autopar.Plan]:
    """The plans of :data:`PLANS`, planned on meta for 4 CPU ranks in fp32."""
    x, _ = batch()
    cluster = autopar.Cluster("cpu", 1, WORLD)
    return {name: autopar.plan(make_model("meta"), (x.to("meta"),), cluster=cluster,
                               precision="fp32", optimizer="adamw", global_batch=BATCH, **kw)
            for name, kw in PLANS.items()}


def measure(texts: dict[str, str]) -> dict[str, dict]:
    """Run inside each rank: the measured step memory of every plan (a pipelined one
    with :func:`_pipeline_tracker`; the probe's own tracker is restored after)."""
    from autopar.runtime import apply_plan
    from autopar.runtime import memory_probe

    own_tracker = memory_probe._tracker
    out = {}
    x, y = batch()
    try:
        for name, text in texts.items():
            plan = autopar.Plan.from_json(text)
            pm = apply_plan(make_model(), plan)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

            def step() -> None:
                pm.step(x, y)
                opt.step()
                opt.zero_grad()
            step()  # AdamW creates its state
            pipelined = plan.pipeline is not None
            memory_probe._tracker = _pipeline_tracker if pipelined else own_tracker
            mem = memory_probe.measure_step_memory(step, modules=[pm], optimizers=[opt],
                                                   device="cpu")
            out[name] = {"peak": mem.peak_bytes, "breakdown": dict(mem.breakdown)}
            del pm, opt
    finally:
        memory_probe._tracker = own_tracker
    return out


def accuracy_table(run: Callable[..., list] = run_distributed
                   ) -> list[tuple[str, float, float, dict, dict]]:
    """(plan, predicted bytes, measured bytes (max over ranks), predicted breakdown,
    measured breakdown of the fullest rank) for every plan, measured on the ranks that
    ``run`` (:func:`run_distributed` or :meth:`RankPool.run`) starts."""
    plans = make_plans()
    ranks = run(WORLD, measure, {n: p.to_json() for n, p in plans.items()}, timeout_s=600)
    rows = []
    for name, plan in plans.items():
        worst = max(ranks, key=lambda r: r[name]["peak"])[name]
        rows.append((name, plan.memory_per_device_bytes, float(worst["peak"]),
                     dict(plan.memory), worst["breakdown"]))
    return rows


@pytest.fixture(scope="module")
def table(rank_pool: RankPool) -> list[tuple[str, float, float, dict, dict]]:
    """The accuracy table (one 4-rank group for every plan)."""
    return accuracy_table(rank_pool.run)


def test_predicted_peak_within_ten_percent_of_measured(table) -> None:
    assert len(table) >= 6
    bad = [(n, p, m) for n, p, m, _, _ in table if abs(p - m) > TOLERANCE * m]
    assert not bad, bad


def main() -> None:
    """Print the accuracy table."""
    for name, pred, meas, pb, mb in accuracy_table():
        print(f"{name:24s} predicted {pred / 2**20:7.3f} MiB  measured {meas / 2**20:7.3f} MiB  "
              f"error {100 * (pred - meas) / meas:+6.1f}%")
        print("    predicted", {k: round(v / 2**20, 3) for k, v in pb.items() if v})
        print("    measured ", {k: round(v / 2**20, 3) for k, v in mb.items() if v})


if __name__ == "__main__":
    main()
