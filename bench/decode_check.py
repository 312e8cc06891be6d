"""
Why captured decoding writes other tokens than eager decoding at 64 rows: the controls the GPU suite's decode section
runs (`gpu_check --suite --only decode`), for a bug to be told from bf16 rounding at near-ties.

Each configuration decodes the same prompts greedily and keeps, for every row, its tokens and the logits each of them
was chosen from. Two configurations are then compared row by row over the steps where they still agree: their inputs
are the same there (the prompt and the same tokens so far), so any difference in the logits is the arithmetic's. A
wrong capture (stale keys, another row's cache) shows as logits far apart; rounding as differences of bf16's size,
the same as two eager runs at different row counts (other kernels, no capture) have between them. The pairs:

    eager     vs captured   what a server would see
    eager     vs static     the static step run eagerly: what the padded shapes and masks change alone
    static    vs captured   the graphs against their own arithmetic uncaptured: should agree, logits and tokens
    eager 64  vs eager 16   the control no capture is in: eager with more rows, on the first 16 prompts
    eager     vs captured   in fp32: rounding near-ties that far down should not flip

Without CUDA, "captured" runs the static step eagerly (nanochat/kernels/decode_graphs.py's CapturedDecode says so)
and the pairs still run, on the CPU.
"""

import copy
import os

import torch


def decode_greedily(model, tokenizer, prompts, max_tokens, decode, rows):
    """tokens [rows][steps] and the logits each was chosen from [rows][steps] (fp32, on the CPU) of greedy decoding
    of prompts[:rows] on a BatchEngine of `rows` rows in the given decode mode."""
    from nanochat.engine import BatchEngine, Sampling
    from nanochat.kernels.decode_graphs import use_decode

    engine = BatchEngine(model, tokenizer, max_batch=rows)
    use_decode(engine, decode)
    seqs = [engine.add(prompt, Sampling(temperature=0.0, max_tokens=max_tokens)) for prompt in prompts[:rows]]
    tokens, logits = {id(s): [] for s in seqs}, {id(s): [] for s in seqs}
    # the logits a row's next token will be chosen from, kept before the step that samples it; a reply's first token
    # is chosen in the step that prefills its prompt (not a decode step: None)
    ready = {}
    while engine.busy():
        for seq in seqs:
            if seq.logits is not None:
                ready[id(seq)] = seq.logits[0].float().cpu()
        for seq, token, _ in engine.step():
            tokens[id(seq)].append(token)
            logits[id(seq)].append(ready.pop(id(seq), None))
    return [tokens[id(s)] for s in seqs], [logits[id(s)] for s in seqs]


def compare(first, second):
    """Row by row over the steps both agree on: {"rows", "same_rows", "median_max_diff", "max_diff", "flips_at_margin"}
    with max_diff the largest |logit difference| of a row's agreeing steps (their median and max over rows), and
    flips_at_margin, for each row that diverges, the top-2 margin of the first one's logits where it does."""
    (tokens_a, logits_a), (tokens_b, logits_b) = first, second
    rows = min(len(tokens_a), len(tokens_b))
    diffs, margins, same = [], [], 0
    for r in range(rows):
        steps = min(len(tokens_a[r]), len(tokens_b[r]))
        first_diff = next((i for i in range(steps) if tokens_a[r][i] != tokens_b[r][i]), None)
        agreeing = steps if first_diff is None else first_diff + 1  # the diverging step's inputs were still the same
        row_diff = max(((logits_a[r][i] - logits_b[r][i]).abs().max().item() for i in range(agreeing)
                        if logits_a[r][i] is not None and logits_b[r][i] is not None), default=0.0)
        diffs.append(row_diff)
        if first_diff is None and len(tokens_a[r]) == len(tokens_b[r]):
            same += 1
        elif first_diff is not None and logits_a[r][first_diff] is not None:
            top2 = logits_a[r][first_diff].topk(2).values
            margins.append(round((top2[0] - top2[1]).item(), 5))
    ordered = sorted(diffs)
    return {"rows": rows, "same_rows": same, "median_max_diff": ordered[len(ordered) // 2] if ordered else 0.0,
            "max_diff": ordered[-1] if ordered else 0.0, "flips_at_margin": sorted(margins)}


def decode_controls(model, tokenizer, prompts, max_tokens, rows, control_rows):
    """The five comparisons of the module docstring at `rows` rows (control: the first `control_rows`), as
    {pair name: compare(...)}. The fp32 pair sets NANOCHAT_DTYPE for its runs and puts it back."""
    runs = {mode: decode_greedily(model, tokenizer, prompts, max_tokens, mode, rows)
            for mode in ("eager", "captured", "static")}
    fewer = decode_greedily(model, tokenizer, prompts, max_tokens, "eager", control_rows)
    results = {"eager_vs_captured": compare(runs["eager"], runs["captured"]),
               "eager_vs_static": compare(runs["eager"], runs["static"]),
               "static_vs_captured": compare(runs["static"], runs["captured"]),
               f"eager_{rows}_vs_eager_{control_rows}": compare(runs["eager"], fewer)}
    saved = os.environ.get("NANOCHAT_DTYPE")
    os.environ["NANOCHAT_DTYPE"] = "float32"  # autocast and the KV cache read it at every call
    model32 = copy.deepcopy(model).float()  # bf16 tables and, on a CPU, prepare_for_inference's bf16 weights too
    try:
        fp32 = {mode: decode_greedily(model32, tokenizer, prompts, max_tokens, mode, rows) for mode in ("eager", "captured")}
    finally:
        if saved is None:
            os.environ.pop("NANOCHAT_DTYPE")
        else:
            os.environ["NANOCHAT_DTYPE"] = saved
    results["eager_vs_captured_fp32"] = compare(fp32["eager"], fp32["captured"])
    return results


def describe(name, result):
    """One row's words: 'eager vs captured: 17/64 rows the same; logits apart by 0.031 (median) / 0.094 (max) where
    they agree; diverged at top-2 margins 0.001-0.12'."""
    line = (f"{result['same_rows']}/{result['rows']} rows the same; logits apart by {result['median_max_diff']:.3g} "
            f"(median) / {result['max_diff']:.3g} (max) where they agree")
    if result["flips_at_margin"]:
        line += f"; diverged at top-2 margins {result['flips_at_margin'][0]:.3g}-{result['flips_at_margin'][-1]:.3g}"
    return f"{name.replace('_vs_', ' vs ').replace('_', ' ')}: {line}"
