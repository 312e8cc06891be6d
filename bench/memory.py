"""
`bench memory`: the peak memory of one bf16 training step on the CPU, ours against the reference project's
(karpathy/nanochat, checked out in .reference, built as bench/reference_train.py builds it), each project in a fresh
process of its own so that one's memory never counts in the other's:

    python -m scripts.bench memory                       # d6, T=512, B=8, vocab 32768, eager
    python -m scripts.bench memory --depth 12 --seq-len 2048 --device-batch-size 1   # the largest a 24 GiB CPU holds
    python -m scripts.bench memory --compile 1           # torch.compile'd steps (inductor on the CPU)

Each project builds its model and optimizers as its base_train does, takes one full step (forward, backward, optimizer
step, zero_grad) so that the optimizer state exists (and, compiled, the graphs), then a second one, whose peak is what
is reported. Both compute in bf16 the way a GPU runs them: ours with NANOCHAT_DTYPE=bfloat16 (bf16 autocast) and
NANOCHAT_CPU_OPS=0 (the plain torch path, not the CPU-only fused Functions), the reference with NANOCHAT_DTYPE=bfloat16
(its own casts to bf16). Both read random tokens of the same shape. The numbers are of eager steps unless --compile 1
says otherwise (the JSON line's "compile"); a GPU trains compiled, where inductor chooses what to save for backward.

The method: torch.profiler's allocation events. Every CPU tensor's memory comes from c10's CPU allocator, which reports
each allocation and each free, with its address and size, while a profiler with profile_memory runs: the temporaries
inside an op and the buffers of inductor's generated code included, so eager and compiled steps are measured alike.
One profile covers the child from the model's construction on, so the running sum of the events is all the tensor
memory the training holds. At the second step's highest point each live block is named by the allocation it is:
parameters and optimizer state (the blocks their storages sit in at the end), gradients (marked by a hook as each
.grad is accumulated), activations and temporaries (everything else the step allocated), other (the rest allocated
before the step: rotary tables, the batch, step counters). A second table charges the activations alive at the peak
to the op that allocated each (in a compiled step, to its compiled frame: generated code allocates without an aten op).
Not counted: memory outside tensors (Python objects, oneDNN's kernel caches, the compiler), which the process's peak
RSS, printed beside, includes. A GPU's max_memory_allocated counts the same tensors, each rounded up to 512 bytes, plus
its kernels' workspaces. Checked in tests/test_bench_memory.py: a tensor saved for backward raises the peak by exactly
its bytes, and the peak and its categories equal those of torch's MemTracker (a TorchDispatchMode counting live
storages, which sees no compiled code) on an eager step.

This file also runs as the reference's child, with the reference's package first on PYTHONPATH: so nothing of ours
(nanochat, bench.common) is imported at its top, only inside the functions that run in our own processes.
"""

import argparse
import json
import os
import resource
import subprocess
import sys

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

MEASURED_STEP = "bench_memory::measured_step"  # the profiler range around the second step
GRADIENT_MARK = "bench_memory::gradient@"  # + the address of a .grad's block, a range entered as it is accumulated
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
MIB = 2**20

# -----------------------------------------------------------------------------
# The measurement


def measure_second_step(build):
    """
    Profile build() -> (model, optimizers, step) and two calls of step(), one full training step each. Returns the
    second step's memory: its peak (bytes of every tensor alive, from the construction on), what is alive at the peak
    by category, the memory just before it, where in the step the peak falls, and the parameters' and optimizer
    state's own sizes (summed from the tensors, to check the categories against).
    """

    def mark_gradient(param):
        with record_function(f"{GRADIENT_MARK}{param.grad.untyped_storage().data_ptr()}"):
            pass

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, optimizers, step = build()
        hooks = [p.register_post_accumulate_grad_hook(mark_gradient) for p in model.parameters() if p.requires_grad]
        step()
        with record_function(MEASURED_STEP):
            step()
    for hook in hooks:
        hook.remove()
    param_storages = unique_storages(model.parameters())
    state_tensors = [t for opt in optimizers for state in opt.state.values() for t in tensors_in(state)]
    state_storages = {address: size for address, size in unique_storages(state_tensors).items()
                      if address not in param_storages}
    result = peak_of_measured_step(prof, set(param_storages), set(state_storages))
    result["parameters_direct"] = sum(param_storages.values())
    result["optimizer_state_direct"] = sum(state_storages.values())
    return result


def unique_storages(tensors):
    """{address of the storage's block: its bytes} of these tensors, a storage shared by several counted once."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def tensors_in(value):
    """The tensors in an optimizer's per-parameter state (a dict of tensors and numbers, maybe nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def profiled_events(prof):
    """The CPU allocations and frees, the gradient marks, in time order, and the measured step's (start, end) in ns."""
    events, window, stack = [], None, list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # the tree in preorder, children in the order they ran: ties of the clock keep that order below
        node = stack.pop()
        stack.extend(reversed(node.children))
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, "memory", node.extra_fields.ptr, node.extra_fields.alloc_size, node))
        elif node.tag == _EventType.TorchOp and node.name == MEASURED_STEP:
            window = (node.start_time_ns, node.end_time_ns)
        elif node.tag == _EventType.TorchOp and node.name.startswith(GRADIENT_MARK):
            events.append((node.start_time_ns, "gradient", int(node.name[len(GRADIENT_MARK):]), 0, node))
    events.sort(key=lambda event: event[0])
    return events, window


def replay(events, until):
    """
    Walk events[:until]: {address: (bytes, number of the allocation event)} of the blocks alive after them, the bytes
    alive after each event, and the numbers of the allocations a gradient mark found .grad in. A free of a block
    allocated before the profile began is not counted (the profiler cannot tell its size): no block of the training is.
    """
    alive, totals, gradient_blocks, total = {}, [], set(), 0
    for number, (_, kind, address, size, _) in enumerate(events[:until]):
        if kind == "memory" and size > 0:
            alive[address] = (size, number)
            total += size
        elif kind == "memory" and address in alive:
            total -= alive.pop(address)[0]
        elif kind == "gradient" and address in alive:
            gradient_blocks.add(alive[address][1])
        totals.append(total)
    return alive, totals, gradient_blocks


def peak_of_measured_step(prof, param_addresses, state_addresses):
    events, (start, end) = profiled_events(prof)
    alive_at_end, totals, gradient_blocks = replay(events, len(events))
    in_step = [i for i, event in enumerate(events) if start <= event[0] <= end]
    first = in_step[0]
    peak_at = max(in_step, key=lambda i: totals[i])
    alive_at_peak, _, _ = replay(events, peak_at + 1)
    # a parameter's or a state's block is the same allocation at the peak as at the end: neither is ever freed
    param_blocks = {alive_at_end[a][1] for a in param_addresses if a in alive_at_end}
    state_blocks = {alive_at_end[a][1] for a in state_addresses if a in alive_at_end}
    at_peak, activations_by_op = dict.fromkeys(CATEGORIES, 0), {}
    for size, number in alive_at_peak.values():
        if number in param_blocks:
            at_peak["parameters"] += size
        elif number in gradient_blocks:
            at_peak["gradients"] += size
        elif number in state_blocks:
            at_peak["optimizer_state"] += size
        elif number >= first:
            at_peak["activations"] += size
            op = op_label(op_chain(events[number][4]))
            activations_by_op[op] = activations_by_op.get(op, 0) + size
        else:
            at_peak["other"] += size
    return {"peak_bytes": totals[peak_at], "before_step_bytes": totals[first - 1] if first else 0,
            "at_peak": at_peak, "peak_ops": op_chain(events[peak_at][4]),
            "activations_by_op": dict(sorted(activations_by_op.items(), key=lambda item: -item[1]))}


def op_chain(node):
    """The ops the allocation at the peak was made in, outermost first, below the measured step's range."""
    names = []
    node = node.parent
    while node is not None and node.name != MEASURED_STEP:
        names.append(node.name)
        node = node.parent
    return names[::-1]


def op_label(ops):
    """The op an allocation is charged to: the autograd node of a backward (MmBackward0, CompiledFunctionBackward), else
    the outermost aten op called (aten::linear, not the aten::mm inside it) or compiled frame ("Torch-Compiled Region:
    0/0", whose generated code allocates without an aten op)."""
    for name in ops:
        if name.startswith("autograd::engine::evaluate_function: "):
            return name.split(": ", 1)[1]
        if name.startswith("aten::") or name.startswith("Torch-Compiled Region"):
            return name
    return ops[-1] if ops else "(outside any op)"


def phase_of(ops):
    """Which part of the step an op chain is in: backward, optimizer or forward (by the names torch gives ranges)."""
    text = " ".join(ops)
    if "autograd::engine" in text or "Backward" in text:
        return "backward"
    if "Optimizer." in text or "zero_grad" in text:
        return "optimizer"
    return "forward"


# -----------------------------------------------------------------------------
# The children: one project's model, optimizers and step, measured


def random_batch(args):
    """Random token ids (the values do not change the memory), targets the ids shifted by one as reference_train's."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab_size, (args.device_batch_size, args.seq_len), generator=generator)
    return x, torch.roll(x, -1, dims=1)


def build_ours(args):
    """Our model, optimizers and base_train's step (loop.train_step, grad_accum 1), built as bench train's Run."""
    from nanochat.common import autocast_for, compile_model, keep_freed_memory_in_process
    from nanochat.gpt import build_model
    from nanochat.kernels.cpu import use_cpu_kernels
    from nanochat.optim import compile_muon_updates
    from nanochat.recipe import build_optimizers, depth_recipe, split_components
    from nanochat.optim import muon_momentum
    from nanochat.loop import train_step

    keep_freed_memory_in_process()  # as base_train does: it changes the peak RSS, not the tensors
    torch.manual_seed(42)
    device = torch.device("cpu")
    model_components, optimizer_components = split_components(args.components)
    recipe = depth_recipe(args.depth, args.vocab_size, args.seq_len, args.device_batch_size * args.seq_len,
                          num_iterations=1, components=model_components)
    model = use_cpu_kernels(build_model(recipe.model_config, device), device)
    train_model = compile_model(model) if args.compile else model
    optimizers = build_optimizers(model, **recipe.lrs(), optimizer_components=optimizer_components)
    if args.compile:  # as base_train: Muon's update compiled with the model
        compile_muon_updates(optimizers)
    autocast = autocast_for(device)
    batch = random_batch(args)

    def step():
        train_step(train_model, optimizers, [batch], lambda m, xy: m(*xy), 1.0, muon_momentum(0), autocast)

    return model, optimizers, step


def build_reference(args):
    """The reference's model, optimizer and step (loss, backward, step, zero_grad), as bench/reference_train.py's."""
    import reference_train  # bench/reference_train.py: this file runs as a script there, its folder first on sys.path

    reference_train.import_reference()
    model, optimizer = reference_train.build_reference(args.depth, args.seq_len, args.vocab_size, args.window_pattern,
                                                       torch.device("cpu"))
    train_model = torch.compile(model, dynamic=False) if args.compile else model
    x, y = random_batch(args)

    def step():
        loss = train_model(x, y)
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        loss.item()

    return model, [optimizer], step


def child_main(argv=None):
    """One project's measurement in this process: one JSON line on stdout."""
    p = argparse.ArgumentParser(description="bench memory's child: one project's training step, measured")
    p.add_argument("--project", choices=["ours", "reference"], required=True)
    p.add_argument("--depth", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--device-batch-size", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--components", default="")
    p.add_argument("--window-pattern", default="L")
    p.add_argument("--compile", type=int, default=0)
    args = p.parse_args(argv)
    build = build_ours if args.project == "ours" else build_reference
    result = measure_second_step(lambda: build(args))
    result["phase"] = phase_of(result["peak_ops"])
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    result["dtype_env"] = os.environ.get("NANOCHAT_DTYPE")
    print(json.dumps(result), flush=True)


# -----------------------------------------------------------------------------
# The command: both children, a table and one JSON line


def run_child(project, args, components, reference_path):
    """One project's child process; its result dict, or {"failed": the end of what it said}."""
    from bench.gpu_check import REPO_ROOT
    from nanochat.common import child_pythonpath

    flags = [f"--project={project}", f"--depth={args.depth}", f"--seq-len={args.seq_len}",
             f"--device-batch-size={args.device_batch_size}", f"--vocab-size={args.vocab_size}",
             f"--window-pattern={args.window_pattern}", f"--compile={args.compile}"]
    # bf16 as a GPU computes it, on the CPU (a GPU here stays out of it), and ours on the plain torch path a GPU takes
    env = {**os.environ, "NANOCHAT_DTYPE": "bfloat16", "CUDA_VISIBLE_DEVICES": ""}
    if project == "ours":
        command = [sys.executable, "-m", "bench.memory", *flags, f"--components={components}"]
        env.update(NANOCHAT_CPU_OPS="0", PYTHONPATH=child_pythonpath(REPO_ROOT))
    else:  # as a file, the reference's package first on the path: `import nanochat` must find the reference's
        command = [sys.executable, os.path.abspath(__file__), *flags]
        env.update(PYTHONPATH=child_pythonpath(os.path.abspath(reference_path)))
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"failed": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
    return json.loads(lines[-1])


def memory_row(project, result):
    if "skipped" in result or "failed" in result:  # why: in a line below the table
        return [project, "skipped" if "skipped" in result else "failed"] + ["-"] * (len(CATEGORIES) + 3)
    mib = [f"{result['at_peak'][c] / MIB:,.1f}" for c in CATEGORIES]
    where = f"{result['phase']}: {op_label(result['peak_ops'])}"
    return [project, f"{result['peak_bytes'] / MIB:,.1f}", *mib, f"{result['before_step_bytes'] / MIB:,.1f}", where,
            f"{result['peak_rss_bytes'] / MIB:,.0f}"]


def ratio_row(ours, reference):
    def ratio(a, b):
        return f"{a / b:.3f}x" if b else "-"

    return ["ours / reference", ratio(ours["peak_bytes"], reference["peak_bytes"]),
            *[ratio(ours["at_peak"][c], reference["at_peak"][c]) for c in CATEGORIES],
            ratio(ours["before_step_bytes"], reference["before_step_bytes"]), "",
            ratio(ours["peak_rss_bytes"], reference["peak_rss_bytes"])]


def activations_rows(results, most=12):
    """The ops whose outputs make up most of the activations alive at the peak, each project's MiB side by side."""
    measured = {project: r["activations_by_op"] for project, r in results.items() if "activations_by_op" in r}
    ops = sorted({op for by_op in measured.values() for op in by_op},
                 key=lambda op: -max(by_op.get(op, 0) for by_op in measured.values()))
    rows = [[op, *[f"{by_op.get(op, 0) / MIB:,.1f}" for by_op in measured.values()]] for op in ops[:most]]
    return rows, list(measured)


def cmd_memory(args):
    from bench.common import emit_json, log, machine_info, print_table
    from bench.gpu_check import REPO_ROOT
    from bench.gpu_suite import reference_checkout
    from nanochat.common import UserError
    from nanochat.recipe import DEFAULT_COMPONENTS, canonical_components

    if min(args.depth, args.seq_len, args.device_batch_size, args.vocab_size) < 1:
        raise UserError("--depth, --seq-len, --device-batch-size and --vocab-size must be >= 1")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    components = canonical_components(DEFAULT_COMPONENTS if args.components == "default" else args.components)
    reference_path, reference_commit = reference_checkout(args.reference or os.path.join(REPO_ROOT, ".reference"))
    print(f"bench memory: d{args.depth} T={args.seq_len} B={args.device_batch_size} vocab={args.vocab_size} | "
          f"{'compiled (inductor)' if args.compile else 'eager'} bf16 on the CPU | ours @ {commit} components="
          f"{components or 'none'} | reference @ {reference_commit[:12] if reference_path else '-'} window pattern "
          f"{args.window_pattern} | the second of two steps, torch.profiler's allocation events", flush=True)
    results = {}
    for project in ("ours", "reference"):
        if project == "reference" and reference_path is None:
            results[project] = {"skipped": reference_commit}
            continue
        log(f"bench memory: {project} ...")
        results[project] = run_child(project, args, components, reference_path)
    rows = [memory_row(project, result) for project, result in results.items()]
    measured = all("peak_bytes" in r for r in results.values())
    if measured:
        rows.append(ratio_row(results["ours"], results["reference"]))
    print_table("memory of one training step at its peak, MiB (parameters .. other: what is alive at the peak; "
                "before: alive as the step begins)",
                ["project", "peak", *CATEGORIES, "before", "peak in", "peak RSS"], rows)
    for project, result in results.items():
        if "skipped" in result or "failed" in result:
            why = f"skipped: {result['skipped']}" if "skipped" in result else f"failed: {result['failed']}"
            print(f"{project}: {why}")
    op_rows, projects = activations_rows(results)
    print_table("the activations alive at the peak by the op that allocated them, MiB (the largest)", ["op", *projects],
                op_rows)
    ratio = results["ours"]["peak_bytes"] / results["reference"]["peak_bytes"] if measured else None
    emit_json({"bench": "memory", "depth": args.depth, "seq_len": args.seq_len,
               "device_batch_size": args.device_batch_size, "vocab_size": args.vocab_size,
               "components": components or "none", "window_pattern": args.window_pattern, "compile": bool(args.compile),
               "commit": commit, "reference_commit": reference_commit if reference_path else None,
               "ours_over_reference": ratio, "projects": results, "machine": machine_info()})
    failed = [project for project, result in results.items() if "failed" in result]
    if failed:
        raise UserError(f"bench memory: {' and '.join(failed)} failed (the table says how)")


if __name__ == "__main__":
    child_main()
