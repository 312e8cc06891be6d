"""
A family of base_train runs and the scaling laws they trace (`python -m scripts.miniseries`).

Two kinds of family:
- series: depths D1..Dn, each at the dial's own budget (--target-param-data-ratio tokens per parameter);
- isoflop: for each FLOP budget C1..Cm, several depths trained to exactly that budget (--target-flops).

Every member is an ordinary base_train run in a base dir of its own under <base_dir>/miniseries/<name>/runs/<run>
(the user's tokenizer and shards linked in), so each keeps its own checkpoints and report curve. A finished run is
skipped on a rerun, a killed one resumes from its checkpoint, a failed one is recorded and the others go on.
The results go to results.json and results.csv beside the runs; the fits and plots to the same folder and to the
report card's "Miniseries <name>" section.

The fits:
- isoflop: per budget, val bpb against log(params) is fitted with a parabola; its minimum is the compute-optimal
  size N* at that budget, D* = C / (6 N*) its tokens, D*/N* the compute-optimal ratio (mean and spread over budgets);
- L(C) = a * C^-b + e through the compute-optimal frontier, with R^2. The frontier is the lowest val bpb any run
  reached at or below each compute, over every evaluation along every run (each run evaluates 4 times on the way),
  so it has points between the budgets; final points alone would give one per isoflop budget.
"""

import csv
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from nanochat.common import UserError, atomic_write_text, get_base_dir, json_load_file
from nanochat.report import _new_figure, _save_png, read_jsonl

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSV_COLUMNS = ["run", "depth", "budget", "status", "params", "scaling_params", "tokens", "flops", "num_iterations",
               "epochs", "val_bpb", "core_metric", "wall_seconds", "tok_per_sec", "mfu", "error"]


@dataclass
class RunSpec:
    """One member of the family: its name (and model tag), depth, and the budget flag base_train gets."""
    name: str
    depth: int
    budget: str  # "ratio=20" or "flops=1e15": what the run was asked for
    flags: list = field(default_factory=list)


def plain_name(name):
    return bool(name) and all(c.isalnum() or c in "-_." for c in name) and name[0].isalnum()


def budget_label(flops):
    return f"{flops:.2g}".replace("+", "")


def plan_series(depths, ratio):
    return [RunSpec(f"d{d}", d, f"ratio={ratio:g}", [f"--depth={d}", f"--target-param-data-ratio={ratio}"])
            for d in depths]


def plan_isoflop(budgets, depths):
    return [RunSpec(f"C{budget_label(c)}-d{d}", d, f"flops={budget_label(c)}", [f"--depth={d}", f"--target-flops={c}"])
            for c in budgets for d in depths]


# -----------------------------------------------------------------------------
# Running the members


def series_dir(name):
    return os.path.join(get_base_dir(), "miniseries", name)


def check_family(directory, settings):
    """
    The settings every member of a family shares (geometry, seed, data, the series' ratio) are kept in family.json;
    a rerun with other settings would skip finished runs trained differently and mix them into one fit, so it is
    refused before any run. Adding depths or budgets is a rerun with the same settings.
    """
    path = os.path.join(directory, "family.json")
    try:
        before = json_load_file(path)
    except FileNotFoundError:
        before = None
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable ({e}); delete it only if every run under {directory} used the "
                        f"settings you are giving now") from None
    if before is not None:
        changed = [f"{k}: {before.get(k)!r} then, {settings.get(k)!r} now" for k in {**before, **settings}
                   if before.get(k) != settings.get(k)]  # a setting absent on one side (e.g. components) reads as None
        if changed:
            raise UserError(f"miniseries {os.path.basename(directory)} was run with other settings ("
                            f"{'; '.join(changed)}); give this family another --name, or delete {directory}")
        return
    os.makedirs(directory, exist_ok=True)
    atomic_write_text(path, json.dumps(settings, indent=1) + "\n")


def prepare_run_dir(run_dir, base_dir):
    """A base dir for one run: the user's tokenizer and shards linked in, everything else its own."""
    os.makedirs(run_dir, exist_ok=True)
    for entry in ("tokenizer", "base_data", "eval_bundle_builtin", "eval_bundle"):
        link, target = os.path.join(run_dir, entry), os.path.join(base_dir, entry)
        if not os.path.exists(target):
            if entry in ("tokenizer", "base_data"):
                raise UserError(f"{target} is missing: the miniseries trains on the base dir's tokenizer and shards; "
                                f"build them first (python -m nanochat.corpus and scripts.tok_train, or speedrun.sh)")
            continue  # CORE bundles: linked when there (the DCLM one is downloaded by the first run otherwise)
        if not os.path.islink(link):
            os.symlink(target, link)


def latest_meta(run_dir, tag):
    """meta.json of the run's newest checkpoint, or None."""
    ckpt_dir = os.path.join(run_dir, "base_checkpoints", tag)
    steps = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("step_")) if os.path.isdir(ckpt_dir) else []
    for name in reversed(steps):
        try:
            return json_load_file(os.path.join(ckpt_dir, name, "meta.json"))
        except (OSError, ValueError):
            continue
    return None


def read_curve(run_dir):
    return read_jsonl(os.path.join(run_dir, "report", "curves", "base_train.jsonl"))  # skips a line a kill cut short


def run_state(run_dir, tag):
    """'done' (finished, final evaluation logged), 'resume' (a checkpoint to continue from) or 'new'."""
    meta = latest_meta(run_dir, tag)
    if meta is None:
        return "new"
    last = meta.get("num_iterations")
    if meta.get("finished") and any(r.get("step") == last and "val_bpb" in r for r in read_curve(run_dir)):
        return "done"
    return "resume"


def launch(spec, run_dir, common_flags, nproc, env, log_path):
    """Run (or resume) one member; returns (exit code, the error line it printed, seconds)."""
    state = run_state(run_dir, spec.name)
    command = [sys.executable, "-m", "scripts.base_train"] if nproc <= 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "scripts.base_train"]
    command += spec.flags + common_flags + [f"--model-tag={spec.name}"] + (["--resume"] if state == "resume" else [])
    t0 = time.time()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        p = subprocess.run(command, cwd=REPO_ROOT, env=dict(env, NANOCHAT_BASE_DIR=run_dir), stdout=log,
                           stderr=subprocess.PIPE, text=True)
        log.write(p.stderr)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    error = errors[0].removeprefix("error: ") if errors else (p.stderr.strip().splitlines() or [""])[-1]
    return p.returncode, error[:300] if p.returncode else "", time.time() - t0


def data_passes(meta):
    """How many times the run went through its training data (from its loader state): above 1, it repeated text."""
    states = [s for s in (meta or {}).get("dataloader_states") or [] if s.get("num_row_groups")]
    if not states:
        return None
    return float(np.mean([s["epoch"] + s["pos"] / s["num_row_groups"] for s in states]))


def collect(spec, run_dir, recipe, total_batch_size, wall_seconds, status, error=""):
    """The results row of one member: its size and budget (from the dial), and what its curve recorded."""
    records = read_curve(run_dir)
    steps = [r for r in records if "tok_per_sec" in r][3:]  # the first steps compile and warm up
    last = lambda key: next((r[key] for r in reversed(records) if key in r), None)  # noqa: E731
    tokens = recipe.num_iterations * total_batch_size
    return {"run": spec.name, "depth": spec.depth, "budget": spec.budget, "status": status,
            "params": recipe.num_params, "scaling_params": recipe.scaling_params, "tokens": tokens,
            "flops": recipe.flops_per_token * tokens, "num_iterations": recipe.num_iterations,
            "epochs": data_passes(latest_meta(run_dir, spec.name)), "val_bpb": last("val_bpb"),
            "core_metric": last("core_metric"), "wall_seconds": wall_seconds,
            "tok_per_sec": float(np.median([r["tok_per_sec"] for r in steps])) if steps else None,
            "mfu": float(np.median([r["mfu"] for r in steps if "mfu" in r])) if steps and "mfu" in steps[0] else None,
            "error": error}


def curve_points(run_dir, recipe, total_batch_size):
    """(FLOPs so far, val bpb) at each evaluation of a run: its trajectory in the val bpb against FLOPs plot."""
    per_step = recipe.flops_per_token * total_batch_size
    return [(r["step"] * per_step, r["val_bpb"]) for r in read_curve(run_dir) if "val_bpb" in r and r["step"] > 0]


def read_results(directory):
    """The rows of an earlier invocation, by run name ({} if none)."""
    try:
        return {row["run"]: row for row in json_load_file(os.path.join(directory, "results.json"))}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def write_results(directory, rows):
    atomic_write_text(os.path.join(directory, "results.json"), json.dumps(rows, indent=1) + "\n")
    tmp = os.path.join(directory, "results.csv.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in CSV_COLUMNS})
    os.replace(tmp, os.path.join(directory, "results.csv"))


# -----------------------------------------------------------------------------
# Fits


def fit_isoflop(points):
    """
    points: [(budget FLOPs, scaling params, val bpb, training tokens)]. Per budget with >= 3 sizes: a parabola in
    log(params), its minimum N*, the tokens D* a run of that size gets at that budget (log tokens is linear in log
    params along a budget; read there rather than C / 6N*, which ignores attention's FLOPs), and the ratio D*/N*.
    Returns {"budgets": [...], "ratio_mean", "ratio_spread"}: the mean and standard deviation over the budgets whose
    optimum lies within the sizes tried (None without any).
    """
    by_budget = {}
    for c, n, loss, tokens in points:
        by_budget.setdefault(c, []).append((n, loss, tokens))
    fits = []
    for c in sorted(by_budget):
        pts = sorted(by_budget[c])
        if len(pts) < 3:
            continue
        x = np.log([n for n, _, _ in pts])
        y = np.array([loss for _, loss, _ in pts])
        a2, a1, a0 = np.polyfit(x, y, 2)
        if a2 <= 0:  # no minimum: the sizes tried do not bracket the optimum
            fits.append({"flops": c, "optimal_params": None, "note": "no minimum within the sizes tried"})
            continue
        x_opt = -a1 / (2 * a2)
        n_opt = float(np.exp(x_opt))
        slope, intercept = np.polyfit(x, np.log([t for _, _, t in pts]), 1)
        d_opt = float(np.exp(intercept + slope * x_opt))
        fits.append({"flops": c, "optimal_params": n_opt, "optimal_tokens": d_opt, "ratio": d_opt / n_opt,
                     "min_bpb": float(a0 + a1 * x_opt + a2 * x_opt**2), "bracketed": bool(x.min() <= x_opt <= x.max()),
                     "coefficients": [float(a2), float(a1), float(a0)]})
    ratios = [f["ratio"] for f in fits if f.get("ratio") and f["bracketed"]]  # an extrapolated optimum is a guess
    return {"budgets": fits, "ratio_mean": float(np.mean(ratios)) if ratios else None,
            "ratio_spread": float(np.std(ratios)) if len(ratios) > 1 else None}


def fit_power_law(flops, losses):
    """L(C) = a * C^-b + e by least squares on L: a grid over e, each with a linear fit of log(L - e) on log C."""
    c, y = np.asarray(flops, dtype=float), np.asarray(losses, dtype=float)
    if len(c) < 3:
        return None
    best = None
    for e in np.linspace(0.0, y.min() * 0.999, 400):
        slope, intercept = np.polyfit(np.log(c), np.log(y - e), 1)
        pred = np.exp(intercept) * c**slope + e
        sse = float(((pred - y) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, float(np.exp(intercept)), float(-slope), float(e))
    sse, a, b, e = best
    total = float(((y - y.mean()) ** 2).sum())
    return {"a": a, "b": b, "e": e, "r2": 1 - sse / total if total > 0 else 1.0}


def fit_loss_surface(points, tied=True):
    """
    L(N, D) = E + A / N^alpha + B / D^beta through (scaling params N, training tokens D, final val bpb) points: for each
    exponent on a grid, E, A and B by linear least squares (kept when all three are >= 0), the best refined on a finer
    grid around it. tied: alpha = beta, as the reference's isoflop runs (and Chinchilla's) found, which fixes one
    compute-optimal tokens-per-parameter ratio, (B/A)^(1/alpha), at every budget; a few tiny models leave two free
    exponents poorly determined (their valley is flat) and unsafe to extrapolate. What --time-budget plans with
    (nanochat.planning.time_budget). None with fewer than 5 points. Returns {E, A, alpha, B, beta, rmse, points}.
    """
    pts = np.asarray(points, dtype=float)
    if len(pts) < 5:
        return None
    n, d, y = pts[:, 0], pts[:, 1], pts[:, 2]
    best = None

    def search(alphas, betas):
        nonlocal best
        for alpha in alphas:
            for beta in ([alpha] if tied else betas):
                x = np.stack([np.ones_like(y), n ** -alpha, d ** -beta], axis=1)
                coef = np.linalg.lstsq(x, y, rcond=None)[0]
                if (coef < 0).any():
                    continue
                sse = float(((x @ coef - y) ** 2).sum())
                if best is None or sse < best[0]:
                    best = (sse, alpha, beta, *coef)

    search(np.linspace(0.05, 2.0, 79), np.linspace(0.05, 2.0, 79))
    if best is None:
        return None
    _, a0, b0 = best[:3]
    search(np.linspace(max(0.01, a0 - 0.025), a0 + 0.025, 51), np.linspace(max(0.01, b0 - 0.025), b0 + 0.025, 51))
    sse, alpha, beta, e, a, b = best
    return {"E": float(e), "A": float(a), "alpha": float(alpha), "B": float(b), "beta": float(beta),
            "rmse": (sse / len(y)) ** 0.5, "points": len(y)}


def frontier(points):
    """The compute-optimal frontier of (FLOPs, bpb) points: the lowest bpb reached at or below each compute."""
    best, out = math.inf, []
    for c, loss in sorted(points):
        if loss < best:
            best = loss
            out.append((c, loss))
    return out


# -----------------------------------------------------------------------------
# Plots and the report


def run_frontier(rows, trajectories):
    """The frontier over every evaluation of every finished run (its trajectory and its final point)."""
    done = [r for r in rows if r["status"] == "done" and r["val_bpb"] is not None]
    return frontier([p for r in done for p in trajectories.get(r["run"], [])] + [(r["flops"], r["val_bpb"]) for r in done])


def plot_all(directory, mode, rows, trajectories, isoflop, power_law):
    """PNG files in `directory`; returns [(title, filename)]."""
    done = [r for r in rows if r["status"] == "done" and r["val_bpb"] is not None]
    plots = []
    fig = _new_figure(7, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    depths = sorted({r["depth"] for r in done})
    colors = {d: f"C{i % 10}" for i, d in enumerate(depths)}  # one color per depth, whatever its budget
    labelled = set()
    for row in done:
        pts = trajectories.get(row["run"]) or [(row["flops"], row["val_bpb"])]
        label = None if row["depth"] in labelled else f"d{row['depth']}"
        labelled.add(row["depth"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color=colors[row["depth"]], label=label)
    front = run_frontier(rows, trajectories)
    if front:
        ax.plot([p[0] for p in front], [p[1] for p in front], "k--", linewidth=1, label="frontier")
    if power_law:
        cs = np.geomspace(front[0][0], front[-1][0], 50)
        ax.plot(cs, power_law["a"] * cs ** -power_law["b"] + power_law["e"], "r:",
                label=f"L = {power_law['a']:.3g} C^-{power_law['b']:.3f} + {power_law['e']:.3f}")
    ax.set_xscale("log")
    ax.set(xlabel="training FLOPs", ylabel="val bpb", title="val bpb against compute")
    ax.legend(fontsize=7)
    _save_png(fig, os.path.join(directory, "bpb_vs_flops.png"))
    plots.append(("val bpb against FLOPs", "bpb_vs_flops.png"))
    if mode == "isoflop":
        fig = _new_figure(7, 4.5)
        ax = fig.add_subplot(1, 1, 1)
        fits = {f"flops={budget_label(f['flops'])}": f for f in isoflop["budgets"]}
        for budget in sorted({r["budget"] for r in done}, key=lambda b: float(b.split("=")[1])):
            mine = sorted((r["scaling_params"], r["val_bpb"]) for r in done if r["budget"] == budget)
            line = ax.plot([p[0] for p in mine], [p[1] for p in mine], "o", label=f"C={budget.split('=')[1]}")
            fit = fits.get(budget, {})
            if fit.get("coefficients"):
                ns = np.geomspace(mine[0][0], mine[-1][0], 50)
                a2, a1, a0 = fit["coefficients"]
                ax.plot(ns, a2 * np.log(ns) ** 2 + a1 * np.log(ns) + a0, color=line[0].get_color())
        ax.set_xscale("log")
        ax.set(xlabel="scaling parameters", ylabel="val bpb", title="isoflop: val bpb against size per budget")
        ax.legend(fontsize=7)
        _save_png(fig, os.path.join(directory, "isoflop.png"))
        plots.append(("isoflop parabolas", "isoflop.png"))
    with_core = [r for r in done if r["core_metric"] is not None]
    if with_core:
        fig = _new_figure(7, 4.5)
        ax = fig.add_subplot(1, 1, 1)
        ax.plot([r["flops"] for r in with_core], [r["core_metric"] for r in with_core], "o")
        for r in with_core:
            ax.annotate(r["run"], (r["flops"], r["core_metric"]), fontsize=7)
        ax.set_xscale("log")
        ax.set(xlabel="training FLOPs", ylabel="CORE", title="CORE against compute")
        _save_png(fig, os.path.join(directory, "core_vs_flops.png"))
        plots.append(("CORE against FLOPs", "core_vs_flops.png"))
    return plots


def best_per_budget(rows):
    """{budget: (val bpb, run)}: the best finished run of each budget, the isoflop frontier of a family."""
    best = {}
    for r in rows:
        if r.get("status") == "done" and r.get("val_bpb") is not None:
            if r["budget"] not in best or r["val_bpb"] < best[r["budget"]][0]:
                best[r["budget"]] = (r["val_bpb"], r["run"])
    return best


def compare_families(directories, out_path):
    """
    Families side by side (e.g. a recipe variant against the plain recipe, same budgets): each one's best val bpb per
    budget and its change from the first family's, and a plot of every run against FLOPs with each family's isoflop
    frontier. Returns the table's rows [(budget, [(bpb, run) or None per family])].
    """
    families = []
    for directory in directories:
        rows = list(read_results(directory).values())
        if not rows:
            path = os.path.join(directory, "results.json")
            raise UserError(f"{path} is unreadable or empty; rerun that family (finished runs are skipped)"
                            if os.path.exists(path) else f"no results.json in {directory}; run that family first")
        families.append((os.path.basename(directory), rows, best_per_budget(rows)))
    budgets = sorted({b for _, _, best in families for b in best}, key=lambda b: float(b.split("=")[1]))
    table = [(b, [best.get(b) for _, _, best in families]) for b in budgets]
    fig = _new_figure(7, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, rows, best) in enumerate(families):
        done = [r for r in rows if r.get("status") == "done" and r.get("val_bpb") is not None]
        ax.plot([r["flops"] for r in done], [r["val_bpb"] for r in done], "o", color=f"C{i}", alpha=0.35)
        front = [(next(r["flops"] for r in done if r["run"] == best[b][1]), best[b][0]) for b in budgets if b in best]
        ax.plot([p[0] for p in front], [p[1] for p in front], "-", marker="s", color=f"C{i}", label=name)
    ax.set_xscale("log")
    ax.set(xlabel="training FLOPs", ylabel="val bpb", title="isoflop frontiers (best run per budget; dots: every run)")
    ax.legend(fontsize=7)
    _save_png(fig, out_path)
    return table


def summary_markdown(name, mode, rows, isoflop, power_law, plots, directory, surface=None):
    """The report section's text: the results table, the fits, the plots."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"Miniseries `{name}` ({mode}), results in {directory}", "",
             "| run | depth | params | tokens | epochs | FLOPs | val bpb | CORE | tok/s | MFU % | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['depth']} | {r['params']:,} | {r['tokens']:,} | {fmt(r.get('epochs'), '.2f')} | "
                     f"{r['flops']:.3g} | "
                     f"{fmt(r['val_bpb'], '.4f')} | {fmt(r['core_metric'], '.4f')} | {fmt(r['tok_per_sec'], ',.0f')} | "
                     f"{fmt(r['mfu'], '.1f')} | {r['status']}{': ' + r['error'] if r['error'] else ''} |")
    lines.append("")
    repeated = [r["run"] for r in rows if (r.get("epochs") or 0) > 1]
    if repeated:
        lines.append(f"Repeated data: {', '.join(repeated)} read their training text more than once (epochs > 1). "
                     f"Repeated text is worth less than fresh text and the smallest models read the most of it, so "
                     f"the fitted optimum leans to larger models and fewer tokens per parameter; a larger source "
                     f"avoids it.\n")
    if power_law:
        lines.append(f"Frontier fit: L(C) = {power_law['a']:.4g} * C^-{power_law['b']:.4f} + {power_law['e']:.4f} "
                     f"(R^2 {power_law['r2']:.3f})")
    if surface:
        lines.append(f"Loss surface (the runs' final val bpb; what --time-budget plans with, scaling_law.json): L(N, D) = "
                     f"{surface['E']:.4f} + {surface['A']:.4g}/N^{surface['alpha']:.3f} + {surface['B']:.4g}/D^"
                     f"{surface['beta']:.3f}, rmse {surface['rmse']:.4f} bpb over {surface['points']} runs")
    if mode == "isoflop":
        for fit in isoflop["budgets"]:
            if fit.get("ratio"):
                lines.append(f"- C = {fit['flops']:.3g}: optimal params {fit['optimal_params']:,.0f}, tokens "
                             f"{fit['optimal_tokens']:,.0f}, tokens/param {fit['ratio']:.1f}"
                             f"{'' if fit['bracketed'] else ' (extrapolated: the optimum lies outside the sizes tried)'}")
            else:
                lines.append(f"- C = {fit['flops']:.3g}: {fit.get('note')}")
        if isoflop["ratio_mean"] is not None:
            spread = f" ± {isoflop['ratio_spread']:.1f}" if isoflop["ratio_spread"] is not None else ""
            lines.append(f"- compute-optimal tokens per parameter: {isoflop['ratio_mean']:.1f}{spread}")
        else:
            lines.append("- no compute-optimal ratio: it takes a budget with at least 3 depths around its optimum")
    lines += [""] + [f"![{title}]({os.path.join(directory, filename)})" for title, filename in plots]
    return "\n".join(lines) + "\n"
