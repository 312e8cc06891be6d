"""
Pretrain a base GPT. One dial, --depth, sets the model size and every other hyperparameter.

Examples:
  python -m scripts.base_train --depth=4 --max-seq-len=256 --device-batch-size=8 --total-batch-size=2048
  torchrun --standalone --nproc_per_node=8 -m scripts.base_train -- --depth=20 --run=d20
Resume after a crash or a stop with the same command plus --resume (or --resume-from-step=N).
"""

import argparse
import json
import math
import os
import time
from contextlib import nullcontext

import torch

from nanochat.checkpoint_manager import (build_model, check_compatible, checkpoint_dir, load_checkpoint, resolve_step,
                                         save_checkpoint, tokenizer_fingerprint)
from nanochat.common import (UserError, compute_cleanup, compute_init, get_compute_dtype, get_peak_flops, print0,
                             resolve_device_type, run_main, seed_everything)
from nanochat.dataloader import DataLoader, eval_batches
from nanochat.loss_eval import evaluate_bpb
from nanochat.report import get_report
from nanochat.tokenizer import get_token_bytes, get_tokenizer
from nanochat.training import (StepTimer, StopSignal, batch_lr_scale, build_optimizers, default_weight_decay, format_duration,
                               grad_accum_steps, greedy_samples, init_wandb, keep_freed_memory_in_process, lr_multiplier,
                               model_config_for_depth, muon_momentum, train_step)

SAMPLE_PROMPTS = ["The capital of", "The main language of", "12 + 35 =", "The word river is spelled", "The opposite of hot is",
                  "If 5*x + 3 = 13, then x is"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Pretrain a base GPT; --depth sets everything else.")
    p.add_argument("--run", default="dummy", help="wandb run name ('dummy' = no wandb)")
    p.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")
    p.add_argument("--model-tag", default="", help="checkpoint tag (default: d<depth>)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--data-source", default=None, help="data source (default: $NANOCHAT_DATA_SOURCE or builtin)")
    # model
    p.add_argument("--depth", type=int, default=20, help="number of layers; sets width, heads, lrs, weight decay, budget")
    p.add_argument("--aspect-ratio", type=int, default=64, help="n_embd = aspect_ratio * depth (rounded to head dim)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--num-kv-heads", type=int, default=0, help="GQA key/value heads (0 = as many as query heads)")
    p.add_argument("--max-seq-len", type=int, default=2048)
    # budget: the first of num-iterations > 0, target-flops > 0, target-param-data-ratio > 0 wins
    p.add_argument("--num-iterations", type=int, default=-1)
    p.add_argument("--target-flops", type=float, default=-1.0)
    p.add_argument("--target-param-data-ratio", type=float, default=20.0)
    # batch
    p.add_argument("--device-batch-size", type=int, default=32)
    p.add_argument("--total-batch-size", type=int, default=524288, help="tokens per optimizer step")
    # optimization (-1 = from the depth dial)
    p.add_argument("--embedding-lr", type=float, default=-1.0)
    p.add_argument("--unembedding-lr", type=float, default=-1.0)
    p.add_argument("--matrix-lr", type=float, default=-1.0)
    p.add_argument("--weight-decay", type=float, default=-1.0)
    p.add_argument("--lr-batch-exponent", type=float, default=0.0, help="lrs scale as (total_batch/2^19)^this")
    p.add_argument("--warmup-ratio", type=float, default=0.0)
    p.add_argument("--warmdown-ratio", type=float, default=0.4)
    p.add_argument("--final-lr-frac", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=0.0, help="max grad norm (0 = off)")
    # evaluation and checkpoints
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-tokens", type=int, default=20 * 524288)
    p.add_argument("--core-metric-every", type=int, default=2000, help="-1 = never")
    p.add_argument("--core-metric-max-per-task", type=int, default=500)
    p.add_argument("--eval-bundle", default="dclm", help="CORE bundle: dclm (downloaded), builtin (offline), or a path")
    p.add_argument("--sample-every", type=int, default=2000, help="-1 = never")
    p.add_argument("--save-every", type=int, default=-1, help="-1 = only at the end (and on a stop signal)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep (the newest is never deleted)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of --model-tag")
    p.add_argument("--resume-from-step", type=int, default=-1)
    p.add_argument("--compile", default="auto", choices=["auto", "0", "1"], help="torch.compile (auto: on for CUDA)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    user_config = vars(args).copy()

    # ---- validate everything we can before touching a device ----
    device_type = resolve_device_type(args.device_type)
    tokenizer = get_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    try:
        model_config = model_config_for_depth(args.depth, vocab_size, args.max_seq_len, args.aspect_ratio, args.head_dim,
                                              args.num_kv_heads or None)
    except ValueError as e:
        raise UserError(str(e)) from e
    is_ddp, rank, local_rank, world_size, device = compute_init(device_type)
    keep_freed_memory_in_process()
    master = rank == 0
    grad_accum = grad_accum_steps(args.total_batch_size, args.device_batch_size, args.max_seq_len, world_size)
    model_tag = args.model_tag or f"d{args.depth}"
    ckpt_dir = checkpoint_dir("base", model_tag)
    resume_step = None
    if args.resume or args.resume_from_step >= 0:
        resume_step = resolve_step(ckpt_dir, args.resume_from_step if args.resume_from_step >= 0 else None)
    core_bundle_dir = None
    if args.core_metric_every > 0:  # fail now, not hours in, if the bundle cannot be had
        from nanochat.core_eval import resolve_eval_bundle

        if master:
            core_bundle_dir = resolve_eval_bundle(args.eval_bundle)
        if is_ddp:
            torch.distributed.barrier()
        core_bundle_dir = core_bundle_dir or resolve_eval_bundle(args.eval_bundle)
    seed_everything(args.seed)

    # ---- model ----
    model = build_model(model_config, device)
    tok_hash = tokenizer_fingerprint()
    num_params = model.num_params()
    flops_per_token = model.estimate_flops()
    dtype = get_compute_dtype(device)
    autocast = torch.autocast(device_type=device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    use_compile = args.compile == "1" or (args.compile == "auto" and device.type == "cuda")
    train_model = torch.compile(model, dynamic=False) if use_compile else model

    # ---- token budget ----
    tokens_per_step = args.total_batch_size
    scaling_params = num_params - model.transformer.wte.weight.numel()  # embedding lookups cost no FLOPs
    if args.num_iterations > 0:
        num_iterations, budget = args.num_iterations, "--num-iterations"
    elif args.target_flops > 0:
        num_iterations, budget = round(args.target_flops / (flops_per_token * tokens_per_step)), "--target-flops"
    elif args.target_param_data_ratio > 0:
        num_iterations = round(args.target_param_data_ratio * scaling_params / tokens_per_step)
        budget = "--target-param-data-ratio"
    else:
        raise UserError("give a token budget: --num-iterations, --target-flops or --target-param-data-ratio > 0")
    num_iterations = max(1, num_iterations)

    # ---- optimizers (the dial: base lrs at 2^19 tokens, scaled to this batch) ----
    lr_scale = batch_lr_scale(args.total_batch_size, args.lr_batch_exponent)
    lrs = dict(
        embedding_lr=args.embedding_lr if args.embedding_lr > 0 else 0.2 * lr_scale,
        unembedding_lr=args.unembedding_lr if args.unembedding_lr > 0 else 0.004 * lr_scale,
        matrix_lr=args.matrix_lr if args.matrix_lr > 0 else 0.02 * lr_scale,
        weight_decay=args.weight_decay if args.weight_decay >= 0 else default_weight_decay(args.depth, args.total_batch_size),
    )
    optimizers = build_optimizers(model, **lrs)

    # ---- resume ----
    start_step, loader_state, loop_state = 0, None, {}
    if resume_step is not None:
        model_state, optim_states, meta = load_checkpoint(ckpt_dir, resume_step, device, rank=rank)
        check_compatible(meta, model_config, tok_hash, ckpt_dir)
        if meta.get("world_size", 1) != world_size:
            raise UserError(f"checkpoint was written by {meta.get('world_size')} ranks; resume with the same number of ranks "
                            f"(got {world_size}) so the sharded optimizer state and data order line up")
        model.load_state_dict(model_state, strict=True)
        for opt, sd in zip(optimizers, optim_states):
            opt.load_state_dict(sd)
        start_step = resume_step
        loader_state = meta["dataloader_states"][rank]
        loop_state = meta.get("loop_state", {})
        num_iterations = meta.get("num_iterations", num_iterations)

    # ---- data ----
    train_loader = DataLoader(tokenizer, args.device_batch_size, args.max_seq_len, split="train", device=device,
                              rank=rank, world_size=world_size, source=args.data_source, resume_state=loader_state)
    token_bytes = get_token_bytes(device=device)

    def val_bpb():
        tokens_per_eval_step = args.device_batch_size * args.max_seq_len * world_size
        steps = max(1, args.eval_tokens // tokens_per_eval_step)
        val_loader, val_iter = eval_batches(tokenizer, args.device_batch_size, args.max_seq_len, "val", device,
                                            rank, world_size, source=args.data_source)
        model.eval()
        with autocast:
            bpb = evaluate_bpb(model, val_iter, steps, token_bytes)
        val_loader.close()
        model.train()
        return bpb

    report = get_report()
    if start_step == 0:
        report.reset_curve("base_train")
    else:
        report.truncate_curve("base_train", start_step)
    wandb_run = init_wandb(args.run, user_config, rank)
    peak_flops = get_peak_flops(device, dtype) * world_size
    print0(f"base_train | {model_tag} | params {num_params:,} | layers {model_config['n_layer']} width {model_config['n_embd']} "
           f"heads {model_config['n_head']}/{model_config['n_kv_head']} | T {args.max_seq_len} | device {device.type} x{world_size} "
           f"{str(dtype).replace('torch.', '')}{' compiled' if use_compile else ''} | batch {tokens_per_step:,} tok "
           f"= {args.device_batch_size}x{args.max_seq_len}x{world_size}x{grad_accum} accum | steps {num_iterations} ({budget}) "
           f"= {num_iterations * tokens_per_step / 1e6:.1f}M tokens, {num_iterations * tokens_per_step / max(1, scaling_params):.1f} tok/param | "
           + " ".join(f"{k} {v:.4g}" for k, v in lrs.items())
           + (f" | resuming at step {start_step}" if start_step else ""))

    # ---- the loop ----
    stopper = StopSignal()
    timer = StepTimer()
    min_val_bpb = loop_state.get("min_val_bpb", float("inf"))
    last_val_bpb = loop_state.get("last_val_bpb")
    total_train_time = loop_state.get("total_train_time", 0.0)
    core_metric = None
    step = start_step

    def save(step):
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise UserError(f"weights are not finite at step {step}; not saving over the last good checkpoint in {ckpt_dir}. "
                            "Lower the learning rates, then --resume")
        meta = {
            "model_config": model_config, "user_config": user_config, "num_iterations": num_iterations,
            "tokenizer_hash": tok_hash, "dataloader_states": gather_loader_states(train_loader.state_dict()),
            "loop_state": {"min_val_bpb": min_val_bpb, "last_val_bpb": last_val_bpb, "total_train_time": total_train_time},
            "lrs": lrs, "device_batch_size": args.device_batch_size, "max_seq_len": args.max_seq_len,
        }
        save_checkpoint(ckpt_dir, step, model, optimizers, meta, keep_last=args.keep_last)

    while True:
        last_step = step == num_iterations
        # a checkpoint always comes before evals, so a failing eval never loses the model
        if step > start_step and (last_step or (args.save_every > 0 and step % args.save_every == 0)):
            save(step)
        if args.eval_every > 0 and (last_step or step % args.eval_every == 0) and not (step == start_step and start_step > 0):
            t0 = time.time()
            last_val_bpb = val_bpb()
            min_val_bpb = min(min_val_bpb, last_val_bpb)
            print0(f"step {step:05d} | val_bpb {last_val_bpb:.4f} | ({time.time() - t0:.1f}s)")
            wandb_run.log({"step": step, "val/bpb": last_val_bpb})
            report.log_curve("base_train", {"step": step, "val_bpb": last_val_bpb})
        if args.core_metric_every > 0 and (last_step or (step > 0 and step % args.core_metric_every == 0)):
            from nanochat.core_eval import evaluate_core

            model.eval()
            with autocast:
                core = evaluate_core(model, tokenizer, device, max_per_task=args.core_metric_max_per_task,
                                     bundle_dir=core_bundle_dir)
            model.train()
            core_metric = core["core_metric"]
            print0(f"step {step:05d} | CORE {core_metric:.4f}")
            wandb_run.log({"step": step, "core_metric": core_metric})
            report.log_curve("base_train", {"step": step, "core_metric": core_metric})
        if master and args.sample_every > 0 and (last_step or (step > 0 and step % args.sample_every == 0)):
            model.eval()
            with autocast:
                for text in greedy_samples(model, tokenizer, SAMPLE_PROMPTS):
                    print0(f"  sample: {text!r}")
            model.train()
        if last_step:
            break

        # -- one optimizer step --
        t0 = time.perf_counter()
        lrm = lr_multiplier(step, num_iterations, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac)
        train_loss = train_step(train_model, train_loader, optimizers, grad_accum, autocast, lrm, muon_momentum(step),
                                args.grad_clip)
        if not math.isfinite(train_loss):
            raise UserError(f"loss is {train_loss} at step {step}; stopping without saving. The last good checkpoint is in "
                            f"{ckpt_dir}; lower the learning rates or check the data, then --resume")
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        step += 1
        timer.add(dt)
        total_train_time += dt
        tok_per_sec = tokens_per_step / dt
        mfu = 100 * flops_per_token * tok_per_sec / peak_flops
        print0(f"step {step:05d}/{num_iterations:05d} ({100 * step / num_iterations:5.1f}%) | loss {train_loss:.6f} | "
               f"lrm {lrm:.3f} | {dt * 1000:.0f} ms | {tok_per_sec:,.0f} tok/s | MFU {mfu:.1f}% | "
               f"ETA {format_duration(timer.eta(num_iterations - step))}")
        record = {"step": step, "train_loss": train_loss, "lrm": lrm, "tok_per_sec": tok_per_sec, "mfu": mfu}
        wandb_run.log({"step": step, "train/loss": train_loss, "train/lrm": lrm, "train/tok_per_sec": tok_per_sec, "train/mfu": mfu})
        report.log_curve("base_train", record)
        if stopper.should_stop(device):
            print0(f"stop requested: saving step {step} and exiting; continue later with --resume")
            save(step)
            break

    train_loader.close()
    stopped_early = step < num_iterations
    report.log(section="Base model training", data=[
        user_config,
        {"Number of parameters": num_params, "FLOPs per token": f"{flops_per_token:e}", "Calculated number of iterations": num_iterations,
         "Number of training tokens": num_iterations * tokens_per_step, "DDP world size": world_size, **lrs},
        {"Steps completed": step, "Stopped early": stopped_early, "Minimum validation bpb": min_val_bpb,
         "Final validation bpb": last_val_bpb, "CORE metric": core_metric, "Dataloader crop fraction": train_loader.crop_fraction(),
         "Total training time": format_duration(total_train_time), "Peak memory (MiB)": peak_memory_mib(device)},
    ])
    print0(f"done: {step}/{num_iterations} steps in {format_duration(total_train_time)} | min val_bpb {min_val_bpb:.4f} | "
           f"crop {100 * train_loader.crop_fraction():.2f}% | checkpoint {ckpt_dir}")
    wandb_run.finish()
    compute_cleanup()


def gather_loader_states(state):
    """Every rank's dataloader state, so rank r can resume exactly where it was."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, json.loads(json.dumps(state)))
        return states
    return [state]


def peak_memory_mib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


if __name__ == "__main__":
    run_main(main)
