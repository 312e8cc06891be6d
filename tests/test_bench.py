"""Smoke tests for scripts/bench.py: every subcommand runs on tiny settings and ends with its table and JSON line.
They never check a speed: the numbers belong in BENCHMARKS.md, not in assertions."""

import json
import os
import re
import subprocess
import sys

import pytest

from scripts import bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def last_json_line(stdout):
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    return json.loads(lines[-1])


def test_train_runs_the_real_step_and_reports_mfu(tiny_env, tmp_path):
    cmd = [sys.executable, "-m", "scripts.bench", "train", "--depth=1", "--seq-len=32", "--device-batch-size=2",
           "--compile=0", "--steps=2", "--warmup=1", "--breakdown-steps=1", "--peak-seconds=0.05", "--probe-seconds=0.02",
           "--vocab-size=1024", "--threads=1", "--device-type=cpu", f"--profile={tmp_path / 'd1'}", "--components", "default"]
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ms/step" in proc.stdout and "MFU" in proc.stdout
    result = last_json_line(proc.stdout)
    assert result["bench"] == "train"
    (run,) = result["runs"]
    assert (run["depth"], run["seq_len"], run["device_batch_size"], run["compile"]) == (1, 32, 2, False)
    assert run["components"] == "value_embeds,residual_scalars,smear,normuon"  # 'default' is base_train's set
    for key in ("ms_per_step", "tok_per_s", "model_flops_per_s", "peak_flops", "mfu", "peak_mem_mib", "first_step_s"):
        assert run[key] > 0, key
    assert set(run["breakdown_ms"]) == {"data", "forward", "backward", "optimizer"}
    assert run["tok_per_s"] == pytest.approx(2 * 32 / (run["ms_per_step"] / 1000))
    assert run["mfu"] == pytest.approx(run["model_flops_per_s"] / run["peak_flops"])
    assert run["peak_flops_interleaved"] > 0
    assert run["mfu_interleaved"] == pytest.approx(run["model_flops_per_s"] / run["peak_flops_interleaved"])
    assert run["final_loss"] > 0
    # the step cycles batches made before it; the loader is timed apart
    assert run["loader_ms_per_batch"] > 0 and run["breakdown_ms"]["data"] < run["breakdown_ms"]["forward"]
    assert run["compile_cache"] == "cold" and run["compile_counts"]["recompiles"] == 0
    profile = (tmp_path / "d1.txt").read_text()  # two steps profiled, the four labelled phases
    assert all(f"\n{phase} " in profile for phase in ("data", "forward", "backward", "optimizer")) and "aten::" in profile


@pytest.mark.quick
def test_train_steps_cycle_batches_made_before_them_and_time_the_loader_apart(tiny_env):
    import torch

    from bench.train import PREMADE_BATCHES, Run
    from nanochat.recipe import canonical_components

    class CountedLoader:  # the real loader, each batch taken from it counted
        def __init__(self, loader):
            self.loader, self.taken = loader, 0

        def __next__(self):
            self.taken += 1
            return next(self.loader)

        def close(self):
            self.loader.close()

    torch.manual_seed(0)
    run = Run(1, 32, 2, 1024, torch.device("cpu"), False, canonical_components("none"))
    assert len(run.batches) == PREMADE_BATCHES and run.batches[0][0].shape == (2, 32)
    run.loader = CountedLoader(run.loader)
    seen = []  # the inputs each step fed the model
    run.model.register_forward_pre_hook(lambda module, args: seen.append(args[0].data_ptr()))
    for _ in range(PREMADE_BATCHES + 1):
        run.train_step()
    assert set(run.instrumented_step()) == {"data", "forward", "backward", "optimizer"}
    assert run.loader.taken == 0  # the timed steps read no data
    assert seen[:PREMADE_BATCHES] == [x.data_ptr() for x, _ in run.batches] and seen[PREMADE_BATCHES] == seen[0]
    assert run.loader_ms_per_batch(batches=3) > 0 and run.loader.taken == 3 * 3  # drained twice over, then timed
    run.close()


@pytest.mark.slow  # two inductor compiles of a d1 model: ~2 minutes on 2 busy cores
def test_train_compile_cache_makes_another_machines_first_step_warm(tiny_env, tmp_path):
    cache = tmp_path / "d1.bin"

    def warm_up(inductor_cache):  # a machine is its inductor cache: the second one's starts empty
        cmd = [sys.executable, "-m", "scripts.bench", "train", "--depth=1", "--seq-len=32", "--device-batch-size=2",
               "--compile=1", "--warmup=2", "--peak-seconds=0.05", "--vocab-size=1024", "--threads=1",
               "--device-type=cpu", "--components=none", f"--compile-cache={cache}", "--warmup-only"]
        env = dict(os.environ, NANOCHAT_COMPILE_BACKEND="inductor", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / inductor_cache))
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (run,) = last_json_line(proc.stdout)["runs"]
        assert "ms_per_step" not in run and run["warmup_steps"] == 2  # nothing timed after the warm-up
        return run

    cold = warm_up("first_machine")
    assert cold["compile_cache"] == "cold" and cold["compile_counts"]["fxgraph_cache_miss"] > 0
    assert cold["compile_cache_saved_bytes"] == cache.stat().st_size > 0
    warm = warm_up("second_machine")
    assert warm["compile_cache"] == "warm" and warm["compile_cache_artifacts"] > 0
    counts = warm["compile_counts"]  # every inductor graph from the file (AOT autograd caches most of its own too)
    assert counts["fxgraph_cache_hit"] > 0 and counts["fxgraph_cache_miss"] == 0
    assert counts["autograd_cache_hit"] > 0 and counts["recompiles"] == 0


@pytest.mark.quick
def test_dataloader_reports_throughput_crop_and_wait(tiny_env, capsys):
    bench.main(["dataloader", "--tokens=4000", "--depth=1", "--seq-len=32", "--device-batch-size=2", "--steps=2",
                "--warmup=1", "--vocab-size=1024", "--device-type=cpu"])
    out = capsys.readouterr().out
    assert "packed tok/s" in out and "cropped" in out and "wait share" in out
    result = last_json_line(out)
    assert result["bench"] == "dataloader"
    assert result["one_core_tok_per_s"] > 0
    assert set(result["crop"]) == {"256", "1024", "2048"}
    for crop in result["crop"].values():
        assert 0.0 <= crop["crop_fraction"] < 1.0 and crop["tokens"] >= 4000
    assert 0.0 <= result["wait"]["wait_share"] < 1.0 and result["wait"]["step_ms"] > 0


@pytest.mark.quick
def test_tokenizer_reports_train_and_encode_speed(tiny_env, capsys):
    bench.main(["tokenizer", "--max-chars=30000", "--vocab-size=300", "--repeats=1"])
    out = capsys.readouterr().out
    assert "chars/s" in out and "MB/s" in out
    result = last_json_line(out)
    assert result["bench"] == "tokenizer"
    assert result["train_chars"] >= 30000 and result["train_chars_per_s"] > 0
    assert result["vocab_size"] == 300
    assert "1" in result["encode_mb_per_s"] and all(v > 0 for v in result["encode_mb_per_s"].values())


@pytest.mark.quick
def test_kernels_checks_fp8_and_the_flex_band_against_their_references(capsys):
    bench.main(["kernels", "--device-type=cpu", "--seq-len=64"])
    out = capsys.readouterr().out
    assert "fp8 grad_w" in out and "flex band out" in out
    result = last_json_line(out)
    assert result["bench"] == "kernels" and result["fp8_native"] is False  # the CPU emulates
    # e4m3/e5m2 with per-tensor scales: a few percent from fp32, far from a broken quantisation (~1)
    for name in ("y", "grad_x", "grad_w"):
        assert 0 < result[f"fp8_emulated_vs_fp32_{name}"] < 0.1
    assert result["flex_vs_masked_sdpa_out"] < 1e-5  # the same band as gpt.band_mask


def test_import_times_a_real_import_of_a_karpathy_format_checkpoint(tmp_path, capsys):
    bench.main(["import", "--depth=2", "--vocab-size=400", "--seq-len=64", "--repeats=1", f"--work-dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "peak RSS" in out
    result = last_json_line(out)
    (run,) = result["runs"]
    assert result["bench"] == "import" and result["params"] > 0 and run["seconds"] > 0 and run["peak_rss_bytes"] > 0
    assert run["written_bytes"] > 4 * result["params"]  # fp32 weights, plus meta and the tokenizer
    assert os.listdir(tmp_path) == []  # the work dir is cleaned up


@pytest.mark.quick
def test_train_alternates_recipes_in_one_process_against_the_first(tiny_env, capsys):
    flags = ["train", "--depth=1", "--seq-len=32", "--device-batch-size=2", "--compile=0", "--steps=3", "--warmup=1",
             "--vocab-size=1024", "--device-type=cpu", "--alternate", "--components"]
    with pytest.raises(bench.UserError, match="at least two"):
        bench.main(flags + ["default"])
    with pytest.raises(bench.UserError, match="--steps must be >= 1"):
        bench.main(flags[:-1] + ["--steps=0", "--components", "none", "default"])
    bench.main(flags + ["none", "default"])
    out = capsys.readouterr().out
    assert "alternated step by step" in out and "vs first" in out
    result = last_json_line(out)
    assert result["mode"] == "alternate"
    plain, default = result["runs"]
    assert (plain["components"], default["components"]) == ("none", "value_embeds,residual_scalars,smear,normuon")
    assert plain["tok_per_s_vs_first"] == 1.0 and default["tok_per_s_vs_first"] > 0
    for run in (plain, default):
        assert run["steps"] == 3 and run["tok_per_s"] == pytest.approx(2 * 32 / (run["ms_per_step"] / 1000))


@pytest.mark.quick
@pytest.mark.parametrize("flag", ["--probe-seconds=-1", "--peak-seconds=0"])
def test_train_refuses_bad_timing_flags_before_any_work(flag):
    with pytest.raises(bench.UserError, match="probe-seconds"):
        bench.main(["train", flag, "--device-type=cpu"])


@pytest.mark.quick
def test_train_refuses_a_cache_or_profile_for_several_configurations():
    for flag in ("--compile-cache=d4.bin", "--warmup-only", "--profile=d4"):  # --compile=both: two runs
        with pytest.raises(bench.UserError, match="are for one configuration"):
            bench.main(["train", flag, "--depth=1", "--device-type=cpu"])


@pytest.mark.quick
def test_quality_trains_from_scratch_and_reports_val_bpb_per_lr(tiny_env, capsys):
    bench.main(["quality", "--data-source=builtin", "--depth=1", "--seq-len=32", "--total-batch-size=128",
                "--device-batch-size=2", "--steps=4", "--eval-at", "2", "--eval-tokens=256", "--lr-mults", "0.5", "1",
                "--seeds", "1", "--vocab-size=1024"])
    out = capsys.readouterr().out
    assert "quality: val bpb on builtin" in out and "best x" in out
    result = last_json_line(out)
    assert result["bench"] == "quality" and [r["lr_mult"] for r in result["runs"]] == [0.5, 1.0]
    for run in result["runs"]:
        assert set(run["val_bpb"]) == {"2", "4"} and all(0 < v < 20 for v in run["val_bpb"].values())
    half, full = result["runs"]
    assert half["lrs"]["matrix_lr"] == pytest.approx(full["lrs"]["matrix_lr"] / 2)
    assert result["best_lr_mult"] in (0.5, 1.0)
    # --lr-groups: the multiplier scales only the named groups; --embedding-lr: another base lr under the same dial
    bench.main(["quality", "--data-source=builtin", "--depth=1", "--seq-len=32", "--total-batch-size=128",
                "--device-batch-size=2", "--steps=2", "--eval-at", "2", "--eval-tokens=256", "--lr-mults", "0.25",
                "--seeds", "1", "--vocab-size=1024", "--lr-groups", "matrix", "--embedding-lr", "0.3"])
    quarter = last_json_line(capsys.readouterr().out)["runs"][0]["lrs"]
    assert quarter["matrix_lr"] == pytest.approx(full["lrs"]["matrix_lr"] / 4)
    assert quarter["embedding_lr"] == pytest.approx(2 * 0.3) and quarter["unembedding_lr"] == full["lrs"]["unembedding_lr"]
    # a 2- or 4-step run trains at base_train's short-run lrs (2x the base ones); --short-run-lrs=0 counts in base lrs
    assert result["base_lr_scale"] == 2.0 and full["lrs"]["matrix_lr"] == 2 * 0.02
    bench.main(["quality", "--data-source=builtin", "--depth=1", "--seq-len=32", "--total-batch-size=128",
                "--device-batch-size=2", "--steps=2", "--eval-at", "2", "--eval-tokens=256", "--lr-mults", "1",
                "--seeds", "1", "--vocab-size=1024", "--short-run-lrs=0"])
    base = last_json_line(capsys.readouterr().out)
    assert base["base_lr_scale"] == 1.0 and base["runs"][0]["lrs"]["matrix_lr"] == 0.02
    # --adam-betas reach AdamW: the same run as `full` with other betas ends elsewhere
    bench.main(["quality", "--data-source=builtin", "--depth=1", "--seq-len=32", "--total-batch-size=128",
                "--device-batch-size=2", "--steps=4", "--eval-at", "2", "--eval-tokens=256", "--lr-mults", "1",
                "--seeds", "1", "--vocab-size=1024", "--adam-betas", "0.5", "0.5"])
    result = last_json_line(capsys.readouterr().out)
    assert result["adam_betas"] == [0.5, 0.5] and result["runs"][0]["val_bpb"]["4"] != full["val_bpb"]["4"]
    with pytest.raises(bench.UserError, match="--adam-betas"):  # refused before any data is built or any step is taken
        bench.main(["quality", "--data-source=builtin", "--adam-betas", "0.9", "1.0"])
    with pytest.raises(bench.UserError, match="--total-batch-size"):
        bench.main(["quality", "--data-source=builtin", "--total-batch-size=0"])
    for flag in ("--embedding-lr=0", "--unembedding-lr=-0.5", "--scalar-lr=0", "--weight-decay=-0.1",
                 "--warmdown-ratio=1.5", "--final-lr-frac=-1"):  # not read as "the default"
        with pytest.raises(bench.UserError, match=f"{flag.split('=')[0]}=\\S+ is not valid"):
            bench.main(["quality", "--data-source=builtin", flag])


@pytest.mark.quick
def test_quality_compares_recipe_variants_with_their_flops_and_speed(tiny_env, capsys):
    bench.main(["quality", "--data-source=builtin", "--depth=2", "--seq-len=32", "--total-batch-size=128",
                "--device-batch-size=2", "--steps=3", "--eval-at", "3", "--eval-tokens=256", "--seeds", "1",
                "--vocab-size=1024", "--variants", "base", "smear,backout", "normuon"])
    out = capsys.readouterr().out
    assert "variants against base" in out
    result = last_json_line(out)
    base, smear, normuon = result["runs"]
    assert [r["variant"] for r in result["runs"]] == ["base", "smear,backout", "normuon"]
    assert smear["flops_per_token"] > base["flops_per_token"] == normuon["flops_per_token"]  # the gate's matmul counts
    assert len({r["val_bpb"]["3"] for r in result["runs"]}) == 3 and all(r["tok_per_s"] > 0 for r in result["runs"])
    with pytest.raises(bench.UserError, match="warp"):  # refused before any data is built or any step is taken
        bench.main(["quality", "--data-source=builtin", "--variants", "base", "warp"])


def test_wordings_counts_answers_per_wording_on_the_dev_split(tiny_env, monkeypatch, capsys):
    # The model stands in as a reply function that knows only capitals: every capital wording is all right, every other
    # all wrong, and the total is the capitals' share; no dev question is an eval one.
    import torch

    import nanochat.chat_eval
    import nanochat.checkpoint_manager
    from tasks.builtin import DEV_QUESTIONS, WorldQA

    class Model(torch.nn.Module):  # a module, as the GPT it stands in for is
        def prepare_for_inference(self):
            pass

    monkeypatch.setattr(nanochat.checkpoint_manager, "find_latest_tag", lambda source: "tiny")
    monkeypatch.setattr(nanochat.checkpoint_manager, "load_model", lambda *a, **k: (Model(), None, {"step": 3}))
    task = WorldQA("dev")

    def replies(model, tokenizer, conversations, max_tokens, **kwargs):
        return [task.world.facts_by_subject[c["subject"]][0].object if c["relation"] == "capital" else "I do not know."
                for c in conversations]

    monkeypatch.setattr(nanochat.chat_eval, "sample_task_replies", replies)
    bench.main(["wordings"])
    result = last_json_line(capsys.readouterr().out)
    capitals = sum(c["relation"] == "capital" for c in task.conversations)
    assert result["split"] == "dev" and result["step"] == 3
    assert result["accuracy"] == round(capitals / len(task), 4) and 0 < capitals < len(task)
    assert result["wordings"] == {f"{r}: {w.replace('{s}', 'X')}": float(r == "capital")
                                  for r, forms in DEV_QUESTIONS.items() for w in forms}


@pytest.mark.quick
def test_estimate_prices_the_8xh100_run_from_a_lease_s_measured_parts(tmp_path, capsys):
    """bench estimate on the H200 lease's committed results: the gpu preset's steps are its tokens per parameter times
    the d24's scaling parameters over its batch, each row's hours are its steps at its step time plus its evaluations,
    the worst case never beats the best, and an H200's measured step is scaled to an H100's (an H100's file is not);
    a results file without a d24 step is refused in one line naming it."""
    from bench import estimate
    from nanochat.common import UserError
    from nanochat.recipe import DEFAULT_COMPONENTS, depth_recipe, split_components

    h200 = os.path.join(REPO, "dev", "gpu_results", "2026-11-28_193525_1x-NVIDIA-H200-torch-2.11.0-cu130-CUDA-13.0.json")
    bench.main(["estimate", "--results", h200])
    result = last_json_line(capsys.readouterr().out)
    params = depth_recipe(24, 32768, 2048, 2**19, num_iterations=1,
                          components=split_components(DEFAULT_COMPONENTS)[0]).scaling_params
    assert result["scaling_params"] == params and result["h100_factor"] > 1
    preset = result["rows"][0]
    ratio, batch = estimate.PRESET_TOKENS_PER_PARAM, estimate.PRESET_BATCH
    assert preset["tokens"] == ratio * params and preset["steps"] == round(ratio * params / batch)
    with open(os.path.join(REPO, "speedrun.sh")) as f:  # the preset priced is speedrun.sh's
        gpu_flags = f.read().split('if [ "$PRESET" = gpu ]; then', 1)[1].split("else", 1)[0]
    assert f"--target-param-data-ratio={ratio:g} " in gpu_flags
    assert (f"--total-batch-size={batch} " in gpu_flags) == (batch != 2**19)
    for name in estimate.PRESET_MUON_OPTIONS:
        assert re.search(rf"--components=\S*{name}", gpu_flags)
    assert {row["run"].split(":")[0] for row in result["rows"]} >= {"ours, the gpu preset", "ours at the record's run"}
    for row in result["rows"]:
        assert 0 < row["step_ms"][0] <= row["step_ms"][1]
        for hours, step_ms in zip(row["hours"], row["step_ms"]):
            assert hours == pytest.approx((row["steps"] * step_ms / 1000 + row["eval_s"]) / 3600)
    # fp8 as a parameter: at the speedup a bf16 row says it needs, that case ends at the record's time
    assert 0 < result["measured_fp8_speedup"] < 1  # the lease's fp8 was slower than bf16
    with open(h200) as f:
        suite = json.load(f)["gpu_suite"]["results"]
    record_run = next(row for row in result["rows"] if row["run"].startswith("ours at the record's run"))
    for case in (0, 1):
        at = estimate.estimate("", suite["ours_d24"], params, 8, 2**20, result["h100_factor"],
                               fp8_speedup=record_run["fp8_needed"][case])
        assert at["hours"][case] == pytest.approx(estimate.RECORD_HOURS)
    bench.main(["estimate", "--results", h200, "--fp8-speedup", "1.5"])
    faster = last_json_line(capsys.readouterr().out)["rows"][1]
    assert faster["fp8_speedup"] == 1.5 and faster["hours"][0] < preset["hours"][0]
    with open(h200) as f:
        as_h100 = json.load(f)
    as_h100["gpu_suite"]["machine"] = "1x NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, CUDA 13.0"
    (tmp_path / "h100.json").write_text(json.dumps(as_h100))
    bench.main(["estimate", "--results", str(tmp_path / "h100.json")])
    on_h100 = last_json_line(capsys.readouterr().out)
    assert on_h100["h100_factor"] == 1.0
    assert on_h100["rows"][0]["step_ms"][0] * result["h100_factor"] == pytest.approx(preset["step_ms"][0])
    del as_h100["gpu_suite"]["results"]["ours_d24"]
    (tmp_path / "no_d24.json").write_text(json.dumps(as_h100))
    with pytest.raises(UserError, match=r"no_d24.json has no measured d24 step"):
        bench.main(["estimate", "--results", str(tmp_path / "no_d24.json")])


def test_int8_reports_weights_agreement_and_decode_steps_of_each_variant(tiny_base_dir, tmp_path, monkeypatch, capsys):
    from test_chat_cli import build_chat_checkpoint

    build_chat_checkpoint(tiny_base_dir, tmp_path / "base", 128)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "builtin")
    bench.main(["int8", "--rows", "1", "2", "--steps", "4", "--rounds", "1", "--val-tokens", "300"])
    results = {r["variant"]: r for r in last_json_line(capsys.readouterr().out)["results"]}
    assert list(results) == ["fp32", "bf16", "int8 fp32", "int8 bf16"]
    assert results["fp32"]["agreement"] == 1.0 and results["int8 fp32"]["agreement"] > 0.9
    assert results["bf16"]["of_fp32"] == pytest.approx(0.5, abs=0.01) and results["int8 fp32"]["of_fp32"] < 0.3
    assert all(set(r["ms_per_step"]) == {"1", "2"} and min(map(min, r["ms_per_step"].values())) > 0
               for r in results.values())
    assert os.environ["NANOCHAT_DTYPE"] == "float32"  # each variant's dtype set while it loaded, then put back
