"""scripts.miniseries: a family of tiny base_train runs, resumable, with results, fits, plots and a report section."""

import csv
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from nanochat.common import UserError
from bench import miniseries as ms
from nanochat.recipe import DEFAULT_COMPONENTS
from scripts import miniseries

from conftest import REPO_ROOT  # noqa: E402
from test_base_train import fresh_base  # noqa: E402

# d1/d2 at width 32 with heads of 32, 64-token rows, 256 tokens per step: a run is tens of steps of a few ms
TINY = ["--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64", "--device-batch-size", "2",
        "--total-batch-size", "256", "--eval-tokens", "1024", "--eval-bundle", "none"]
SERIES = ["--depths", "1", "2", "--ratio", "0.1", "--name", "tiny", *TINY]


@pytest.fixture
def base(tiny_base_dir, tmp_path, monkeypatch):
    path = fresh_base(tiny_base_dir, tmp_path, "base")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", path)
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "builtin")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return path


def results(base, name):
    with open(os.path.join(base, "miniseries", name, "results.csv"), encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # 9 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_series_writes_results_plots_and_report_and_a_rerun_skips_everything(base, capsys):
    miniseries.main(SERIES)
    rows = results(base, "tiny")
    assert [(r["run"], r["status"]) for r in rows] == [("d1", "done"), ("d2", "done")]
    assert float(rows[1]["val_bpb"]) < float(rows[0]["val_bpb"])  # the bigger model, trained longer, is better
    assert int(rows[1]["params"]) > int(rows[0]["params"]) and float(rows[1]["flops"]) > float(rows[0]["flops"])
    assert all(float(r["tok_per_sec"]) > 0 for r in rows)
    assert 0 < float(rows[0]["epochs"]) < float(rows[1]["epochs"])  # passes over the training text, from the loader
    directory = os.path.join(base, "miniseries", "tiny")
    assert os.path.getsize(os.path.join(directory, "bpb_vs_flops.png")) > 1000
    section = open(os.path.join(base, "report", "miniseries-tiny.md"), encoding="utf-8").read()
    assert "## Miniseries tiny" in section and "| d2 | 2 |" in section and "bpb_vs_flops.png" in section
    # each run is an ordinary base_train run with its own checkpoints and curve
    assert os.path.isdir(os.path.join(directory, "runs", "d2", "base_checkpoints", "d2"))
    capsys.readouterr()
    miniseries.main(SERIES)
    out = capsys.readouterr().out
    assert out.count("done already, skipping") == 2 and "training (" not in out
    assert results(base, "tiny") == rows
    # other shared settings under the same name would mix differently trained runs into one fit: refused
    with pytest.raises(UserError, match="ratio: 0.1 then, 0.2 now.*another --name"):
        miniseries.main([a if a != "0.1" else "0.2" for a in SERIES])
    with pytest.raises(UserError, match="seed: 42 then, 7 now"):
        miniseries.main(SERIES + ["--seed", "7"])
    with pytest.raises(UserError, match="components: 'value_embeds,residual_scalars,smear,normuon' then, 'smear' now"):  # a recipe variant is another family
        miniseries.main(SERIES + ["--components", "smear"])
    assert "training (" not in capsys.readouterr().out


@pytest.mark.slow  # 18 s: an isoflop family of real runs
def test_isoflop_sweep_records_a_failed_run_and_completes_the_others(base, monkeypatch):
    plan = ms.plan_isoflop

    def plan_with_a_bad_run(budgets, depths):
        specs = plan(budgets, depths)
        specs[1].flags.append("--warmup-ratio=7")  # base_train refuses it before any compute
        return specs

    monkeypatch.setattr(ms, "plan_isoflop", plan_with_a_bad_run)
    args = ["--mode", "isoflop", "--depths", "1", "2", "--budgets", "2e9", "6e9", "--name", "iso", *TINY]
    with pytest.raises(UserError, match="1 run\\(s\\) failed: C2e09-d2"):
        miniseries.main(args)
    rows = {r["run"]: r for r in results(base, "iso")}
    assert rows["C2e09-d2"]["status"] == "failed" and "warmup" in rows["C2e09-d2"]["error"]
    assert [rows[n]["status"] for n in ("C2e09-d1", "C6e09-d1", "C6e09-d2")] == ["done"] * 3
    for name in ("C2e09-d1", "C6e09-d1", "C6e09-d2"):  # each trained to its budget
        budget = 2e9 if name.startswith("C2") else 6e9
        assert abs(float(rows[name]["flops"]) / budget - 1) < 0.1
    directory = os.path.join(base, "miniseries", "iso")
    assert os.path.exists(os.path.join(directory, "isoflop.png")) and os.path.exists(os.path.join(directory, "fits.json"))
    assert "no compute-optimal ratio" in open(os.path.join(base, "report", "miniseries-iso.md")).read()


@pytest.mark.slow  # 17 s; a rerun that skips finished runs is in the default run
def test_a_series_killed_mid_run_resumes_that_run(base):
    args = [sys.executable, "-m", "scripts.miniseries", "--depths", "1", "2", "--ratio", "0.5", "--name", "killed", *TINY]
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    d2 = os.path.join(base, "miniseries", "killed", "runs", "d2", "base_checkpoints", "d2")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.isdir(d2) and any(n.startswith("step_") for n in os.listdir(d2))):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert os.path.isdir(d2), proc.stdout.read()[-2000:]
    p = subprocess.run(args, cwd=REPO_ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "d1: done already, skipping" in p.stdout and "d2: resuming" in p.stdout
    log = open(os.path.join(base, "miniseries", "killed", "runs", "d2", "train.log")).read()
    assert "resuming at step" in log
    assert [r["status"] for r in results(base, "killed")] == ["done", "done"]


@pytest.mark.quick
def test_fits_recover_a_known_optimum_and_power_law():
    # isoflop: bpb = 2 + 0.3 (log N - log N*)^2 with N* = 1e6 at C = 6e12 and N* = 2e6 at C = 4.8e13; a run of N
    # params costs 7.5 N FLOPs per token (attention's share on top of 6N), so D* = C / 7.5N*: ratios 0.8 and 1.6
    points = []
    for c, n_opt in ((6e12, 1e6), (4.8e13, 2e6)):
        for n in np.geomspace(n_opt / 8, n_opt * 8, 5):
            points.append((c, n, 2 + 0.3 * (np.log(n) - np.log(n_opt)) ** 2, c / (7.5 * n)))
    fit = ms.fit_isoflop(points)
    optima = [f["optimal_params"] for f in fit["budgets"]]
    assert optima == pytest.approx([1e6, 2e6], rel=1e-6)
    assert [f["ratio"] for f in fit["budgets"]] == pytest.approx([0.8, 1.6], rel=1e-6)
    assert fit["ratio_mean"] == pytest.approx(1.2) and fit["ratio_spread"] == pytest.approx(0.4)
    # an optimum outside the sizes tried is reported but not averaged
    beyond = [(6e12, n, 2 + 0.3 * (np.log(n) - np.log(1e6)) ** 2, 6e12 / (7.5 * n)) for n in (2e6, 4e6, 8e6)]
    edge = ms.fit_isoflop(beyond + points[5:])
    assert not edge["budgets"][0]["bracketed"] and edge["ratio_mean"] == pytest.approx(1.6)
    # two sizes are not a fit; a rising curve has no minimum
    assert ms.fit_isoflop([(1e12, 1e5, 2.0, 1e6), (1e12, 2e5, 1.9, 5e5)])["ratio_mean"] is None
    assert ms.fit_isoflop([(1e12, n, 3 - 0.1 * (np.log(n) - 11) ** 2, 1e6) for n in (1e5, 2e5, 4e5)])["budgets"][0][
        "optimal_params"] is None
    # L(C) = 5 C^-0.1 + 1.2
    cs = np.geomspace(1e12, 1e18, 12)
    law = ms.fit_power_law(cs, 5 * cs ** -0.1 + 1.2)
    assert law["b"] == pytest.approx(0.1, rel=0.05) and law["e"] == pytest.approx(1.2, abs=0.02)
    assert law["r2"] > 0.999
    assert ms.frontier([(1, 3.0), (2, 3.5), (3, 2.5)]) == [(1, 3.0), (3, 2.5)]


@pytest.mark.quick
def test_bad_flags_fail_before_any_run_and_a_dry_run_only_plans(base, monkeypatch, capsys):
    with pytest.raises(UserError, match="--depths must be >= 1"):
        miniseries.main(["--depths", "0", "--name", "zero", *TINY])
    with pytest.raises(UserError, match="--name"):
        miniseries.main(["--depths", "1", "--name", "../up", *TINY])
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "nope")
    with pytest.raises(UserError, match="'nope' is not a data source"):
        miniseries.main(["--depths", "1", "--name", "nodata", *TINY])
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "builtin")
    capsys.readouterr()
    miniseries.main(["--mode", "isoflop", "--depths", "1", "2", "--budgets", "2e9", "6e9", "--name", "plan", "--dry-run",
                     *TINY])
    out = capsys.readouterr().out
    assert "4 runs" in out and "C6e09-d2" in out and "FLOPs in all" in out
    assert not os.path.exists(os.path.join(base, "miniseries"))  # nothing trained, nothing written
    # a recipe variant's family: its components reach the plan (value embeddings add parameters) and base_train's flags
    miniseries.main(["--depths", "2", "--ratio", "1", "--name", "ve", "--dry-run", "--components", "value_embeds", *TINY])
    with_ve = capsys.readouterr().out
    assert "components value_embeds" in with_ve
    miniseries.main(["--depths", "2", "--ratio", "1", "--name", "plain", "--dry-run", "--components", "none", *TINY])
    plain = capsys.readouterr().out
    assert "components none (plain recipe)" in plain
    params = [int(re.search(r"params\s+([\d,]+)", out).group(1).replace(",", "")) for out in (with_ve, plain)]
    assert params[0] > params[1]
    assert "--components=value_embeds" in miniseries.run_flags(miniseries.parse_args(["--components", "value_embeds"]), 10)
    # base_train's default recipe unless named; the plain one spelled out, since base_train's default is not plain
    assert f"--components={DEFAULT_COMPONENTS}" in miniseries.run_flags(miniseries.parse_args([]), 10)
    assert "--components=none" in miniseries.run_flags(miniseries.parse_args(["--components", "none"]), 10)
    with pytest.raises(UserError, match="warp"):
        miniseries.parse_args(["--components", "warp"])
    # the presets: an isoflop sweep takes the preset's isoflop depths, a series its series depths
    assert miniseries.parse_args(["--mode", "isoflop"]).depths == miniseries.PRESETS["cpu"]["isoflop_depths"]
    assert miniseries.parse_args([]).depths == miniseries.PRESETS["cpu"]["depths"]


@pytest.mark.quick
def test_compare_sets_two_families_side_by_side(base, capsys):
    # two finished families written directly (no training): the best run per budget of each, the change, a plot
    def family(name, bpbs):
        rows = [{"run": f"C{b}-d{d}", "depth": d, "budget": f"flops={b}", "status": "done", "flops": float(b),
                 "val_bpb": bpb} for (b, d), bpb in bpbs.items()]
        directory = ms.series_dir(name)
        os.makedirs(directory)
        ms.write_results(directory, rows)

    family("old", {("1e12", 2): 0.50, ("1e12", 3): 0.55, ("3e12", 2): 0.45, ("3e12", 3): 0.40})
    family("new", {("1e12", 2): 0.45, ("1e12", 3): 0.48, ("3e12", 3): 0.38})
    capsys.readouterr()
    miniseries.main(["--compare", "old", "new"])
    out = capsys.readouterr().out
    assert "| 1e12 | 0.5000 (d2) | 0.4500 (d2, -10.00 %) |" in out
    assert "| 3e12 | 0.4000 (d3) | 0.3800 (d3, -5.00 %) |" in out
    assert os.path.getsize(os.path.join(base, "miniseries", "new", "compare-old-vs-new.png")) > 1000
    with pytest.raises(UserError, match="two or more"):
        miniseries.main(["--compare", "old"])
    with pytest.raises(UserError, match="no results.json"):
        miniseries.main(["--compare", "old", "missing"])
    with open(os.path.join(base, "miniseries", "new", "results.json"), "w") as f:
        f.write("{truncated")
    with pytest.raises(UserError, match="unreadable or empty; rerun"):
        miniseries.main(["--compare", "old", "new"])
