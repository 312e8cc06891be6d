"""
Bits per byte checked against a hand computation: nanochat.loss_eval.evaluate_bpb on a real tiny GPT and real
eval batches of the built-in corpus, then scripts/base_loss end to end on a saved checkpoint of that model.

By hand: bpb = (sum of per-token cross-entropy, in nats, over targets that stand for at least one byte)
             / (ln 2 * total UTF-8 bytes of those targets);
targets of -1 are ignored and special tokens (BOS) count 0 bytes, so they drop out of both sums.
"""

import pytest
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys

import torch
from conftest import random_tiny_gpt

from nanochat.checkpoint_manager import checkpoint_dir, save_checkpoint
from nanochat.dataloader import eval_batches
from nanochat.loss_eval import evaluate_bpb
from nanochat.tokenizer import RustBPETokenizer, get_token_bytes, get_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T = 2, 64


def tiny_gpt(vocab_size):
    """Every matrix random, so a wrong weighting of tokens cannot hide behind losses of about ln(vocab)."""
    return random_tiny_gpt(vocab_size, T)


def first_batches(tokenizer, split, n):
    loader, batches = eval_batches(tokenizer, B, T, split, "cpu", 0, 1)
    taken = [next(batches) for _ in range(n)]
    loader.close()
    return taken


def bpb_by_hand(model, batches, byte_lengths, count_zero_byte_targets=False):
    """One target at a time, in float64, straight from the logits."""
    nats, nbytes = 0.0, 0
    for x, y in batches:
        with torch.no_grad():
            logprobs = torch.log_softmax(model(x).double(), dim=-1)
        for b in range(y.size(0)):
            for t in range(y.size(1)):
                target = int(y[b, t])
                if target == -1 or (byte_lengths[target] == 0 and not count_zero_byte_targets):
                    continue
                nats -= logprobs[b, t, target].item()
                nbytes += int(byte_lengths[target])
    return nats / (math.log(2) * nbytes)


@pytest.mark.quick
def test_evaluate_bpb_matches_hand_computation(tiny_env, single_torch_thread):
    """evaluate_bpb = the hand formula within 1e-6 relative, with BOS targets (0 bytes) and -1 targets present."""
    tokenizer = get_tokenizer()
    byte_lengths = tokenizer.token_byte_lengths()
    # the byte lengths are those of the tokens' own bytes, and 0 exactly for the specials
    for i in range(tokenizer.get_vocab_size()):
        is_special = i >= len(tokenizer.mergeable_ranks)
        assert byte_lengths[i] == (0 if is_special else len(tokenizer.enc.decode_single_token_bytes(i))), i
    model = tiny_gpt(tokenizer.get_vocab_size())
    batches = first_batches(tokenizer, "val", 3)
    x, y = batches[1]
    y = y.clone()
    y[0, 5:15] = -1  # ignored targets, as a masked batch would have them
    y[1, -3:] = -1
    batches[1] = (x, y)
    targets = torch.cat([y.reshape(-1) for _, y in batches])
    bos = tokenizer.get_bos_token_id()
    assert (targets == bos).any() and (targets == -1).sum() == 13

    by_hand = bpb_by_hand(model, batches, byte_lengths)
    token_bytes = get_token_bytes("cpu")
    got, tokens, ran_out = evaluate_bpb(model, batches, len(batches), token_bytes)
    assert abs(got - by_hand) <= 1e-6 * by_hand, (got, by_hand)
    assert tokens == int((targets != -1).sum()) and not ran_out
    # the check is sharp enough to see the BOS targets' loss wrongly counted (at zero bytes)
    assert abs(bpb_by_hand(model, batches, byte_lengths, count_zero_byte_targets=True) - by_hand) > 1e-4 * by_hand
    # steps bounds how many batches are read
    first_two, _, _ = evaluate_bpb(model, iter(batches), 2, token_bytes)
    assert abs(first_two - bpb_by_hand(model, batches[:2], byte_lengths)) <= 1e-6 * first_two
    # a stream that ends before `steps` (a split smaller than asked for) ends the evaluation and says so
    assert evaluate_bpb(model, iter(batches), 10, token_bytes) == (got, tokens, True)


def test_base_loss_script_reports_hand_computed_bpb(tiny_base_dir, tmp_path, monkeypatch, single_torch_thread):
    """scripts/base_loss on a saved tiny checkpoint prints (and reports) the hand-computed bpb of both splits."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base, ignore=shutil.ignore_patterns("base_checkpoints", "report"))
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "builtin")
    tokenizer = get_tokenizer()
    model = tiny_gpt(tokenizer.get_vocab_size())
    meta = {"model_config": dataclasses.asdict(model.config), "tokenizer_hash": tokenizer.fingerprint(),
            "dataloader_states": [{}]}
    save_checkpoint(checkpoint_dir("base", "tiny"), 1, model, [], meta)

    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base), NANOCHAT_DATA_SOURCE="builtin", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "scripts.base_loss", "--device-batch-size=2", "--split-tokens=256", "--model-tag=tiny"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # while it starts: 256 tokens per split at 2 x 64 tokens per batch on one rank = the first 2 batches
        byte_lengths = tokenizer.token_byte_lengths()
        by_hand = {split: bpb_by_hand(model, first_batches(tokenizer, split, 256 // (B * T)), byte_lengths)
                   for split in ("train", "val")}
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-3000:]

    for split in ("train", "val"):
        printed = re.findall(rf"^{split} bpb: ([0-9.]+)", output, flags=re.M)
        assert len(printed) == 1, output[-3000:]
        assert abs(float(printed[0]) - by_hand[split]) <= 0.5e-4 + 1e-9, (split, printed, by_hand)
    assert by_hand["train"] != by_hand["val"]  # two different streams, so a split mix-up would show
    # the report keeps full precision
    with open(base / "report" / "base-model-loss.json") as f:
        reported = json.load(f)["data"][0]
    assert reported["step"] == 1
    for split in ("train", "val"):
        assert abs(reported[f"{split} bpb"] - by_hand[split]) <= 1e-6 * by_hand[split], (split, reported, by_hand)


@pytest.mark.slow  # 10 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_base_loss_past_the_split_evaluates_it_once_on_one_rank_and_two(tiny_base_dir, tmp_path):
    """--split-tokens far beyond the tiny val split: each split is read once and the output says so; 1 rank with
    device batch 4 and 2 ranks with 2 (the same global batch) evaluate the same tokens to the same bpb."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base, ignore=shutil.ignore_patterns("base_checkpoints", "report"))
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base), NANOCHAT_DATA_SOURCE="builtin", OMP_NUM_THREADS="1")
    tokenizer = RustBPETokenizer.from_directory(str(base / "tokenizer"))
    model = tiny_gpt(tokenizer.get_vocab_size())
    meta = {"model_config": dataclasses.asdict(model.config), "tokenizer_hash": tokenizer.fingerprint()}
    save_checkpoint(str(base / "base_checkpoints" / "tiny"), 1, model, [], meta)
    outputs = []
    for launch, batch in (([sys.executable, "-m"], 4),
                          ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"], 2)):
        p = subprocess.run(launch + ["scripts.base_loss", f"--device-batch-size={batch}", "--split-tokens=100000000",
                                     "--model-tag=tiny"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        outputs.append(re.findall(r"^val bpb: ([0-9.]+) over ([0-9,]+) tokens, the whole val split once", p.stdout, re.M))
    assert len(outputs[0]) == 1 and outputs[0] == outputs[1], outputs
