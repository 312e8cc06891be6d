"""
base_train end to end, in real subprocesses: exact resume after SIGKILL (1 and 2 ranks), a kill in the
middle of a checkpoint save, 1-rank vs 2-rank vs 2-node agreement, learning, and bad input.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from nanochat.checkpoint_manager import list_steps

# A tiny model: 2 layers, width 64, 2 heads of 32; 4 x 64 tokens per step.
TINY = ["--depth=2", "--aspect-ratio=32", "--head-dim=32", "--max-seq-len=64", "--device-batch-size=2",
        "--total-batch-size=256", "--eval-tokens=1024", "--core-metric-every=-1", "--sample-every=-1", "--model-tag=tiny"]


def fresh_base(tiny_base_dir, tmp_path, name):
    """A private copy of the tiny corpus + tokenizer, so runs don't share checkpoints or report curves."""
    base = tmp_path / name
    shutil.copytree(tiny_base_dir, base, ignore=shutil.ignore_patterns("base_checkpoints", "report"))
    return str(base)


def env_for(base):
    env = dict(os.environ, NANOCHAT_BASE_DIR=base, NANOCHAT_DATA_SOURCE="builtin", OMP_NUM_THREADS="1")
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(nproc=1):
    if nproc == 1:
        return [sys.executable, "-m", "scripts.base_train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "scripts.base_train"]


def run_train(base, args, nproc=1, env_extra=None, check=True, timeout=300):
    env = env_for(base)
    env.update(env_extra or {})
    if nproc > 1:  # standalone picks a free port itself, but two tests in parallel could collide on the default
        args = list(args)
    p = subprocess.run(train_cmd(nproc) + TINY + list(args), env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"base_train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def curve(base):
    path = os.path.join(base, "report", "curves", "base_train.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(base):
    return {r["step"]: r["train_loss"] for r in curve(base) if "train_loss" in r}


def val_bpbs(base):
    return {r["step"]: r["val_bpb"] for r in curve(base) if "val_bpb" in r}


def final_weights(base, step, tag="tiny"):
    return load_file(os.path.join(base, "base_checkpoints", tag, f"step_{step:06d}", "model.safetensors"))


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def start_and_kill_after_save(base, args, kill_after_step, nproc=1):
    """Start a run, wait until it has saved `kill_after_step`, then SIGKILL the whole process group."""
    p = subprocess.Popen(train_cmd(nproc) + TINY + list(args), env=env_for(base), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    marker = f"saved checkpoint step {kill_after_step} "
    seen = []
    deadline = time.time() + 300
    try:
        for line in p.stdout:
            seen.append(line)
            if marker in line:
                os.killpg(p.pid, signal.SIGKILL)
                break
            assert time.time() < deadline, "run never saved the expected checkpoint"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=60)
    assert any(marker in line for line in seen), "".join(seen[-40:])


@pytest.mark.slow  # 12 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2 ranks: 17 s, slow
def test_resume_after_sigkill_is_exact(tiny_base_dir, tmp_path, nproc):
    n, half = 8, 4
    common = [f"--num-iterations={n}", "--save-every=2", "--eval-every=4"]
    straight = fresh_base(tiny_base_dir, tmp_path, "straight")
    run_train(straight, common, nproc=nproc)

    killed = fresh_base(tiny_base_dir, tmp_path, "killed")
    start_and_kill_after_save(killed, common, half, nproc=nproc)
    run_train(killed, common + ["--resume"], nproc=nproc)

    assert_same_weights(final_weights(straight, n), final_weights(killed, n))
    a, b = train_losses(straight), train_losses(killed)
    assert [a[s] for s in range(half + 1, n + 1)] == [b[s] for s in range(half + 1, n + 1)]
    assert val_bpbs(straight)[n] == val_bpbs(killed)[n]


@pytest.mark.slow  # 20 s; a save that fails leaves the previous checkpoint in the default run (test_hardening's full disk)
def test_kill_during_checkpoint_save_keeps_previous_checkpoint(tiny_base_dir, tmp_path):

    base = fresh_base(tiny_base_dir, tmp_path, "fault")
    args = ["--num-iterations=6", "--save-every=2", "--eval-every=-1"]
    for fault in ("after_optimizer@4", "after_model@4", "before_rename@4"):
        shutil.rmtree(os.path.join(base, "base_checkpoints"), ignore_errors=True)
        p = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "ckpt_fault.py"), fault] + TINY + args,
                           env=env_for(base), capture_output=True, text=True, timeout=300)
        assert p.returncode != 0
        ckpt_dir = os.path.join(base, "base_checkpoints", "tiny")
        assert list_steps(ckpt_dir) == [2], fault
        # the surviving checkpoint is complete: resuming from it finishes the run
        p = run_train(base, args + ["--resume"])
        assert "resuming at step 2" in p.stdout
        assert list_steps(ckpt_dir)[-1] == 6


@pytest.mark.slow  # 20 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_one_rank_two_ranks_and_two_nodes_agree(tiny_base_dir, tmp_path):
    # --eval-tokens far past the tiny val split: each evaluation reads it once, and says so
    args = ["--num-iterations=30", "--eval-every=30", "--eval-tokens=100000000"]
    one = fresh_base(tiny_base_dir, tmp_path, "one")
    p1 = run_train(one, args)
    two = fresh_base(tiny_base_dir, tmp_path, "two")
    p = run_train(two, args, nproc=2)
    assert "x2" in p.stdout  # really two ranks (DistMuon/DistAdamW steps, tested exactly in test_optim)
    reach = [re.findall(r"^step 00000 \| val_bpb [0-9.]+ \| ([0-9,]+) tokens, the whole val split once", out.stdout, re.M)
             for out in (p1, p)]
    assert len(reach[0]) == 1 and reach[0] == reach[1], reach  # the same tokens, once, on one rank and on two
    # evaluation packs the same tokens whatever the world size, so step 0 agrees to rounding ...
    assert abs(val_bpbs(one)[0] - val_bpbs(two)[0]) < 1e-4
    # ... and after training on the same global batch size within 2 %: the ranks read other row groups than one rank
    # does, so this is sampling noise (measured 0.95 % here with the default components); the distributed optimizer
    # math is checked exactly in test_optim, and two nodes against two ranks exactly below
    bpb1, bpb2 = val_bpbs(one)[30], val_bpbs(two)[30]
    assert abs(bpb1 - bpb2) / bpb1 < 0.02, (bpb1, bpb2)

    # two "machines" (two torchrun launches) rendezvous over c10d on 127.0.0.1
    nodes = fresh_base(tiny_base_dir, tmp_path, "nodes")
    port = free_port()
    procs = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=nanochat-test",
               "-m", "scripts.base_train"] + TINY + args
        procs.append(subprocess.Popen(cmd, env=env_for(nodes), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    # same ranks, same data, same collectives: the same model (allclose in case c10d orders ranks differently)
    w2, wn = final_weights(two, 30), final_weights(nodes, 30)
    for k in w2:
        assert torch.allclose(w2[k], wn[k], atol=1e-5, rtol=0), k
    assert abs(val_bpbs(two)[30] - val_bpbs(nodes)[30]) < 1e-4


def unigram_bpb(base):
    """Bits per byte of the val split under the train split's smoothed unigram token distribution."""
    import math
    from collections import Counter

    from nanochat.dataset import parquets_iter_batched
    from nanochat.tokenizer import get_tokenizer

    tok = get_tokenizer()
    counts = Counter()
    for batch in parquets_iter_batched("train"):
        for ids in tok.encode(batch):
            counts.update(ids)
    total, vocab = sum(counts.values()), tok.get_vocab_size()
    nats = nbytes = 0
    for batch in parquets_iter_batched("val"):
        for text, ids in zip(batch, tok.encode(batch)):
            nats -= sum(math.log((counts[i] + 1) / (total + vocab)) for i in ids)
            nbytes += len(text.encode("utf-8"))
    return nats / math.log(2) / nbytes


@pytest.mark.slow  # 11 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_tiny_model_learns_on_builtin_corpus(tiny_env, tmp_path):
    base = fresh_base(tiny_env, tmp_path, "learn")
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    run_train(base, ["--num-iterations=150", "--eval-every=150", "--aspect-ratio=64", "--head-dim=64", "--max-seq-len=128",
                     "--device-batch-size=4", "--total-batch-size=512", "--eval-tokens=4096", "--run=learn"],
              env_extra={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"})
    assert list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")), "wandb offline run was not written"
    bpb, unigram = val_bpbs(base), unigram_bpb(base)
    print(f"val_bpb step 0: {bpb[0]:.3f} -> step 150: {bpb[150]:.3f} (unigram level {unigram:.3f})")
    assert bpb[150] < 0.6 * bpb[0]
    assert bpb[150] < 0.75 * unigram
    losses = train_losses(base)
    assert losses[150] < losses[1] - 2.0


@pytest.mark.slow  # 16 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_bad_input_fails_before_compute(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "bad")
    p = run_train(base, ["--num-iterations=2", "--total-batch-size=300"], check=False)
    assert p.returncode == 1 and "multiple" in p.stderr and "step 0000" not in p.stdout
    p = run_train(base, ["--num-iterations=2", "--resume"], check=False)
    assert p.returncode == 1 and "no checkpoint" in p.stderr

    from nanochat.common import UserError
    from scripts import base_train

    with pytest.raises(UserError, match="--target-flops=nan is not valid: must be a finite number"):
        base_train.parse_args(TINY + ["--num-iterations=-1", "--target-flops=nan"])

    run_train(base, ["--num-iterations=2", "--eval-every=-1", "--save-every=1"])
    # resumed from a step with later ones in the directory: they would be overwritten, then pruned in favour of its own
    ckpt_dir = os.path.join(base, "base_checkpoints", "tiny")
    p = run_train(base, ["--num-iterations=3", "--resume-from-step=1", "--keep-last=1"], check=False)
    assert p.returncode == 1 and "after step 1 (steps 2..2)" in p.stderr and "step 0000" not in p.stdout
    assert list_steps(ckpt_dir) == [1, 2]
    # a different shape under the same tag
    p = run_train(base, ["--num-iterations=4", "--resume", "--aspect-ratio=64", "--head-dim=64"], check=False)
    assert p.returncode == 1 and "different model" in p.stderr
    # a corrupt weights file
    path = os.path.join(base, "base_checkpoints", "tiny", "step_000002", "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(200)
        f.write(b"\x00garbage\x00")
    p = run_train(base, ["--num-iterations=4", "--resume"], check=False)
    assert p.returncode == 1 and "corrupt" in p.stderr and "step_000002" in p.stderr


@pytest.mark.slow  # 12 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_sigterm_saves_and_stops_and_nan_refuses(tiny_base_dir, tmp_path):
    from nanochat.checkpoint_manager import list_steps

    base = fresh_base(tiny_base_dir, tmp_path, "signals")
    p = subprocess.Popen(train_cmd() + TINY + ["--num-iterations=100000", "--eval-every=-1"], env=env_for(base),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step 00003/"):
            p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0, "".join(lines[-20:])
    out = "".join(lines)
    assert "stop requested" in out
    steps = list_steps(os.path.join(base, "base_checkpoints", "tiny"))
    assert len(steps) == 1 and steps[0] >= 3 and f"saved checkpoint step {steps[0]}" in out

    # a learning rate that overflows the weights: the run stops at the first non-finite loss and names the step
    shutil.rmtree(os.path.join(base, "base_checkpoints"))
    huge = ["--num-iterations=20", "--eval-every=-1", "--embedding-lr=1e30", "--unembedding-lr=1e30", "--components=none"]
    p = run_train(base, huge, check=False)
    assert p.returncode == 1 and "loss is nan at step" in p.stderr.lower(), p.stderr[-2000:]
    assert not list_steps(os.path.join(base, "base_checkpoints", "tiny"))
    # with a save due while the weights are already non-finite, the save refuses rather than overwrite good state
    p = run_train(base, huge + ["--save-every=1"], check=False)
    assert p.returncode == 1 and "weights are not finite at step" in p.stderr, p.stderr[-2000:]
    steps = list_steps(os.path.join(base, "base_checkpoints", "tiny"))
    bad_step = int(p.stderr.split("at step ")[1].split(";")[0])
    assert steps and max(steps) < bad_step


def test_samples_and_core_metric_during_training(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "evals")
    p = run_train(base, ["--num-iterations=4", "--eval-every=2", "--sample-every=2", "--core-metric-every=2",
                         "--eval-bundle=builtin", "--core-metric-max-per-task=4"])
    assert p.stdout.count("  sample: ") == 2 * 6  # six prompts at steps 2 and 4 (not at step 0)
    core = {r["step"]: r["core_metric"] for r in curve(base) if "core_metric" in r}
    assert sorted(core) == [2, 4] and all(-1.0 <= v <= 1.0 for v in core.values())
    assert f"core_metric {core[4]:.4f}" in p.stdout and "world_capital" in p.stdout  # per-task lines of the bundle


def test_flags_not_given_come_from_the_devices_preset_and_the_config_line_says_so(tiny_base_dir, tmp_path):
    """On a CPU, base_train without size flags runs the cpu preset's d4 on 256-token rows (the config line names every
    flag the preset filled); the chat stages, the evaluations and base_loss take their cpu sizes the same way."""
    base = fresh_base(tiny_base_dir, tmp_path, "preset")
    p = subprocess.run(train_cmd(1) + ["--num-iterations=1", "--eval-every=-1", "--model-tag=p", "--device-type=cpu"],
                       env=env_for(base),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    config = next(line for line in p.stdout.splitlines() if line.startswith("base_train |"))
    assert "layers 4 " in config and "T 256" in config and "batch 2,048 tok = 8x256x1x1" in config, config
    assert config.endswith("cpu preset: --depth=4 --max-seq-len=256 --device-batch-size=8 --total-batch-size=2048 "
                           "--eval-tokens=32768 --core-metric-every=-1 --sample-every=350"), config
    from scripts import base_loss, chat_eval, chat_rl, chat_sft, mid_train

    cpu = ["--device-type=cpu"]  # (a GPU would pick the gpu preset)
    assert vars(mid_train.parse_args(cpu))["total_batch_size"] == 4096
    sft = chat_sft.parse_args(cpu + ["--total-batch-size=64"])  # a flag given wins; the rest from the preset
    from nanochat.presets import PRESETS
    cpu_sft = PRESETS["chat_sft"]["cpu"]
    assert (sft.total_batch_size, sft.device_batch_size, sft.num_iterations) == \
        (64, cpu_sft["device_batch_size"], cpu_sft["num_iterations"])
    assert "--total-batch-size" not in sft.preset and "--device-batch-size=16" in sft.preset
    assert (chat_rl.parse_args(cpu).num_samples, chat_eval.parse_args(cpu).max_problems) == (8, 200)
    assert (base_loss.parse_args(cpu).split_tokens, base_loss.parse_args(cpu + ["--split-tokens=7"]).split_tokens) == (65536, 7)


def files_of_one_step(main, argv, step):
    """The project's files whose Python code runs, in this thread, during one step of a training script: from its loop
    asking the schedule for step `step`'s lr to asking it for the next's (optim.lr_multiplier, called once a step)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    files, seen = set(), []

    def project_file(code):
        path = os.path.relpath(code.co_filename, root)
        return path if path.split(os.sep)[0] in ("nanochat", "scripts", "tasks", "bench") else None

    def note(frame, event, arg):
        if event != "call":
            return
        if frame.f_code.co_name == "lr_multiplier" and frame.f_code.co_filename.endswith(os.path.join("nanochat", "optim.py")):
            seen.append(frame.f_locals["step"])
        if seen and seen[-1] == step:  # the function called, and the code calling it (a script's loop is no call)
            files.update(f for f in (project_file(frame.f_code), frame.f_back and project_file(frame.f_back.f_code)) if f)

    sys.setprofile(note)
    try:
        main(argv)
    finally:
        sys.setprofile(None)
    assert step in seen and step + 1 in seen, seen
    return files


def test_a_training_step_runs_code_of_six_files(tiny_base_dir, tmp_path, monkeypatch):
    """docs/layout.md: one base_train step, from one lr to the next (the micro-batches, forward and backward, both
    optimizers, the progress line, the stop signal's check), on the GPU's path (the plain ops) runs code of six
    files; a step that starts no evaluation, checkpoint or calibration runs none of the add-ons' code."""
    from scripts import base_train

    monkeypatch.setenv("NANOCHAT_BASE_DIR", fresh_base(tiny_base_dir, tmp_path, "files"))
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "builtin")
    monkeypatch.setenv("NANOCHAT_CPU_OPS", "0")
    files = files_of_one_step(base_train.main, TINY + ["--num-iterations=8", "--eval-every=-1"], step=5)
    assert files == {"scripts/base_train.py", "nanochat/loop.py", "nanochat/dataloader.py", "nanochat/gpt.py",
                     "nanochat/optim.py", "nanochat/common.py"}, sorted(files)
