"""The code generator (:mod:`autopar.runtime.codegen`; pipelined plans in
test_codegen_pipeline.py): emitted programs compile,
pass pyflakes, match a golden file, and under ``torchrun`` on 4 CPU processes print
the same losses as ``apply_plan`` with the same plan, seed and data (programs that
save and resume under other plans: test_checkpoints.py)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pyflakes.api import checkPath
from pyflakes.reporter import Reporter

from autopar.cli import main as cli_main
from autopar.errors import LoweringError
from autopar.plans import Plan
from autopar.runtime.codegen import emit_program, model_facts
from tests.dist_utils import RankPool, free_port
from tests.handmade_plans import megatron_plan, pipeline_plan

TESTS = Path(__file__).resolve().parent
MODELS = TESTS / "codegen_models.py"
GOLDEN = TESTS / "golden" / "gpt_dp2_tp2_zero3_selective.py"
BATCH, SEQ, VOCAB, SEED, TOL = 8, 16, 128, 0, 1e-5

CASES = {  # name -> (factory, megatron_plan arguments, optimizer, lr)
    "gpt dp2 tp2 sequence-parallel loss-parallel zero3 full-recompute 2 micro-batches": (
        "tiny_gpt", dict(dp=2, tp=2, sequence_parallel=True, zero=3, recompute="full",
                         num_microbatches=2, loss_parallel=True), "sgd", 0.1),
    "llama dp2 tp2 zero3 selective-recompute": (
        "tiny_llama", dict(dp=2, tp=2, zero=3, recompute="selective"), "adamw", 1e-2),
}


def make_plan(factory: str, kwargs: dict) -> Plan:
    """The hand-made plan of a case."""
    return megatron_plan(model_facts(f"{MODELS}:{factory}").model, global_batch=BATCH, **kwargs)


def golden_plan() -> Plan:
    """The golden test's plan, with made-up predicted costs so every comment shows one."""
    plan = make_plan("tiny_gpt", dict(dp=2, tp=2, zero=3, recompute="selective"))
    for k, mp in enumerate(plan.modules.values()):
        mp.time_s = 1e-4 * (k % 5 + 1)
    plan.step_time_s, plan.throughput, plan.mfu = 0.0125, 640.0, 0.41
    plan.cluster = {"gpu": "h100-sxm", "nodes": 1, "gpus_per_node": 4}
    plan.memory = {"params": 2**20, "grads": 2**20, "optimizer": 2**21,
                   "activations": 3 * 2**20, "recompute": 2**19, "total": 8 * 2**20}
    plan.breakdown = {"comm_s": 0.003, "exposed_comm_s": 0.001}
    return plan


def write_batch(path: Path) -> Path:
    """One global batch of token ids and targets, saved for ``--data``."""
    g = torch.Generator().manual_seed(1)
    torch.save({"inputs": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                "targets": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)}, path)
    return path


def reference_losses(cases: list[tuple[str, dict, str, float, int]], data: str) -> list[list[float]]:
    """Losses of ``apply_plan`` for each case (one gloo group) on the model the factory
    builds on the CPU under the seed, as the emitted program builds it by default; a
    case whose plan arguments name ``pp`` gets a pipelined plan."""
    from autopar.examples import zoo
    from autopar.runtime import apply_plan

    batch = torch.load(data)
    out = []
    for factory, kwargs, optimizer, lr, steps in cases:
        torch.manual_seed(SEED)
        model, _ = zoo.load(f"{MODELS}:{factory}")
        make = pipeline_plan if "pp" in kwargs else megatron_plan
        pm = apply_plan(model, make(model, global_batch=BATCH, **kwargs),
                        example_inputs=batch["inputs"])
        opt_cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
        opt = opt_cls(pm.parameters(), lr=lr)
        losses = []
        for _ in range(steps):
            losses.append(pm.step(batch["inputs"], batch["targets"]).item())
            opt.step()
            opt.zero_grad()
        out.append(losses)
    return out


def torchrun_output(program: Path, *args: str, nproc: int = 4) -> str:
    """Run ``program`` on ``nproc`` gloo processes; return what they printed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), str(program), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def torchrun_outputs(runs: list[tuple[Path, list[str]]], out_dir: Path,
                     nproc: int = 4) -> list[str]:
    """Run each ``(program, args)`` of ``runs`` in turn on ``nproc`` gloo processes, all
    under one torchrun job (:mod:`tests.program_runner`: each program in fresh processes
    of its own, without paying torch's import again); what rank 0 printed for each."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [{"program": str(program), "args": list(args), "port": free_port()}
            for program, args in runs]
    spec = out_dir / "jobs.json"
    spec.write_text(json.dumps({"out_dir": str(out_dir), "jobs": jobs}))
    torchrun_output(TESTS / "program_runner.py", str(spec), nproc=nproc)
    return [(out_dir / f"{k}.0.out").read_text() for k in range(len(runs))]


def printed_losses(stdout: str) -> list[float]:
    """The losses a program printed, one per step."""
    return [float(v) for v in re.findall(r"^step \d+ loss (\S+)", stdout, re.M)]


def torchrun(program: Path, *args: str, nproc: int = 4) -> list[float]:
    """Run ``program`` on ``nproc`` gloo processes; return the losses rank 0 printed."""
    return printed_losses(torchrun_output(program, *args, nproc=nproc))


def save_then_resume(tmp: Path, factory: str, batch: tuple[torch.Tensor, torch.Tensor],
                     lr: float) -> tuple[list[float], list[Plan]]:
    """Plan ``tests/codegen_models.py:factory`` for dp2 x ep2 with ZeRO-3 and for plain
    dp2 (2 CPU ranks, fp32, SGD at ``lr``); run the first program 2 steps on ``batch``
    saving a checkpoint, the second 1 step from it (2 gloo processes each). The three
    losses, and the two plans."""
    import autopar
    from tests import codegen_models

    x, y = batch
    data = tmp / "batch.pt"
    torch.save({"inputs": x, "targets": y}, data)
    common = ["--optimizer", "sgd", "--lr", str(lr), "--data", str(data)]
    plans, programs = [], []
    for name, space in (("ep2", {"dp": 2, "ep": 2, "zero": 3}), ("dp2", {"dp": 2, "ep": 1})):
        plans.append(autopar.plan(getattr(codegen_models, factory)(), (x,), example_targets=y,
                                  cluster=autopar.Cluster("cpu", 1, 2), precision="fp32",
                                  optimizer="sgd", **space))
        programs.append(tmp / f"{name}.py")
        programs[-1].write_text(emit_program(plans[-1], f"{MODELS}:{factory}"))
        assert pyflakes(programs[-1]) == ""
    ckpt = str(tmp / "ckpt")
    first = torchrun(programs[0], "--steps", "2", "--save", ckpt, *common, nproc=2)
    second = torchrun(programs[1], "--steps", "1", "--load", ckpt, *common, nproc=2)
    return first + second, plans


def emit_to(tmp: Path, name: str, plan: Plan, factory: str) -> Path:
    """Write the program for ``plan`` under ``tmp``."""
    path = tmp / f"{name}.py"
    path.write_text(emit_program(plan, f"{MODELS}:{factory}", model_file=str(MODELS)))
    return path


def pyflakes(path: Path) -> str:
    """pyflakes' findings on ``path`` ('' when clean), checked in this process."""
    out = io.StringIO()
    checkPath(str(path), Reporter(out, out))
    return out.getvalue()


def test_golden_text() -> None:
    """The emitted text for one plan is pinned (AUTOPAR_UPDATE_GOLDEN=1 rewrites it)."""
    text = emit_program(golden_plan(), f"{MODELS}:tiny_gpt", model_file="../codegen_models.py")
    if os.environ.get("AUTOPAR_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
    assert pyflakes(GOLDEN) == ""
    assert max(len(line) for line in text.splitlines()) <= 99


def test_emitted_programs_are_clean(tmp_path: Path) -> None:
    """Programs for many layouts compile, pass pyflakes with no findings, and import
    nothing of autopar (its checkpoint format they write under its own name)."""
    variants = [dict(dp=4), dict(dp=4, zero=0, precision="bf16"), dict(tp=4),
                dict(tp=2, sequence_parallel=True), dict(dp=2, zero=2, num_microbatches=2),
                dict(dp=2, zero=3, offload=True, recompute="full"), {}]
    for factory in ("tiny_gpt", "tiny_llama"):
        for k, kwargs in enumerate(variants + [kw for _, kw, _, _ in CASES.values()]):
            path = emit_to(tmp_path, f"{factory}_{k}", make_plan(factory, kwargs), factory)
            compile(path.read_text(), str(path), "exec")
            assert pyflakes(path) == "", (kwargs, pyflakes(path))
            assert not re.search(r"^\s*(import|from) autopar", path.read_text(), re.M)


def test_bad_pipeline_is_refused() -> None:
    """A pipelined plan whose stages name units the model lacks: one clear error."""
    model = model_facts(f"{MODELS}:tiny_gpt").model
    plan = pipeline_plan(model, pp=2)
    assert plan.pipeline is not None
    plan.pipeline.stages[1].units.append("no_such_unit")
    with pytest.raises(LoweringError, match="no_such_unit"):
        emit_program(plan, f"{MODELS}:tiny_gpt")


def test_cli_codegen(tmp_path: Path) -> None:
    """`autopar codegen PLAN --model FILE:factory -o OUT` writes the program."""
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(golden_plan().to_json())
    out = tmp_path / "train.py"
    assert cli_main(["codegen", str(plan_file), "--model", f"{MODELS}:tiny_gpt",
                     "-o", str(out)]) == 0
    assert 'MODEL_FILE = "' + os.path.relpath(MODELS, tmp_path) + '"' in out.read_text()
    assert pyflakes(out) == ""


@pytest.mark.multirank
def test_programs_match_apply_plan(rank_pool: RankPool, tmp_path: Path) -> None:
    """Under torchrun, each emitted program's losses equal apply_plan's (4 steps), the
    Llama program's over two runs: 2 steps saved in --checkpoint-dir, then resumed
    there up to step 4 (keeping the last 2). Across plans: test_checkpoints.py. (The
    three runs share one torchrun job, each in processes of its own.)"""
    data = str(write_batch(tmp_path / "batch.pt"))
    specs = [(f, kw, opt, lr, 4) for f, kw, opt, lr in CASES.values()]
    expected = rank_pool.run(4, reference_losses, specs, data)[0]
    (gpt_name, (gpt, gpt_kw, gpt_opt, gpt_lr)), (_, (llama, llama_kw, opt, lr)) = CASES.items()
    common = ["--data", data, "--seed", str(SEED)]
    gpt_program = emit_to(tmp_path, "gpt", make_plan(gpt, gpt_kw), gpt)
    program = emit_to(tmp_path, "llama", make_plan(llama, llama_kw), llama)
    ckpt = tmp_path / "ckpt"  # steps 1-2, then a later run goes on from there to step 4
    args = ["--optimizer", opt, "--lr", str(lr), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "1", *common]
    outs = torchrun_outputs([
        (gpt_program, ["--steps", "4", "--optimizer", gpt_opt, "--lr", str(gpt_lr), *common]),
        (program, ["--steps", "2", *args]), (program, ["--steps", "4", *args])],
        tmp_path / "runs")
    got, *llama_outs = [printed_losses(out) for out in outs]
    assert got == pytest.approx(expected[0], abs=TOL), gpt_name
    got = llama_outs[0] + llama_outs[1]
    assert got == pytest.approx(expected[1], abs=TOL), llama
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000003", "step-00000004"]
