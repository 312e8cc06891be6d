"""
The report card of a training run (an add-on). Each stage writes its section into `<base_dir>/report/` (markdown for
people, JSON with the raw numbers), a training stage through TrainingReport, a callback of its TrainingLoop, which
also appends the stage's curve to `report/curves/<stage>.jsonl`. `python -m nanochat.report reset` (at the start,
__main__.py) records the machine and git state, and `generate` (at the end) assembles `report.md`: that header, the
code's size, the sections in pipeline order, a summary table, wall clock, cost and PNG plots. Only rank 0 writes;
other ranks get a DummyReport that does nothing.
"""

import datetime
import io
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import time
from collections import Counter

from nanochat.common import (UserError, json_loads, atomic_write_bytes, atomic_write_text, cpu_name, ensure_writable,
                             format_duration, get_base_dir, get_dist_info, read_json_object)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Sections in the order the pipeline produces them; anything else goes after, oldest first.
PIPELINE_SECTIONS = ["Tokenizer training", "Tokenizer evaluation", "Base model training", "Base model loss",
                     "Base model evaluation", "Chat evaluation base", "Midtraining", "Chat evaluation mid", "Chat SFT",
                     "Chat evaluation sft", "Chat RL", "Chat evaluation rl"]

# Summary table: which sections feed each column, and which metrics make the rows.
SUMMARY_COLUMNS = [("BASE", ["Base model evaluation", "Chat evaluation base"]), ("MID", ["Chat evaluation mid"]),
                   ("SFT", ["Chat evaluation sft"]), ("RL", ["Chat evaluation rl"])]
SUMMARY_METRICS = ["CORE", "ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee", "SimpleSpelling",
                   "WorldFacts", "WorldQA", "Arithmetic", "Arithmetic calculator use", "Identity", "ChatCORE"]

# Rough on-demand cloud price per GPU-hour in USD (a ballpark, not a quote): 8×H100 ≈ $24/h.
GPU_HOURLY_USD = [("H200", 3.50), ("H100", 3.00), ("A100", 1.80)]

BLOAT_EXTENSIONS = (".py", ".sh", ".md", ".html", ".toml")
CHARS_PER_TOKEN = 4  # the usual rule of thumb for English text and code

HEADER_NAME = "header"
REPORT_NAME = "report.md"
CURVES_DIR = "curves"


def slugify(name):
    """'Base model training' -> 'base-model-training': the file name of a section."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not slug:
        raise UserError(f"report section name {name!r} has no letters or digits; give it a readable name")
    return slug


def format_value(value):
    """Numbers as a person wants to read them in a report; everything else as str()."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if not isinstance(value, float) or not math.isfinite(value):
        return str(value)
    if value == 0.0:
        return "0"
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.3e}" if abs(value) < 1e-3 else f"{value:.4f}"


def _json_default(obj):
    # Tensors, numpy scalars and friends become plain numbers; anything else its text.
    if hasattr(obj, "item"):
        try:
            return obj.item()
        except (ValueError, RuntimeError):
            pass
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def to_json(obj):
    return json.dumps(obj, default=_json_default)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _now_iso(epoch):
    return datetime.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


# -----------------------------------------------------------------------------
# What the machine and the code look like


def _git(args):
    """stdout of a git command run in the repo, or None when git or the repo is not there."""
    try:
        result = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_info():
    if _git(["rev-parse", "--is-inside-work-tree"]) != "true":
        return {"in_repo": False}
    status = _git(["status", "--porcelain"])
    return {
        "in_repo": True,
        # symbolic-ref and rev-parse fail on a detached HEAD and on a repo with no commits, respectively.
        "branch": _git(["symbolic-ref", "--short", "HEAD"]) or "(detached)",
        "commit": _git(["rev-parse", "--short", "HEAD"]) or "(no commits yet)",
        "dirty": bool(status),
    }


def gpu_info():
    """[{name, memory_gib}] for each visible CUDA device; empty on CPU-only machines."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [{"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
            for props in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))]


def system_info():
    import psutil
    import torch

    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_model": cpu_name(),
        "cpu_logical": os.cpu_count(),
        "cpu_physical": psutil.cpu_count(logical=False),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpu_info(),
        "git": git_info(),
    }


def describe_gpus(gpus):
    if not gpus:
        return "none (CPU only)"
    counts = Counter((gpu["name"], gpu["memory_gib"]) for gpu in gpus)
    return ", ".join(f"{n} × {name} ({mem} GiB each)" for (name, mem), n in counts.items())


def render_header(info, start_time):
    git = info["git"]
    git_line = "not a git repository" if not git["in_repo"] else \
        f"{git['commit']} on {git['branch']}" + (" (dirty: uncommitted changes)" if git["dirty"] else " (clean)")
    lines = [
        "## Environment",
        "",
        f"- Run started: {_now_iso(start_time)}",
        f"- Git: {git_line}",
        f"- Hostname: {info['hostname']}",
        f"- Platform: {info['platform']}",
        f"- Python: {info['python']}",
        f"- PyTorch: {info['torch']}",
        f"- CPU: {info['cpu_model']} ({info['cpu_logical']} logical, {info['cpu_physical']} physical cores)",
        f"- RAM: {info['ram_gib']} GiB",
        f"- GPUs: {describe_gpus(info['gpus'])}",
    ]
    return "\n".join(lines) + "\n"


def bloat_files():
    """The repo's code and docs: what git tracks or would track (not ignored), else a walk skipping hidden and venv dirs."""
    listing = _git(["ls-files", "--cached", "--others", "--exclude-standard"])
    if listing is not None:
        paths = [os.path.join(REPO_ROOT, p) for p in listing.splitlines()]
    else:
        paths = []
        for root, dirs, files in os.walk(REPO_ROOT):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "node_modules", "venv"))
            paths.extend(os.path.join(root, f) for f in sorted(files))
    # A file deleted from disk but still in git's index is not part of the code any more.
    return sorted(p for p in set(paths) if p.endswith(BLOAT_EXTENSIONS) and os.path.isfile(p))


def bloat_stats():
    stats = {"files": 0, "lines": 0, "chars": 0}
    for path in bloat_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        stats["files"] += 1
        stats["lines"] += text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        stats["chars"] += len(text)
    stats["tokens"] = stats["chars"] // CHARS_PER_TOKEN
    return stats


def hourly_price(gpus):
    """(USD per hour for this node, how we got it) from the GPU table; (None, reason) when we cannot say."""
    if not gpus:
        return None, "CPU-only run: no GPU rental cost"
    total = 0.0
    for gpu in gpus:
        price = next((p for key, p in GPU_HOURLY_USD if key in gpu["name"]), None)
        if price is None:
            return None, f"no price known for {gpu['name']}; pass --hourly-price"
        total += price
    per_gpu = ", ".join(f"{key} ${p:.2f}" for key, p in GPU_HOURLY_USD)
    return total, f"assumed on-demand cloud prices per GPU-hour ({per_gpu}) for {describe_gpus(gpus)}"


# -----------------------------------------------------------------------------
# Plots


def _new_figure(width, height):
    # The Agg canvas directly, without pyplot: no display, no global figure state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save_png(fig, path):
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(path, buffer.getvalue())


def plot_curve(stage, records, path):
    """One panel per numeric field of the stage's records against step; returns False when there is nothing to plot."""
    fields = list(dict.fromkeys(key for record in records for key, value in record.items()  # first seen first
                                if key != "step" and _is_number(value)))
    if not fields:
        return False
    steps = [r["step"] if _is_number(r.get("step")) else i for i, r in enumerate(records)]
    ncols = min(2, len(fields))
    nrows = math.ceil(len(fields) / ncols)
    fig = _new_figure(6 * ncols, 3.2 * nrows)
    for i, field in enumerate(fields):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        points = [(step, r[field]) for step, r in zip(steps, records) if _is_number(r.get(field))]
        xs, ys = zip(*points)
        # Sparse curves (val_bpb every few hundred steps) read better with their points marked.
        ax.plot(xs, ys, marker="o" if len(points) <= 50 else None, markersize=3, linewidth=1.2)
        ax.set_title(field)
        ax.set_xlabel("step")
        if min(steps) < max(steps):
            ax.set_xlim(min(steps), max(steps))  # every panel on the same step axis, for comparing
        ax.grid(True, alpha=0.3)
    fig.suptitle(stage)
    fig.tight_layout()
    _save_png(fig, path)
    return True


def _measured(table):
    """The summary's metrics and columns that hold a value: only what this run measured (the offline preset has no
    hub-task rows, a run without RL no RL column)."""
    metrics = [m for m in SUMMARY_METRICS if any(_is_number(v) for v in table[m].values())]
    return metrics, [col for col, _ in SUMMARY_COLUMNS if any(_is_number(table[m][col]) for m in metrics)]


def plot_summary(table, path):
    """Grouped bars: each metric that has a value, one bar per stage."""
    metrics, columns = _measured(table)
    if not metrics:
        return False
    fig = _new_figure(max(6, 1.4 * len(metrics)), 3.6)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(columns)
    for j, col in enumerate(columns):
        values = [table[m][col] if _is_number(table[m][col]) else 0.0 for m in metrics]
        ax.bar([i + (j - (len(columns) - 1) / 2) * width for i in range(len(metrics))], values, width, label=col)
    ax.set_xticks(range(len(metrics)))
    ax.set_xticklabels(metrics)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.legend()
    ax.set_title("eval metrics per stage")
    fig.tight_layout()
    _save_png(fig, path)
    return True


# -----------------------------------------------------------------------------
# The report


def _metric_key(name):
    """'CORE metric', 'core', 'ChatCORE metric', 'arc_easy' -> canonical row names of the summary table."""
    key = re.sub(r"metric$", "", re.sub(r"[^a-z0-9]", "", name.lower()))
    return next((m for m in SUMMARY_METRICS if key == re.sub(r"[^a-z0-9]", "", m.lower())), None)


def _read_text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def read_jsonl(path):
    """Records of a JSON-lines file; lines that do not parse (a write cut short by a kill) are skipped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json_loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


class Report:
    def __init__(self, report_dir):
        self.report_dir = report_dir
        ensure_writable(report_dir, "the report")
        os.makedirs(report_dir, exist_ok=True)

    def path(self, *names):
        return os.path.join(self.report_dir, *names)

    # --- sections ---

    def log(self, section, data):
        """Write a section: dicts become '- key: value' bullets, strings go in as-is. Re-logging replaces it."""
        if isinstance(data, (dict, str)):
            data = [data]
        if not isinstance(data, (list, tuple)):
            raise TypeError(f"report.log({section!r}, data): data must be a list of dicts and strings, got {type(data).__name__}")
        slug = slugify(section)
        now = time.time()
        blocks = [f"## {section}\ntimestamp: {_now_iso(now)}"]
        for item in data:
            # Blank lines between items, or markdown would fold a string into the bullet list above it.
            if isinstance(item, dict):
                blocks.append("\n".join(f"- {key}: {format_value(value)}" for key, value in item.items()))
            elif item is not None:
                blocks.append(str(item).rstrip("\n"))
        markdown = "\n\n".join(b for b in blocks if b) + "\n"
        record = {"section": section, "time": now, "timestamp": _now_iso(now), "data": list(data)}
        os.makedirs(self.report_dir, exist_ok=True)
        # JSON first: a section whose markdown exists always has its numbers beside it.
        atomic_write_text(self.path(f"{slug}.json"), to_json(record) + "\n")
        atomic_write_text(self.path(f"{slug}.md"), markdown)
        return self.path(f"{slug}.md")

    # --- curves ---

    def curve_path(self, stage):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", stage):
            raise UserError(f"curve stage name {stage!r} must be letters, digits, '_', '-' or '.' (e.g. 'base_train')")
        return self.path(CURVES_DIR, f"{stage}.jsonl")

    def log_curve(self, stage, record):
        """Append one record (e.g. {"step": 10, "train_loss": 3.2}) to curves/<stage>.jsonl."""
        path = self.curve_path(stage)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        line = to_json(record) + "\n"
        # If a kill cut the previous line short, start on a fresh line so only that one record is lost.
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
        # One write of one whole line: a kill can only leave a partial last line, which readers skip.
        with open(path, "ab") as f:
            f.write(line.encode("utf-8"))

    def read_curve(self, stage):
        return read_jsonl(self.curve_path(stage))

    def reset_curve(self, stage):
        """Forget a stage's curve: a fresh (not resumed) training run starts from step 0."""
        path = self.curve_path(stage)
        if os.path.exists(path):
            os.remove(path)

    def truncate_curve(self, stage, after_step):
        """Drop records with step > after_step: a run resumed from after_step will log those steps again."""
        path = self.curve_path(stage)
        if not os.path.exists(path):
            return
        kept = [r for r in read_jsonl(path) if not (_is_number(r.get("step")) and r["step"] > after_step)]
        atomic_write_text(path, "".join(to_json(r) + "\n" for r in kept))

    # --- start and end of a run ---

    def reset(self):
        """Clear the report dir and record the machine, the code and the start time."""
        if os.path.isdir(self.report_dir):
            shutil.rmtree(self.report_dir)
        os.makedirs(self.report_dir)
        start_time = time.time()
        info = system_info()
        header = {"start_time": start_time, "timestamp": _now_iso(start_time), "system": info}
        atomic_write_text(self.path(f"{HEADER_NAME}.json"), to_json(header) + "\n")
        atomic_write_text(self.path(f"{HEADER_NAME}.md"), render_header(info, start_time))
        return header

    def sections(self):
        """[(slug, name, record)] of the logged sections: pipeline order first, then the rest oldest first."""
        known = {slugify(name): i for i, name in enumerate(PIPELINE_SECTIONS)}
        found = []
        for filename in os.listdir(self.report_dir):
            slug, ext = os.path.splitext(filename)
            if ext != ".md" or slug == HEADER_NAME or filename == REPORT_NAME:
                continue
            record = read_json_object(self.path(f"{slug}.json"))
            if record is None:
                record = {"section": slug, "time": os.path.getmtime(self.path(filename)), "data": []}
            found.append((slug, record.get("section", slug), record))
        found.sort(key=lambda s: (known.get(s[0], len(known)), s[2].get("time", 0.0), s[0]))
        return found

    def summary_table(self, sections):
        """{metric: {column: value or None}} from the numbers stored by the eval sections."""
        by_slug = {slug: record for slug, _, record in sections}
        table = {m: {col: None for col, _ in SUMMARY_COLUMNS} for m in SUMMARY_METRICS}
        for col, names in SUMMARY_COLUMNS:
            for name in names:
                for item in by_slug.get(slugify(name), {}).get("data", []):
                    if isinstance(item, dict):
                        for key, value in item.items():
                            metric = _metric_key(str(key))
                            if metric and _is_number(value):
                                table[metric][col] = value
        return table

    def _time_and_cost(self, header, sections, end_time, hourly_price_usd):
        """The report's wall clock (from `report reset`, else the first section) and its estimated cost."""
        if header is not None:
            start, since = header["start_time"], "`report reset`"
        elif sections:
            start, since = min(r.get("time", end_time) for _, _, r in sections), "the first logged section (no header)"
        else:
            return ["Total wall clock time: unknown (nothing logged and no header)", ""]
        gpus = header["system"]["gpus"] if header is not None else gpu_info()
        price, assumption = hourly_price(gpus) if hourly_price_usd is None else \
            (hourly_price_usd, "price per hour given with --hourly-price")
        wall = end_time - start
        cost = f"${wall / 3600 * price:,.2f} at ${price:,.2f}/h" if price is not None else "none"
        return [f"Total wall clock time: {format_duration(wall)} (from {since} at {_now_iso(start)} to "
                "`report generate`)", "", f"Estimated cost: {cost} ({assumption})", ""]

    def generate(self, hourly_price_usd=None, copy_to=None):
        """Assemble report.md in the report dir, plus a copy in copy_to (default: the current directory)."""
        end_time = time.time()
        header = read_json_object(self.path(f"{HEADER_NAME}.json"))
        sections = self.sections()
        parts = ["# nanochat training report", "", f"Generated: {_now_iso(end_time)}", ""]
        header_md = self.path(f"{HEADER_NAME}.md")
        parts.append(_read_text(header_md) if os.path.exists(header_md) else
                     "_No environment header: run `python -m nanochat.report reset` at the start of a run._\n")

        bloat = bloat_stats()
        extensions = ", ".join(BLOAT_EXTENSIONS)
        parts += ["## Bloat", "", f"Code and docs in the repo ({extensions}; files git tracks or would track):", ""]
        for label, key in (("Files", "files"), ("Lines", "lines"), ("Characters", "chars"),
                           (f"Tokens (approx., characters / {CHARS_PER_TOKEN})", "tokens")):
            parts.append(f"- {label}: {bloat[key]:,}")
        parts.append("")
        parts += [_read_text(self.path(f"{slug}.md")) for slug, _, _ in sections]

        table = self.summary_table(sections)
        metrics, columns = _measured(table)
        parts += ["## Summary", ""]
        if metrics:
            parts += ["| Metric | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
            for metric in metrics:
                cells = [f"{table[metric][c]:.4f}" if _is_number(table[metric][c]) else "-" for c in columns]
                parts.append(f"| {metric} | " + " | ".join(cells) + " |")
        else:
            parts.append("No evaluation has run yet.")
        parts.append("")
        parts += self._time_and_cost(header, sections, end_time, hourly_price_usd)

        plots = [("eval metrics", "summary.png")] if plot_summary(table, self.path("summary.png")) else []
        curves_dir = self.path(CURVES_DIR)
        names = os.listdir(curves_dir) if os.path.isdir(curves_dir) else []
        for stage in sorted(f.removesuffix(".jsonl") for f in names if f.endswith(".jsonl")):
            if plot_curve(stage, self.read_curve(stage), self.path(f"curve-{stage}.png")):
                plots.append((stage, f"curve-{stage}.png"))

        def render(link_prefix):
            plot_lines = ["## Plots", ""] + ([] if plots else ["_No curves were logged._"])
            for title, filename in plots:
                plot_lines += [f"### {title}", "", f"![{title}]({link_prefix}{filename})", ""]
            return "\n".join(parts + plot_lines).rstrip("\n") + "\n"

        report_path = self.path(REPORT_NAME)
        atomic_write_text(report_path, render(""))
        copy_dir = os.path.abspath(copy_to if copy_to is not None else os.getcwd())
        if os.path.realpath(copy_dir) != os.path.realpath(self.report_dir):
            # The copy points at the plots in the report dir, relative to where it lives.
            prefix = os.path.relpath(self.report_dir, copy_dir).replace(os.sep, "/") + "/"
            atomic_write_text(os.path.join(copy_dir, REPORT_NAME), render(prefix))
        return report_path


class DummyReport:
    """What ranks other than 0 get: every call does nothing (and reads no curve), so scripts never check their rank."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: [] if name == "read_curve" else None


def get_report():
    """The Report writing to <base_dir>/report/ on rank 0, a DummyReport everywhere else."""
    _, rank, _, _ = get_dist_info()
    if rank != 0:
        return DummyReport()
    return Report(os.path.join(get_base_dir(), "report"))


class TrainingReport:
    """
    A training stage's part of the report card, a callback of its TrainingLoop (nanochat/loop.py): the curve of its
    steps and evaluations, written up to each checkpoint as it is saved (so the curve never runs ahead of where a
    resume starts, and a resume truncates it there), and the stage's section at the end.
    """

    def __init__(self):
        self.report = get_report()

    def on_start(self, loop):
        if loop.start_step == 0:
            self.report.reset_curve(loop.settings.name)
        else:
            self.report.truncate_curve(loop.settings.name, loop.start_step)  # the steps after it are logged again

    def on_checkpoint(self, loop, records):
        for record in records:
            self.report.log_curve(loop.settings.name, record)

    def on_finish(self, loop, section, data, records):
        self.on_checkpoint(loop, records)
        self.report.log(section=section, data=data)
