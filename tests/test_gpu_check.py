"""
scripts.gpu_check on a machine without CUDA: DRY_RUN prints its plan and runs nothing; a real run does the CPU checks
(the smoke, 2 ranks against 1 over gloo, all-reduce bandwidth, decode speed) apart from the user's own runs, and ends
with its verdict, table rows and JSON line; the verdict turns each problem a GPU node can have into what to change.
"""

import datetime
import json
import os
import subprocess
import sys

import pytest
from test_base_train import fresh_base

from bench import gpu_check as check

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_check(base, args, extra_env=None):
    env = dict(os.environ, NANOCHAT_BASE_DIR=base, NANOCHAT_DATA_SOURCE="builtin", OMP_NUM_THREADS="1", **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "scripts.gpu_check"] + args, env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    p = gpu_check(str(tmp_path), ["--nproc=2"], {"DRY_RUN": "1"})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("no CUDA GPU visible: running the CPU checks only")
    assert any("-m scripts.base_train --depth=4 --max-seq-len=256" in line for line in lines)
    assert any("--nproc-per-node=2 -m scripts.base_train" in line for line in lines)
    assert any("--worker=allreduce" in line for line in lines)
    assert os.listdir(tmp_path) == []  # nothing built, nothing run


@pytest.mark.slow  # 18 s; gpu_check's pieces are tested one by one in the default run
def test_cpu_run_checks_what_a_cpu_can_apart_from_the_users_runs(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "user")
    rows_file = tmp_path / "BENCHMARKS.md"
    rows_file.write_text("# Benchmarks\n")
    before = sorted(os.listdir(base))
    p = gpu_check(base, ["--smoke-depths=2", "--seq-len=64", "--nproc=2", f"--append={rows_file}"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert out.startswith("no CUDA GPU visible") and "  torch " in out and "  free disk " in out
    result = json.loads(out.strip().splitlines()[-1])["gpu_check"]
    smoke = result["smokes"]["d2 base_train, cpu preset path, 1 process"]
    assert smoke["tok_per_sec"] > 0 and 0 < smoke["mfu"] < 100
    assert smoke["val_bpb"]["30"] < smoke["val_bpb"]["0"]  # it trained
    assert result["multi_rank"]["agrees"] and result["multi_rank"]["start_difference"] < 1e-3
    assert result["allreduce_busbw_gbs"] > 0 and result["decode"]["16"] > result["decode"]["1"] > 0
    assert result["ready"] and out.splitlines()[-2].startswith("verdict: no CUDA GPU: this machine runs the cpu preset")
    appended = rows_file.read_text().splitlines()[1:]
    # the GPU table's six columns: check | result | machine | command | commit | date
    assert len(appended) == 5 and appended[0].startswith("| d2 base_train, cpu preset path") and "engine decode" in appended[-1], appended
    assert all(row.count(" | ") == 5 and row.endswith(f" | {datetime.date.today().isoformat()} |") for row in appended), appended
    table = out.splitlines()[out.splitlines().index("| check | result | machine | command | commit | date |") + 2:]
    assert appended == table[:5]
    # its runs went to <base>/gpu_check/runs, the user's checkpoints and report were not touched
    assert sorted(os.listdir(base)) == sorted(before + ["gpu_check"])
    assert sorted(os.listdir(os.path.join(base, "gpu_check", "runs"))) == ["d2", "two_ranks"]


def results_for(gpus=8, name="NVIDIA H100 80GB HBM3", bf16=True, disk_free=500.0, probe=None, smokes=None, multi=None):
    env = {"cuda_available": True, "gpus": [{"name": name, "bf16": bf16}] * gpus, "disk_free_gib": disk_free,
           "base_dir": "/data", "torch": "2.15", "cuda": "13.2"}
    return {"environment": env, "nproc": gpus, "smokes": smokes or {"d12": {"tok_per_sec": 1e6, "mfu": 40.0}},
            "batch_probe": probe or {"speedrun_batch": 16, "speedrun_fits": True, "largest_fitting": 32, "summary": "32"},
            "disk_needed_gib": 60.0, "multi_rank": multi}


@pytest.mark.quick
def test_the_verdict_says_what_to_change():
    assert check.verdict(results_for()) == (True, [])
    ready, changes = check.verdict(results_for(
        gpus=3, bf16=False, disk_free=20.0,
        probe={"speedrun_batch": 16, "speedrun_fits": False, "largest_fitting": 8, "summary": "8"},
        smokes={"d12": {"error": "out of memory in base_train (depth 12, --device-batch-size=16): try ..."}},
        multi=check.rank_agreement({0: 3.0, 30: 2.0}, {0: 3.0, 30: 2.2}, 30)))
    assert not ready and len(changes) == 6, changes
    text = " | ".join(changes)
    for words in ("d12 failed (out of memory in base_train", "without bf16", "1, 2, 4, 8 or 16 GPUs, not 3",
                  "NANOCHAT_DEVICE_BATCH=8 bash speedrun.sh", "20 GiB free under /data", "10.0% at the end"):
        assert words in text, words
    # nothing fits at all; a world of ranks that agrees at the start but not at the end
    ready, changes = check.verdict(results_for(probe={"speedrun_batch": 16, "speedrun_fits": False,
                                                      "largest_fitting": None, "summary": "none"}))
    assert not ready and "too little memory" in changes[0]
    assert check.rank_agreement({0: 3.0, 30: 2.0}, {0: 3.0, 30: 2.01}, 30)["agrees"]
    assert not check.rank_agreement({0: 3.0, 30: 2.0}, {0: 3.1, 30: 2.0}, 30)["agrees"]
    rows = check.markdown_rows(results_for(), "2026-11-25", "abc1234")
    assert rows[0] == "| d12 | 1,000,000 tok/s, MFU 40.0 % | 8x NVIDIA H100 80GB HBM3, torch 2.15, CUDA 13.2 " \
                      "| `python -m scripts.gpu_check` | abc1234 | 2026-11-25 |"


def git(folder, *args):
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.quick
def test_the_lease_dry_run_sizes_what_travels_and_refuses_past_the_limits(tmp_path, monkeypatch):
    """gpu_check --prepare-lease's check (bench/lease.py): the tree (tracked and unignored files, not the ignored
    ones) and each carried path with its size; the reference written as a git archive of its commit with a COMMIT
    file and no history; refusals in one line past 64 MiB or 8 paths, and for a missing wheel or the wrong reference."""
    from bench import lease

    for variable in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(variable, "t")
    upstream = tmp_path / "upstream"  # the reference's repository: two commits, the older one wanted
    (upstream / "nanochat").mkdir(parents=True)
    git(upstream, "init", "-q")
    (upstream / "nanochat" / "gpt.py").write_text("x = 1\n")
    git(upstream, "add", "-A")
    git(upstream, "commit", "-qm", "wanted")
    wanted = git(upstream, "rev-parse", "HEAD").strip()
    (upstream / "later.py").write_text("y = 2\n")
    git(upstream, "add", "-A")
    git(upstream, "commit", "-qm", "later")

    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    (root / ".gitignore").write_text("/.whl/\n/.reference/\n/.compile_cache/\n/junk/\n")
    (root / "code.py").write_bytes(b"a" * 1000)
    (root / "junk").mkdir()
    (root / "junk" / "big").write_bytes(b"b" * 5000)  # ignored and not carried: not counted
    git(root, "add", "-A")
    (root / "new.py").write_bytes(b"c" * 500)  # untracked but not ignored: it travels
    (root / ".whl").mkdir()
    (root / ".whl" / "requirements.txt").write_text("typing-extensions==4.16.0\nrustbpe==0.1.0\n")
    for name in ("typing_extensions-4.16.0-py3-none-any.whl", "rustbpe-0.1.0-cp312-cp312-manylinux_2_17_x86_64.whl"):
        (root / ".whl" / name).write_bytes(b"w" * 100)
    assert lease.reference_from_git(str(upstream), str(root / ".reference"), wanted[:7]) == wanted
    assert sorted(os.listdir(root / ".reference")) == ["COMMIT", "nanochat"]  # that commit's files, no .git
    carry = [".whl", ".reference", ".compile_cache"]
    lines, named, problems = lease.check(str(root), carry, wanted)
    assert problems == [] and named == [".whl", ".reference"]
    assert lease.tree_size(str(root)) == (len((root / ".gitignore").read_bytes()) + 1500, 3)
    assert any(line.split()[0] == ".whl" and "3 files" in line and "2 wheels" in line for line in lines), lines
    assert any("none here (every compile starts cold)" in line for line in lines)
    assert lines[-1].split()[:3] == ["total", "0.0", "MiB"] and "2 carried paths of 8" in lines[-1]

    (root / ".compile_cache").mkdir()
    with open(root / ".compile_cache" / "compile_cache.tar.gz", "wb") as f:
        f.truncate(64 * 2**20)  # with the rest, past 64 MiB
    _, _, problems = lease.check(str(root), carry, wanted)
    wheels = 200 + len((root / ".whl" / "requirements.txt").read_bytes())
    reference = len(wanted) + 1 + len("x = 1\n")  # COMMIT and gpt.py
    total = 64 * 2**20 + lease.tree_size(str(root))[0] + wheels + reference
    assert problems == [f"{total:,} bytes would travel, more than 67,108,864 (64.0 MiB; the largest: .compile_cache "
                        "64.0 MiB, the tree 0.0 MiB, .whl 0.0 MiB)"]
    os.remove(root / ".compile_cache" / "compile_cache.tar.gz")
    _, _, problems = lease.check(str(root), carry + [f"more{i}" for i in range(6)], wanted)
    assert problems[0] == "9 carried paths, more than 8"
    os.remove(root / ".whl" / "rustbpe-0.1.0-cp312-cp312-manylinux_2_17_x86_64.whl")
    (root / ".whl" / "typing_extensions-4.15.0-py3-none-any.whl").write_bytes(b"")
    _, _, problems = lease.check(str(root), carry, git(upstream, "rev-parse", "HEAD").strip())
    assert problems == ["typing_extensions: wheels of 2 versions (4.15.0, 4.16.0)",
                        "no wheel of rustbpe==0.1.0 in .../.whl: bash dev/offline_wheels.sh .whl".replace(
                            ".../.whl", str(root / ".whl")),
                        ".reference is not the reference at " + git(upstream, "rev-parse", "HEAD").strip()[:7] +
                        " with its COMMIT: give --reference-git GIT_DIR (a clone or mirror of karpathy/nanochat)"]
