"""Training plumbing: the depth dial, batch arithmetic, schedules, and Muon+AdamW on the real GPT."""

import math

import pytest
import torch

from nanochat.common import UserError
from nanochat.gpt import GPT, GPTConfig
from nanochat.optim import apply_schedules, lr_multiplier, muon_momentum
from nanochat.recipe import (BASE_LRS, batch_lr_scale, build_optimizers, default_weight_decay, depth_recipe, dial_lrs,
                             grad_accum_steps, model_config_for_depth, short_run_lr_scale)


@pytest.mark.quick
def test_depth_dial_shapes():
    cfg = model_config_for_depth(20, vocab_size=32768, sequence_len=2048)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head) == (20, 1280, 10, 10)
    cfg = model_config_for_depth(4, vocab_size=4096, sequence_len=256)
    assert (cfg.n_embd, cfg.n_head) == (256, 2)
    cfg = model_config_for_depth(3, vocab_size=4096, sequence_len=256)  # 192 rounds up to a multiple of 128
    assert (cfg.n_embd, cfg.n_head) == (256, 2)
    with pytest.raises(UserError, match="num-kv-heads"):
        model_config_for_depth(12, 4096, 256, n_kv_head=4)  # 6 heads, 4 kv heads
    with pytest.raises(UserError):
        model_config_for_depth(0, 4096, 256)


@pytest.mark.quick
def test_grad_accum_is_validated_before_compute():
    assert grad_accum_steps(524288, 32, 2048, 8) == 1
    assert grad_accum_steps(524288, 16, 2048, 1) == 16
    with pytest.raises(UserError, match="multiple"):
        grad_accum_steps(1000, 8, 64, 1)
    with pytest.raises(UserError, match="multiple"):
        grad_accum_steps(2048, 8, 256, 2)  # 2 ranks x 8 x 256 = 4096 > 2048
    with pytest.raises(UserError, match="positive"):
        grad_accum_steps(2048, 0, 256, 1)


@pytest.mark.quick
def test_schedules():
    n = 100
    assert lr_multiplier(0, n) == 1.0 and lr_multiplier(60, n) == 1.0
    assert lr_multiplier(80, n) == pytest.approx(0.5)
    assert lr_multiplier(100, n, final_lr_frac=0.1) == pytest.approx(0.1)
    assert lr_multiplier(0, n, warmup_ratio=0.1) == pytest.approx(0.1)
    assert muon_momentum(0) == pytest.approx(0.85) and muon_momentum(300) == pytest.approx(0.95)
    assert muon_momentum(150) == pytest.approx(0.90)
    # the small-batch rule: every exponent agrees at the reference batch; the default keeps base lrs at any batch
    assert batch_lr_scale(2**19) == batch_lr_scale(2**19, exponent=0.5) == 1.0
    assert batch_lr_scale(2048) == 1.0
    assert batch_lr_scale(2048, exponent=0.25) / batch_lr_scale(2048, exponent=0.5) == pytest.approx(4.0)
    # the short-run raise: base lrs from 700 steps, twice them at 100 and below, log-linear between
    assert short_run_lr_scale(700) == short_run_lr_scale(14000) == 1.0
    assert short_run_lr_scale(100) == short_run_lr_scale(1) == 2.0
    assert short_run_lr_scale(200) == pytest.approx(2 ** (math.log(3.5) / math.log(7)))  # 1.5624
    assert short_run_lr_scale(265) == pytest.approx(math.sqrt(2), rel=1e-3)  # sqrt(700 * 100) is half way in log steps
    scales = [short_run_lr_scale(n) for n in range(50, 800, 10)]
    assert all(a >= b for a, b in zip(scales, scales[1:]))
    short = depth_recipe(4, 4096, 256, 2048, num_iterations=200)
    assert short.matrix_lr == BASE_LRS["matrix_lr"] * short_run_lr_scale(200)
    assert depth_recipe(4, 4096, 256, 2048, num_iterations=200, short_run_lrs=False).matrix_lr == BASE_LRS["matrix_lr"]
    assert depth_recipe(4, 4096, 256, 2048, num_iterations=700).lrs() == dial_lrs(4, 2048)  # the CPU preset's run
    assert depth_recipe(4, 4096, 256, 2048, num_iterations=50, matrix_lr=0.01).matrix_lr == 0.01  # explicit lrs win
    assert default_weight_decay(12) == pytest.approx(0.2)
    assert default_weight_decay(4, 2048) == pytest.approx(1.8 / 16)


def tiny_gpt():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=32))
    model.to_empty(device="cpu")
    model.init_weights()
    return model


@pytest.mark.quick
def test_muon_adamw_overfit_one_batch():
    model = tiny_gpt()
    optimizers = build_optimizers(model, unembedding_lr=0.02, embedding_lr=0.2, matrix_lr=0.05, weight_decay=0.0)
    kinds = sorted(type(o).__name__ for o in optimizers)
    assert kinds == ["DistAdamW", "DistMuon"]
    # every parameter is optimized by exactly one of them
    owned = [id(p) for o in optimizers for g in o.param_groups for p in g["params"]]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    first = model(x, y).item()
    for step in range(120):
        apply_schedules(optimizers, 1.0, momentum=muon_momentum(step))
        model(x, y).backward()
        for o in optimizers:
            o.step()
        model.zero_grad(set_to_none=True)
    final = model(x, y).item()
    assert first > 3.5  # ~ln(64) at init
    assert final < 0.05, final


@pytest.mark.quick
def test_weight_decay_follows_the_lr_schedule_once():
    # Decay per step is lr(t) * weight_decay: the scheduled lr carries the schedule, the decay rate stays put.
    model = tiny_gpt()
    optimizers = build_optimizers(model, unembedding_lr=0.01, embedding_lr=0.1, matrix_lr=0.02, weight_decay=0.5)
    muon = optimizers[1]
    apply_schedules(optimizers, 0.25, momentum=0.9)
    for group in muon.param_groups:
        assert group["lr"] == pytest.approx(0.02 * 0.25)
        assert group["weight_decay"] == 0.5
        assert group["momentum"] == 0.9
    # With zero gradients Muon's update is zero, so one step shows the decay alone: p <- p * (1 - 0.005 * 0.5).
    matrices = [p for g in muon.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in matrices]
    for p in matrices:
        p.grad = torch.zeros_like(p)
    muon.step()
    for p, p0 in zip(matrices, before):
        torch.testing.assert_close(p, p0 * (1 - 0.02 * 0.25 * 0.5), rtol=1e-6, atol=0)


@pytest.mark.quick
def test_peak_flops_probe_leaves_the_random_stream_alone():
    # Every stage measures the matmul peak for MFU after seeding; the probe must not shift what training draws next.
    from nanochat.common import measure_matmul_flops

    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    assert measure_matmul_flops("cpu", n=256, seconds=0.01, rounds=1) > 0
    assert torch.equal(torch.rand(4), expected)
