"""
Learning, measured (slow: a few minutes on 2 cores; `uv run pytest -m slow`): on the built-in world a small base
model is pretrained for real, then SFT must raise its accuracy on held-out questions (subjects SFT never asks
about, in wordings it never uses) far above the base model's, and RL must raise the reward on the built-in
arithmetic over its SFT start. Margins are set well inside what two seeds gave (docs/speedrun.md, "The CPU preset").
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run(base, module, *args):
    env = dict(os.environ, NANOCHAT_BASE_DIR=base, NANOCHAT_DATA_SOURCE="builtin")
    p = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, f"{module} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def accuracy(base, source, task, problems=100):
    out = run(base, "scripts.chat_eval", "-i", source, "-g", "d4", "-a", task, "-x", str(problems), "--max-new-tokens=40")
    line = next(line for line in out.splitlines() if line.startswith(task))
    return float(line.split("accuracy")[1].split("%")[0]) / 100


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The CPU preset's data and a d4 base model of 500 steps (its full run is 700)."""
    base = str(tmp_path_factory.mktemp("learning"))
    run(base, "nanochat.corpus")
    run(base, "scripts.tok_train", "--max-chars=20000000", "--vocab-size=4096")
    run(base, "scripts.base_train", "--depth=4", "--max-seq-len=256", "--device-batch-size=8", "--total-batch-size=2048",
        "--num-iterations=500", "--eval-every=-1", "--core-metric-every=-1", "--sample-every=-1", "--model-tag=d4")
    return base


def test_sft_answers_held_out_questions_the_base_model_cannot(pretrained):
    base_accuracy = accuracy(pretrained, "base", "WorldQA")
    run(pretrained, "scripts.chat_sft", "-i", "base", "-g", "d4", "--num-iterations=150", "--device-batch-size=16",
        "--total-batch-size=32", "--init-lr-frac=0.15")
    sft_accuracy = accuracy(pretrained, "sft", "WorldQA")
    print(f"held-out WorldQA: base {base_accuracy:.2f} -> sft {sft_accuracy:.2f}")
    assert sft_accuracy >= base_accuracy + 0.30


def test_rl_raises_the_arithmetic_reward_over_its_sft_start(pretrained, tmp_path):
    # A short SFT leaves the arithmetic half solved, so there is reward to gain (after the full SFT it is ~98 %).
    shutil.rmtree(os.path.join(pretrained, "chatsft_checkpoints"), ignore_errors=True)  # the other test's SFT run
    run(pretrained, "scripts.chat_sft", "-i", "base", "-g", "d4", "--num-iterations=110", "--device-batch-size=16",
        "--total-batch-size=32", "--init-lr-frac=0.1")
    run(pretrained, "scripts.chat_rl", "-g", "d4", "--task=Arithmetic", "--num-iterations=50", "--total-batch-size=8",
        "--num-samples=8", "--device-batch-size=16", "--max-new-tokens=40", "--init-lr-frac=0.1", "--temperature=0.7",
        "--eval-problems=64")
    with open(os.path.join(pretrained, "report", "curves", "chat_rl.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    rewards = [r["reward"] for r in records if "reward" in r]
    pass_at_1 = [r["pass@1"] for r in records if "pass@1" in r]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"RL mean reward: first 10 steps {first:.3f} -> last 10 {last:.3f}; pass@1 {pass_at_1[0]:.3f} -> {pass_at_1[-1]:.3f}")
    assert last >= first + 0.05 and pass_at_1[-1] >= pass_at_1[0] + 0.03
