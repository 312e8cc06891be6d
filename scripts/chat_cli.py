"""
Chat with a trained model in the terminal, replies streamed as they are written.

    python -m scripts.chat_cli                        # latest sft model, interactive
    python -m scripts.chat_cli -i rl -t 0.8 -k 40     # another stage and sampling
    python -m scripts.chat_cli -p "What is 12*3?"     # one question, print the reply, exit
    python -m scripts.chat_cli -i base -p "The capital of"   # a base model continues the text

Interactive commands: `clear` starts a new conversation, `quit`, `exit` or Ctrl-D leaves. Tool calls show as
[python: 12*3] [output: 36]. A conversation that outgrows the model's context loses its oldest turns, with a note.
Status lines go to stderr, replies to stdout, so `-p` output can be piped.
"""

import argparse
import secrets
import sys

import torch

from nanochat.checkpoint_manager import load_model
from nanochat.kernels.cpu import use_cpu_kernels
from nanochat.kernels.decode_dtype import checkpoint_config, use_fastest_decode_dtype
from nanochat.kernels.int8 import quantize_int8, weight_bytes
from nanochat.common import UserError, compute_init, format_bytes, inference_threads, run_main
from nanochat.engine import Engine, Sampling
from nanochat.tokenizer import get_tokenizer
from nanochat.serving.chat import (MAX_TOKENS_RANGE, SEED_MODULUS, TEMPERATURE_RANGE, TERMINAL_MARKUP, TOP_K_RANGE,
                                   Finish, MarkupWriter, Piece, RequestError, check_number, fit_conversation, fit_text,
                                   generate_replies, model_info, prompt_token_limit, summary_line)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Chat with a trained nanochat model in the terminal.")
    p.add_argument("-i", "--source", default="sft", choices=["base", "mid", "sft", "rl"], help="which stage's model")
    p.add_argument("-g", "--model-tag", default=None, help="model tag (default: the latest)")
    p.add_argument("-s", "--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("-p", "--prompt", default=None, help="answer this one prompt, print the reply and exit")
    p.add_argument("-t", "--temperature", type=float, default=0.6, help="0 = always the most likely token")
    p.add_argument("-k", "--top-k", type=int, default=50, help="sample among the k most likely tokens")
    p.add_argument("--max-tokens", type=int, default=512, help="longest reply, in tokens")
    p.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads on a CPU (default: $OMP_NUM_THREADS, else one fewer than its cores, at least 1: "
                        "decoding one reply barely gains from the last core and stalls when anything else wants it)")
    p.add_argument("--int8", action="store_true",
                   help="int8 weights on a CPU: about a quarter of fp32's memory, the same reply nearly always")
    args = p.parse_args(argv)
    try:
        check_number("--threads", args.threads, 0, 4096, integer=True)
        check_number("--temperature", args.temperature, *TEMPERATURE_RANGE)
        check_number("--top-k", args.top_k, *TOP_K_RANGE, integer=True)
        check_number("--max-tokens", args.max_tokens, *MAX_TOKENS_RANGE, integer=True)
    except RequestError as e:
        raise UserError(str(e)) from None
    return args


def status(message):
    print(message, file=sys.stderr, flush=True)


def stream_reply(engine, prompt_ids, args, chat):
    """Print one reply as it is written; returns its parts (for the conversation) once it is finished."""
    writer = MarkupWriter(TERMINAL_MARKUP)
    parts, reason = [], None
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, max_tokens=args.max_tokens,
                        seed=secrets.randbelow(SEED_MODULUS))  # a fresh draw each reply: asked again, it may differ
    for event in generate_replies(engine, prompt_ids, sampling, chat=chat):
        if isinstance(event, Piece):
            print(writer.write(event.kind, event.text), end="", flush=True)
        elif isinstance(event, Finish):
            parts, reason = event.parts, event.reason
    print(writer.close(), flush=True)
    if reason == "length":
        status(f"(reply cut at {args.max_tokens} tokens or the end of the context)")
    return parts


def answer(engine, tokenizer, conversation, text, args, chat):
    """Add the user's text to the conversation (chat) or take it as a prompt (base), and stream the reply."""
    context = engine.model.config.sequence_len
    prompt_limit = prompt_token_limit(context, args.max_tokens)
    if not chat:
        prompt = fit_text(tokenizer, text, prompt_limit)
    else:
        try:
            prompt = fit_conversation(tokenizer, conversation + [{"role": "user", "content": text}], prompt_limit)
        except RequestError as e:
            status(f"note: {e.reason}")
            return
        conversation[:] = prompt.messages  # turns dropped to fit the context stay dropped
    if prompt.note:
        status(f"note: {prompt.note}")
    parts = stream_reply(engine, prompt.ids, args, chat)
    if chat:
        conversation.append({"role": "assistant", "content": parts})


def main(argv=None):
    args = parse_args(argv)
    _, _, _, _, device = compute_init(args.device_type)
    if args.int8 and device.type != "cpu":
        raise UserError(f"--int8 runs on a CPU, not {device.type}: add --device-type=cpu")
    if device.type == "cpu":
        torch.set_num_threads(inference_threads(device, args.threads))
        # fp32 or bf16, whichever decodes faster here (sets NANOCHAT_DTYPE unless it is set), before the model loads
        use_fastest_decode_dtype(device, checkpoint_config(args.source, args.model_tag, args.step), get_tokenizer(),
                                 int8=args.int8, say=status)  # stderr: stdout is the reply's
    status(f"loading the {args.source} model on {device} ...")
    model, tokenizer, meta = load_model(args.source, device, model_tag=args.model_tag, step=args.step)
    use_cpu_kernels(model, device)  # on a CPU, unless NANOCHAT_CPU_OPS=0
    model.prepare_for_inference()
    if args.int8:  # the module swap, after the preparation (kernels/int8.py)
        quantize_int8(model)
        status(f"int8 weights: {format_bytes(weight_bytes(model))}, against {format_bytes(4 * model.num_params())} "
               "in fp32")
    line = summary_line(model_info(meta, model, device, args.source))
    threads = f", {torch.get_num_threads()} torch thread{'s' if torch.get_num_threads() > 1 else ''}" if device.type == "cpu" else ""
    status(f"loaded {line}{threads}")
    engine = Engine(model, tokenizer)
    chat = args.source != "base"  # a base model never saw the chat format: it continues text instead

    conversation = []
    if args.prompt is not None:
        answer(engine, tokenizer, conversation, args.prompt, args, chat)
        return
    if chat:
        status("Chat with the model. 'clear' starts a new conversation; 'quit', 'exit' or Ctrl-D leaves.")
    else:
        status("Base model: each line you type is continued as plain text. 'quit', 'exit' or Ctrl-D leaves.")
    while True:
        try:
            text = input("\nYou: ").strip()
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            return
        if text in ("quit", "exit"):
            return
        if text == "clear":
            conversation = []
            status("(new conversation)")
            continue
        if not text:
            continue
        print("Assistant: " if chat else "Model: ", end="", flush=True)
        try:
            answer(engine, tokenizer, conversation, text, args, chat)
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the program
            print()
            status("(reply stopped)")
            if conversation and conversation[-1]["role"] == "user":
                conversation.pop()


if __name__ == "__main__":
    run_main(main)
