"""
`bench quality`: val bits per byte after a short from-scratch run of base_train's recipe (all three lrs times a multiplier),
on the built-in corpus, the Brown corpus or a source you imported. With --variants it is the ablation bench of the recipe's
optional components: each variant (a set of base_train --components) trained with the same seeds, its val bpb, its FLOPs
per token against the plain model's, and its speed.
"""

import hashlib
import os
import tempfile
import time

import torch

from bench.common import emit_json, holds_training_data, log, machine_info, print_table
from nanochat.common import UserError, autocast_for, get_base_dir, get_compute_dtype, json_load_file


def quality_data(source, vocab_size):
    """Point NANOCHAT_BASE_DIR at <tmp>/nanochat_bench_quality/<source>, with the source's shards and a tokenizer
    trained on them (built once, then reused)."""
    from nanochat.dataset import get_data_dir, get_source, parquets_iter_batched
    from nanochat.tokenizer import RustBPETokenizer

    src = get_source(source)  # a built-in source, or one imported into the current base dir
    os.environ["NANOCHAT_DATA_SOURCE"] = source
    current = os.environ.get("NANOCHAT_BASE_DIR")
    if current and holds_training_data(current, vocab_size):  # a base dir that already holds this source and a tokenizer
        return current
    from nanochat.data.brown import LAYOUT  # one directory per Brown layout: a changed layout never reuses old shards
    name = f"brown-{LAYOUT}" if source == "brown" else source
    imported_dir = None
    if source not in ("builtin", "brown"):  # your own data: its shards, linked, with a tokenizer of the bench's size
        imported_dir = os.path.join(get_base_dir(), "base_data", src.name)
        created = json_load_file(os.path.join(imported_dir, "import.json"))["created"]
        name = f"{source}-{hashlib.sha256(f'{imported_dir} {created}'.encode()).hexdigest()[:10]}"
    base = os.path.join(tempfile.gettempdir(), "nanochat_bench_quality", name)
    os.environ["NANOCHAT_BASE_DIR"] = base
    if holds_training_data(base, vocab_size):
        return base
    log(f"building the {source} source and a {vocab_size}-token tokenizer in {base}")
    if source == "builtin":
        from nanochat.corpus.build import write_corpus

        write_corpus(get_data_dir("builtin"), seed=42, size_mb=6.0, verbose=False)
    elif source == "brown":
        from nanochat.data.brown import write_brown

        write_brown()
    else:
        os.makedirs(os.path.join(base, "base_data"), exist_ok=True)
        link = os.path.join(base, "base_data", source)
        if not os.path.islink(link):
            os.symlink(imported_dir, link)
    texts = (t for batch in parquets_iter_batched("train", source=source) for t in batch)
    RustBPETokenizer.train_from_iterator(texts, vocab_size).save(os.path.join(base, "tokenizer"))
    return base


def quality_run(args, seed, lr_mult, variant="base"):
    """Train from scratch with base_train's recipe (all three lrs times lr_mult, the variant's components on);
    val bpb at each --eval-at step."""
    from nanochat.dataloader import DataLoader, eval_batches
    from nanochat.gpt import build_model
    from nanochat.kernels.cpu import use_cpu_kernels
    from nanochat.loss_eval import evaluate_bpb
    from nanochat.tokenizer import get_token_bytes, get_tokenizer
    from nanochat.recipe import BASE_LRS, SCALAR_LR, build_optimizers, depth_recipe, grad_accum_steps, split_components
    from nanochat.optim import lr_multiplier, muon_momentum
    from nanochat.loop import train_step

    tokenizer = get_tokenizer()
    model_components, optimizer_components = split_components("" if variant == "base" else variant)
    recipe = depth_recipe(args.depth, tokenizer.get_vocab_size(), args.seq_len, args.total_batch_size,
                          num_iterations=args.steps, lr_batch_exponent=args.lr_batch_exponent,
                          weight_decay=None if args.weight_decay < 0 else args.weight_decay,
                          short_run_lrs=bool(args.short_run_lrs), components=model_components)
    lrs = recipe.lrs()
    for name, base in (("embedding_lr", args.embedding_lr), ("unembedding_lr", args.unembedding_lr)):
        if base > 0:  # another base lr (as at 2^19 tokens a step), under the same dial as the default's
            lrs[name] *= base / BASE_LRS[name]
    for group in args.lr_groups:
        lrs[f"{group}_lr"] *= lr_mult
    device = torch.device("cpu")
    torch.manual_seed(seed)
    model = use_cpu_kernels(build_model(recipe.model_config, device), device)
    optimizers = build_optimizers(model, **lrs, adam_betas=tuple(args.adam_betas),
                                  scalar_lr=SCALAR_LR if args.scalar_lr < 0 else args.scalar_lr,
                                  optimizer_components=optimizer_components)
    accum = grad_accum_steps(args.total_batch_size, args.device_batch_size, args.seq_len, 1)
    loader = DataLoader(tokenizer, args.device_batch_size, args.seq_len, split="train", device=device)
    token_bytes = get_token_bytes()
    eval_steps = max(1, args.eval_tokens // (args.device_batch_size * args.seq_len))
    bpb, t0, train_seconds = {}, time.perf_counter(), 0.0
    for step in range(args.steps + 1):
        if step in args.eval_at:
            val_loader, batches = eval_batches(tokenizer, args.device_batch_size, args.seq_len, "val", device, 0, 1)
            model.eval()
            with autocast_for(device):  # what base_train trains and evaluates in: bf16 on a CPU with native bf16
                bpb[step] = evaluate_bpb(model, batches, eval_steps, token_bytes)[0]
            model.train()
            val_loader.close()
        if step == args.steps:
            break
        lrm = lr_multiplier(step, args.steps, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac)
        t_step = time.perf_counter()
        train_step(model, optimizers, [next(loader) for _ in range(accum)], lambda m, xy: m(*xy), lrm,
                   muon_momentum(step), autocast_for(device))
        train_seconds += time.perf_counter() - t_step
    loader.close()
    return {"seed": seed, "lr_mult": lr_mult, "variant": variant, "lrs": lrs, "val_bpb": bpb,
            "flops_per_token": recipe.flops_per_token, "tok_per_s": args.steps * args.total_batch_size / train_seconds,
            "seconds": time.perf_counter() - t0}


def cmd_quality(args):
    from nanochat.recipe import dial_lr_scale

    if not all(0 <= beta < 1 for beta in args.adam_betas):
        raise UserError(f"--adam-betas must both be in [0, 1) (got {args.adam_betas[0]:g} {args.adam_betas[1]:g})")
    if min(args.total_batch_size, args.device_batch_size, args.seq_len, args.steps, args.depth) < 1:
        raise UserError("--total-batch-size, --device-batch-size, --seq-len, --steps and --depth must be >= 1")
    from nanochat.stage import validate_lrs_and_schedule

    # base_train's checks: -1 is the default's sign, and an lr of 0 or below a slip, not "the default"
    validate_lrs_and_schedule(args, ("embedding_lr", "unembedding_lr", "scalar_lr"))
    from nanochat.recipe import split_components

    for variant in args.variants:  # an unknown component fails here, before any training
        split_components("" if variant == "base" else variant)
    # what x1 means in base lrs: the dial's scale for a run this long, as base_train would train it
    base_lr_scale = dial_lr_scale(args.total_batch_size, args.lr_batch_exponent, args.steps if args.short_run_lrs else None)
    args.eval_at = sorted(set(args.eval_at) | {args.steps})
    quality_data(args.data_source, args.vocab_size)
    runs = []
    for variant in args.variants:
        for lr_mult in args.lr_mults:
            for seed in args.seeds:
                log(f"bench quality: {args.data_source} d{args.depth} T={args.seq_len} batch {args.total_batch_size} "
                    f"{variant} lr x{lr_mult:g} seed {seed} ...")
                runs.append(quality_run(args, seed, lr_mult, variant))
    rows = [[r["variant"], f"{r['lr_mult']:g}", r["seed"]] + [f"{r['val_bpb'][s]:.4f}" for s in args.eval_at]
            + [f"{r['flops_per_token']:,}", f"{r['tok_per_s']:,.0f}", f"{r['seconds']:.0f}"] for r in runs]
    dtype = str(get_compute_dtype("cpu")).replace("torch.", "")  # what quality_run trained in
    print_table(f"quality: val bpb on {args.data_source} ({dtype}), d{args.depth} T={args.seq_len} {args.total_batch_size} tokens/step, "
                f"{args.steps} steps, lr x scales {'+'.join(args.lr_groups)} (x1 = base lrs x{base_lr_scale:.4g}), "
                f"wd {'dial' if args.weight_decay < 0 else args.weight_decay}, warmup {args.warmup_ratio} "
                f"warmdown {args.warmdown_ratio} to {args.final_lr_frac:g}, adam betas {args.adam_betas[0]:g}/{args.adam_betas[1]:g}",
                ["variant", "lr x", "seed"] + [f"step {s}" for s in args.eval_at] + ["FLOPs/token", "tok/s", "s"], rows)
    final = {}
    for r in runs:
        final.setdefault(r["lr_mult"], []).append(r["val_bpb"][args.steps])
    means = {m: sum(v) / len(v) for m, v in final.items()}
    best = min(means, key=means.get)
    print("\nmean final val bpb per lr multiplier: " + ", ".join(f"x{m:g} {v:.4f}" for m, v in means.items())
          + f" | best x{best:g}" + (f"; the default (x1) is {100 * (means[1.0] / means[best] - 1):+.2f} % from it"
                                      if 1.0 in means else ""))
    if len(args.variants) > 1:
        print_variants(args, runs)
    emit_json({"bench": "quality", "machine": machine_info(), "dtype": dtype,
               "source": args.data_source, "depth": args.depth,
               "seq_len": args.seq_len, "total_batch_size": args.total_batch_size, "steps": args.steps,
               "weight_decay": args.weight_decay, "warmup_ratio": args.warmup_ratio, "warmdown_ratio": args.warmdown_ratio,
               "final_lr_frac": args.final_lr_frac, "embedding_lr": args.embedding_lr,
               "unembedding_lr": args.unembedding_lr, "variants": args.variants, "adam_betas": args.adam_betas, "lr_batch_exponent": args.lr_batch_exponent, "short_run_lrs": args.short_run_lrs,
               "base_lr_scale": base_lr_scale, "lr_groups": args.lr_groups, "runs": runs, "mean_final": means, "best_lr_mult": best})


def print_variants(args, runs):
    """Per variant (at lr x1, or the first multiplier): mean final val bpb over the seeds and its change from the first
    variant, the seeds' spread, extra FLOPs per token and the speed cost."""
    lr_mult = 1.0 if 1.0 in args.lr_mults else args.lr_mults[0]
    by_variant = {}
    for r in runs:
        if r["lr_mult"] == lr_mult:
            by_variant.setdefault(r["variant"], []).append(r)
    first = by_variant[args.variants[0]]
    ref_bpb = sum(r["val_bpb"][args.steps] for r in first) / len(first)
    ref_flops, ref_speed = first[0]["flops_per_token"], sum(r["tok_per_s"] for r in first) / len(first)
    rows = []
    for variant, rs in by_variant.items():
        finals = [r["val_bpb"][args.steps] for r in rs]
        mean, speed = sum(finals) / len(finals), sum(r["tok_per_s"] for r in rs) / len(rs)
        rows.append([variant, f"{mean:.4f}", f"{100 * (mean / ref_bpb - 1):+.2f} %", f"{max(finals) - min(finals):.4f}",
                     f"{100 * (rs[0]['flops_per_token'] / ref_flops - 1):+.2f} %", f"{speed:,.0f}",
                     f"{100 * (speed / ref_speed - 1):+.1f} %"])
    print_table(f"variants against {args.variants[0]} (lr x{lr_mult:g}, {len(first)} seed(s), final val bpb)",
                ["variant", "val bpb", "change", "seed spread", "FLOPs/token", "tok/s", "speed"], rows)
