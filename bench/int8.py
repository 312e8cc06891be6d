"""
`bench int8`: a checkpoint's weights, its greedy next token and its decode step in fp32, bf16 and int8 (kernels/int8.py)
on a CPU, as chat_cli serves each: the weights' bytes against fp32's, the share of val tokens whose teacher-forced
argmax is fp32's, and ms a decode step at each row count, the variants taking turns within each round.
"""

import contextlib
import os
import statistics
import time

import torch

from bench.common import OtherLoad, emit_json, machine_info, print_table
from nanochat.checkpoint_manager import load_model
from nanochat.common import UserError
from nanochat.dataset import parquets_iter_batched
from nanochat.engine import BatchEngine, Sampling
from nanochat.kernels.cpu import use_cpu_kernels
from nanochat.kernels.int8 import quantize_int8, weight_bytes

VARIANTS = {"fp32": ("float32", False), "bf16": ("bfloat16", False), "int8 fp32": ("float32", True),
            "int8 bf16": ("bfloat16", True)}


@contextlib.contextmanager
def decoding_in(name):
    """NANOCHAT_DTYPE for a variant, while its model loads and prepares and its engine is built."""
    before = os.environ.get("NANOCHAT_DTYPE")
    os.environ["NANOCHAT_DTYPE"] = name
    try:
        yield
    finally:
        os.environ.pop("NANOCHAT_DTYPE") if before is None else os.environ.update(NANOCHAT_DTYPE=before)


def served_model(args, dtype, int8):
    with decoding_in(dtype):
        model, tokenizer, meta = load_model(args.source, "cpu", model_tag=args.model_tag or None, step=args.step)
        use_cpu_kernels(model, "cpu")
        model.prepare_for_inference()
        return (quantize_int8(model) if int8 else model), tokenizer, meta


def val_rows(tokenizer, context, tokens):
    """(rows, context) val tokens, documents after a BOS each, enough for `tokens` teacher-forced predictions."""
    rows = -(-(tokens + 1) // context)
    stream = []
    for texts in parquets_iter_batched("val"):
        for ids in tokenizer.encode(texts, prepend=tokenizer.get_bos_token_id()):
            stream.extend(ids)
        if len(stream) >= rows * context:
            return torch.tensor(stream[:rows * context]).view(rows, context)
    raise UserError(f"the val split holds fewer than {rows * context} tokens: ask for fewer --val-tokens")


def greedy_tokens(model, dtype, ids, tokens):
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
    with torch.inference_mode(), autocast:
        return model(ids).argmax(-1).flatten()[:tokens]


def decode_engine(model, tokenizer, dtype, rows, steps):
    """A BatchEngine with `rows` greedy sequences past their prompt, none of which stops before `steps` more."""
    with decoding_in(dtype):
        engine = BatchEngine(model, tokenizer, rows)
    never_stop = {token: -1e4 for token in engine.ids.terminals}
    for row in range(rows):
        engine.add([tokenizer.get_bos_token_id(), 100 + row], Sampling(temperature=0.0, max_tokens=steps + 2,
                                                                      logit_bias=never_stop))
    engine.step()
    return engine


def cmd_int8(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {name: served_model(args, *variant) for name, variant in VARIANTS.items()}
    reference, tokenizer, meta = models["fp32"]
    context = reference.config.sequence_len
    if max(args.rows) > 64 or 2 + args.steps >= context:
        raise UserError(f"--steps {args.steps} must leave room in the model's context ({context}), --rows at most 64")
    ids = val_rows(tokenizer, context, args.val_tokens)
    fp32_bytes, expected = 4 * reference.num_params(), greedy_tokens(reference, "float32", ids, args.val_tokens)
    seconds = {(name, rows): [] for name in models for rows in args.rows}
    with OtherLoad() as load:
        for _ in range(args.rounds):
            for name, rows in seconds:
                model, _, _ = models[name]
                engine = decode_engine(model, tokenizer, VARIANTS[name][0], rows, args.steps)
                started = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                seconds[name, rows].append((time.perf_counter() - started) / args.steps)
    results = []
    for name, (model, _, _) in models.items():
        dtype = VARIANTS[name][0]
        agreement = (greedy_tokens(model, dtype, ids, args.val_tokens) == expected).float().mean().item()
        timing = {rows: (min(seconds[name, rows]), statistics.median(seconds[name, rows])) for rows in args.rows}
        results.append({"variant": name, "weight_bytes": weight_bytes(model), "of_fp32": weight_bytes(model) / fp32_bytes,
                        "agreement": agreement, "ms_per_step": {rows: [1e3 * s for s in t] for rows, t in timing.items()}})
    print_table(f"{args.source} '{meta['model_tag']}' step {meta['step']}: {reference.num_params() / 1e6:.2f}M params, "
                f"{args.val_tokens:,} val tokens, {args.rounds} rounds of {args.steps} decode steps "
                f"(other processes used {load.cores:.2f} cores meanwhile)",
                ["variant", "weights MiB", "x fp32", "next token = fp32's"]
                + [f"ms a step at {rows} row(s): best / median" for rows in args.rows],
                [[r["variant"], f"{r['weight_bytes'] / 2**20:.1f}", f"{r['of_fp32']:.3f}", f"{100 * r['agreement']:.1f} %"]
                 + [f"{best:.2f} / {median:.2f}" for best, median in r["ms_per_step"].values()] for r in results])
    emit_json({"bench": "int8", "source": args.source, "tag": meta["model_tag"], "step": meta["step"],
               "other_cores": load.cores, "machine": machine_info(), "results": results})
