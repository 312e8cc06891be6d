"""
bench memory: its measurement of a training step's memory (torch.profiler's allocation events) checked against tensors
of known size, and the command run for both projects at a tiny shape. No test asserts how much memory either project
uses: those numbers belong in BENCHMARKS.md.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from bench.memory import CATEGORIES, measure_second_step
from nanochat.gpt import GPT
from nanochat.recipe import DEFAULT_COMPONENTS, canonical_components, depth_recipe, split_components

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH_BYTES = 4096 * 64 * 4  # the toy's one fp32 batch


class KeepForBackward(torch.autograd.Function):
    """The identity on a tensor, which keeps a block of `nbytes` bytes for its backward: a known extra activation."""

    @staticmethod
    def forward(ctx, x, nbytes):
        ctx.save_for_backward(torch.zeros(nbytes, dtype=torch.uint8))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Toy(nn.Module):
    """Two linears whose activations outweigh their parameters, so the step's peak falls early in the backward."""

    def __init__(self, extra_saved_bytes=0, extra_param_numel=0):
        super().__init__()
        self.up = nn.Linear(64, 256, bias=False)
        self.down = nn.Linear(256, 64, bias=False)
        self.extra = nn.Parameter(torch.zeros(extra_param_numel)) if extra_param_numel else None
        self.extra_saved_bytes = extra_saved_bytes

    def forward(self, x):
        # kept on the first layer's weight, whose backward runs last: the extra block lives through the whole backward
        w = KeepForBackward.apply(self.up.weight, self.extra_saved_bytes) if self.extra_saved_bytes else self.up.weight
        loss = self.down(torch.relu(x @ w.t())).square().mean()
        return loss + self.extra.sum() if self.extra is not None else loss


def measure_toy(**options):
    def build():
        torch.manual_seed(0)
        model = Toy(**options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(4096, 64)

        def step():
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return model, [optimizer], step

    return measure_second_step(build)


def test_the_memory_before_the_step_is_the_parameters_the_optimizer_state_and_the_batch(single_torch_thread):
    result = measure_toy()
    # every block the first step freed is subtracted again: what stays is exactly what the training holds
    assert result["before_step_bytes"] == result["parameters_direct"] + result["optimizer_state_direct"] + BATCH_BYTES
    assert result["parameters_direct"] == (64 * 256 * 2) * 4
    at_peak = result["at_peak"]
    assert sum(at_peak.values()) == result["peak_bytes"]
    assert at_peak["parameters"] == result["parameters_direct"]
    assert at_peak["optimizer_state"] == result["optimizer_state_direct"]
    assert at_peak["other"] == BATCH_BYTES
    assert at_peak["activations"] > 2 * 4096 * 256 * 4  # at least the first layer's output and its relu


def test_a_tensor_saved_for_backward_raises_the_peak_by_its_bytes(single_torch_thread):
    extra = 3 * 2**20 + 17
    base, more = measure_toy(), measure_toy(extra_saved_bytes=extra)
    assert more["peak_bytes"] - base["peak_bytes"] == extra
    assert more["at_peak"]["activations"] - base["at_peak"]["activations"] == extra
    for category in ("parameters", "gradients", "optimizer_state", "other"):
        assert more["at_peak"][category] == base["at_peak"][category], category


def test_a_parameter_counts_once_as_itself_once_as_its_gradient_and_twice_in_adamw(single_torch_thread):
    numel = 100_000
    base, more = measure_toy(), measure_toy(extra_param_numel=numel)
    delta = {c: more["at_peak"][c] - base["at_peak"][c] for c in CATEGORIES}
    assert delta["parameters"] == 4 * numel
    assert delta["gradients"] == 4 * numel  # its gradient comes first in the backward: alive at the peak
    assert 8 * numel <= delta["optimizer_state"] <= 8 * numel + 64  # exp_avg, exp_avg_sq (and a step counter)
    assert delta["activations"] == delta["other"] == 0


def test_the_peak_equals_torch_memtrackers_an_independent_count_of_live_storages(single_torch_thread):
    # MemTracker (torch.distributed._tools) counts tensors' storages from a TorchDispatchMode, not from the allocator
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model, x = Toy(), torch.randn(4096, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer, x)
    with tracker:
        step()
    (tracked,) = tracker.get_tracker_snapshot("peak").values()
    ours = measure_toy()
    assert ours["peak_bytes"] == tracked["Total"]
    assert ours["at_peak"]["parameters"] == tracked["Parameter"] and ours["at_peak"]["gradients"] == tracked["Gradient"]
    assert ours["at_peak"]["optimizer_state"] == tracked["Optstate"]
    assert ours["at_peak"]["activations"] == tracked["Activation"] + tracked["Temp"]


def run_bench(*flags):
    cmd = [sys.executable, "-m", "scripts.bench", "memory", "--depth=1", "--seq-len=32", "--device-batch-size=2",
           "--vocab-size=256", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memory of one training step at its peak" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "memory" and (result["depth"], result["seq_len"]) == (1, 32)
    assert result["components"] == canonical_components(DEFAULT_COMPONENTS)  # 'default' is base_train's set
    return proc.stdout, result


def check_measured(project):
    """What holds for any project's row: the categories add up, and parameters and state are the tensors' own sizes."""
    assert project["dtype_env"] == "bfloat16"
    assert sum(project["at_peak"].values()) == project["peak_bytes"] > project["before_step_bytes"] > 0
    assert project["at_peak"]["parameters"] == project["parameters_direct"] > 0
    assert project["at_peak"]["optimizer_state"] == project["optimizer_state_direct"] > 0
    assert project["at_peak"]["activations"] > 0


def test_bench_measures_ours_and_says_how_to_get_a_missing_reference(tmp_path):
    stdout, result = run_bench(f"--reference={tmp_path / 'no-checkout'}")
    ours = result["projects"]["ours"]
    check_measured(ours)
    recipe = depth_recipe(1, 256, 32, 2 * 32, num_iterations=1, components=split_components(DEFAULT_COMPONENTS)[0])
    with torch.device("meta"):
        num_params = GPT(recipe.model_config).num_params()
    assert 2 * num_params <= ours["parameters_direct"] <= 4 * num_params  # each in fp32 or bf16
    assert result["projects"]["reference"]["skipped"].startswith("no reference checkout")
    assert "git clone https://github.com/karpathy/nanochat" in stdout and result["ours_over_reference"] is None


@pytest.mark.slow
def test_bench_compares_ours_with_the_reference_where_its_checkout_exists():
    # runs everywhere: with a checkout both rows are measured, without one the reference's row must say how to get it
    stdout, result = run_bench()
    check_measured(result["projects"]["ours"])
    reference = result["projects"]["reference"]
    if os.path.isfile(os.path.join(REPO, ".reference", "nanochat", "gpt.py")):
        check_measured(reference)
        assert result["ours_over_reference"] == result["projects"]["ours"]["peak_bytes"] / reference["peak_bytes"]
        assert "ours / reference" in stdout
    else:
        assert reference["skipped"].startswith("no reference checkout") and result["ours_over_reference"] is None
