"""
What a timed training run records beside its speed, for the work between GPU leases, in a few KB of text: a profile
of two steps reduced to the top kernels (GPU time; on a CPU, ops by CPU time) with their count and share of the step
and each labelled phase's total; what holds a step's peak memory (a CUDA memory snapshot reduced to the largest blocks
live at the peak, grouped by the Python frame that allocated them); the compile counts; and the chrome trace, gzipped,
where it is small. Both projects' timing scripts label their step's phases with phase(): data, forward, backward,
optimizer, each ended by a sync, so that a kernel belongs to the phase whose time range it starts in.

Only torch and the standard library: bench/reference_train.py, which must not import our packages, loads this module
by its file. (It is not bench/profile.py: a script run from bench/ would shadow the standard library's `profile`, which
torch._dynamo imports through cProfile.)
"""

import contextlib
import gzip
import json
import os
import shutil

import torch
from torch.autograd import DeviceType

PHASES = ("data", "forward", "backward", "optimizer")
TRACE_LIMIT_BYTES = 3 * 2**20  # a gzipped trace larger than this is not kept: a lease returns 16 MiB a file


@contextlib.contextmanager
def phase(name, sync):
    """One labelled phase of a step: a range the profiler records under `name`, ended by `sync` (a device sync on a
    GPU) so that the work it queued runs inside it."""
    with torch.profiler.record_function(name):
        yield
        sync()


def synchronizer(device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def profile_steps(step, device, steps=2):
    """torch.profiler over `steps` calls of step() after one more it does not keep (the profiler's own start-up lands
    in that one). Returns the profiler, its trace ready to read."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for _ in range(1 + steps):
            step()
            prof.step()
    return prof


def is_annotation(event):
    """A labelled range (ours, or the profiler's ProfilerStep#N), not work: on a GPU the profiler mirrors each range
    onto the device's timeline too."""
    return event.name in PHASES or event.name.startswith("ProfilerStep") or getattr(event, "is_user_annotation", False)


def reduce_profile(events, steps, cuda, top=25):
    """The profiler's events reduced to a table: {step_ms, busy_ms, time_kind, phases: {name: {wall_ms, busy_ms}},
    kernels: [{name, ms, count, share}]}, everything a step (the total over `steps` divided by it). On a GPU the work is
    the device's kernels and copies, each taken by the phase whose range its start falls in; without one, the ops' self
    CPU time (what the profiler can see: a compiled graph's own kernels count as the graph call's time)."""
    ranges = sorted((e for e in events if e.device_type == DeviceType.CPU and e.name in PHASES),
                    key=lambda e: e.time_range.start)
    if cuda:
        work = [(e.name, e.time_range.start, e.time_range.end - e.time_range.start) for e in events
                if e.device_type == DeviceType.CUDA and not is_annotation(e)]
    else:
        work = [(e.name, e.time_range.start, e.self_cpu_time_total) for e in events
                if e.device_type == DeviceType.CPU and not is_annotation(e)]
    phases = {name: {"wall_ms": 0.0, "busy_ms": 0.0} for name in PHASES}
    for r in ranges:
        phases[r.name]["wall_ms"] += (r.time_range.end - r.time_range.start) / 1000 / steps
    by_name = {}
    for name, start, duration_us in work:
        owner = next((r.name for r in ranges if r.time_range.start <= start < r.time_range.end), None)
        if owner:
            phases[owner]["busy_ms"] += duration_us / 1000 / steps
        total, count = by_name.get(name, (0.0, 0))
        by_name[name] = (total + duration_us, count + 1)
    step_ms = sum(p["wall_ms"] for p in phases.values())
    kernels = [{"name": name, "ms": total / 1000 / steps, "count": count / steps,
                "share": total / 1000 / steps / step_ms if step_ms else 0.0}
               for name, (total, count) in sorted(by_name.items(), key=lambda item: -item[1][0])]
    rest = kernels[top:]
    return {"time_kind": "GPU kernel time" if cuda else "CPU self time of each op", "steps": steps,
            "step_ms": step_ms, "busy_ms": sum(k["ms"] for k in kernels), "phases": phases, "kernels": kernels[:top],
            "other_kernels": {"kinds": len(rest), "ms": sum(k["ms"] for k in rest), "count": sum(k["count"] for k in rest)}}


def save_trace(prof, path, limit=TRACE_LIMIT_BYTES):
    """The chrome trace gzipped to `path` if it stays under `limit`, else nothing: a line saying which."""
    raw = path.removesuffix(".gz")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    size = os.path.getsize(path)
    if size > limit:
        os.remove(path)
        return f"not kept: {size / 2**20:.1f} MiB gzipped, over {limit / 2**20:.0f} MiB"
    return f"{os.path.basename(path)} ({size / 2**20:.2f} MiB)"


# -----------------------------------------------------------------------------
# What holds a step's peak memory


def peak_memory(step, device, top=12):
    """One step under the CUDA allocator's history, reduced by reduce_snapshot(); without CUDA a line saying so."""
    if device.type != "cuda":
        return {"skipped": f"no CUDA memory snapshot on a {device.type} (the allocator's history is CUDA's)"}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return reduce_snapshot(snapshot, before, torch.cuda.current_device(), top)


def reduce_snapshot(snapshot, allocated_before, device_index=0, top=12):
    """A memory snapshot's trace of one step replayed: the bytes allocated at its peak, and the blocks live there
    grouped by the frame that allocated each (allocated_before: what was live when the recording began, weights and
    optimizer state, which the trace has no frames for). A block counts from its alloc to its free_completed."""
    trace = snapshot["device_traces"][device_index]

    def replay(until):
        live, before, total, peak, peak_at = {}, allocated_before, allocated_before, allocated_before, -1
        for i, entry in enumerate(trace[:until]):
            if entry["action"] == "alloc":
                live[entry["addr"]] = entry
                total += entry["size"]
            elif entry["action"] == "free_completed":
                freed = live.pop(entry["addr"], None)
                if freed is None:  # a block from before the recording
                    before -= entry["size"]
                total -= entry["size"]
            if total > peak:
                peak, peak_at = total, i
        return live, before, peak, peak_at

    _, _, peak, peak_at = replay(len(trace))
    live, before, _, _ = replay(peak_at + 1)
    groups = {"allocated before the step (weights, optimizer state, ...)": [max(0, before), 1 if before > 0 else 0]}
    for entry in live.values():
        where = allocated_at(entry.get("frames") or [])
        group = groups.setdefault(where, [0, 0])
        group[0] += entry["size"]
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    return {"peak_bytes": peak, "trace_entries": len(trace),
            "held_by": [{"bytes": size, "blocks": blocks, "allocated_at": where}
                        for where, (size, blocks) in ranked[:top] if size > 0],
            "others": {"bytes": sum(size for _, (size, _) in ranked[top:]),
                       "blocks": sum(blocks for _, (_, blocks) in ranked[top:])}}


def allocated_at(frames):
    """Where a block was allocated, as one line: the innermost frame in the projects' own code, else the compiled graph
    whose generated code allocated it (its buffers grouped together), else the innermost frame at all."""
    def own_code(filename):
        return not any(part in filename for part in ("site-packages", "/torch/", "torchinductor", "<", "/lib/python"))

    for frame in frames:
        if own_code(frame["filename"]):
            return f"{short_path(frame['filename'])}:{frame['line']} {frame['name']}"
    for frame in frames:
        if "torchinductor" in frame["filename"]:
            return f"compiled graph {os.path.basename(frame['filename'])} ({frame['name']})"
    if frames:
        return f"{short_path(frames[0]['filename'])}:{frames[0]['line']} {frames[0]['name']}"
    return "no Python frame (the autograd engine or C++)"


def short_path(filename):
    """A path from the project's folder on (nanochat/gpt.py, bench/train.py), or its last two parts."""
    parts = filename.replace("\\", "/").split("/")
    for anchor in ("nanochat", "bench", "scripts"):
        if anchor in parts[:-1]:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return "/".join(parts[-2:])


# -----------------------------------------------------------------------------
# The whole record, and its text


def record(stem, name, step, device, compile_counts=None, steps=2):
    """Profile `steps` calls of step(), snapshot one more's memory, and write `stem`.json and `stem`.txt (and the
    trace, `stem`.trace.json.gz, where small). step() must label its phases with phase(). Returns the report."""
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    prof = profile_steps(step, device, steps)
    report = {"name": name, "device": device.type, **reduce_profile(prof.events(), steps, device.type == "cuda")}
    report["trace"] = save_trace(prof, stem + ".trace.json.gz")
    del prof
    report["memory"] = peak_memory(step, device)
    report["compile"] = compile_counts
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".txt", "w") as f:
        f.write(format_report(report))
    return report


def format_report(report):
    """The report as a small text table (what is committed after a lease)."""
    unit = "GPU" if report["device"] == "cuda" else "CPU"
    step = report["step_ms"] or 1.0
    lines = [f"{report['name']}: {report['device']}, {report['steps']} profiled steps, {report['step_ms']:.1f} ms a step "
             f"(the labelled phases' wall time, each ended by a sync)",
             f"{report['time_kind']}: {report['busy_ms']:.1f} ms a step ({100 * report['busy_ms'] / step:.1f} % of it)", "",
             f"{'phase':<10} {'wall ms':>9} {unit + ' ms':>9} {'share':>7}"]
    for name, p in report["phases"].items():
        lines.append(f"{name:<10} {p['wall_ms']:9.2f} {p['busy_ms']:9.2f} {100 * p['wall_ms'] / step:6.1f}%")
    lines += ["", f"top {len(report['kernels'])} by {report['time_kind']}, a step:",
              f"{'ms':>9} {'count':>7} {'share':>7}  name"]
    for k in report["kernels"]:
        lines.append(f"{k['ms']:9.3f} {k['count']:7.1f} {100 * k['share']:6.1f}%  {k['name'][:120]}")
    other = report["other_kernels"]
    lines.append(f"{other['ms']:9.3f} {other['count']:7.1f} {100 * other['ms'] / step:6.1f}%  ({other['kinds']} others)")
    memory = report["memory"]
    lines.append("")
    if "skipped" in memory:
        lines.append(f"peak memory: skipped: {memory['skipped']}")
    else:
        lines += [f"peak memory of a step: {memory['peak_bytes'] / 2**30:.2f} GiB allocated, held by:",
                  f"{'GiB':>8} {'blocks':>7}  allocated at"]
        for h in memory["held_by"]:
            lines.append(f"{h['bytes'] / 2**30:8.3f} {h['blocks']:7d}  {h['allocated_at']}")
        lines.append(f"{memory['others']['bytes'] / 2**30:8.3f} {memory['others']['blocks']:7d}  (the others)")
    counts = report.get("compile") or {}
    if counts:
        lines += ["", "compile: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items())]
    lines.append(f"trace: {report['trace']}")
    return "\n".join(lines) + "\n"
