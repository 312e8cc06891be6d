"""
float16 training (NANOCHAT_DTYPE=float16, for GPUs without bf16): train_step's dynamic loss scale (loop.loss_scaler).
A step whose gradients hold an inf or NaN moves no parameter and no optimizer state and halves the scale, on every
rank alike; the scale is saved with a checkpoint and restored on resume, so that a resumed run goes on exactly; and a
tiny base_train run in fp16 on the CPU follows fp32's. bf16 and fp32 steps never scale (their numbers must not move).
"""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import nanochat.loop as loop_module
from nanochat.common import autocast_for
from nanochat.gpt import GPTConfig, build_model
from nanochat.loop import RunSettings, StartPoint, TrainingLoop, lm_loss, loss_scaler, resume_from, train_step
from nanochat.recipe import build_optimizers, config_dict

pytestmark = pytest.mark.usefixtures("single_torch_thread")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LRS = dict(unembedding_lr=0.02, embedding_lr=0.2, matrix_lr=0.03, weight_decay=0.1)
OVERFLOW = 1e4  # a loss this many times larger overflows fp16 in the backward at the starting scale (65536)


def tiny_run(seed=0):
    """A tiny GPT with the default components and its optimizers, built where the compute dtype is the environment's."""
    torch.manual_seed(seed)
    config = GPTConfig(sequence_len=32, vocab_size=128, n_layer=2, n_head=2, n_kv_head=2, n_embd=32, value_embeds=True,
                       residual_scalars=True, smear=True)
    model = build_model(config, "cpu")
    return model, build_optimizers(model, **LRS, optimizer_components=["normuon"])


def batch(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 128, (2, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def overflowing(model, xy):
    return lm_loss(model, xy) * OVERFLOW


def snapshot(model, optimizers):
    """Copies of every parameter and every optimizer's state dict."""
    return ({name: p.detach().clone() for name, p in model.named_parameters()},
            [copy.deepcopy(opt.state_dict()) for opt in optimizers])


def assert_same(a, b):
    """Two nested structures of tensors and plain values, bitwise equal."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.quick
def test_an_inf_gradient_skips_the_update_and_halves_the_scale(monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_DTYPE", "float16")
    model, optimizers = tiny_run()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the tables too: fp16 moments would underflow
    autocast = autocast_for("cpu")
    for step in range(2):  # the optimizers' state exists before the step that overflows
        train_step(model, optimizers, [batch(step)], lm_loss, 1.0, 0.9, autocast)
    scaler = loss_scaler(optimizers, autocast)
    assert scaler.state_dict()["scale"] == 2.0 ** 16 and scaler.state_dict()["_growth_tracker"] == 2
    before = snapshot(model, optimizers)

    loss = train_step(model, optimizers, [batch(2)], overflowing, 1.0, 0.9, autocast)
    assert loss == loss and loss < float("inf")  # the loss is a number: the overflow is in the gradients alone
    assert_same(before, snapshot(model, optimizers))
    assert all(p.grad is None for p in model.parameters())
    assert scaler.state_dict()["scale"] == 2.0 ** 15 and scaler.state_dict()["_growth_tracker"] == 0
    assert "this step's update skipped, loss scale now 32768" in capsys.readouterr().out

    train_step(model, optimizers, [batch(3)], lm_loss, 1.0, 0.9, autocast)  # and the next step trains again
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(model.lm_head.weight, before[0]["lm_head.weight"])
    assert scaler.state_dict()["_growth_tracker"] == 1


@pytest.mark.quick
def test_the_optimizers_see_the_gradients_unscaled(monkeypatch):
    """What step_optimizers gets (and clips) are the loss's own gradients, not 65536 times them: those of fp32's
    backward to fp16's rounding (measured: within 0.1 % where they are not ~0)."""
    monkeypatch.setenv("NANOCHAT_DTYPE", "float16")
    model, optimizers = tiny_run()
    lm_loss(model, batch(0)).backward()  # fp32: no autocast
    exact = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    seen = {}
    monkeypatch.setattr(loop_module, "step_optimizers",
                        lambda *args: seen.update({name: p.grad.clone() for name, p in model.named_parameters()}))
    train_step(model, optimizers, [batch(0)], lm_loss, 1.0, 0.9, autocast_for("cpu"))
    compared = [name for name, grad in exact.items() if grad.norm() > 1e-6]
    assert len(compared) >= 6, compared
    for name in compared:
        assert (seen[name] - exact[name]).norm() < 0.01 * exact[name].norm(), name


@pytest.mark.quick
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_bf16_or_fp32_step_has_no_loss_scale(monkeypatch, dtype):
    monkeypatch.setenv("NANOCHAT_DTYPE", dtype)
    model, optimizers = tiny_run()
    autocast = autocast_for("cpu")
    assert loss_scaler(optimizers, autocast) is None
    train_step(model, optimizers, [batch(0)], lm_loss, 1.0, 0.9, autocast)
    assert not any(hasattr(opt, "loss_scaler") for opt in optimizers)


class Rows:
    """A stand-in for a stage's loader: the loop saves its state_dict() with each checkpoint."""

    def state_dict(self):
        return {}


def run_loop(ckpt_dir, model, optimizers, start, steps, save_every):
    """A TrainingLoop over `steps` steps of batch(step), saving every save_every. Returns the scaler's state after
    each step."""
    settings = RunSettings("fp16", str(ckpt_dir), steps, {"device_batch_size": 2, "total_batch_size": 64},
                           config_dict(model.config), "", 64, save_every=save_every, keep_last=-1)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}  # StopSignal takes them
    scales = {}
    try:
        loop = TrainingLoop(settings, model, optimizers, Rows(), start, torch.device("cpu"), autocast_for("cpu"))
        for step in loop.steps():
            if step == loop.num_iterations:
                break
            loss = train_step(model, optimizers, [batch(step)], lm_loss, 1.0, 0.9, loop.autocast)
            loop.end_step(loss, time.perf_counter())
            scales[loop.step] = loop.scaler.state_dict()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return scales


@pytest.mark.quick
def test_a_resume_under_fp16_restores_the_scale_and_goes_on_exactly(monkeypatch, tmp_path, capsys):
    """The run starts at a scale its gradients overflow (as a real run's first steps may), so the scale a checkpoint
    holds is not the starting one: a resume that started the scale afresh would skip other steps than the run did."""
    monkeypatch.setenv("NANOCHAT_DTYPE", "float16")
    monkeypatch.setattr(loop_module, "LOSS_SCALE_START", 2.0 ** 20)  # this model's gradients overflow it at step 1
    model, optimizers = tiny_run()
    straight = run_loop(tmp_path / "straight", model, optimizers, StartPoint(), steps=6, save_every=3)
    assert "this step's update skipped" in capsys.readouterr().out
    assert straight[3]["scale"] < 2.0 ** 20  # the scale a resume from step 3 must start from

    resumed_model, resumed_optimizers = tiny_run(seed=1)  # other weights: the checkpoint must bring everything
    start = resume_from(str(tmp_path / "straight"), 3, resumed_model, resumed_optimizers,
                        config_dict(resumed_model.config), "", torch.device("cpu"))
    assert start.loop_state["loss_scale"] == straight[3]
    resumed = run_loop(tmp_path / "straight", resumed_model, resumed_optimizers, start, steps=6, save_every=-1)
    assert [resumed[s] for s in (4, 5, 6)] == [straight[s] for s in (4, 5, 6)]
    for (name, a), b in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.timeout(120)  # 10 s on a 2-core EPYC, most of it two ranks importing torch (as test_optim's 2 ranks)
def test_two_ranks_skip_alike_when_one_rank_overflows(tmp_path):
    """Rank 1's gradients overflow and rank 0's do not: both skip the update (had rank 0 stepped alone, it would
    wait forever in the optimizers' collectives), both halve the scale, and the next step trains on both."""
    out = tmp_path / "ranks.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "tests", "fp16_ranks_worker.py"), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", NANOCHAT_DTYPE="float16")
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-4000:]
    result = torch.load(out, weights_only=True)
    assert result["unchanged_after_skip"] == [True, True]
    assert result["scales"] == [[2.0 ** 15, 2.0 ** 15], [2.0 ** 15, 2.0 ** 15]]  # after the skip, after the next step
    assert result["ranks_agree"] and result["trained"]


# -----------------------------------------------------------------------------
# base_train and SFT in fp16, in real subprocesses

N, HALF = 30, 15
RUN_ARGS = [f"--num-iterations={N}", f"--eval-every={HALF}", f"--save-every={HALF}", "--eval-tokens=8192"]
FP16 = {"NANOCHAT_DTYPE": "float16"}


@pytest.mark.slow  # four tiny runs, 40 s on a 2-core EPYC (fp16 matmuls are emulated on most CPUs)
def test_fp16_base_train_follows_fp32_resumes_exactly_and_sft_goes_on(tiny_base_dir, tmp_path):
    """The d2 model of the tests in fp16 on the CPU: finite losses, val bpb within 3 % of fp32's (measured: 0.01 %
    at step 30), a resume from its step-HALF checkpoint (which holds the scale) equal to the straight run, and
    chat_sft on top in fp16."""
    from test_base_train import final_weights, fresh_base, run_train, train_losses, val_bpbs
    from test_chat_stages import SFT, curve, run

    bases = {name: fresh_base(tiny_base_dir, tmp_path, name) for name in ("fp32", "fp16")}
    run_train(bases["fp32"], RUN_ARGS)
    p = run_train(bases["fp16"], RUN_ARGS, env_extra=FP16)
    assert "cpu x1 float16" in p.stdout, p.stdout[:2000]
    fp32, fp16 = train_losses(bases["fp32"]), train_losses(bases["fp16"])
    assert sorted(fp16) == list(range(1, N + 1)) and all(loss == loss and loss < 20 for loss in fp16.values())
    assert fp16 != fp32 and fp16[N] < fp16[1] - 1.0  # other arithmetic, and it learns
    bpb32, bpb16 = val_bpbs(bases["fp32"])[N], val_bpbs(bases["fp16"])[N]
    assert abs(bpb16 - bpb32) / bpb32 < 0.03, (bpb16, bpb32)

    step_dir = os.path.join(bases["fp16"], "base_checkpoints", "tiny", f"step_{HALF:06d}")
    with open(os.path.join(step_dir, "meta.json")) as f:
        assert json.load(f)["loop_state"]["loss_scale"]["scale"] > 1
    resumed = str(tmp_path / "resumed")
    shutil.copytree(bases["fp16"], resumed)
    shutil.rmtree(os.path.join(resumed, "base_checkpoints", "tiny", f"step_{N:06d}"))
    p = run_train(resumed, RUN_ARGS + ["--resume"], env_extra=FP16)
    assert f"resuming at step {HALF}" in p.stdout
    assert [train_losses(resumed)[s] for s in range(HALF + 1, N + 1)] == [fp16[s] for s in range(HALF + 1, N + 1)]
    a, b = final_weights(bases["fp16"], N), final_weights(resumed, N)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    run(bases["fp16"], "chat_sft", SFT + ["-i", "base", "-g", "tiny", "--num-iterations=4", "--eval-every=2"],
        env_extra=FP16)
    losses = [r["train_loss"] for r in curve(bases["fp16"], "chat_sft") if "train_loss" in r]
    assert len(losses) == 4 and all(loss == loss and loss < 20 for loss in losses), losses
    with open(os.path.join(bases["fp16"], "chatsft_checkpoints", "tiny", "step_000004", "meta.json")) as f:
        assert "loss_scale" in json.load(f)["loop_state"]
