"""
`bench wordings`: a chat checkpoint's WorldQA answers counted per question wording (greedy), on the dev split by default.
A tiny model maps a held-out wording to a relation for nearly every subject or for none, so one run's WorldQA moves by
whole wordings; this table shows which. Tune SFT on the dev split (a third set of wordings); the eval split is for
reporting, and reading its failures to choose a change would fit the change to them.
"""

import collections

from bench.common import emit_json, log, machine_info, print_table


def cmd_wordings(args):
    from nanochat.chat_eval import sample_task_replies
    from nanochat.checkpoint_manager import find_latest_tag, load_model
    from nanochat.common import UserError, autocast_for, compute_init
    from nanochat.kernels.cpu import use_cpu_kernels
    from tasks.builtin import WorldQA

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens={args.max_new_tokens} is not valid: must be >= 1")
    task = WorldQA(args.split)
    _, _, _, _, device = compute_init(args.device_type)
    tag = args.model_tag or find_latest_tag(args.source)
    model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=tag)
    use_cpu_kernels(model, device).prepare_for_inference()
    conversations = [task.get_example(i) for i in range(len(task))]
    log(f"wordings | {args.source} {tag} step {meta['step']} | WorldQA {args.split}: {len(conversations)} questions, greedy")
    with autocast_for(device):
        replies = sample_task_replies(model, tokenizer, conversations, args.max_new_tokens,
                                      seeds=[0] * len(conversations))
    right = collections.defaultdict(lambda: [0, 0])  # (relation, wording) -> [right, asked]
    wrong_example = {}
    for conversation, reply in zip(conversations, replies):
        question = conversation["messages"][-2]["content"]
        key = (conversation["relation"], question.replace(conversation["subject"], "X"))
        ok = reply is not None and task.evaluate(conversation, reply)
        right[key][0] += ok
        right[key][1] += 1
        if not ok:
            wrong_example.setdefault(key, (reply or "").replace(conversation["subject"], "X")[:60])
    rows = [(relation, wording, f"{a}/{n}", wrong_example.get((relation, wording), ""))
            for (relation, wording), (a, n) in sorted(right.items())]
    total = sum(a for a, _ in right.values()) / len(conversations)
    print_table(f"WorldQA {args.split} by wording: {100 * total:.1f} % right ({args.source} {tag} step {meta['step']})",
                ["relation", "wording", "right", "a wrong reply"], rows)
    emit_json({"bench": "wordings", "split": args.split, "source": args.source, "tag": tag, "step": meta["step"],
               "accuracy": round(total, 4), "wordings": {f"{r}: {w}": a / n for (r, w), (a, n) in right.items()},
               "machine": machine_info()})
