"""
The memory model of a training step (nanochat/planning/memory_model.py), activation checkpointing (gpt.py), and the
plans that fit a memory limit (time_budget, base_train, FittingBatches' message). No test asserts how many bytes a
step needs: BENCHMARKS.md holds the prediction against the measured peak (`python -m bench.memory_model predict`).
"""

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from nanochat.common import GIB, MIB, UserError, format_bytes, parse_memory
from nanochat.gpt import has_value_embed
from nanochat.planning import memory_model as mm
from nanochat.recipe import DEFAULT_COMPONENTS, split_components

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_COMPONENTS, OPTIMIZER_COMPONENTS = (tuple(c) for c in split_components(DEFAULT_COMPONENTS))


def tiny_spec(**changes):
    """A small step of the default recipe: 4 layers of width 64 (heads of 32), 64-token rows, a 512-token vocabulary."""
    fields = dict(depth=4, seq_len=64, vocab_size=512, aspect_ratio=16, head_dim=32,
                  model_components=MODEL_COMPONENTS, optimizer_components=OPTIMIZER_COMPONENTS, dtype="float32",
                  compiled=False, cpu_ops=True, device_type="cpu")
    fields.update(changes)
    return mm.StepSpec(**fields)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A base dir of its own, so no profile traced before (by another test, or by hand) is read back."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    mm.step_profile.cache_clear()
    yield tmp_path
    mm.step_profile.cache_clear()


@pytest.mark.quick
def test_memory_is_read_as_users_write_it_and_nonsense_is_refused():
    assert parse_memory("24GiB") == 24 * 2**30 == parse_memory("24G") == parse_memory(" 24 gib ")
    assert parse_memory("80GB") == 80 * 10**9 and parse_memory("512MiB") == 2**29
    assert parse_memory("1.5TiB") == int(1.5 * 2**40) and parse_memory(str(2**30)) == 2**30
    for bad in ("abc", "24 apples", "-1GiB", "0", "1KiB", "", "nan"):
        with pytest.raises(UserError, match="NANOCHAT_GPU_MEMORY="):
            parse_memory(bad)


def loss_and_grads(model, idx):
    model.zero_grad(set_to_none=True)
    loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_activation_checkpointing_gives_the_same_loss_and_gradients_and_a_smaller_peak(single_torch_thread, monkeypatch):
    """Each block's forward run again in its backward, by the same kernels on the same inputs: the loss and every
    gradient are equal to the last bit (tolerance 0, fp32 on the CPU, its fused Functions swapped in and the plain path
    alike);
    the step's peak (torch.profiler's allocation events, bench memory's measurement) is at least a fifth lower."""
    from bench.memory import measure_second_step
    from nanochat.gpt import build_model
    from nanochat.kernels.cpu import use_cpu_kernels
    from nanochat.optim import muon_momentum
    from nanochat.recipe import build_optimizers, depth_recipe
    from nanochat.loop import train_step

    recipe = depth_recipe(4, 512, 128, 8 * 128, 32, 32, num_iterations=1, components=MODEL_COMPONENTS)
    idx = torch.randint(0, 512, (8, 128), generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv("NANOCHAT_DTYPE", "float32")
    for cpu_ops in ("1", "0"):
        monkeypatch.setenv("NANOCHAT_CPU_OPS", cpu_ops)
        torch.manual_seed(0)
        model = use_cpu_kernels(build_model(recipe.model_config, torch.device("cpu")), "cpu")
        plain = loss_and_grads(model, idx)
        model.checkpoint_activations = True
        checkpointed = loss_and_grads(model, idx)
        assert torch.equal(plain[0], checkpointed[0]), cpu_ops
        for name, grad in plain[1].items():
            assert torch.equal(grad, checkpointed[1][name]), (cpu_ops, name)

    def build(checkpoint):
        def make():
            torch.manual_seed(0)
            model = use_cpu_kernels(build_model(recipe.model_config, torch.device("cpu")), "cpu")
            model.checkpoint_activations = checkpoint
            optimizers = build_optimizers(model, **recipe.lrs(), optimizer_components=OPTIMIZER_COMPONENTS)

            def step():
                train_step(model, optimizers, [(idx, idx)], lambda m, xy: m(*xy), 1.0, muon_momentum(0),
                           torch.autocast("cpu", enabled=False))

            return model, optimizers, step
        return make

    peaks = {checkpoint: measure_second_step(build(checkpoint))["peak_bytes"] for checkpoint in (False, True)}
    assert peaks[True] < 0.8 * peaks[False], peaks


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)],  # compiled: 13 s
                         ids=["eager", "compiled"])
def test_a_few_layers_traced_stand_for_the_whole_model(compiled, fresh_cache, single_torch_thread):
    """The model's first layer and one of each other kind (value embedding or not) are traced, and the other layers
    counted as copies: the same peak, parameters and gradients as tracing all eight layers, at any device batch."""
    spec = tiny_spec(depth=8, compiled=compiled, dtype="bfloat16" if compiled else "float32", cpu_ops=not compiled)
    assert mm.reduced_layers(mm.layer_kinds(spec.model_config())) == [(True, None), (True, None), (False, None)]
    few, whole = mm.trace_profile(spec), mm.trace_profile(spec, whole=True)
    for batch in (1, 3, 8):
        a, b = few.at(batch), whole.at(batch)
        assert (a.parameters, a.optimizer_state, a.gradients) == (b.parameters, b.optimizer_state, b.gradients)
        assert a.activations == pytest.approx(b.activations, rel=0.005), batch
        assert a.peak == pytest.approx(b.peak, rel=0.01), batch


def test_the_prediction_follows_the_measured_step(fresh_cache, single_torch_thread, monkeypatch):
    """The eager CPU step as base_train takes it (fp32, the fused CPU Functions), with and without activation
    checkpointing: the predicted peak within 15 % of the measured one (torch.profiler's allocation events)."""
    from bench.memory import measure_second_step
    from nanochat.gpt import build_model
    from nanochat.kernels.cpu import use_cpu_kernels
    from nanochat.optim import muon_momentum
    from nanochat.recipe import build_optimizers, depth_recipe
    from nanochat.loop import train_step

    monkeypatch.setenv("NANOCHAT_DTYPE", "float32")
    spec = tiny_spec(seq_len=128)
    recipe = depth_recipe(spec.depth, spec.vocab_size, spec.seq_len, 4 * spec.seq_len, spec.aspect_ratio,
                          spec.head_dim, num_iterations=1, components=MODEL_COMPONENTS)
    idx = torch.randint(0, spec.vocab_size, (4, spec.seq_len), generator=torch.Generator().manual_seed(0))
    for checkpoint in (False, True):
        def build():
            model = use_cpu_kernels(build_model(recipe.model_config, torch.device("cpu")), "cpu")  # as base_train
            model.checkpoint_activations = checkpoint
            optimizers = build_optimizers(model, **recipe.lrs(), optimizer_components=OPTIMIZER_COMPONENTS)
            batch = (idx, idx.roll(-1, dims=1))

            def step():
                train_step(model, optimizers, [batch], lambda m, xy: m(*xy), 1.0, muon_momentum(0),
                           torch.autocast("cpu", enabled=False))

            return model, optimizers, step

        measured = measure_second_step(build)["peak_bytes"]
        predicted = mm.predict(tiny_spec(seq_len=128, checkpoint_activations=checkpoint), 4).peak
        assert predicted == pytest.approx(measured, rel=0.15), (checkpoint, predicted, measured)


def test_a_smaller_memory_gets_a_smaller_device_batch_checkpointing_or_nothing(fresh_cache):
    """fit_step: the largest device batch (a divisor of the rows per step) whose predicted peak is within MEMORY_SHARE
    of the memory; with less memory a smaller one, then activation checkpointing, then nothing; the least memory
    least_memory names for one row is enough, and a little less is not."""
    spec = tiny_spec()
    rows = 32
    one_row, all_rows = mm.predict(spec, 1).peak, mm.predict(spec, rows).peak
    fits = {}
    for limit in (2 * all_rows, all_rows, (one_row + all_rows) // 2, one_row):
        fit = mm.fit_step(spec, limit, rows)
        fits[limit] = fit
        if fit is not None:
            assert fit.memory.peak <= mm.MEMORY_SHARE * limit and rows % fit.device_batch == 0
    batches = [f.device_batch if f and not f.checkpoint_activations else 0 for f in fits.values()]
    assert batches == sorted(batches, reverse=True) and batches[0] == rows and batches[-1] < batches[0]
    least = mm.least_memory(spec)
    assert least < one_row / mm.MEMORY_SHARE  # less than one row needs without checkpointing
    fit = mm.fit_step(spec, least, rows)
    assert fit is not None and fit.checkpoint_activations and fit.memory.peak <= mm.MEMORY_SHARE * least
    assert mm.fit_step(spec, least, rows, checkpoint=False) is None  # without checkpointing it needs more
    assert mm.fit_step(spec, int(least * 0.97), rows) is None


def test_the_budget_plan_fits_the_memory_it_is_given(fresh_cache):
    """plan_pretraining with a memory limit (NANOCHAT_GPU_MEMORY's path), from step times measured before: less memory gives
    a smaller device batch or a smaller model, and no plan's predicted peak exceeds its share of its memory; the plan
    prints the predicted peak beside the memory. A memory no model fits is refused before anything is measured,
    naming the least memory that would do."""
    from nanochat.planning import time_budget as tb

    device = torch.device("cpu")

    def shape(limit):
        return tb.RunShape(512, 64, 2048, 1, 16, 32, None, list(MODEL_COMPONENTS), list(OPTIMIZER_COMPONENTS), False,
                           32, 1024, None, False, 0.0, memory_limit=limit, checkpoint_activations=None,
                           device_type="cpu", memory_label=f"NANOCHAT_GPU_MEMORY={limit}")

    small, large = 30 * MIB, 400 * MIB
    for limit in (small, large):  # the probe's seconds per step, as an earlier probe on this machine measured them
        tb.write_measurements(tb.machine_signature(shape(limit), device), {d: (32, 0.002 * d * d) for d in range(1, 13)})
    law = tb.LAWS["cpu-builtin"]
    plans = {limit: tb.plan_pretraining(law, shape(limit), 600, time.time(), device, torch.autocast("cpu", enabled=False))
             for limit in (small, large)}
    for limit, plan in plans.items():
        assert plan.memory_limit == limit and plan.predicted_peak <= mm.MEMORY_SHARE * limit
        assert "plan | memory: d" in tb.memory_line(plan) and f"predicted peak {format_bytes(plan.predicted_peak)}" \
            in tb.memory_line(plan)
    assert (plans[small].device_batch_size, plans[small].depth) < (plans[large].device_batch_size, plans[large].depth)
    started = time.time()
    with pytest.raises(UserError, match=r"NANOCHAT_GPU_MEMORY=1048576 is too little for d1, the smallest model, .* give "
                                        r"at least [\d.]+ MiB"):
        tb.plan_pretraining(law, shape(MIB), 600, time.time(), device, torch.autocast("cpu", enabled=False))
    assert time.time() - started < 30


def test_an_impossible_memory_is_refused_in_one_line_before_any_work(tiny_base_dir, tmp_path):
    """base_train with NANOCHAT_GPU_MEMORY too small for one row of its model: one line naming the least memory, exit
    1, no step taken; at that least memory the run plans a device batch and takes its steps."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base)
    command = [sys.executable, "-m", "scripts.base_train", "--depth=2", "--aspect-ratio=32", "--head-dim=32",
               "--max-seq-len=64", "--total-batch-size=256", "--num-iterations=2", "--eval-every=-1",
               "--core-metric-every=-1", "--sample-every=-1", "--model-tag=m"]
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base), NANOCHAT_DATA_SOURCE="builtin", OMP_NUM_THREADS="1",
               NANOCHAT_GPU_MEMORY="1MiB")
    p = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "step 0000" not in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: NANOCHAT_GPU_MEMORY=1MiB is too little for --depth=2"), errors
    least = re.search(r"give at least (\d+) MiB", errors[0]).group(1)
    p = subprocess.run(command, cwd=REPO, env={**env, "NANOCHAT_GPU_MEMORY": f"{least}MiB"}, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.search(rf"memory \| device batch \d+, activation checkpointing (on|off): predicted peak .* of "
                     rf"NANOCHAT_GPU_MEMORY={least}MiB", p.stdout) and "2/2 steps" in p.stdout


@pytest.mark.quick
def test_an_out_of_memory_says_how_far_off_the_prediction_was(capsys):
    """FittingBatches still halves the device batch on an out-of-memory in the first steps, and its line gives the
    memory model's peak for the device batch that did not fit."""
    from nanochat.loop import FittingBatches

    class Loader:
        def __init__(self, device_batch):
            self.device_batch = device_batch

        def state_dict(self):
            return {}

        def __next__(self):
            return torch.zeros(self.device_batch, 4), torch.zeros(self.device_batch, 4)

        def close(self):
            pass

    batches = FittingBatches(lambda b, state: Loader(b), 8, 8 * 4, 4, 1, 2, torch.device("cpu"),
                             predicted_peak=lambda b: b * 3 * GIB)
    while True:  # base_train's step, with more than 2 rows not fitting
        try:
            if batches.next_step()[0][0].size(0) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory")
            ran_out = False
        except Exception as error:
            if not batches.recovers_from(error):
                raise
            ran_out = True
        if batches.every_rank_fitted(ran_out):
            break
        batches.shrink()
    out = capsys.readouterr().out
    assert "out of memory at --device-batch-size=8 on the cpu's memory (the memory model predicted a peak of 24.0 GiB)" \
        in out and "going on at 4" in out and "out of memory at --device-batch-size=4" in out
    assert batches.device_batch_size == 2 and batches.grad_accum == 4 and batches.steps_taken == 1


@pytest.mark.slow  # ~1-2 minutes: the compiled steps of several GPU-sized depths traced
def test_a_12_gib_card_gets_a_smaller_plan_than_an_80_gib_one(fresh_cache):
    """The GPU's plan at GPU sizes (T 2048, vocabulary 32,768, the compiled bf16 step), with NANOCHAT_GPU_MEMORY at 12
    and 80 GiB: the depth the plan's walk reaches fits a smaller device batch (or needs checkpointing) in 12 GiB, and
    no predicted peak exceeds the share of its memory."""
    from nanochat.planning import time_budget as tb

    def shape(limit):
        return tb.RunShape(32768, 2048, 2**19, 1, 64, 128, None, list(MODEL_COMPONENTS), list(OPTIMIZER_COMPONENTS),
                           False, 256, 0, None, False, 60.0, memory_limit=limit, checkpoint_activations=None,
                           device_type="cuda", compiled=True)

    fits = {gib: tb.plan_memory(20, shape(gib * GIB)) for gib in (12, 80)}
    assert fits[80] is not None and fits[80].device_batch >= 16 and not fits[80].checkpoint_activations
    small = fits[12]
    assert small is None or small.device_batch < fits[80].device_batch or small.checkpoint_activations
    for gib, fit in fits.items():
        assert fit is None or fit.memory.peak <= mm.MEMORY_SHARE * gib * GIB


@pytest.mark.quick
def test_the_speedrun_checks_the_memory_before_any_work_and_says_what_it_does(tmp_path, monkeypatch, capsys):
    """NANOCHAT_GPU_MEMORY under a budgeted speedrun: a value that is no amount of memory is refused as the plan is made
    (before any stage), and the plan says that base_train fits itself to a good one."""
    from scripts.speedrun_plan import main as speedrun_plan

    command = ["plan", "5m", "--dry-run", "--plan-file", str(tmp_path / "plan.json")]
    monkeypatch.setenv("NANOCHAT_GPU_MEMORY", "lots")
    with pytest.raises(UserError, match="NANOCHAT_GPU_MEMORY=lots is not an amount of memory"):
        speedrun_plan(command)
    monkeypatch.setenv("NANOCHAT_GPU_MEMORY", "24GiB")
    speedrun_plan(command)
    assert "plan | memory         NANOCHAT_GPU_MEMORY=24GiB: base_train fits its depth, device batch" in \
        capsys.readouterr().out


@pytest.mark.quick
def test_every_stage_on_a_gpu_keeps_to_the_card_named_by_nanochat_gpu_memory(monkeypatch):
    """compute_init caps a CUDA process to NANOCHAT_GPU_MEMORY (so mid_train, the chat stages and chat_eval keep to a
    24 GB card too, not base_train alone); nothing is capped without it, or where the card is smaller than named."""
    from nanochat import common

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=140 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda share, device: asked.append(share))
    monkeypatch.delenv("NANOCHAT_GPU_MEMORY", raising=False)
    common.cap_gpu_memory(torch.device("cuda", 0))
    monkeypatch.setenv("NANOCHAT_GPU_MEMORY", "28GiB")
    common.cap_gpu_memory(torch.device("cuda", 0))
    monkeypatch.setenv("NANOCHAT_GPU_MEMORY", "200GiB")
    common.cap_gpu_memory(torch.device("cuda", 0))
    assert asked == [pytest.approx(0.2)]
    monkeypatch.setenv("NANOCHAT_GPU_MEMORY", "lots")
    with pytest.raises(common.UserError, match="NANOCHAT_GPU_MEMORY=lots is not an amount of memory"):
        common.cap_gpu_memory(torch.device("cuda", 0))


def test_an_fp16_step_needs_what_a_bf16_one_does_but_its_tables_in_fp32(fresh_cache, single_torch_thread):
    """fp16 autocast keeps the same activations as bf16's (both 2 bytes a value; fp32's here are 1.4 times more); its
    embedding tables stay fp32 (gpt.store_embeddings_in_compute_dtype), so their weights, gradients and both AdamW
    moments take 2 bytes a value more each."""
    spec = tiny_spec(cpu_ops=False, device_type="cuda")  # the plain path a GPU runs, eager
    fp16, bf16 = (mm.predict(replace(spec, dtype=dtype), 8) for dtype in ("float16", "bfloat16"))
    config = spec.model_config()
    tables = config.vocab_size * config.n_embd * (1 + sum(has_value_embed(config, i) for i in range(config.n_layer)))
    assert fp16.parameters - bf16.parameters == 2 * tables == fp16.gradients - bf16.gradients
    assert fp16.optimizer_state - bf16.optimizer_state == 4 * tables
    assert fp16.activations == pytest.approx(bf16.activations, rel=0.01)


@pytest.mark.quick
def test_a_plan_for_a_gpu_predicts_the_dtype_nanochat_dtype_names(monkeypatch):
    """A T4's plan (NANOCHAT_DTYPE=float16) predicts an fp16 step, here or not; without the variable a GPU not here is
    planned in bf16."""
    from nanochat.planning import time_budget as tb

    shape = tb.RunShape(32768, 2048, 2**19, 1, 64, 128, None, [], [], False, 256, 0, None, False, 60.0,
                        device_type="cuda", compiled=True)
    monkeypatch.setenv("NANOCHAT_DTYPE", "float16")
    assert tb.step_spec(12, shape).dtype == "float16"
    if not torch.cuda.is_available():
        monkeypatch.delenv("NANOCHAT_DTYPE")
        assert tb.step_spec(12, shape).dtype == "bfloat16"
