"""
`bench engine`: inference speed: prefill, decode at batch 1 and N, the cost of a decode step by cache length, and the KV-cache engine against a naive recompute loop.
"""

import statistics
import time

import torch

from bench.common import BENCH_TOKENIZER_VOCAB, OtherLoad, emit_json, ensure_data, machine_info, print_table
from nanochat.common import UserError, autocast_for, compute_init, get_compute_dtype, kv_cache_dtype
from nanochat.kernels.cpu import use_cpu_kernels


def engine_model(args, device):
    """(model, tokenizer, description): a checkpoint with --source, else a random-init model from the depth dial;
    with the CPU's kernels (on a CPU) and prepared for inference (GPT.prepare_for_inference) as chat_web and chat_cli
    serve it."""
    if args.source:
        from nanochat.checkpoint_manager import load_model

        model, tokenizer, meta = load_model(args.source, device, model_tag=args.model_tag or None, step=args.step)
        use_cpu_kernels(model, device)
        return model.prepare_for_inference(), tokenizer, f"{args.source}/{meta['model_tag']}"
    from nanochat.gpt import build_model
    from nanochat.tokenizer import get_tokenizer
    from nanochat.recipe import DEFAULT_COMPONENTS, depth_recipe, split_components

    ensure_data(BENCH_TOKENIZER_VOCAB)
    tokenizer = get_tokenizer()
    if tokenizer.get_vocab_size() > BENCH_TOKENIZER_VOCAB:
        raise UserError(f"the tokenizer in $NANOCHAT_BASE_DIR has more than {BENCH_TOKENIZER_VOCAB} tokens")
    model_components, _ = split_components(DEFAULT_COMPONENTS if args.components == "default" else args.components)
    recipe = depth_recipe(args.depth, BENCH_TOKENIZER_VOCAB, args.seq_len, 2048, num_iterations=1,
                          components=model_components)
    torch.manual_seed(42)
    named = ",".join(model_components) or "plain"
    model = use_cpu_kernels(build_model(recipe.model_config, device), device)
    return model.prepare_for_inference(), tokenizer, f"d{args.depth} random init ({named})"


def time_engine_run(engine, prompt, num_samples, max_tokens, temperature, sync):
    """Seconds from the call to each yielded step of engine.generate, and the tokens of row 0."""
    stamps, row0 = [], []
    t0 = time.perf_counter()
    for column, _ in engine.generate(prompt, num_samples=num_samples, max_tokens=max_tokens, temperature=temperature):
        sync()
        stamps.append(time.perf_counter() - t0)
        row0.append(column[0])
    return stamps, row0


def decode_step_ms(model, cached_len, batch, steps, device, sync):
    """ms per one-token forward with `cached_len` positions already in the cache (filled with noise, not a prompt)."""
    from nanochat.engine import RowKVCache

    c = model.config
    rows = list(range(batch))
    with torch.inference_mode(), autocast_for(device):
        cache = RowKVCache(batch, c.n_kv_head, cached_len + steps + 2, c.n_embd // c.n_head, c.n_layer, c.n_embd, device,
                           kv_cache_dtype(device))
        cache.k_cache.normal_()
        cache.v_cache.normal_()
        cache.last_embedding.normal_()  # what smear reads back at decode
        cache.lengths = [cached_len] * batch
        ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        model.forward(ids, kv_cache=cache.rows(rows))
        model.forward(ids, kv_cache=cache.rows(rows))
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            model.forward(ids, kv_cache=cache.rows(rows))
        sync()
    return (time.perf_counter() - t0) / steps * 1000


def cmd_engine(args):
    from nanochat.engine import Engine, RowKVCache

    if args.threads:
        torch.set_num_threads(args.threads)
    _, _, _, _, device = compute_init(args.device_type)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, tokenizer, description = engine_model(args, device)
    c = model.config
    if args.prompt_tokens + args.new_tokens > c.sequence_len:
        raise UserError(f"--prompt-tokens + --new-tokens = {args.prompt_tokens + args.new_tokens} exceeds the model's "
                        f"context of {c.sequence_len}")
    engine = Engine(model, tokenizer)
    # A random prompt of ordinary (non-special) tokens; the nine specials are the last ids of the vocabulary.
    rng = torch.Generator().manual_seed(0)
    ordinary = tokenizer.get_vocab_size() - 9
    prompt = [tokenizer.get_bos_token_id()] + torch.randint(0, ordinary, (args.prompt_tokens - 1,), generator=rng).tolist()
    time_engine_run(engine, prompt, 2, 8, 1.0, sync)  # warm up allocator and kernels

    with OtherLoad() as other:
        prefill_s = []
        for _ in range(args.repeats):
            with torch.inference_mode(), autocast_for(device):
                cache = RowKVCache(1, c.n_kv_head, len(prompt), c.n_embd // c.n_head, c.n_layer, c.n_embd, device,
                                   kv_cache_dtype(device))
                ids = torch.tensor([prompt], device=device)
                sync()
                t0 = time.perf_counter()
                model.forward(ids, kv_cache=cache.rows([0]))
                sync()
                prefill_s.append(time.perf_counter() - t0)

        decode = {}
        for batch in (1, args.batch):
            runs = [time_engine_run(engine, prompt, batch, args.new_tokens, args.temperature, sync)[0]
                    for _ in range(args.repeats)]
            per_run = []
            for stamps in runs:
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                per_run.append({"steps": len(stamps), "first_token_ms": stamps[0] * 1000,
                                "tok_per_s": batch * len(gaps) / sum(gaps), "step_ms_first32": 1000 * statistics.mean(gaps[:32]),
                                "step_ms_last32": 1000 * statistics.mean(gaps[-32:])})
            decode[batch] = {key: statistics.median(r[key] for r in per_run) for key in per_run[0]}

        # Greedy at batch 1, engine against recomputing the whole sequence for every new token.
        engine_greedy_s, engine_tokens = [], None
        for _ in range(args.repeats):
            stamps, engine_tokens = time_engine_run(engine, prompt, 1, args.new_tokens, 0.0, sync)
            engine_greedy_s.append(stamps[-1])
        naive_tokens = []
        ids = torch.tensor([prompt], device=device)
        t0 = time.perf_counter()
        with torch.inference_mode(), autocast_for(device):
            for _ in range(args.new_tokens):
                next_id = model.forward(ids)[:, -1].argmax(dim=-1, keepdim=True)
                naive_tokens.append(int(next_id))
                ids = torch.cat([ids, next_id], dim=1)
        naive_s = time.perf_counter() - t0

        by_length = {L: {batch: decode_step_ms(model, L, batch, args.length_steps, device, sync) for batch in (1, args.batch)}
                     for L in args.cached_lengths}

    engine_s = statistics.median(engine_greedy_s)
    # The engine stops at <|assistant_end|> or <|bos|>; the naive loop never does, so compare time per new token.
    speedup = (naive_s / len(naive_tokens)) / (engine_s / len(engine_tokens))
    same_tokens = engine_tokens == naive_tokens[:len(engine_tokens)]
    prefill_tok_s = len(prompt) / statistics.median(prefill_s)
    batch_gain = decode[args.batch]["tok_per_s"] / decode[1]["tok_per_s"]

    print_table(f"engine: {description} {c.n_layer}L/{c.n_embd}d, vocab {c.vocab_size}, context {c.sequence_len}, "
                f"{device.type}, {torch.get_num_threads()} threads, median of {args.repeats}",
                ["measure", "value"], [
                    ["prefill, batch 1", f"{len(prompt)} tokens, {prefill_tok_s:,.0f} tok/s"],
                    ["first-token latency, batch 1", f"{decode[1]['first_token_ms']:.1f} ms"],
                    [f"first-token latency, batch {args.batch}", f"{decode[args.batch]['first_token_ms']:.1f} ms"],
                    ["decode, batch 1", f"{decode[1]['tok_per_s']:,.0f} tok/s ({decode[1]['steps']:.0f} steps, T={args.temperature})"],
                    [f"decode, batch {args.batch}",
                     f"{decode[args.batch]['tok_per_s']:,.0f} tok/s ({decode[args.batch]['steps']:.0f} steps) = {batch_gain:.1f}x batch 1"],
                    ["greedy, engine (prefill + decode)", f"{len(engine_tokens)} tokens in {engine_s:.2f} s"],
                    ["greedy, naive full recompute", f"{len(naive_tokens)} tokens in {naive_s:.2f} s"],
                    ["engine speedup per new token", f"{speedup:.1f}x (same tokens: {'yes' if same_tokens else 'NO'})"],
                    ["other load", f"{other.cores:.2f} cores"],
                ])
    print_table("engine: one decode step (ms) by positions already cached (cache filled with noise)",
                ["cached", "batch 1", f"batch {args.batch}"],
                [[L, f"{v[1]:.2f}", f"{v[args.batch]:.2f}"] for L, v in by_length.items()])
    emit_json({"bench": "engine", "machine": machine_info(), "model": description, "model_config": vars(c),
               "device": device.type, "dtype": str(get_compute_dtype(device)).replace("torch.", ""),
               "threads": torch.get_num_threads(), "repeats": args.repeats, "prompt_tokens": len(prompt),
               "new_tokens": args.new_tokens, "temperature": args.temperature, "prefill_tok_per_s": prefill_tok_s,
               "decode": {str(b): d for b, d in decode.items()}, "batch_gain": batch_gain,
               "greedy_engine_s": engine_s, "greedy_engine_tokens": len(engine_tokens), "naive_s": naive_s,
               "naive_tokens": len(naive_tokens), "speedup_vs_naive": speedup, "same_tokens": same_tokens,
               "step_ms_by_cached_length": {str(L): {str(b): ms for b, ms in v.items()} for L, v in by_length.items()},
               "other_load_cores": other.cores})
