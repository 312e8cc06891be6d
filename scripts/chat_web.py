"""
Serve a trained model over HTTP: a chat UI in the browser and an OpenAI-compatible API.

    python -m scripts.chat_web                          # latest sft model, http://127.0.0.1:8000/
    python -m scripts.chat_web -i rl --num-gpus 8 --host 0.0.0.0 --port 8000

Endpoints:
    GET  /                      the chat UI (nanochat/ui.html)
    GET  /health                {"status": "ok", "workers": N, "model": {...}}
    GET  /stats                 queue depth, busy/free workers, requests served, tokens generated, tokens/s
    POST /chat/completions      nanochat's own: SSE of {"token"}, {"python"}, {"python_output"} ... then {"done": true}
    POST /v1/chat/completions   the OpenAI chat completions API, streaming or not (the `openai` client works)
    GET  /v1/models             the one model served, id "nanochat-<source>-<tag>"

One worker per GPU (one on CPU) holds a model; requests wait in a queue for a free worker, and one that waits
longer than --queue-timeout gets a 503. The server itself (workers, queue, cancellation, both APIs) is
nanochat/serve.py; request limits are the constants at the top of nanochat/chat.py.
"""

import argparse

import uvicorn

from nanochat.chat import MAX_TOKENS_RANGE, TEMPERATURE_RANGE, TOP_K_RANGE, RequestError, check_number
from nanochat.common import UserError, print0, run_main
from nanochat.serve import WorkerPool, bind_socket, create_app, load_workers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Serve a model: browser chat UI and OpenAI-compatible API.")
    p.add_argument("-i", "--source", default="sft", choices=["base", "mid", "sft", "rl"], help="which stage's model")
    p.add_argument("-g", "--model-tag", default=None, help="model tag (default: the latest)")
    p.add_argument("-s", "--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 serves every network: no auth!)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--num-gpus", "--workers", dest="workers", type=int, default=0, metavar="N",
                   help="workers, one model replica each: on CUDA one per GPU (default: every GPU); on CPU they share "
                        "one copy of the weights (default: 1)")
    p.add_argument("-t", "--temperature", type=float, default=0.6, help="default temperature of a request")
    p.add_argument("-k", "--top-k", type=int, default=50, help="default top-k of a request")
    p.add_argument("--max-tokens", type=int, default=512, help="default reply length limit of a request")
    p.add_argument("--queue-timeout", type=float, default=30.0,
                   help="seconds a request may wait for a free worker before it gets a 503")
    args = p.parse_args(argv)
    try:
        check_number("--temperature", args.temperature, *TEMPERATURE_RANGE)
        check_number("--top-k", args.top_k, *TOP_K_RANGE, integer=True)
        check_number("--max-tokens", args.max_tokens, *MAX_TOKENS_RANGE, integer=True)
        check_number("--queue-timeout", args.queue_timeout, 0.0, 3600.0, low_open=True)
        check_number("--port", args.port, 0, 65535, integer=True)
    except RequestError as e:
        raise UserError(str(e)) from None
    return args


def main(argv=None):
    args = parse_args(argv)
    sock = bind_socket(args.host, args.port)
    workers, tokenizer, info = load_workers(args.source, args.model_tag, args.step, args.device_type, args.workers)
    if args.source == "base":
        print0("note: a base model was never taught the chat format; expect it to ramble "
               "(chat_cli -i base continues plain text)")
    pool = WorkerPool(workers, args.queue_timeout)
    defaults = {"temperature": args.temperature, "top_k": args.top_k, "max_tokens": args.max_tokens}
    app = create_app(pool, tokenizer, info, defaults)
    host, port = sock.getsockname()[:2]
    shown_host = {"0.0.0.0": "localhost", "::": "localhost"}.get(host, f"[{host}]" if ":" in host else host)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print0(f"warning: listening on {args.host}: anyone who can reach this machine can use the model (no auth)")
    url = f"http://{shown_host}:{port}/"
    print0(f"serving at {url} (open it in a browser; OpenAI API at {url}v1)")
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    print0("server stopped")


if __name__ == "__main__":
    run_main(main)
