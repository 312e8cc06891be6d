"""Tests for nanochat.report: sections, curves, the summary table, plots, rank handling and the CLI."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from nanochat import report as report_mod
from nanochat.common import UserError
from nanochat.report import DummyReport, Report, get_report
from nanochat.report.__main__ import main as report_command

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def report(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    r = get_report()
    assert isinstance(r, Report)
    r.reset()
    return r


def log_some_run(r):
    # Logged out of pipeline order on purpose: the report must reorder them.
    r.log("Base model evaluation", [{"CORE metric": 0.2565, "hellaswag": 0.31}])
    r.log("My custom stage", [{"note": 1}])
    r.log("Base model training", [{"depth": 4, "lr": 0.02, "tokens": 123456789}, "free-form **markdown** line"])
    for step in range(0, 100, 10):
        record = {"step": step, "train_loss": 5.0 - step / 50, "tok_per_sec": 1000.0 + step}
        if step % 30 == 0:
            record["val_bpb"] = 2.0 - step / 100
        r.log_curve("base_train", record)


def summary_row(text, metric):
    match = re.search(rf"^\| {re.escape(metric)} \|(.*)\|$", text, flags=re.MULTILINE)
    assert match, f"no summary row for {metric}"
    return [cell.strip() for cell in match.group(1).split("|")]


def assert_png(path):
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5000  # a real rendered figure, not an empty stub


@pytest.mark.quick
def test_full_report(report, tmp_path):
    log_some_run(report)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    path = report.generate(copy_to=str(cwd))
    text = pathlib.Path(path).read_text()

    # Header and bloat made it in.
    assert "## Environment" in text and "- Git:" in text and "- PyTorch:" in text
    bloat_files = int(re.search(r"- Files: ([\d,]+)", text).group(1).replace(",", ""))
    assert bloat_files > 0  # at least nanochat/report/__init__.py itself

    # Sections in pipeline order, unknown ones after.
    order = [text.index(f"## {name}") for name in ("Base model training", "Base model evaluation", "My custom stage", "Summary")]
    assert order == sorted(order)
    assert "- tokens: 123,456,789" in text
    assert "free-form **markdown** line" in text

    # The summary table comes from the stored numbers, and shows only what was measured: one column, one row.
    assert re.search(r"^\| Metric \| BASE \|$", text, flags=re.MULTILINE)
    assert summary_row(text, "CORE") == ["0.2565"]
    for metric in ("ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "ChatCORE"):
        assert not re.search(rf"^\| {metric} \|", text, flags=re.MULTILINE), metric

    assert "Total wall clock time:" in text
    assert "Estimated cost:" in text

    # Plots exist, are real PNGs, and are linked relatively from both copies.
    links = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert "curve-base_train.png" in links and "summary.png" in links
    for link in links:
        assert not os.path.isabs(link)
        assert_png(os.path.join(report.report_dir, link))
    copy_text = (cwd / "report.md").read_text()
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", copy_text):
        assert_png(os.path.join(cwd, link))


@pytest.mark.quick
def test_section_json_keeps_raw_numbers(report):
    report.log("Chat evaluation sft", [{"ARC-Easy": 0.123456789, "GSM8K": 0.05}])
    with open(os.path.join(report.report_dir, "chat-evaluation-sft.json")) as f:
        stored = json.load(f)
    assert stored["section"] == "Chat evaluation sft"
    assert stored["data"] == [{"ARC-Easy": 0.123456789, "GSM8K": 0.05}]
    assert isinstance(stored["time"], float)
    md = pathlib.Path(report.report_dir, "chat-evaluation-sft.md").read_text()
    assert "- ARC-Easy: 0.1235" in md and "timestamp:" in md

    text = pathlib.Path(report.generate(copy_to=report.report_dir)).read_text()
    assert summary_row(text, "ARC-Easy") == ["0.1235"]  # the SFT column, the only one measured
    assert summary_row(text, "GSM8K") == ["0.0500"]


@pytest.mark.quick
def test_partial_last_curve_line_is_skipped(report):
    report.log_curve("sft", {"step": 1, "train_loss": 2.0})
    report.log_curve("sft", {"step": 2, "train_loss": 1.5})
    path = report.curve_path("sft")
    with open(path, "a") as f:
        f.write('{"step": 3, "train_lo')  # a kill in the middle of a write
    assert [r["step"] for r in report.read_curve("sft")] == [1, 2]
    # The next append starts on its own line, so only the cut record is lost.
    report.log_curve("sft", {"step": 4, "train_loss": 1.0})
    assert [r["step"] for r in report.read_curve("sft")] == [1, 2, 4]


@pytest.mark.quick
def test_truncate_and_reset_curve(report):
    for step in range(10):
        report.log_curve("base_train", {"step": step, "train_loss": 10.0 - step})
    report.truncate_curve("base_train", after_step=5)
    assert [r["step"] for r in report.read_curve("base_train")] == [0, 1, 2, 3, 4, 5]
    report.log_curve("base_train", {"step": 6, "train_loss": 0.5})
    assert [r["step"] for r in report.read_curve("base_train")] == [0, 1, 2, 3, 4, 5, 6]
    report.truncate_curve("never_logged", after_step=3)  # nothing to do, no error
    report.reset_curve("base_train")
    assert report.read_curve("base_train") == []
    with pytest.raises(UserError):
        report.log_curve("../escape", {"step": 0})


@pytest.mark.quick
def test_reset_clears_everything(report):
    report.log("Chat RL", [{"reward": 0.5}])
    report.log_curve("rl", {"step": 0, "reward": 0.5})
    report.reset()
    assert sorted(os.listdir(report.report_dir)) == ["header.json", "header.md"]


@pytest.mark.quick
def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    r = get_report()
    assert isinstance(r, DummyReport)
    r.reset()
    r.log("Base model training", [{"depth": 4}])
    r.log_curve("base_train", {"step": 0, "train_loss": 1.0})
    r.truncate_curve("base_train", 0)
    r.reset_curve("base_train")
    r.generate(copy_to=str(tmp_path))
    assert not (base / "report").exists()
    assert not (tmp_path / "report.md").exists()


@pytest.mark.quick
def test_bloat_and_git_outside_a_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "README.md").write_text("hello")  # no trailing newline still counts as a line
    (tmp_path / "data.csv").write_text("not,code\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "site.py").write_text("ignored\n")
    monkeypatch.setattr(report_mod, "REPO_ROOT", str(tmp_path))
    assert report_mod.git_info() == {"in_repo": False}
    assert report_mod.bloat_stats() == {"files": 2, "lines": 3, "chars": 17, "tokens": 4}


@pytest.mark.quick
def test_bloat_in_a_git_repo_skips_ignored_files(tmp_path, monkeypatch):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("build/\n")
    (tmp_path / "train.sh").write_text("echo hi\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "gen.py").write_text("generated = True\n")
    monkeypatch.setattr(report_mod, "REPO_ROOT", str(tmp_path))
    info = report_mod.git_info()
    assert info["in_repo"] and info["dirty"] and info["commit"] == "(no commits yet)"
    assert report_mod.bloat_stats()["files"] == 1


@pytest.mark.quick
def test_cost_estimate_assumptions():
    price, why = report_mod.hourly_price([{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.6}] * 8)
    assert price == pytest.approx(24.0) and "H100" in why
    assert report_mod.hourly_price([])[0] is None
    assert report_mod.hourly_price([{"name": "Mystery GPU", "memory_gib": 8.0}])[0] is None


def test_cli_generate_subprocess(report, tmp_path):
    log_some_run(report)
    cwd = tmp_path / "cli"
    cwd.mkdir()
    env = {**os.environ, "NANOCHAT_BASE_DIR": os.environ["NANOCHAT_BASE_DIR"], "PYTHONPATH": REPO_ROOT}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    result = subprocess.run([sys.executable, "-m", "nanochat.report", "generate", "--hourly-price", "10"],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    text = (cwd / "report.md").read_text()
    assert summary_row(text, "CORE") == ["0.2565"]
    assert "at $10.00/h" in text
    assert os.path.exists(os.path.join(report.report_dir, "report.md"))



@pytest.mark.quick
def test_cli_rejects_bad_price(report, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["nanochat.report", "generate", "--hourly-price", "-1"])
    with pytest.raises(UserError, match="--hourly-price"):
        report_command()
    assert not os.path.exists(os.path.join(report.report_dir, "report.md"))


@pytest.mark.quick
def test_every_chat_eval_task_has_a_summary_row(report):
    # a task chat_eval scores but the summary leaves out is a number the report card hides
    from scripts.chat_eval import SUITES

    tasks = sorted({name for suite in SUITES.values() for name in suite})
    report.log("Chat evaluation sft", [{name: 0.25 + i / 100 for i, name in enumerate(tasks)}])
    text = pathlib.Path(report.generate()).read_text()
    for i, name in enumerate(tasks):
        assert summary_row(text, name) == [f"{0.25 + i / 100:.4f}"], name
