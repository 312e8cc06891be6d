"""
Train a family of base_train runs and fit the scaling laws they trace (bench/miniseries.py).

    python -m scripts.miniseries --preset=cpu --mode=isoflop        # 3 FLOP budgets x d2,d3,d4,d6 on 2 cores
    python -m scripts.miniseries --preset=cpu                       # d2..d4 at 4 tokens/param (a quick look)
    python -m scripts.miniseries --preset=gpu --nproc=8             # d10..d26 on a GPU node (torchrun)
    python -m scripts.miniseries --depths 4 6 8 --ratio=10 --name=ratio10 --data-source=brown
    python -m scripts.miniseries --mode=isoflop --components=none --name=cpu-isoflop-plain   # another recipe (here the plain one)
    python -m scripts.miniseries --compare cpu-isoflop cpu-isoflop-smear    # their isoflop frontiers side by side
    python -m scripts.miniseries --preset=gpu --mode=isoflop --dry-run  # the plan only: sizes, steps, FLOPs

Run it again after a kill or a failure: finished runs are skipped, a killed one resumes, a failed one is retried.
Results: <base_dir>/miniseries/<name>/results.{csv,json} and plots; the report card gets a "Miniseries" section.
"""

import argparse
import json
import os

from nanochat.common import UserError, atomic_write_text, get_base_dir, print0, run_main
from nanochat.report import get_report
from bench import miniseries as ms
from nanochat.recipe import REFERENCE_BATCH

PRESETS = {
    # 2 cores, the CPU preset's sequence and batch (T=256, 2,048 tokens per step), CORE on the built-in bundle at each
    # run's end. Narrow models (n_embd = 32 x depth, heads of 32: 0.36M to 3.4M parameters) so that the compute-optimal
    # size at these budgets lies among the sizes tried. A CPU does ~1.2e11 FLOP/s here: the isoflop sweep (4 depths x
    # 3 budgets, 1.4e14 FLOPs) takes about 25 minutes, the series (4 tokens per parameter) about 10.
    "cpu": {"depths": [2, 3, 4], "budgets": [2.5e12, 8e12, 2.5e13], "isoflop_depths": [2, 3, 4, 6], "ratio": 4.0,
            "max_seq_len": 256, "device_batch_size": 8, "total_batch_size": 2048, "eval_tokens": 32768,
            "eval_bundle": "builtin", "aspect_ratio": 32, "head_dim": 32},
    # a GPU node, the speedrun's geometry, the dial's 20 tokens per parameter
    "gpu": {"depths": [10, 14, 18, 22, 26], "budgets": [1e18, 3e18, 1e19], "isoflop_depths": [8, 10, 12, 14, 16, 20],
            "ratio": 20.0, "max_seq_len": 2048, "device_batch_size": 16, "total_batch_size": REFERENCE_BATCH,
            "eval_tokens": 10 * REFERENCE_BATCH, "eval_bundle": "dclm", "aspect_ratio": 64, "head_dim": 128},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="A family of base_train runs, their results, the scaling-law fits.")
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS), help="defaults for everything below")
    p.add_argument("--mode", default="series", choices=["series", "isoflop"],
                   help="series: each depth at --ratio tokens/param; isoflop: each budget x each depth")
    p.add_argument("--name", default="", help="the family's name (default: <preset>-<mode>)")
    p.add_argument("--depths", type=int, nargs="+", default=None)
    p.add_argument("--budgets", type=float, nargs="+", default=None, help="isoflop: training FLOPs per run")
    p.add_argument("--ratio", type=float, default=None, help="series: training tokens per (scaling) parameter")
    for flag in ("max-seq-len", "device-batch-size", "total-batch-size", "eval-tokens", "aspect-ratio", "head-dim"):
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--eval-bundle", default=None, help="CORE at each run's end: builtin (offline), dclm, a path, or none")
    p.add_argument("--data-source", default=None, help="default: $NANOCHAT_DATA_SOURCE or builtin")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--components", default=None, help="base_train --components for every run, 'none' for the plain "
                   "recipe (default: base_train's, nanochat.recipe.DEFAULT_COMPONENTS)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs per run (torchrun when > 1)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (runs, sizes, steps, FLOPs) and stop")
    p.add_argument("--compare", nargs="+", default=None, metavar="NAME",
                   help="train nothing: set the finished families NAME... side by side (best val bpb per budget, plot)")
    args = p.parse_args(argv)
    if args.compare is not None:
        if len(args.compare) < 2 or not all(ms.plain_name(n) for n in args.compare):
            raise UserError("--compare takes two or more family names (letters, digits, '-', '_', '.')")
        return args
    for key, value in PRESETS[args.preset].items():
        if key in ("depths", "isoflop_depths"):
            continue
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.depths is None:
        args.depths = PRESETS[args.preset]["isoflop_depths" if args.mode == "isoflop" else "depths"]
    args.name = args.name or f"{args.preset}-{args.mode}"
    if min(args.depths) < 1 or (args.mode == "isoflop" and min(args.budgets) <= 0) or args.ratio <= 0:
        raise UserError("--depths must be >= 1, --budgets and --ratio > 0")
    from nanochat.recipe import DEFAULT_COMPONENTS, canonical_components

    args.components = canonical_components(DEFAULT_COMPONENTS if args.components is None else args.components)
    if not ms.plain_name(args.name):
        raise UserError(f"--name {args.name!r}: use letters, digits, '-', '_' and '.'")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.compare is not None:
        return compare(args.compare)
    from nanochat.dataset import list_parquet_files
    from nanochat.tokenizer import get_tokenizer
    from nanochat.recipe import depth_recipe, split_components

    base_dir = get_base_dir()
    list_parquet_files("train", args.data_source)  # a missing source fails here, before any run
    vocab_size = get_tokenizer().get_vocab_size()
    specs = ms.plan_isoflop(args.budgets, args.depths) if args.mode == "isoflop" else \
        ms.plan_series(args.depths, args.ratio)
    recipes = {}
    for spec in specs:
        budget = {"target_flops": float(spec.budget.split("=")[1])} if args.mode == "isoflop" else \
            {"target_param_data_ratio": args.ratio}
        recipes[spec.name] = r = depth_recipe(spec.depth, vocab_size, args.max_seq_len, args.total_batch_size,
                                              args.aspect_ratio, args.head_dim, **budget,
                                              components=split_components(args.components)[0])
        if r.num_iterations < 1:
            raise UserError(f"run {spec.name}: its budget is less than one step of {args.total_batch_size:,} tokens; "
                            f"raise --budgets/--ratio or lower --total-batch-size")
    directory = ms.series_dir(args.name)
    data_source = args.data_source or os.environ.get("NANOCHAT_DATA_SOURCE", "builtin")
    total_flops = sum(r.flops_per_token * r.num_iterations * args.total_batch_size for r in recipes.values())
    print0(f"miniseries {args.name} | {args.mode} | {len(specs)} runs |"
           f" components {args.components or 'none (plain recipe)'} | T {args.max_seq_len} | batch "
           f"{args.total_batch_size:,} tok | data {data_source} | {total_flops:.3g} FLOPs in all | {directory}")
    for spec in specs:
        r = recipes[spec.name]
        print0(f"  {spec.name:<14} params {r.num_params:>12,}  scaling {r.scaling_params:>12,}  steps "
               f"{r.num_iterations:>7,}  FLOPs {r.flops_per_token * r.num_iterations * args.total_batch_size:.3g}")
    if args.dry_run:
        return
    ms.check_family(directory, {"mode": args.mode, "ratio": args.ratio if args.mode == "series" else None,
                                "data_source": data_source, "vocab_size": vocab_size, "seed": args.seed,
                                **{k: getattr(args, k) for k in ("max_seq_len", "total_batch_size", "aspect_ratio",
                                                                 "head_dim", "eval_tokens", "eval_bundle")},
                                **({"components": args.components} if args.components else {})})
    os.makedirs(os.path.join(directory, "runs"), exist_ok=True)

    rows, trajectories, previous = [], {}, ms.read_results(directory)
    for k, spec in enumerate(specs, start=1):
        run_dir = os.path.join(directory, "runs", spec.name)
        ms.prepare_run_dir(run_dir, base_dir)
        r = recipes[spec.name]
        state = ms.run_state(run_dir, spec.name)
        if state == "done":
            print0(f"[{k}/{len(specs)}] {spec.name}: done already, skipping")
            rc, error, seconds = 0, "", None
        else:
            print0(f"[{k}/{len(specs)}] {spec.name}: {'resuming' if state == 'resume' else 'training'} "
                   f"({r.num_iterations} steps; log: {run_dir}/train.log)")
            rc, error, seconds = ms.launch(spec, run_dir, run_flags(args, r.num_iterations), args.nproc, os.environ,
                                           os.path.join(run_dir, "train.log"))
            print0(f"[{k}/{len(specs)}] {spec.name}: " + (f"failed: {error}" if rc else f"done in {seconds:.0f} s"))
        earlier = (previous.get(spec.name) or {}).get("wall_seconds") if state != "new" else None
        wall = earlier if seconds is None else (earlier or 0.0) + seconds  # a resumed run adds its attempts
        rows.append(ms.collect(spec, run_dir, r, args.total_batch_size, wall, "failed" if rc else "done", error))
        trajectories[spec.name] = ms.curve_points(run_dir, r, args.total_batch_size)
        ms.write_results(directory, rows)

    finish(args, directory, rows, trajectories)


def compare(names):
    """Families side by side: a markdown table of each one's best val bpb per budget, a PNG, and a JSON line."""
    directories = [ms.series_dir(name) for name in names]
    out_path = os.path.join(directories[-1], f"compare-{'-vs-'.join(names)}.png")
    table = ms.compare_families(directories, out_path)
    lines = ["| budget | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for budget, cells in table:
        first = cells[0][0] if cells[0] else None
        shown = [("—" if c is None else f"{c[0]:.4f} ({c[1].split('-')[-1]}"
                  + (f", {100 * (c[0] / first - 1):+.2f} %" if first and i else "") + ")") for i, c in enumerate(cells)]
        lines.append(f"| {budget.split('=')[1]} | " + " | ".join(shown) + " |")
    print0("\n".join(lines))
    if os.path.exists(out_path):
        print0(f"plot: {out_path}")
    print0(json.dumps({"miniseries_compare": names, "best_per_budget": [
        {"budget": b, **{n: (c[0] if c else None) for n, c in zip(names, cells)}} for b, cells in table]}))


def run_flags(args, num_iterations):
    """base_train's flags for one member: the family's geometry, evals at a few points, checkpoints for resuming."""
    every = max(1, num_iterations // 4)
    core = ["--core-metric-every=-1"] if args.eval_bundle == "none" else \
        [f"--core-metric-every={num_iterations}", f"--eval-bundle={args.eval_bundle}"]
    return [f"--max-seq-len={args.max_seq_len}", f"--device-batch-size={args.device_batch_size}",
            f"--total-batch-size={args.total_batch_size}", f"--aspect-ratio={args.aspect_ratio}",
            f"--head-dim={args.head_dim}", f"--eval-every={every}", f"--eval-tokens={args.eval_tokens}",
            f"--save-every={every}", "--sample-every=-1", f"--seed={args.seed}", *core] + \
        [f"--components={args.components or 'none'}"] + \
        ([f"--data-source={args.data_source}"] if args.data_source else [])


def finish(args, directory, rows, trajectories):
    """Fits, plots, the report section, a summary line and a JSON line."""
    done = [r for r in rows if r["status"] == "done" and r["val_bpb"] is not None]
    isoflop = ms.fit_isoflop([(float(r["budget"].split("=")[1]), r["scaling_params"], r["val_bpb"], r["tokens"])
                        for r in done]) \
        if args.mode == "isoflop" else {"budgets": [], "ratio_mean": None, "ratio_spread": None}
    front = ms.run_frontier(rows, trajectories)
    power_law = ms.fit_power_law([c for c, _ in front], [loss for _, loss in front])
    surface = ms.fit_loss_surface([(r["scaling_params"], r["tokens"], r["val_bpb"]) for r in done])
    plots = ms.plot_all(directory, args.mode, rows, trajectories, isoflop, power_law)
    markdown = ms.summary_markdown(args.name, args.mode, rows, isoflop, power_law, plots, directory, surface)
    with open(os.path.join(directory, "fits.json"), "w", encoding="utf-8") as f:
        json.dump({"isoflop": isoflop, "power_law": power_law, "loss_surface": surface}, f, indent=1)
    if surface:  # what base_train --time-budget --scaling-law=<this file> plans with (nanochat.planning.time_budget)
        law = {"name": args.name, "about": f"miniseries {args.name} ({len(done)} runs, {args.data_source or 'builtin'})",
               **surface, "aspect_ratio": args.aspect_ratio, "head_dim": args.head_dim}
        atomic_write_text(os.path.join(directory, "scaling_law.json"), json.dumps(law, indent=1) + "\n")
    get_report().log(section=f"Miniseries {args.name}", data=[markdown])
    print0(markdown)
    failed = [r["run"] for r in rows if r["status"] == "failed"]
    print0(f"miniseries {args.name}: {len(done)} of {len(rows)} runs done" +
           (f", failed: {', '.join(failed)} (rerun to retry them)" if failed else ""))
    print0(json.dumps({"miniseries": args.name, "mode": args.mode, "runs": rows, "isoflop": isoflop,
                       "power_law": power_law}))
    if failed:
        raise UserError(f"{len(failed)} run(s) failed: {', '.join(failed)}; their logs are in {directory}/runs/")


if __name__ == "__main__":
    run_main(main)
