"""Context parallelism on whole models: Llama and GPT as autopar's examples write them,
nanoGPT as its author does, and Hugging Face's Llama and GPT-2 built from configs,
each planned with cp > 1 and trained for 3 SGD steps on 4 gloo ranks (fp32): every
loss equals a single-process run's to 1e-5, under cp2 x dp2, cp4, cp2 x tp2 and pp2 x
cp2, with the all-gather, ring and Ulysses variants (every pair for Llama and GPT);
the emitted program runs cp as the runtime does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.demo import reference_step, sgd_losses
from autopar.plans import Plan
from tests import codegen_models, foreign_models
from tests.dist_utils import RankPool

STEPS, LR = 3, 0.1
MESHES = {"cp2xdp2": dict(dp=2, cp=2, tp=1), "cp4": dict(dp=1, cp=4, tp=1),
          "cp2xtp2": dict(dp=1, cp=2, tp=2), "pp2xcp2": dict(pp=2, dp=1, cp=2, tp=1)}
VARIANTS = ("allgather", "ring", "ulysses")


def _hf(kind: str) -> torch.nn.Module:
    from tests import test_hf_models as hf

    return hf._Logits(hf.make(kind))


def make(name: str) -> torch.nn.Module:
    """Model ``name`` with the same weights on every call."""
    torch.manual_seed(0)
    if name == "llama":
        return codegen_models.tiny_llama()
    if name == "gpt":
        return codegen_models.tiny_gpt()
    if name == "nanogpt":
        return foreign_models.NanoGPT(vocab_size=foreign_models.VOCAB,
                                      block_size=foreign_models.SEQ)
    return _hf(name.removeprefix("hf-"))


def cases() -> list[tuple[str, str, str]]:
    """(model, mesh, variant): every mesh with every variant for autopar's Llama and
    GPT; a few for the others, each variant once for Hugging Face's models (not
    pipelined: their traced masks keep them from pp with cp)."""
    out = [(m, mesh, v) for m in ("llama", "gpt") for mesh in MESHES for v in VARIANTS]
    out += [("nanogpt", "cp2xdp2", "ring")]
    if _has_transformers():
        out += [("hf-llama", "cp2xtp2", "ring"), ("hf-gpt2", "cp2xdp2", "allgather"),
                ("hf-llama", "cp4", "ulysses")]
    return out


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _plan(name: str, mesh: str, variant: str) -> Plan:
    x, y = foreign_models.example_batch()
    degrees = {"pp": 1} | MESHES[mesh]
    local = foreign_models.BATCH // degrees["dp"]
    return autopar.plan(make(name), (x,), example_targets=y, precision="fp32",
                        cluster=autopar.Cluster("cpu", 1, 4), cp_variant=variant, zero=2,
                        microbatch_size=local // degrees["pp"], **degrees)


def _losses(jobs: list[tuple[str, str]]) -> list[list[float]]:
    """On each rank: the losses of every (model, plan JSON) job."""
    x, y = foreign_models.example_batch()
    out = []
    for name, text in jobs:
        pm = autopar.parallelize(make(name), plan=Plan.from_json(text))
        out.append(sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR))
    return out


@pytest.fixture(scope="module")
def planned() -> dict[tuple[str, str, str], Plan]:
    """The plan of every case: one search per model and mesh, its variant swapped for
    the others (the layout is the same; the variant is what the runtime reads)."""
    out: dict[tuple[str, str, str], Plan] = {}
    for name, mesh, variant in cases():
        first = next((p for (n, m, _), p in out.items() if (n, m) == (name, mesh)), None)
        if first is None:
            out[(name, mesh, variant)] = _plan(name, mesh, variant)
            continue
        swapped = Plan.from_json(first.to_json())
        swapped.context = dataclasses.replace(first.context, variant=variant)
        out[(name, mesh, variant)] = swapped
    return out


@pytest.mark.multirank
def test_cp_training_equals_one_process(rank_pool: RankPool, planned) -> None:
    x, y = foreign_models.example_batch()
    jobs = [(c[0], p.to_json()) for c, p in planned.items()]
    got = rank_pool.run(4, _losses, jobs, timeout_s=900)
    for r in range(1, 4):
        assert got[r] == got[0]
    refs: dict[str, list[float]] = {}
    for (name, mesh, variant), p, losses in zip(planned, planned.values(), got[0]):
        assert p.mesh == {k: v for k, v in MESHES[mesh].items() if k != "pp" or v > 1}
        assert p.context is not None and p.context.variant == variant
        if name not in refs:
            model = make(name)
            refs[name] = sgd_losses(model.parameters(), reference_step(model, x, y), STEPS, LR)
        assert losses == pytest.approx(refs[name], abs=1e-5), (name, mesh, variant)


REFERENCE = """
import sys
import torch
import torch.distributed as dist
sys.path.insert(0, {root!r})
from autopar.demo import sgd_losses
from autopar.plans import Plan
from autopar.runtime import apply_plan
from tests import codegen_models

dist.init_process_group("gloo")
batch = torch.load({data!r})
torch.manual_seed(0)
model = codegen_models.tiny_llama()
pm = apply_plan(model, Plan.from_json(open({plan!r}).read()), example_inputs=batch["inputs"])
losses = sgd_losses(pm.parameters(), lambda: pm.step(batch["inputs"], batch["targets"]),
                    {steps}, {lr})
if dist.get_rank() == 0:
    print("\\n".join(f"step {{k}} loss {{v:.8f}}" for k, v in enumerate(losses, 1)))
dist.destroy_process_group()
"""
"""``apply_plan`` on the tiny Llama built on the CPU under seed 0, as the emitted
program builds it, printing its losses as the program does."""


@pytest.mark.multirank
@pytest.mark.parametrize("mesh", ["cp2xtp2", "pp2xcp2"])
def test_the_emitted_program_runs_cp_as_the_runtime(planned, tmp_path, mesh: str) -> None:
    """Llama under cp2 x tp2 and pp2 x cp2 with ring attention: each program under
    torchrun prints the losses ``apply_plan`` gives under torchrun (the two share one
    torchrun job, each in processes of its own)."""
    from pathlib import Path

    from autopar.runtime.codegen import emit_program
    from tests.test_codegen import printed_losses, torchrun_outputs

    plan = planned[("llama", mesh, "ring")]
    x, y = foreign_models.example_batch()
    data, saved = tmp_path / "batch.pt", tmp_path / "plan.json"
    torch.save({"inputs": x, "targets": y}, data)
    saved.write_text(plan.to_json())
    program = tmp_path / "train_cp.py"
    program.write_text(emit_program(plan, f"{codegen_models.__file__}:tiny_llama"))
    text = program.read_text()
    assert 'CP_VARIANT = "ring"' in text and "SEQUENCE_DIMS = [1, 1]" in text
    reference = tmp_path / "reference.py"
    reference.write_text(REFERENCE.format(root=str(Path(__file__).parent.parent),
                                          data=str(data), plan=str(saved), steps=STEPS,
                                          lr=LR))
    expected, got = (printed_losses(out) for out in torchrun_outputs(
        [(reference, []), (program, ["--steps", str(STEPS), "--optimizer", "sgd", "--lr",
                                     str(LR), "--data", str(data), "--seed", "0"])],
        tmp_path / "runs"))
    assert len(got) == STEPS and got == pytest.approx(expected, abs=1e-5)
