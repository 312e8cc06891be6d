"""
speedrun.sh as a user sees it with DRY_RUN=1: every stage in order, torchrun over the GPUs it detects, and flags
that add up (each training stage's batch splits exactly into micro-batches on 8 GPUs and on 1), checked by parsing
the printed commands with the scripts' own argument parsers.
"""

import os
import shlex
import subprocess

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING = ["base_train", "mid_train", "chat_sft", "chat_rl"]
ORDER = ["nanochat.dataset", "scripts.tok_train", "scripts.tok_eval", "scripts.base_train", "scripts.base_loss",
         "scripts.base_eval", "scripts.mid_train", "scripts.chat_eval", "scripts.chat_sft", "scripts.chat_eval",
         "scripts.chat_rl", "scripts.chat_eval", "nanochat.report"]


def dry_run(tmp_path, preset, ngpu, **extra_env):
    env = dict(os.environ, DRY_RUN="1", NANOCHAT_PRESET=preset, NANOCHAT_NGPU=str(ngpu),
               NANOCHAT_BASE_DIR=str(tmp_path / "base"), **extra_env)
    return subprocess.run(["bash", "speedrun.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def torch_run_parser():
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def commands(stdout):
    """(module, launcher words, flags) of each printed command."""
    out = []
    for line in stdout.splitlines():
        if " -m " not in line or line.startswith("plan | "):  # commands only, not the budget's printed plan
            continue
        words = shlex.split(line.rstrip(" &"))
        if "-m" not in words:
            continue
        at = len(words) - 1 - words[::-1].index("-m")  # torchrun has its own flags before the script's -m
        flags = words[at + 2:]
        out.append((words[at + 1], words[:at], flags[1:] if flags[:1] == ["--"] else flags))  # "--": torchrun's end
    return out


@pytest.mark.quick
@pytest.mark.parametrize("ngpu, device_batch", [(8, "16"), (1, "16"), (8, "4")])
def test_gpu_preset_runs_every_stage_on_every_gpu_with_exact_batches(tmp_path, ngpu, device_batch, monkeypatch):
    from nanochat import presets
    from nanochat.recipe import grad_accum_steps
    from nanochat.stage import micro_steps
    from scripts import base_train, chat_rl, chat_sft, mid_train

    p = dry_run(tmp_path, "gpu", ngpu, NANOCHAT_DEVICE_BATCH=device_batch)
    assert p.returncode == 0, p.stderr
    cmds = commands(p.stdout)
    modules = [m for m, _, _ in cmds]
    assert [m for i, m in enumerate(modules) if i == 0 or m != modules[i - 1]] == ORDER, modules
    assert not os.path.exists(tmp_path / "base" / "report"), "a dry run must not run anything"
    monkeypatch.setattr(presets, "preset_for", lambda device_type="": "gpu")  # parse the flags as a GPU node would
    parsers = {"base_train": base_train.parse_args, "mid_train": mid_train.parse_args, "chat_sft": chat_sft.parse_args,
               "chat_rl": chat_rl.parse_args}
    seen = set()
    for module, launcher, flags in cmds:
        name = module.split(".")[-1]
        if name not in TRAINING + ["base_loss", "base_eval", "chat_eval"]:
            continue
        assert "torchrun" in launcher and f"--nproc_per_node={ngpu}" in launcher, (module, launcher)
        # torchrun's own parser must hand the stage every flag untouched (it once read --run=... as its --run-path)
        line = next(line for line in p.stdout.splitlines() if f"-m {module} " in line and shlex.split(line)[-len(flags):] == flags)
        words = shlex.split(line)
        launched = torch_run_parser().parse_args(words[words.index("torchrun") + 1:])
        assert (launched.training_script, launched.training_script_args) == (module, flags), line
        if name not in parsers:
            continue
        args = parsers[name](flags)
        seen.add(name)
        if name in ("base_train", "mid_train"):  # a smaller device batch for GPUs with less memory (gpu_check's advice)
            assert args.device_batch_size == int(device_batch)
        if name == "base_train":
            # the record's schedule (BENCHMARKS.md "Recipe components": it helped at d4 and d6 on Brown)
            assert (args.warmdown_ratio, args.final_lr_frac) == (0.65, 0.05)
            assert grad_accum_steps(args.total_batch_size, args.device_batch_size, args.max_seq_len, ngpu) * \
                args.device_batch_size * args.max_seq_len * ngpu == 2**19
        elif name == "mid_train":  # rows as long as the base model's context
            assert micro_steps(args.total_batch_size, args.device_batch_size * 2048, ngpu, "tokens") >= 1
        elif name == "chat_sft":
            assert micro_steps(args.total_batch_size, args.device_batch_size, ngpu, "conversations") >= 1
        else:
            assert args.total_batch_size % ngpu == 0
            micro_steps(args.total_batch_size // ngpu * args.num_samples, args.device_batch_size, 1, "samples")
    assert seen == set(TRAINING)


def test_a_budgeted_gpu_run_keeps_the_records_schedule(tmp_path):
    """The time-budgeted gpu preset trains on the same warmdown as the plain one (its plan calibrates the steps before
    the warmdown begins); a few seconds: the dry run plans the whole pipeline."""
    p = dry_run(tmp_path, "gpu", 8, NANOCHAT_TIME_BUDGET="2h")
    assert p.returncode == 0, p.stderr
    flags = next(f for m, _, f in commands(p.stdout) if m == "scripts.base_train")
    assert {"--warmdown-ratio=0.65", "--final-lr-frac=0.05"} <= set(flags), flags
    assert any(f.startswith("--time-budget=") for f in flags), flags


@pytest.mark.quick
def test_gpu_preset_refuses_a_gpu_count_or_device_batch_that_cannot_split_the_batch(tmp_path):
    p = dry_run(tmp_path, "gpu", 3)
    assert p.returncode == 1 and "1, 2, 4, 8 or 16 GPUs" in p.stderr and not p.stdout.count("-m ")
    for device_batch in ("3", "0", "x", "512"):
        p = dry_run(tmp_path, "gpu", 1, NANOCHAT_DEVICE_BATCH=device_batch)
        assert p.returncode == 1 and "NANOCHAT_DEVICE_BATCH must divide 256" in p.stderr, (device_batch, p.stderr)
    p = dry_run(tmp_path, "gpu", 8, NANOCHAT_DEVICE_BATCH="64")  # 64 x 8 rows > the 256 of one batch
    assert p.returncode == 1 and "device batch 64 x 8 GPUs must divide 256" in p.stderr


def test_cpu_preset_is_offline_single_process_and_complete(tmp_path):
    p = dry_run(tmp_path, "cpu", 0)
    assert p.returncode == 0, p.stderr
    cmds = commands(p.stdout)
    assert "nanochat.dataset" not in [m for m, _, _ in cmds] and "nanochat.corpus" in [m for m, _, _ in cmds]
    assert not any("torchrun" in launcher for _, launcher, _ in cmds)
    trained = [m.split(".")[-1] for m, _, _ in cmds if m.split(".")[-1] in TRAINING]
    assert trained == ["base_train", "mid_train", "chat_sft"]  # RL does not pay on the cpu preset: opt-in
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, DRY_RUN="1", NANOCHAT_PRESET="cpu", NANOCHAT_NGPU="0", NANOCHAT_RL="1",
                                NANOCHAT_BASE_DIR=str(tmp_path / "base")))
    assert [m.split(".")[-1] for m, _, _ in commands(p.stdout) if m.split(".")[-1] in TRAINING] == TRAINING
    # a stage run alone on a CPU gets the numbers this preset passes (presets.PRESETS): no flag here contradicts them
    from nanochat.presets import PRESETS

    checked = 0
    for module, _, flags in commands(p.stdout):
        preset = PRESETS.get(module.split(".")[-1], {}).get("cpu", {})
        for flag in flags:
            name, _, value = flag.lstrip("-").partition("=")
            name = {"x": "max_problems"}.get(name, name.replace("-", "_"))
            if name in preset and value:
                assert type(preset[name])(value) == preset[name], (module, flag, preset[name])
                checked += 1
    assert checked >= 20, checked
    # base_train's own schedule, to which the CPU laws and the preset's figures were fitted (the gpu preset's is longer)
    assert not any(f.startswith(("--warmdown-ratio", "--final-lr-frac")) for m, _, flags in cmds for f in flags
                   if m == "scripts.base_train")
    # the recipe's components: base_train's default unless NANOCHAT_COMPONENTS names others ('none' = plain)
    assert not any(f.startswith("--components") for _, _, flags in cmds for f in flags)
    plain = commands(dry_run(tmp_path, "cpu", 0, NANOCHAT_COMPONENTS="none").stdout)
    assert [(m, f) for m, _, flags in plain for f in flags if f.startswith("--components")] == \
        [("scripts.base_train", "--components=none")]
    typo = dry_run(tmp_path, "cpu", 0, NANOCHAT_COMPONENTS="smear,warp_drive")  # refused before any stage
    assert typo.returncode == 1 and "unknown component(s) warp_drive" in typo.stderr and "scripts." not in typo.stdout
    p = dry_run(tmp_path, "gpu", 0)
    assert p.returncode == 1 and "no CUDA GPU" in p.stderr


@pytest.mark.quick
def test_a_base_dir_of_another_seed_is_refused_before_any_stage(tmp_path):
    # A real (not dry) run: it must stop at the signature check, before the report reset or any stage.
    base = tmp_path / "base"
    base.mkdir()
    (base / "speedrun_config.txt").write_text("preset=cpu seed=42\n")
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, NANOCHAT_PRESET="cpu", NANOCHAT_NGPU="0", NANOCHAT_SEED="43",
                                NANOCHAT_BASE_DIR=str(base)))
    assert p.returncode == 1 and "holds a speedrun with preset=cpu seed=42, not preset=cpu seed=43" in p.stderr, p.stderr
    assert sorted(os.listdir(base)) == ["speedrun_config.txt"]  # nothing reset, nothing run
    assert (base / "speedrun_config.txt").read_text() == "preset=cpu seed=42\n"


@pytest.mark.quick
def test_your_own_source_is_used_without_a_download_and_must_be_imported_first(tmp_path):
    p = dry_run(tmp_path, "gpu", 8, NANOCHAT_DATA_SOURCE="mine")
    assert p.returncode == 0, p.stderr
    modules = [m for m, _, _ in commands(p.stdout)]
    assert "nanochat.dataset" not in modules and "nanochat.corpus" not in modules and "scripts.base_train" in modules
    assert "NANOCHAT_DATA_SOURCE=mine" in p.stdout and "data: your source mine" in p.stdout
    assert "WorldFacts" not in p.stdout  # the built-in world's eval means nothing for other text
    p = dry_run(tmp_path, "cpu", 0, NANOCHAT_DATA_SOURCE="brown")
    assert "scripts.brown" in [m for m, _, _ in commands(p.stdout)]
    # A real run on a source that was never imported stops before any stage, saying how to import it.
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, NANOCHAT_PRESET="cpu", NANOCHAT_NGPU="0", NANOCHAT_DATA_SOURCE="mine",
                                NANOCHAT_BASE_DIR=str(tmp_path / "real")))
    assert p.returncode == 1 and "python -m nanochat.dataset import mine FILES_OR_FOLDERS" in p.stderr, p.stderr
    assert not (tmp_path / "real").exists() or os.listdir(tmp_path / "real") == []


@pytest.mark.quick
def test_a_ready_environment_runs_without_uv_and_a_builtin_gpu_run_stays_offline(tmp_path):
    """NANOCHAT_PYTHON runs every stage with that Python as it is (a cluster's image, a lease's machine: no uv, no
    sync); the gpu preset on the built-in corpus evaluates CORE on the built-in world's tasks, not the download."""
    p = dry_run(tmp_path, "gpu", 1, NANOCHAT_PYTHON="/opt/env/bin/python3", NANOCHAT_DATA_SOURCE="builtin")
    assert p.returncode == 0, p.stderr
    cmds = commands(p.stdout)
    assert cmds and "uv" not in p.stdout
    for module, launcher, _ in cmds:
        assert launcher[0] == "/opt/env/bin/python3", (module, launcher)
        if module.startswith("scripts.") and module not in ("scripts.tok_train", "scripts.tok_eval"):
            assert launcher[1:3] == ["-m", "torch.distributed.run"], (module, launcher)
    flags = {module: f for module, _, f in cmds}
    assert "--eval-bundle=builtin" in flags["scripts.base_eval"] and "--eval-bundle=builtin" in flags["scripts.base_train"]
    p = dry_run(tmp_path, "gpu", 1)  # the preset's own text: the published bundle
    assert "--eval-bundle=builtin" not in p.stdout and "--eval-bundle=dclm" in p.stdout


@pytest.mark.quick
def test_a_python_that_cannot_run_the_project_is_refused_before_any_stage(tmp_path):
    env = dict(os.environ, NANOCHAT_PYTHON=str(tmp_path / "no_python"), NANOCHAT_BASE_DIR=str(tmp_path / "base"))
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and f"NANOCHAT_PYTHON={tmp_path / 'no_python'} cannot import torch and nanochat" in p.stderr
    assert not (tmp_path / "base").exists()
