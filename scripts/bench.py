"""
Benchmarks for the numbers in BENCHMARKS.md: the training step, the dataloader, the tokenizer, inference, serving,
quality, time budgets.

    python -m scripts.bench train          # CPU: d4/T=256/B=8 and d6/T=512/B=8, eager and compiled
    python -m scripts.bench train --depth=20 --seq-len=2048 --device-batch-size=32 --compile=1   # a GPU
    python -m scripts.bench train --depth=4 --seq-len=256 --device-batch-size=8 --compile=0 --alternate  # what the default set costs
    python -m scripts.bench memory --depth=6 --seq-len=512   # peak memory of a bf16 step on the CPU, ours and the reference's
    python -m scripts.bench dataloader     # packing speed, cropped fraction, time a step waits for data
    python -m scripts.bench tokenizer      # tok_train chars/s, encode MB/s on 1 and all threads
    python -m scripts.bench engine         # inference: prefill, decode at batch 1 and 16, naive recompute loop
    python -m scripts.bench int8 -i sft    # a CPU: weights, greedy agreement and decode speed in fp32, bf16 and int8
    python -m scripts.bench quality --data-source=brown --lr-mults 0.25 0.5 1 2   # val bpb of short runs, real text
    python -m scripts.bench quality --data-source=brown --variants base smear value_embeds,normuon   # recipe components
    python -m scripts.bench kernels        # a GPU: fp8 linear and sliding-window attention, numerics and speed
    python -m scripts.bench import --depth=20   # scripts.import_model on a d20 karpathy/nanochat checkpoint: time, memory
    python -m scripts.bench serve -i sft --max-batch 1 64   # chat_web under 1..64 concurrent openai clients
    python -m scripts.bench serve --fresh --lm-eval --concurrency 1 8   # lm-evaluation-harness against chat_web
    python -m scripts.bench serve --fresh --scoring          # the largest scoring request beside a stream
    python -m scripts.bench budget --budgets 2m 5m 10m     # base_train --time-budget: plan, time, predicted vs val bpb
    python -m scripts.bench wordings -i sft                # held-out WorldQA per question wording (the dev split)
    python -m scripts.bench estimate                       # the time to GPT-2's CORE on 8xH100, from a lease's parts

Each subcommand prints a table and then, as the last line of stdout, one line of JSON
({"bench": ..., ...}) for scripts to read. Nothing here asserts a speed.

`train` times the real base_train step: DataLoader -> training.train_step with the Muon + AdamW
optimizers from training.build_optimizers (grad_accum = 1). MFU is model FLOPs (estimate_flops)
per second over a peak: on a GPU in bf16 the data-sheet number (common.get_peak_flops), elsewhere
an fp32 matmul measured in this same process before and after the run (the higher kept). Where
the peak is measured, a short probe of it also follows every timed step, and "MFU interleaved"
divides by the median probe: on a shared VM both speeds swing by 20-30 % from minute to minute,
and this ratio swings far less. Every (config, compile) run goes in a fresh process of its own,
so its peak RSS is its own.

Data: the current base dir ($NANOCHAT_BASE_DIR or ~/.cache/nanochat) is used when it holds a
tokenizer no bigger than --vocab-size and training shards; otherwise a built-in corpus and a
4096-token tokenizer are built once in <tmp>/nanochat_bench and reused.
"""

import argparse

from bench import (budget, dataloader, engine, estimate, importing, int8, kernels, memory, quality, serve, tokenizer, train,
                   wordings)
from bench.common import BENCH_TOKENIZER_VOCAB
from nanochat.common import RenamedFlag, UserError, run_main  # noqa: F401 (UserError: what a bad flag raises, for callers)

# -----------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Benchmarks: training step / MFU, dataloader, tokenizer, inference, serving, "
                                            "quality.")
    sub = p.add_subparsers(dest="command", required=True)
    add_training_benchmarks(sub)
    add_inference_benchmarks(sub)
    add_quality_benchmark(sub)
    b = sub.add_parser("budget", help="base_train --time-budget: plan, wall time, predicted against measured val bpb")
    b.add_argument("--budgets", nargs="+", default=["2m", "5m", "10m"], help="one run each, one after another")
    b.add_argument("--base-dir", default="", help="a base dir with data and a tokenizer (default: the built-in corpus "
                   "and a 4,096-token tokenizer, built in the work dir)")
    b.add_argument("--data-source", default="", help="base_train --data-source (default: builtin)")
    b.add_argument("--work-dir", default="", help="where the runs go (default: the temp dir)")
    b.add_argument("--device-type", default="", help="cuda|cpu (default: autodetect)")
    w = sub.add_parser("wordings", help="a chat model's held-out WorldQA per question wording (dev split: tune on it)")
    w.add_argument("-i", "--source", default="sft", choices=["mid", "sft", "rl"], help="which stage's model")
    w.add_argument("-g", "--model-tag", default=None, help="checkpoint tag (default: the latest)")
    w.add_argument("--split", default="dev", choices=["dev", "eval"], help="eval: for reporting, not for choosing a change")
    w.add_argument("--max-new-tokens", type=int, default=48)
    w.add_argument("--device-type", default="", help="cuda|cpu (default: autodetect)")
    s = sub.add_parser("estimate", help="the time to GPT-2's CORE on one 8xH100 node, from a GPU lease's measured parts")
    s.add_argument("--results", default="", help="a gpu_check --suite results file (default: the newest in "
                   "dev/gpu_results/ with a d24 step)")
    s.add_argument("--fp8-speedup", type=float, default=None, help="fp8's speedup of the forward+backward over bf16 "
                   "(default: the results file's measured ratio, else 1)")
    return p.parse_args(argv)


def add_training_benchmarks(sub):
    t = sub.add_parser("train", help="time the real base_train step")
    t.add_argument("--depth", type=int, default=0, help="model depth (default: the two standard configs)")
    t.add_argument("--seq-len", type=int, default=0)
    t.add_argument("--device-batch-size", type=int, default=0)
    t.add_argument("--compile", default="both", choices=["0", "1", "both"], help="torch.compile the model")
    t.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    t.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    t.add_argument("--breakdown-steps", type=int, default=5, help="extra instrumented steps for the phase breakdown")
    t.add_argument("--peak-seconds", type=float, default=1.0, help="length of each of the 3 peak-matmul timings")
    t.add_argument("--probe-seconds", type=float, default=0.2,
                   help="peak-matmul probe after every timed step, for the interleaved MFU (0: none)")
    t.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch's default)")
    t.add_argument("--fp8", default="", choices=["", "ours", "torchao"],
                   help="the blocks' matmuls in fp8: base_train's --fp8 (ours) or torchao's float8 training")
    t.add_argument("--components", nargs="+", default=["none", "default"],
                   help="recipes to time, each a comma list of components, 'none' (the plain recipe) or 'default' "
                        "(base_train's default set); default: both")
    t.add_argument("--alternate", action="store_true",
                   help="take the recipes' steps in turn in one process and report each one's tok/s against the first's "
                        "(what a recipe costs, without the machine's drift between runs)")
    t.add_argument("--compile-cache", default="", metavar="FILE",
                   help="a portable compile cache: loaded before the first compile if FILE exists, saved after the warm-up")
    t.add_argument("--warmup-only", action="store_true", help="stop after the warm-up steps (and the cache's save)")
    t.add_argument("--profile", default="", metavar="STEM",
                   help="after the timed steps: a profile of two steps and a step's peak memory, reduced, to STEM.txt/.json")

    r = sub.add_parser("memory", help="peak memory of one bf16 training step on the CPU, by category: ours against the "
                       "reference project's (.reference), each in a fresh process")
    r.add_argument("--depth", type=int, default=6)
    r.add_argument("--seq-len", type=int, default=512)
    r.add_argument("--device-batch-size", type=int, default=8)
    r.add_argument("--vocab-size", type=int, default=32768)
    r.add_argument("--components", default="default", help="our recipe's components: 'default' (base_train's), 'none' "
                   "or a comma list")
    r.add_argument("--window-pattern", default="L", help="the reference's (L: full context, as ours by default)")
    r.add_argument("--compile", type=int, default=0, choices=[0, 1], help="torch.compile both models (inductor)")
    r.add_argument("--reference", default="", help="the reference's checkout (default: .reference in the repository)")

    d = sub.add_parser("dataloader", help="packing throughput, cropped fraction, data wait")
    d.add_argument("--tokens", type=int, default=1_000_000, help="tokens per throughput / crop measurement")
    d.add_argument("--depth", type=int, default=4, help="model for the data-wait measurement")
    d.add_argument("--seq-len", type=int, default=256)
    d.add_argument("--device-batch-size", type=int, default=8)
    d.add_argument("--steps", type=int, default=20, help="instrumented training steps for the data wait")
    d.add_argument("--warmup", type=int, default=3)

    k = sub.add_parser("tokenizer", help="tok_train and encode speed")
    k.add_argument("--max-chars", type=int, default=10_000_000, help="text to train and encode on")
    k.add_argument("--repeats", type=int, default=3)

    for s in (t, d, k):
        s.add_argument("--vocab-size", type=int, default=0 if s is not k else BENCH_TOKENIZER_VOCAB,
                       help="model / tokenizer vocabulary (default 4096 on CPU, 32768 on CUDA)")
    for s in (t, d):
        s.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")


def add_inference_benchmarks(sub):
    e = sub.add_parser("engine", help="inference: prefill, decode at batch 1 and N, against a naive recompute loop")
    e.add_argument("--depth", type=int, default=4, help="depth of the random-init model (without --source)")
    e.add_argument("--seq-len", type=int, default=512, help="context of the random-init model")
    e.add_argument("--components", default="default",
                   help="recipe components of the random-init model: 'default' (base_train's), 'none' (plain) or a list")
    e.add_argument("--source", default="", help="time a checkpoint instead: base|mid|sft|rl")
    e.add_argument("--model-tag", default="", help="checkpoint tag (default: the latest)")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: the last)")
    e.add_argument("--prompt-tokens", type=int, default=128)
    e.add_argument("--new-tokens", type=int, default=256)
    e.add_argument("--batch", type=int, default=16, help="samples decoded together, compared with batch 1")
    e.add_argument("--temperature", type=float, default=1.0, help="for the decode rows (the naive comparison is greedy)")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--cached-lengths", type=int, nargs="+", default=[128, 512, 2048],
                   help="cache fill levels for the decode-step-by-length table")
    e.add_argument("--length-steps", type=int, default=30, help="decode steps timed per cache fill level")
    e.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch's default)")
    e.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")
    q = sub.add_parser("int8", help="a CPU: a checkpoint's weights, greedy agreement and decode step in fp32, bf16, int8")
    q.add_argument("-i", "--source", default="sft", choices=["base", "mid", "sft", "rl"])
    q.add_argument("-g", "--model-tag", default="", help="checkpoint tag (default: the latest)")
    q.add_argument("-s", "--step", type=int, default=None, help="checkpoint step (default: the last)")
    q.add_argument("--val-tokens", type=int, default=1000, help="teacher-forced val tokens the agreement counts")
    q.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="sequences decoded together, timed apart")
    q.add_argument("--steps", type=int, default=64, help="decode steps timed per round, after one untimed")
    q.add_argument("--rounds", type=int, default=7, help="rounds, each timing every variant in turn")
    q.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch's default)")
    g = sub.add_parser("kernels", help="fp8 linear and sliding-window attention against what they replace (a GPU)")
    g.add_argument("--square", type=int, default=8192, help="side of the square fwd+bwd linear timed in fp8 and bf16")
    g.add_argument("--seq-len", type=int, default=0, help="attention length (default 2048 on CUDA, 256 elsewhere)")
    g.add_argument("--repeats", type=int, default=20)
    g.add_argument("--device-type", default="", help="cuda|cpu (default: autodetect)")
    m = sub.add_parser("import", help="scripts.import_model's time and peak memory on a karpathy/nanochat checkpoint")
    m.add_argument("--depth", type=int, default=20, help="depth of the source model (width 64 x depth, head dim 128)")
    m.add_argument("--vocab-size", type=int, default=32768)
    m.add_argument("--seq-len", type=int, default=2048)
    m.add_argument("--repeats", type=int, default=2, help="imports timed, each into a fresh base dir")
    m.add_argument("--work-dir", default="", help="where the source and the imports go (default: the temp dir)")
    v = sub.add_parser("serve", help="chat_web under concurrent openai clients: tok/s, first-token and total latency")
    v.add_argument("-i", "--source", default="sft", choices=["base", "mid", "sft", "rl"], help="which stage's model")
    v.add_argument("-g", "--model-tag", default=None, help="checkpoint tag (default: the latest)")
    v.add_argument("--fresh", action="store_true", help="serve a fresh random d4 instead of a checkpoint")
    v.add_argument("--max-batch", type=int, nargs="+", default=[1, 64], help="a server for each (1 = one at a time)")
    v.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="clients at once, per level")
    v.add_argument("--requests", type=int, default=32, help="requests per level (at least the concurrency)")
    v.add_argument("--seconds", type=float, default=120.0, help="no new request of a level starts after this")
    v.add_argument("--max-tokens", type=int, default=32, help="tokens per reply")
    v.add_argument("--threads", type=int, default=0, help="the server's torch threads (0 = chat_web's default)")
    v.add_argument("--decode", default="eager", choices=["eager", "captured"], help="chat_web's --decode")
    v.add_argument("--lm-eval", action="store_true", help="instead: lm-evaluation-harness's log-likelihood requests at "
                   "each --concurrency (requests/s), and a scoring request's cost against a generation's")
    v.add_argument("--lm-eval-items", type=int, default=100, help="multiple-choice items (x 4 requests each)")
    v.add_argument("--scoring", action="store_true", help="instead: the largest scoring request beside a streaming "
                   "client (its time and memory, /health's latency, the stream's gaps; --fresh: a 2,048-token d4)")
    v.add_argument("--hostile", nargs="*", choices=serve.HOSTILE_ATTACKS, default=None, metavar="ATTACK",
                   help="instead: one client's attacks (all, or those named: " + ", ".join(serve.HOSTILE_ATTACKS) +
                   "), each beside a neighbour's stream: /health's worst latency, the neighbour's tok/s beside against "
                   "alone (--fresh: a 2,048-token d2)")
    v.add_argument("--client-share", type=float, default=0.0, help="with --hostile: chat_web's --client-share (0: its "
                   "default)")


def add_quality_benchmark(sub):
    q = sub.add_parser("quality", help="val bpb after a short run of the CPU preset's geometry, on built-in or real text")
    q.add_argument("--data-source", default="builtin",
                   help="builtin, brown, or a source you imported (python -m nanochat.dataset import NAME ...)")
    q.add_argument("--source", dest="data_source", action=RenamedFlag, new="--data-source",
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    q.add_argument("--depth", type=int, default=4)
    q.add_argument("--seq-len", type=int, default=256)
    q.add_argument("--total-batch-size", type=int, default=2048, help="tokens per step")
    q.add_argument("--device-batch-size", type=int, default=8)
    q.add_argument("--steps", type=int, default=200)
    q.add_argument("--eval-at", type=int, nargs="+", default=[50, 100, 150], help="steps to measure val bpb at (and the last)")
    q.add_argument("--eval-tokens", type=int, default=65536)
    q.add_argument("--lr-mults", type=float, nargs="+", default=[1.0], help="multipliers of base_train's lrs")
    q.add_argument("--lr-groups", nargs="+", default=["embedding", "unembedding", "matrix"],
                   choices=["embedding", "unembedding", "matrix"], help="which lrs the multipliers scale (default: all three)")
    q.add_argument("--lr-batch-exponent", type=float, default=0.0)
    q.add_argument("--short-run-lrs", type=int, default=1, choices=[0, 1],
                   help="as base_train's (1: up to 2x the dial's lrs under 700 steps; 0: --lr-mults count in base lrs)")
    q.add_argument("--embedding-lr", type=float, default=-1.0, help="the embedding's base lr, before the dial's "
                   "short-run raise as base_train's 0.2 (-1 = that)")
    q.add_argument("--unembedding-lr", type=float, default=-1.0, help="the lm_head's base lr, likewise (-1 = 0.004)")
    q.add_argument("--weight-decay", type=float, default=-1.0, help="Muon weight decay (-1 = the dial's)")
    q.add_argument("--warmup-ratio", type=float, default=0.0)
    q.add_argument("--warmdown-ratio", type=float, default=0.4)
    q.add_argument("--final-lr-frac", type=float, default=0.0)
    q.add_argument("--variants", nargs="+", default=["base"],
                   help="recipe variants to compare, each 'base' (the plain model, whatever base_train's default) or a comma list of "
                   "components (base_train --components)")
    q.add_argument("--scalar-lr", type=float, default=-1.0, help="AdamW lr of the components' scalars (-1 = the default)")
    q.add_argument("--adam-betas", type=float, nargs=2, default=[0.8, 0.95], help="AdamW's beta1 beta2 (embedding, lm_head)")
    q.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    q.add_argument("--vocab-size", type=int, default=BENCH_TOKENIZER_VOCAB)


def main(argv=None):
    args = parse_args(argv)
    commands = {"train": train.cmd_train, "dataloader": dataloader.cmd_dataloader, "tokenizer": tokenizer.cmd_tokenizer,
                "engine": engine.cmd_engine, "int8": int8.cmd_int8, "kernels": kernels.cmd_kernels, "import": importing.cmd_import, "memory": memory.cmd_memory, "serve": serve.cmd_serve, "quality": quality.cmd_quality, "budget": budget.cmd_budget,
                "wordings": wordings.cmd_wordings, "estimate": estimate.cmd_estimate}
    commands[args.command](args)


if __name__ == "__main__":
    run_main(main)
