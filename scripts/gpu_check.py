"""
Is this node ready for the speedrun? What to run on a machine you just rented, before `bash speedrun.sh` (minutes):

    python -m scripts.gpu_check                          # every check, then a verdict and one JSON line
    DRY_RUN=1 python -m scripts.gpu_check                # print what it would run, run nothing
    python -m scripts.gpu_check --append my_nodes.md     # also append its rows to that file
    python -m scripts.gpu_check --suite                  # developers: ours against the reference, every GPU path;
                                                         # the rows also go to dev/gpu_results/<date>_<machine>.md
    python -m scripts.gpu_check --suite --only train,fp8 --compile-cache-dir .compile_cache --out-dir $OUT
                                                         # a lease: its files in $OUT, the compile caches carried
    python -m scripts.gpu_check --prepare-lease --only train,fp8 --suite-minutes 9.2
                                                         # before a lease: what it carries, and the command to paste

On CUDA: the environment (torch, CUDA, driver, NCCL, each GPU's memory and bf16/fp8 support, free disk), a d4 and a
d12 base_train smoke (compiled, bf16) with tok/s and MFU against the data-sheet peak, the largest --device-batch-size
that fits at the speedrun's depth (each candidate probed by a real training step), and with 2+ GPUs the all-reduce
bandwidth and a 2-GPU base_train that must agree with 1 GPU; then engine decode speed at batch 1 and 16. Without
CUDA it says so and runs the same checks the CPU can (the smoke on what the CPU preset runs, decode, and with
--nproc=2 the distributed checks over gloo). Its runs live in $NANOCHAT_BASE_DIR/gpu_check/, away from your own.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch

from bench import gpu_check as check
from bench import gpu_suite as suite
from bench import lease
from bench.common import ensure_builtin_workspace, holds_training_data
from nanochat.common import UserError, compute_cleanup, compute_init, get_base_dir, print0, run_main
from nanochat.recipe import DEFAULT_COMPONENTS, depth_recipe, split_components

REPO_ROOT, CHILD_PYTHONPATH = check.REPO_ROOT, check.CHILD_PYTHONPATH
run_smoke = check.run_smoke


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description="Qualify this machine for the speedrun: environment, smokes, memory, verdict.")
    p.add_argument("--smoke-depths", default="4,12" if cuda else "4", help="base_train smoke depths, comma-separated")
    p.add_argument("--smoke-steps", type=int, default=30, help="optimizer steps per smoke (the first 3 are not timed)")
    p.add_argument("--seq-len", type=int, default=2048 if cuda else 256, help="the smokes' context")
    p.add_argument("--nproc", type=int, default=torch.cuda.device_count() if cuda else 1,
                   help="ranks for the distributed checks (all GPUs; 2 on a CPU runs them over gloo)")
    p.add_argument("--speedrun-batch", type=int, default=None,
                   help="the device batch the speedrun will use (default: $NANOCHAT_DEVICE_BATCH, else speedrun.sh's 16)")
    p.add_argument("--append", default=None, help="append the result rows to this markdown file (not --suite's: it writes --results-dir)")
    p.add_argument("--suite", action="store_true", help="instead: the GPU suite (bench/gpu_suite.py): ours against "
                   "the reference, fp8, a 200-step run, decode, serving, the stages in miniature")
    p.add_argument("--only", default="", help="--suite's sections, comma-separated (default: all)")
    p.add_argument("--results-dir", default=os.path.join(REPO_ROOT, "dev", "gpu_results"),
                   help="--suite's results: a dated markdown file per run (default: dev/gpu_results/)")
    p.add_argument("--suite-minutes", type=float, default=9.0,
                   help="--suite's deadline, from its start to its last file written: later sections are skipped")
    p.add_argument("--out-dir", default="", help="--suite's output folder (a lease's $OUT): the results .md and .json, "
                   "the log, compile_cache.tar.gz and profiles.tar.gz, instead of --results-dir")
    p.add_argument("--compile-cache-dir", default="",
                   help="--suite's portable compile caches, a file per compiled configuration: a compile_cache.tar.gz "
                   "in it (carried from the last lease) is unpacked first (default: $NANOCHAT_BASE_DIR/gpu_check/"
                   "compile_cache)")
    p.add_argument("--commit", default="", help="--suite's rows name this commit instead of the checkout's HEAD: a GPU "
                   "machine that got a copy of the working tree may hold an older .git (give it the sender's commit)")
    p.add_argument("--reference", default=suite.REFERENCE_DIR, help="a checkout of karpathy/nanochat for --suite")
    p.add_argument("--prepare-lease", action="store_true", help="instead: the dry run of what a GPU lease carries for "
                   "--suite (each path's size, 64 MiB and 8 paths at most), then the carry list and the command to "
                   "paste with --only and --suite-minutes (bench/lease.py)")
    p.add_argument("--reference-git", default="", help="--prepare-lease: write .reference/ first, as a git archive "
                   "of the reference's commit from this clone or mirror of karpathy/nanochat")
    p.add_argument("--carry", default=",".join((lease.WHEELS, lease.REFERENCE, lease.CACHES)),
                   help="--prepare-lease: the ignored paths the lease carries, comma-separated")
    p.add_argument("--worker", choices=["probe", "allreduce", "decode"], help=argparse.SUPPRESS)  # subprocesses' jobs
    p.add_argument("--decode-depth", type=int, default=12, help=argparse.SUPPRESS)
    p.add_argument("--decode-rows", default="1,16,64", help=argparse.SUPPRESS)
    p.add_argument("--probe-batch", type=int, default=16, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.smoke_depths = [int(d) for d in args.smoke_depths.split(",") if d]
        if args.speedrun_batch is None:
            args.speedrun_batch = int(os.environ.get("NANOCHAT_DEVICE_BATCH") or check.SPEEDRUN["device_batch"])
    except ValueError as e:
        raise UserError(f"--smoke-depths and NANOCHAT_DEVICE_BATCH take whole numbers ({e})") from None
    for flag in ("smoke_steps", "nproc", "speedrun_batch", "seq_len"):
        if getattr(args, flag) < 1 or not args.smoke_depths or min(args.smoke_depths) < 1:
            raise UserError(f"--{flag.replace('_', '-')} and --smoke-depths must be >= 1")
    if args.smoke_steps <= 3:
        raise UserError("--smoke-steps must be > 3: the first 3 steps (compile, warmup) are not timed")
    return args


def train_command(nproc, depth, args, tag):
    """A smoke: base_train of this depth, two micro-batches per step on one rank (one on two), so 1 and 2 ranks agree."""
    device_batch = 8 if not torch.cuda.is_available() else 32 if depth <= 4 else 16
    launch = [sys.executable, "-m", "scripts.base_train"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "scripts.base_train"]
    total = 2 * device_batch * args.seq_len
    return launch + [f"--depth={depth}", f"--max-seq-len={args.seq_len}", f"--device-batch-size={device_batch}",
                     f"--total-batch-size={total}", f"--num-iterations={args.smoke_steps}", f"--eval-every={args.smoke_steps}",
                     f"--eval-tokens={4 * total}", "--core-metric-every=-1", "--sample-every=-1", f"--model-tag={tag}"]


def probe_batches(args, workspace_dir, log):
    """The largest device batch that fits at the speedrun's depth: the speedrun's own, then doubling while it fits (up to
    one micro-batch per step), or halving until one does. Each candidate is one fresh process (a clean CUDA heap)."""
    most = check.SPEEDRUN["total_batch"] // (check.SPEEDRUN["seq_len"] * max(1, torch.cuda.device_count()))
    tried, batch = {}, args.speedrun_batch
    while 1 <= batch <= most and batch not in tried:
        p = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--worker=probe", f"--probe-batch={batch}"],
                           cwd=REPO_ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH))
        result = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"fits": False, "error": p.stderr[-300:]}
        tried[batch] = result
        log(f"  device batch {batch}: " + (f"fits, peak {result['peak_gib']:.1f} GiB, {result['step_s']:.2f} s/step"
                                           if result["fits"] else "does not fit"))
        batch = batch * 2 if result["fits"] and batch == max(tried) else batch // 2 if not result["fits"] else 0
    fitting = [b for b, r in tried.items() if r["fits"]]
    largest = max(fitting) if fitting else None
    summary = f"{largest} (peak {tried[largest]['peak_gib']:.1f} GiB)" if largest else "none fits"
    if largest == most:
        summary += ", the most the 2^19-token batch can use"
    return {"speedrun_batch": args.speedrun_batch, "speedrun_fits": tried.get(args.speedrun_batch, {}).get("fits", False),
            "largest_fitting": largest, "tried": tried, "summary": summary}


def run_worker(args):
    """The jobs gpu_check runs in processes of their own: one memory probe, or the all-reduce timing under torchrun."""
    if args.worker == "decode":
        return suite.decode_worker(args.decode_depth, args.seq_len, [int(r) for r in args.decode_rows.split(",")],
                                   get_base_dir())
    if args.worker == "probe":
        s = check.SPEEDRUN
        print(json.dumps(check.probe_device_batch(s["depth"], s["seq_len"], s["vocab_size"], args.probe_batch,
                                                  torch.device("cuda"))))
        return
    _, rank, _, _, device = compute_init()
    busbw = check.allreduce_bandwidth(device)
    if rank == 0:
        print(json.dumps({"busbw_gbs": busbw}))
    compute_cleanup()


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    cuda, t_start = torch.cuda.is_available(), time.time()
    root = os.path.join(get_base_dir(), "gpu_check")
    log = lambda message: print0(f"[{time.time() - t_start:5.0f}s] {message}")  # noqa: E731
    if args.prepare_lease:
        return None if lease.main(args, REPO_ROOT, suite.REFERENCE_COMMIT) else sys.exit(1)
    if args.suite:
        return None if suite.main(args, log) else sys.exit(1)
    if not cuda:
        print0("no CUDA GPU visible: running the CPU checks only (on a GPU node, check the driver and that torch is a "
               "CUDA build: python -c 'import torch; print(torch.version.cuda)')")
    print0(f"gpu_check | {torch.cuda.device_count()} GPU(s) | smokes d{',d'.join(map(str, args.smoke_depths))}, "
           f"{args.smoke_steps} steps at T {args.seq_len} | distributed checks on {args.nproc} rank(s) | speedrun device "
           f"batch {args.speedrun_batch} | runs in {root}")
    smokes = {f"d{d} base_train, {'bf16 compiled, 1 GPU' if cuda else 'cpu preset path, 1 process'}":
              train_command(1, d, args, f"d{d}") for d in args.smoke_depths}
    two_ranks = train_command(args.nproc, args.smoke_depths[0], args, "two") if args.nproc >= 2 else None
    if os.environ.get("DRY_RUN") == "1":
        print0(f"gpu_check would run, in {root}:\n  environment table (torch, CUDA, driver, NCCL, GPUs, disk)")
        for name, command in smokes.items():
            print0(f"  {name}: {' '.join(command[1:])}")
        if two_ranks:
            print0(f"  {args.nproc} ranks vs 1: {' '.join(two_ranks[1:])}")
            print0(f"  all-reduce bandwidth: torchrun --nproc-per-node={args.nproc} -m scripts.gpu_check --worker=allreduce")
        if cuda:
            print0(f"  largest device batch at depth {check.SPEEDRUN['depth']}: -m scripts.gpu_check --worker=probe "
                   f"--probe-batch={args.speedrun_batch}, then doubling or halving")
        print0(f"  engine decode at batch 1 and 16 on the d{args.smoke_depths[-1]} smoke's checkpoint")
        return

    env = check.environment(get_base_dir())
    print0("\n".join(f"  {k:<20} {v}" for k, v in check.environment_rows(env)))
    results = {"environment": env, "nproc": args.nproc, "smokes": {}, "decode": {}}
    if holds_training_data(get_base_dir()):  # the speedrun's own tokenizer and shards, once it has them
        workspace = {"base_dir": get_base_dir(), "source": os.environ.get("NANOCHAT_DATA_SOURCE", "builtin")}
    else:
        workspace = ensure_builtin_workspace(os.path.join(root, "workspace"), 32768 if cuda else 4096, log=log)
    log(f"data: {workspace['source']} shards and the tokenizer in {workspace['base_dir']}")
    for name, command in smokes.items():
        log(f"{name} ({args.smoke_steps} steps)")
        results["smokes"][name] = smoke = run_smoke(name.split()[0], command, workspace, root)
        log(f"  {smoke['error']}" if smoke.get("error") else f"  {smoke['tok_per_sec']:,.0f} tok/s"
            + (f", MFU {smoke['mfu']:.1f} %" if smoke.get("mfu") else "") + f" ({smoke['seconds']:.0f} s)")
    if two_ranks:
        log(f"{args.nproc} ranks against 1 on the same global batch")
        one, two = next(iter(results["smokes"].values())), run_smoke("two_ranks", two_ranks, workspace, root)
        if one.get("error") or two.get("error"):
            results["smokes"][f"{args.nproc}-rank base_train"] = two if two.get("error") else {"error": "its 1-rank run failed"}
        else:
            results["multi_rank"] = agreement = check.rank_agreement(one["val_bpb"], two["val_bpb"], args.smoke_steps)
            log(f"  val bpb {agreement['one']:.4f} (1 rank) vs {agreement['two']:.4f} ({args.nproc} ranks) after "
                f"{args.smoke_steps} steps: {'agree' if agreement['agrees'] else 'DISAGREE'}")
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                            "-m", "scripts.gpu_check", "--worker=allreduce"], cwd=REPO_ROOT, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH))
        results["allreduce_busbw_gbs"] = json.loads(p.stdout.strip().splitlines()[-1])["busbw_gbs"] if p.returncode == 0 else None
        log(f"  all-reduce bus bandwidth {results['allreduce_busbw_gbs'] or 0:.1f} GB/s")
    if cuda:
        log(f"largest device batch at the speedrun's depth {check.SPEEDRUN['depth']} (compiled bf16 training steps)")
        results["batch_probe"] = probe_batches(args, root, log)
        recipe = depth_recipe(check.SPEEDRUN["depth"], check.SPEEDRUN["vocab_size"], check.SPEEDRUN["seq_len"], check.SPEEDRUN["total_batch"],
                              components=split_components(DEFAULT_COMPONENTS)[0])
        matrices = recipe.scaling_params - recipe.model_config.vocab_size * recipe.model_config.n_embd
        results["disk_needed_gib"] = check.speedrun_disk_gib(recipe.num_params, matrices)
    last = results["smokes"][next(reversed(smokes))]
    if not last.get("error"):
        log("engine decode speed")
        from nanochat.checkpoint_manager import load_model
        from nanochat.kernels.cpu import use_cpu_kernels

        os.environ.update(NANOCHAT_BASE_DIR=last["base_dir"])
        model, tokenizer, _ = load_model("base", "cuda" if cuda else "cpu", model_tag=f"d{args.smoke_depths[-1]}")
        use_cpu_kernels(model, "cuda" if cuda else "cpu")  # on a CPU, unless NANOCHAT_CPU_OPS=0
        results["decode"] = {batch: check.decode_speed(model, tokenizer, batch) for batch in (1, 16)}

    ready, changes = check.verdict(results)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    rows = check.markdown_rows(results, datetime.date.today().isoformat(), commit or "unknown commit")
    print0("\n| check | result | machine | command | commit | date |\n|---|---|---|---|---|---|\n" + "\n".join(rows))
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n".join(rows) + "\n")
        print0(f"appended {len(rows)} rows to {args.append}")
    if not cuda:
        line = "no CUDA GPU: this machine runs the cpu preset (bash speedrun.sh)" + ("" if ready else ", after: " + "; ".join(changes))
    else:
        line = "ready for the speedrun" if ready else "not ready: " + "; ".join(changes)
    print0(f"verdict: {line} ({time.time() - t_start:.0f} s)")
    print0(json.dumps({"gpu_check": {**results, "ready": ready, "changes": changes, "verdict": line}}, default=str))
    if not ready:
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
