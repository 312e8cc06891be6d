"""
`bench estimate`: the time to GPT-2's CORE on one 8xH100 node, estimated from the parts a GPU lease measured (a
`gpu_check --suite` results file: the d24 step's forward, backward and optimizer on one GPU), next to the record's
1.65 h (karpathy/nanochat's leaderboard: d24, 8 tokens per parameter, fp8, 2^20-token steps). Nothing here is timed:
each row is arithmetic on measured numbers and the assumptions below, printed with them.

    one step on 8 GPUs = its micro-steps' forward + backward (the step's tokens / 8 GPUs, at the measured per-token
                         time) + the optimizer + the gradients' reduce-scatter and the parameters' all-gather
    the run            = steps x one step + the val evaluations during training (forward only, every 250 steps)

Best and worst case: the optimizer split evenly over the 8 ranks and the collectives hidden behind it, or the
optimizer as slow as on one GPU and every collective exposed. Not priced: start-up and compiles, CORE during training,
the data loader (measured at 0.1-0.2 ms of a step).

Muon options the lease did not run (the gpu preset's muoneq, muon_plus) are priced as what they add: whole passes over
the Muon matrices in fp32 at the H100's memory bandwidth, on one GPU in the worst case and split over 8 in the best.
fp8 is a parameter: --fp8-speedup S divides the forward+backward (and the evaluations) by S, the bf16 time over the
fp8 time as gpu_check measures the whole d24 micro-step (default: the lease's own ratio, when it measured ours). Each
bf16 row also says the S its best / worst case needs to end within the record's 1.65 h ("never" where the optimizer
and collectives alone take longer). That the run reaches GPT-2's CORE at its tokens is the recipe's claim, not priced.
"""

import glob
import os

from bench.common import emit_json, print_table
from nanochat.common import UserError, json_load_file

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD_HOURS = 1.65  # karpathy/nanochat's leaderboard, entry 6 (2026-03-14): CORE 0.2626 against GPT-2's 0.2565
GPUS = 8
# The H100's step against the H200's: the same bf16 peak, less memory bandwidth. Measured: gpu_check's d12 base_train,
# 551,946 tok/s on an H200 (c2af0e1) and 498,052 on an H100 (f6dba28), 2026-11-26 (BENCHMARKS.md "GPU")
H100_OVER_H200 = 551_946 / 498_052
# NCCL's reduce-scatter and all-gather bus bandwidth inside one NVLink-4 node of 8 H100s: an assumption (nccl-tests on
# such nodes report ~350-480 GB/s), the lower end taken
BUS_BYTES_PER_S = 360e9
GRADIENT_BYTES = 4  # fp32 gradients and parameters travel (the model keeps fp32 weights under bf16 autocast)
EVAL_EVERY, EVAL_BATCHES = 250, 20  # the gpu preset's val bpb: every 250 steps, 20 x 2^19 tokens
# The gpu preset's base_train (speedrun.sh; a test keeps them in step): tokens per parameter, tokens a step, the Muon
# options beyond base_train's default set
PRESET_TOKENS_PER_PARAM, PRESET_BATCH, PRESET_MUON_OPTIONS = 10, 2**19, ()
HBM_BYTES_PER_S = 3.35e12  # an H100 SXM's memory bandwidth (data sheet)
# Whole fp32 passes over the stacked Muon matrices each option adds (nanochat.optim._update_matrices): MuonEq reads
# them for the row norms, then reads and writes them divided; Muon+ reads them for the norm, then reads and writes them
OPTION_PASSES = {"muoneq": 3, "muon_plus": 3}


def newest_results():
    """The newest suite results file under dev/gpu_results/ that holds our d24 step."""
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "dev", "gpu_results", "*.json")), reverse=True):
        try:
            read_results(path)
            return path
        except UserError:  # another section's results, or a file cut short: the next older one
            continue
    raise UserError("no results file in dev/gpu_results/ holds a d24 step: give --results, from a GPU lease's "
                    "`python -m scripts.gpu_check --suite --only train`")


def read_results(path):
    try:
        suite = json_load_file(path)["gpu_suite"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{path} is not a gpu_check --suite results file ({e}): give one from dev/gpu_results/") from None
    if "ours_d24" not in suite["results"] or "breakdown_ms" not in suite["results"]["ours_d24"]:
        raise UserError(f"{path} has no measured d24 step (ours_d24): give a results file of "
                        "`gpu_check --suite --only train`")
    return suite


def step_parts(run, h100_factor):
    """(ms of forward+backward per token, ms of forward per token, ms of one optimizer step) on one H100."""
    phases, tokens = run["breakdown_ms"], run["device_batch_size"] * run["seq_len"]
    return ((phases["forward"] + phases["backward"]) / tokens * h100_factor, phases["forward"] / tokens * h100_factor,
            phases["optimizer"] * h100_factor)


def estimate(label, run, params, tokens_per_param, batch_tokens, h100_factor, fp8_speedup=1.0, extra_optimizer_ms=0.0):
    """One row: the run's tokens and steps, a step on 8 GPUs and the whole run, best and worst case; the forward and
    backward divided by fp8_speedup, extra_optimizer_ms (on one GPU) added to the measured optimizer; and the fp8
    speedup each case needs to end within the record's time (None: never)."""
    per_token, forward_per_token, optimizer = step_parts(run, h100_factor)
    optimizer += extra_optimizer_ms
    tokens = tokens_per_param * params
    steps = round(tokens / batch_tokens)
    compute = batch_tokens / GPUS * per_token  # ms: each GPU's share of the step's tokens, in bf16
    collectives = 2 * run["params"] * GRADIENT_BYTES * (GPUS - 1) / GPUS / BUS_BYTES_PER_S * 1000
    rest = [optimizer / GPUS, optimizer + collectives]  # best, worst: what fp8 does not shorten
    evals = (steps // EVAL_EVERY + 1) * EVAL_BATCHES * 2**19 / GPUS * forward_per_token / 1000  # seconds, in bf16
    step_ms = [compute / fp8_speedup + r for r in rest]
    hours = [(steps * ms / 1000 + evals / fp8_speedup) / 3600 for ms in step_ms]
    budget_s = [RECORD_HOURS * 3600 - steps * r / 1000 for r in rest]  # what the record leaves the forward+backward
    needed = [] if run.get("fp8") else [(steps * compute / 1000 + evals) / b if b > 0 else None for b in budget_s]
    return {"run": label, "tokens": tokens, "steps": steps, "step_ms": step_ms, "collectives_ms": collectives,
            "eval_s": evals / fp8_speedup, "fp8_speedup": fp8_speedup, "extra_optimizer_ms": extra_optimizer_ms,
            "hours": hours, "over_record": [h / RECORD_HOURS for h in hours], "fp8_needed": needed}


def options_ms(options, muon_params):
    """ms one GPU spends on the Muon options' extra passes over all the Muon matrices."""
    return sum(OPTION_PASSES[name] for name in options) * muon_params * 4 / HBM_BYTES_PER_S * 1000


def cmd_estimate(args):
    from nanochat.recipe import DEFAULT_COMPONENTS, depth_recipe, split_components

    path = args.results or newest_results()
    suite = read_results(path)
    results, machine = suite["results"], suite["machine"]
    h100_factor = 1.0 if "H100" in machine else H100_OVER_H200
    model_components, _ = split_components(DEFAULT_COMPONENTS)
    recipe = depth_recipe(24, 32768, 2048, 2**19, num_iterations=1, components=model_components)
    params, c = recipe.scaling_params, recipe.model_config
    muon_params = c.n_layer * 12 * c.n_embd**2  # each block: q, k, v, o (n_embd^2 each) and the MLP's 2 x 4 n_embd^2
    measured_fp8 = None
    if "breakdown_ms" in results.get("ours_fp8_d24", {}):
        bf16, fp8 = results["ours_d24"]["breakdown_ms"], results["ours_fp8_d24"]["breakdown_ms"]
        measured_fp8 = (bf16["forward"] + bf16["backward"]) / (fp8["forward"] + fp8["backward"])
    if args.fp8_speedup is not None and args.fp8_speedup <= 0:
        raise UserError(f"--fp8-speedup must be > 0 (got {args.fp8_speedup:g})")
    speedup = args.fp8_speedup or measured_fp8 or 1.0
    extra = options_ms(PRESET_MUON_OPTIONS, muon_params)
    preset = (f"d24, {PRESET_TOKENS_PER_PARAM:g} tokens/param, 2^{PRESET_BATCH.bit_length() - 1}-token steps"
              + "".join(f" +{name}" for name in PRESET_MUON_OPTIONS))
    ours = results["ours_d24"]
    rows = [estimate(f"ours, the gpu preset: {preset}, bf16", ours, params, PRESET_TOKENS_PER_PARAM, PRESET_BATCH,
                     h100_factor, extra_optimizer_ms=extra),
            estimate(f"the same, fp8 at {speedup:.2f}x bf16's forward+backward"
                     f"{' (measured)' if speedup == measured_fp8 else ''}", ours, params, PRESET_TOKENS_PER_PARAM,
                     PRESET_BATCH, h100_factor, fp8_speedup=speedup, extra_optimizer_ms=extra),
            estimate("ours at the record's run: d24, 8 tokens/param, 2^20-token steps, bf16", ours, params, 8, 2**20,
                     h100_factor)]
    if (PRESET_TOKENS_PER_PARAM, PRESET_BATCH, PRESET_MUON_OPTIONS) != (10, 2**19, ()):
        rows.insert(2, estimate("the gpu preset before 2026-12-06: d24, 10 tokens/param, 2^19-token steps, bf16", ours,
                                params, 10, 2**19, h100_factor))
    if measured_fp8:
        rows.append(estimate("the same with our fp8 (measured)", results["ours_fp8_d24"], params, 8, 2**20, h100_factor))
    if "breakdown_ms" in results.get("reference_d24", {}):
        rows.append(estimate("the reference's step at the record's run, bf16 (its fp8 not measured)",
                             {**results["reference_d24"], "params": ours["params"]}, params, 8, 2**20, h100_factor))
    print(f"estimate | from {os.path.relpath(path, REPO_ROOT)} ({machine}, {suite['commit']}); one H100 = one "
          f"{'H100 as measured' if h100_factor == 1 else f'H200 x {h100_factor:.3f}'}; collectives at "
          f"{BUS_BYTES_PER_S / 1e9:.0f} GB/s bus bandwidth; d24 scaling params {params:,}; "
          + (f"the Muon options {'+'.join(PRESET_MUON_OPTIONS)} priced at {extra:.1f} ms a step on one GPU "
             f"({HBM_BYTES_PER_S / 1e12:.2f} TB/s)" if PRESET_MUON_OPTIONS else "no Muon options beyond the defaults"))

    def needed(r):
        if r["fp8_speedup"] != 1.0 or not r["fp8_needed"]:  # a row already in fp8
            return ""
        return "-".join("never" if s is None else f"{s:.2f}x" for s in r["fp8_needed"])

    print_table("The time to GPT-2's CORE on one 8xH100 node, estimated", ["run", "tokens", "steps",
                "a step on 8xH100, best-worst", "hours, best-worst", "x the record's 1.65 h", "fp8 needed for 1.65 h"],
                [[r["run"], f"{r['tokens'] / 1e9:.2f}B", f"{r['steps']:,}",
                  f"{r['step_ms'][0]:.0f}-{r['step_ms'][1]:.0f} ms", f"{r['hours'][0]:.2f}-{r['hours'][1]:.2f}",
                  f"{r['over_record'][0]:.2f}-{r['over_record'][1]:.2f}", needed(r)] for r in rows])
    emit_json({"bench": "estimate", "results": os.path.relpath(path, REPO_ROOT), "machine": machine,
               "commit": suite["commit"], "h100_factor": h100_factor, "bus_bytes_per_s": BUS_BYTES_PER_S,
               "scaling_params": params, "muon_params": muon_params, "options_ms": extra,
               "measured_fp8_speedup": measured_fp8, "record_hours": RECORD_HOURS, "rows": rows})
