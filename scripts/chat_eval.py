"""
Evaluate a chat model on tasks and sum it up as ChatCORE; writes its section of the report.

  python -m scripts.chat_eval -i sft                         # every task of the suite
  python -m scripts.chat_eval -i rl -a GSM8K -x 200          # one task, its first 200 problems
  python -m scripts.chat_eval -i sft -a file:held_out.jsonl  # your questions: right when a reply contains the answer
  torchrun --standalone --nproc_per_node=8 -m scripts.chat_eval -- -i sft
The default suite is the built-in one (offline: WorldQA on held-out subjects, Identity, Arithmetic,
SpellingBee, SimpleSpelling) when $NANOCHAT_DATA_SOURCE is builtin or unset, else the hub one (ARC-Easy,
ARC-Challenge, MMLU, GSM8K, HumanEval, SpellingBee). A file:PATH task is a JSONL file of conversations (as chat_sft's
--data reads) whose last assistant message is the expected answer: a reply is right when it contains that answer, both
casefolded with punctuation and whitespace runs made one space, as whole words (tasks/customjson.py, answer_matches).
"""

import argparse

from nanochat.checkpoint_manager import checkpoint_dir, find_latest_tag, load_meta, load_model, resolve_step
from nanochat.kernels.cpu import use_cpu_kernels
from nanochat.kernels.decode_dtype import checkpoint_config, use_fastest_decode_dtype
from nanochat.common import UserError, autocast_for, compute_cleanup, compute_init, print0, run_main
from nanochat.report import get_report
from nanochat.tokenizer import get_tokenizer
from tasks import CustomJSON, canonical_name, get_task
from nanochat.chat_eval import chatcore, evaluate_chat_tasks
from nanochat.presets import fill_from_preset, preset_help
from nanochat.stage import mixture_kind

# The split each task is measured on: never one that training saw.
EVAL_SPLITS = {"ARC-Easy": "test", "ARC-Challenge": "test", "MMLU": "test", "GSM8K": "test", "HumanEval": "test",
               "SpellingBee": "test", "SimpleSpelling": "test", "WorldQA": "eval", "WorldFacts": "eval", "Identity": "eval",
               "Arithmetic": "test"}
SUITES = {"builtin": ["WorldQA", "Identity", "Arithmetic", "SpellingBee", "SimpleSpelling"],
          "hub": ["ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Evaluate a chat model; ChatCORE over the tasks.")
    p.add_argument("-i", "--source", default="sft", choices=["base", "mid", "sft", "rl"])
    p.add_argument("-a", "--tasks", default="", help="task names separated by | (default: the whole suite); file:PATH "
                   "for a JSONL file of your questions, each conversation's last assistant message its expected answer")
    p.add_argument("-x", "--max-problems", type=int, default=None,
                   help=f"problems per task, -1 = all {preset_help('chat_eval', 'max_problems')}")
    p.add_argument("-g", "--model-tag", default=None)
    p.add_argument("-s", "--step", type=int, default=None)
    p.add_argument("-t", "--temperature", type=float, default=0.0, help="sampling temperature for generative tasks")
    p.add_argument("-k", "--top-k", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=None, help=preset_help("chat_eval", "max_new_tokens"))
    p.add_argument("--batch-size", type=int, default=8, help="problems per forward pass for categorical tasks")
    p.add_argument("--suite", default="", choices=["", "builtin", "hub"], help="default: from $NANOCHAT_DATA_SOURCE")
    p.add_argument("--device-type", default="")
    args = fill_from_preset(p.parse_args(argv), "chat_eval")
    for flag in ("max_new_tokens", "batch_size", "top_k"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')}={getattr(args, flag)} is not valid: must be >= 1")
    if args.max_problems == 0 or args.max_problems < -1:
        raise UserError(f"--max-problems={args.max_problems} is not valid: must be >= 1, or -1 for all")
    if not 0 <= args.temperature <= 2:
        raise UserError(f"--temperature={args.temperature} is not valid: must be between 0 and 2")
    return args


def main(argv=None):
    args = parse_args(argv)
    suite = mixture_kind(args.suite)
    files = {n: n[len("file:"):] for n in args.tasks.split("|") if n.startswith("file:")}  # your questions, by path
    names = [n if n in files else canonical_name(n) for n in args.tasks.split("|") if n] or SUITES[suite]
    unknown = [n for n in names if n not in EVAL_SPLITS and n not in files]
    if unknown:
        raise UserError(f"{', '.join(unknown)} cannot be evaluated here; tasks with an eval split: {', '.join(EVAL_SPLITS)}"
                        ", or file:PATH (a JSONL file of your questions)")
    if "" in files.values():
        raise UserError("-a file: names no file: give file:PATH, a JSONL file of conversations")
    # downloads (or fails, naming a bad line) before the model loads
    tasks = {name: CustomJSON(files[name]) if name in files else get_task(name, EVAL_SPLITS[name]) for name in names}
    tag = args.model_tag or find_latest_tag(args.source)
    if files:  # a line no reply could pass (no room for its answer) is refused before the model loads, too
        ckpt_dir = checkpoint_dir(args.source, tag)
        context = load_meta(ckpt_dir, resolve_step(ckpt_dir, args.step))["model_config"]["sequence_len"]
        tokenizer = get_tokenizer()
        for name in files:
            tasks[name].check_answerable(tokenizer, context, args.max_new_tokens)
    get_report()  # proves the report directory is writable
    _, rank, _, world_size, device = compute_init(args.device_type)
    if world_size == 1:  # a CPU decodes in fp32 or bf16, whichever is faster here (ranks measuring apart could differ)
        use_fastest_decode_dtype(device, checkpoint_config(args.source, tag, args.step), get_tokenizer(),
                                 rows=(1, 32))  # sample_task_replies decodes up to 32 together
    model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=tag, step=args.step)
    use_cpu_kernels(model, device)  # on a CPU, unless NANOCHAT_CPU_OPS=0
    model.prepare_for_inference()
    print0(f"chat_eval | {args.source} {tag} step {meta['step']} | {world_size} rank(s) | tasks {', '.join(names)} | "
           f"max problems {args.max_problems if args.max_problems > 0 else 'all'} | temperature {args.temperature}"
           + (f" | {args.preset}" if args.preset else ""))
    with autocast_for(device):
        max_problems = None if args.max_problems < 0 else args.max_problems
        accuracies, baselines, tool_rates = evaluate_chat_tasks(
            model, tokenizer, tasks, max_problems, batch_size=args.batch_size, max_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k)
    score = chatcore(accuracies, baselines)
    print0(f"ChatCORE {score:.4f} over {len(accuracies)} task(s)")
    table = ["| Task | Accuracy | Baseline | Replies calling the calculator |", "|---|---:|---:|---:|"]
    table += [f"| {name} | {accuracies[name]:.4f} | {baselines[name]:.4f} | "
              f"{tool_rates[name]:.2f} |" if name in tool_rates else f"| {name} | {accuracies[name]:.4f} | {baselines[name]:.4f} | - |"
              for name in accuracies]
    get_report().log(section=f"Chat evaluation {args.source}", data=[
        {"Source": args.source, "Model tag": tag, "Step": meta["step"], "Max problems": args.max_problems,
         "Temperature": args.temperature},
        {**accuracies, "ChatCORE": score},
        {f"{name} calculator use": rate for name, rate in tool_rates.items() if name in ("Arithmetic", "GSM8K")},
        "\n".join(table),
    ])
    compute_cleanup()


if __name__ == "__main__":
    run_main(main)
