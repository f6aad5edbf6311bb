"""Checkpoints move between plans: a model trained 3 AdamW steps under a
Megatron-style dp2 x tp2 plan on 4 gloo ranks (vocabulary-parallel embedding and
head, heads split) is saved, loaded under pp2 on 2 ranks (1f1b, and zbv, where the
tied embedding and head of GPT are two copies on one rank), under ZeRO-3 dp4 with
full recomputation, and from Hugging Face GPT-2's tp2 plan into its pp2 plan; the
next 3 steps' losses and the final parameters equal an uninterrupted single-process
run's to 1e-6 (in float64). Also: a half-written folder is never loaded, a folder with a
shard file cut short raises CheckpointError and resume() falls back past it, the
plain-model file converts both ways, and the other mistakes get their messages."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import autopar
from autopar.demo import reference_step
from autopar.plans import Plan
from autopar.runtime.checkpoint import from_torch_file, to_torch_file
from tests import codegen_models, foreign_models
from tests.dist_utils import RankPool
from tests.handmade_plans import megatron_plan, pipeline_plan

STEPS, LR, TOL = 3, 1e-2, 1e-6
LOSSES = {"nano": foreign_models.lm_loss}  # a model's own loss, else the default


def make(kind: str) -> torch.nn.Module:
    """Model ``kind`` with the same weights on every call, in float64: the plans'
    different orders of summation then differ by about 1e-15, so that equality to
    1e-6 leaves no room for a wrong tensor."""
    torch.manual_seed(0)
    if kind == "gpt":  # 4 blocks: zbv's 4 stages on 2 ranks
        from autopar.examples.gpt import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=4, n_heads=4))
    elif kind == "llama":
        model = codegen_models.tiny_llama()
    elif kind == "nano":  # its own loss (LOSSES), a fused c_attn
        model = foreign_models.NanoGPT(vocab_size=128, block_size=16)
    else:
        from tests import test_hf_models as hf

        model = hf._Logits(hf.make("gpt2"))
    return model.double()


def plans(kind: str) -> dict[str, Plan]:
    """The plan saved under and the plans loaded under."""
    model = make(kind)
    if kind == "hf-gpt2":
        x, y = foreign_models.example_batch()
        cpu = {"precision": "fp32", "example_targets": y, "optimizer": "adamw"}
        return {"save": autopar.plan(model, (x,), cluster=autopar.Cluster("cpu", 1, 2), tp=2,
                                     dp=1, **cpu),
                "pp2": autopar.plan(model, (x,), cluster=autopar.Cluster("cpu", 1, 2), pp=2,
                                    dp=1, tp=1, microbatch_size=4, **cpu)}
    out = {"save": megatron_plan(model, dp=2, tp=2),
           "pp2": pipeline_plan(model, pp=2),
           "zero3-full": megatron_plan(model, dp=4, zero=3, recompute="full")}
    if kind == "gpt":
        out["pp2-zbv"] = pipeline_plan(model, pp=2, schedule="zbv")
    return out


def train(kind: str, text: str, folder: str, load: bool) -> dict:
    """On each rank: (load, then) 3 AdamW steps under the plan, then save (unless it
    loaded); the losses, what load returned, and the full parameters after."""
    x, y = foreign_models.example_batch()
    pm = autopar.parallelize(make(kind), (x[:1],), plan=Plan.from_json(text),
                             loss_fn=LOSSES.get(kind))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    resumed = autopar.load(folder, pm, opt) if load else None
    losses = []
    for _ in range(STEPS):
        losses.append(float(pm.step(x, y)))
        opt.step()
        opt.zero_grad()
    if not load:
        autopar.save(folder, pm, opt, step=STEPS, extra={"samples": STEPS * len(x)})
    modules, _ = pm.state_modules()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for m in modules for n, p in m.named_parameters()}
    return {"losses": losses, "resumed": resumed, "params": params}


def uninterrupted(kind: str, steps: int = 2 * STEPS
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps in one process: the losses and the final parameters."""
    x, y = foreign_models.example_batch()
    model, loss_fn = make(kind), LOSSES.get(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step, losses = reference_step(model, x, y), []
    for _ in range(steps):
        if loss_fn is None:
            losses.append(float(step()))
        else:
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _world(plan: Plan) -> int:
    return plan.world_size


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["llama", "gpt", "hf-gpt2"])
def test_a_checkpoint_loads_under_other_plans(rank_pool: RankPool, tmp_path: Path,
                                              kind: str) -> None:
    if kind == "hf-gpt2":
        pytest.importorskip("transformers")
    ref_losses, ref_params = uninterrupted(kind)
    planned = plans(kind)
    folder = str(tmp_path / "ckpt")
    saved = rank_pool.run(_world(planned["save"]), train, kind, planned["save"].to_json(),
                          folder, False)
    assert saved[0]["losses"] == pytest.approx(ref_losses[:STEPS], abs=TOL)
    for name, plan in planned.items():
        if name == "save":
            continue
        got = rank_pool.run(_world(plan), train, kind, plan.to_json(), folder, True)
        resumed = got[0]["resumed"]
        assert (resumed.step, resumed.extra) == (STEPS, {"samples": 24}), name
        assert resumed.optimizer_restored and resumed.saved_mesh == planned["save"].mesh
        assert got[0]["losses"] == pytest.approx(ref_losses[STEPS:], abs=TOL), name
        params = {n: t for r in got for n, t in r["params"].items()}
        for n, want in ref_params.items():
            if n in params:
                assert torch.allclose(params[n], want, atol=TOL, rtol=0), (name, n)
        assert set(ref_params) <= set(params) | {"head.weight"}, name


def _save_job(folder: str) -> None:
    """Save a dp2 model, then start a second save that dies before its commit."""
    pm = autopar.parallelize(make("llama"), plan=megatron_plan(make("llama"), dp=2))
    autopar.save(folder, pm, None, step=1)
    Path(folder + ".partial").mkdir(exist_ok=True)  # a later save, killed mid-write


def _load_job(folder: str) -> str:
    pm = autopar.parallelize(make("llama"), plan=megatron_plan(make("llama"), dp=2))
    try:
        autopar.load(folder, pm)
    except autopar.CheckpointError as e:
        return str(e)
    return "loaded"


@pytest.mark.multirank
def test_a_half_written_checkpoint_is_never_loaded(rank_pool: RankPool, tmp_path: Path) -> None:
    folder = str(tmp_path / "step-00000001")
    rank_pool.run(2, _save_job, folder)
    assert rank_pool.run(2, _load_job, folder) == ["loaded", "loaded"]
    shutil.copytree(folder, tmp_path / "step-00000002")
    (tmp_path / "step-00000002" / "autopar.json").unlink()  # killed before its commit
    msg = rank_pool.run(2, _load_job, str(tmp_path / "step-00000002"))[0]
    assert msg == (f"{tmp_path / 'step-00000002'} is not a complete autopar checkpoint (no "
                   "autopar.json: it was half written when its job stopped, or not written "
                   "by autopar); load an earlier one")
    from autopar.runtime.checkpoint_state import committed_steps

    assert committed_steps(tmp_path) == [1]


def test_a_plain_state_dict_converts_both_ways(tmp_path: Path) -> None:
    """The plain GPT's state dict (tied embedding and head) becomes a checkpoint folder
    and comes back with the same tensors under every name."""
    model = make("gpt")
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    kept = from_torch_file(tmp_path / "plain.pt", tmp_path / "ckpt", model="GPT")
    assert "head.weight" not in kept and "tok_emb.weight" in kept
    names = to_torch_file(tmp_path / "ckpt", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert names == sorted(model.state_dict())
    make("gpt").load_state_dict(back)  # strict: every name, tied ones included
    for n, t in model.state_dict().items():
        assert torch.equal(back[n], t), n


def test_convert_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(autopar.CheckpointError, match="not a folder"):
        to_torch_file(tmp_path / "missing", tmp_path / "out.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(autopar.CheckpointError, match="could not read .*junk.pt as a torch.save"):
        from_torch_file(tmp_path / "junk.pt", tmp_path / "ckpt")


def _pool_save(folder: str) -> list[float]:
    """3 AdamW steps of the float64 Llama under dp2 x tp2 through autopar, saved."""
    return train("llama", megatron_plan(make("llama"), dp=2, tp=2).to_json(), folder,
                 False)["losses"]


def _pool_resume(folder: str) -> list[float]:
    """Load ``folder`` into the float64 Llama under dp2 x tp2, then 1 AdamW step."""
    x, y = foreign_models.example_batch()
    pm = autopar.parallelize(make("llama"), plan=megatron_plan(make("llama"), dp=2, tp=2))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    assert autopar.load(folder, pm, opt).step == 2 * STEPS
    return [float(pm.step(x, y))]


@pytest.mark.multirank
def test_emitted_programs_resume_under_other_plans(rank_pool: RankPool, tmp_path: Path) -> None:
    """autopar.save after 3 steps under dp2 x tp2 (4 ranks); the emitted pp2 program
    (2 ranks) and the emitted ZeRO-3 dp4 program (4 ranks) each load it and train 3
    steps, the first saving after; autopar.load under dp2 x tp2 resumes that for a
    7th step. Every loss equals one uninterrupted run's to 1e-6."""
    from tests.test_codegen import emit_to, torchrun

    ref_losses, _ = uninterrupted("llama", steps=2 * STEPS + 1)
    data = tmp_path / "batch.pt"
    x, y = foreign_models.example_batch()
    torch.save({"inputs": x, "targets": y}, data)
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    saved = rank_pool.run(4, _pool_save, first)[0]
    assert saved == pytest.approx(ref_losses[:STEPS], abs=TOL)
    model = make("llama")
    piped = emit_to(tmp_path, "pp2", pipeline_plan(model, pp=2), "tiny_llama_f64")
    zero3 = emit_to(tmp_path, "zero3", megatron_plan(model, dp=4, zero=3), "tiny_llama_f64")
    args = ["--data", str(data), "--optimizer", "adamw", "--lr", str(LR), "--steps", "3"]
    got = torchrun(piped, "--load", first, "--save", second, *args, nproc=2)
    assert got == pytest.approx(ref_losses[STEPS:2 * STEPS], abs=TOL), "pp2 program"
    got = torchrun(zero3, "--load", first, *args)
    assert got == pytest.approx(ref_losses[STEPS:2 * STEPS], abs=TOL), "ZeRO-3 program"
    got = rank_pool.run(4, _pool_resume, second)[0]
    assert got == pytest.approx(ref_losses[2 * STEPS:], abs=TOL), "back in autopar"


@pytest.mark.multirank
def test_a_killed_rank_resumes_from_the_last_complete_checkpoint(tmp_path: Path) -> None:
    """Under torchrun --max-restarts 1, rank 1 of 4 is SIGKILLed at step 5 of 10; the
    job comes back from its last committed checkpoint (the asynchronous save of step
    4 may not have committed), and the losses after the restart and the final
    parameters equal an uninterrupted run's."""
    import os
    import re
    import subprocess
    import sys

    from tests.dist_utils import free_port

    ref_losses, ref_params = uninterrupted("llama", steps=10)
    job = Path(__file__).resolve().parent / "fault_job.py"
    out = tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--max-restarts", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"localhost:{free_port()}", str(job), str(tmp_path / "ckpt"),
           str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    attempts = re.findall(r"^attempt (\d) resumed from (\d+)$", proc.stdout, re.M)
    assert attempts[0] == ("0", "0") and attempts[1][0] == "1", proc.stdout
    assert 2 <= int(attempts[1][1]) <= 4, proc.stdout  # step 4's save may not have landed
    losses = [(int(s), float(v)) for s, v in re.findall(r"^step (\d+) loss (\S+)$",
                                                         proc.stdout, re.M)]
    assert [s for s, _ in losses][-10 + int(attempts[1][1]):] == \
        list(range(int(attempts[1][1]) + 1, 11))
    for step, loss in losses:
        assert loss == pytest.approx(ref_losses[step - 1], abs=TOL), step
    final = torch.load(out, weights_only=True)
    assert set(final) == set(ref_params)
    for n, want in ref_params.items():
        assert torch.allclose(final[n], want, atol=TOL, rtol=0), n
    from autopar.runtime.checkpoint_state import committed_steps

    assert committed_steps(tmp_path / "ckpt") == [9, 10]  # keep=2


@pytest.mark.multirank
def test_a_fused_projection_split_piecewise_saves_and_loads(rank_pool: RankPool,
                                                            tmp_path: Path) -> None:
    """nanoGPT's fused c_attn split as Megatron does (S(0)/3, DTensor's _StridedShard,
    whose local rows DCP cannot chunk) under tp4, saved and loaded under dp4: the
    losses continue one process's to 1e-6."""
    x, y = foreign_models.example_batch()
    model = make("nano")
    cpu = dict(cluster=autopar.Cluster(gpu="cpu", gpus_per_node=4), example_targets=y,
               loss_fn=foreign_models.lm_loss, precision="fp32")
    fused = autopar.plan(model, (x,), dp=1, tp=4, split_weights=True, **cpu)
    assert fused.params["h.0.attn.c_attn.weight"][-1] == "S(0)/3"
    plain = autopar.plan(model, (x,), dp=4, tp=1, **cpu)
    want, _ = uninterrupted("nano")
    folder = str(tmp_path / "ckpt")
    got = rank_pool.run(4, train, "nano", fused.to_json(), folder, False)[0]["losses"]
    got += rank_pool.run(4, train, "nano", plain.to_json(), folder, True)[0]["losses"]
    assert got == pytest.approx(want, abs=TOL)


def _cut_job(root: str) -> dict:
    """dp2 Llama, SGD: save steps 1 and 2 with a Checkpointer, cut step 2's largest shard
    file to half its bytes, then on a fresh model load step 2 directly, resume, save
    step 2 again, and resume from a root holding only the cut copy; what each did."""
    import os
    import warnings

    import torch.distributed as dist

    x, y = foreign_models.example_batch()
    plan = megatron_plan(make("llama"), dp=2)
    pm = autopar.parallelize(make("llama"), plan=plan)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    ckpt = autopar.Checkpointer(root, pm, opt, keep=5)
    after_1 = None
    for step in (1, 2):
        pm.step(x, y)
        opt.step()
        opt.zero_grad()
        ckpt.save(step)
        after_1 = after_1 or {n: p.detach().clone() for n, p in pm.state_dict().items()}
    cut = Path(ckpt.folder(2))
    shard = max(cut.glob("*.distcp"), key=lambda f: f.stat().st_size)
    whole = shard.stat().st_size
    dist.barrier()
    if dist.get_rank() == 0:
        shard.write_bytes(shard.read_bytes()[:whole // 2])
        shutil.copytree(cut, Path(root + "-only-cut") / cut.name)
        shutil.copytree(cut, Path(root + "-index") / cut.name)
        index = Path(root + "-index") / cut.name / ".metadata"
        index.write_bytes(index.read_bytes()[:100])
    dist.barrier()
    out: dict = {"shard": shard.name, "whole": whole, "half": whole // 2}
    pm = autopar.parallelize(make("llama"), plan=plan)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    for key, folder in (("direct", cut), ("index", Path(root + "-index") / cut.name)):
        try:
            autopar.load(folder, pm, opt)
        except autopar.CheckpointError as e:
            out[key] = str(e)
    ckpt = autopar.Checkpointer(root, pm, opt, keep=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["resumed"] = ckpt.resume().step
    out["warnings"] = [str(w.message) for w in caught]
    out["equal"] = all(torch.equal(t, after_1[n]) for n, t in pm.state_dict().items())
    ckpt.save(2)  # keep=1: prunes step 1, never the cut folder
    out["folders"] = sorted(os.listdir(root))
    out["cut_size"] = (Path(root) / "step-00000002.unloadable" / shard.name).stat().st_size
    try:
        autopar.Checkpointer(root + "-only-cut", pm, opt).resume()
    except autopar.CheckpointError as e:
        out["none"] = str(e)
    return out


@pytest.mark.multirank
def test_resume_falls_back_past_a_cut_shard(rank_pool: RankPool, tmp_path: Path) -> None:
    """A shard file of the newest checkpoint cut short (torch raises its
    CheckpointException, a BaseException): loading it raises CheckpointError naming the
    folder and file; resume() warns and loads the step before, with its parameters; the
    cut folder is kept aside, untouched, through later saves and pruning."""
    root = str(tmp_path / "ckpt")
    got = rank_pool.run(2, _cut_job, root)
    assert got[0] == got[1]
    got = got[0]
    cut = tmp_path / "ckpt" / "step-00000002"
    why = (f"cannot load the checkpoint {cut}: its file {got['shard']} has {got['half']} "
           f"bytes, fewer than the {got['whole']} its index lists: it was cut short (a full "
           "disk, or a copy that stopped); load an earlier checkpoint, or copy this one again")
    assert got["direct"] == why
    assert got["index"] == (f"cannot load the checkpoint {tmp_path / 'ckpt-index'}/step-00000002"
                            ": reading its index file .metadata raised UnpicklingError: pickle "
                            "data was truncated; load an earlier checkpoint, or copy this one "
                            "again")
    assert got["resumed"] == 1 and got["equal"]
    assert got["warnings"] == [f"resuming from {tmp_path / 'ckpt'}/step-00000001 (step 1): the "
                               f"newer checkpoint {cut} does not load, kept as "
                               f"step-00000002.unloadable: {why}"]
    assert got["folders"] == ["step-00000002", "step-00000002.unloadable"]
    assert got["cut_size"] == got["half"]
    only = tmp_path / "ckpt-only-cut"
    assert got["none"] == (f"no checkpoint under {only} loads (1 tried, all left in place); the "
                           f"newest: {why.replace(str(cut), str(only / 'step-00000002'))}")
