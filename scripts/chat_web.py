"""
Serve a trained model over HTTP: a chat UI in the browser and an OpenAI-compatible API.

    python -m scripts.chat_web                          # latest sft model, http://127.0.0.1:8000/
    python -m scripts.chat_web -i rl --num-gpus 8 --host 0.0.0.0 --port 8000

Endpoints:
    GET  /                      the chat UI (nanochat/serving/ui.html)
    GET  /health                {"status": "ok", "workers": N, "model": {...}}
    GET  /stats                 queue depth, busy/free workers, requests served, tokens generated, tokens/s
    POST /chat/completions      nanochat's own: SSE of {"token"}, {"python"}, {"python_output"} ... then {"done": true}
    POST /v1/chat/completions   the OpenAI chat completions API, streaming or not (the `openai` client works)
    GET  /v1/models             the one model served, id "nanochat-<source>-<tag>"

One worker process per GPU (one on CPU) holds a model and decodes every request it has in one batch (continuous
batching, nanochat/engine.py): new requests join between steps, up to --max-batch sequences; one that waits
longer than --queue-timeout for a row gets a 503. With --api-key (or NANOCHAT_API_KEY) every route but / and /health needs
`Authorization: Bearer KEY`; without one, a request must name this server in its Host header (--allowed-hosts adds
names). A reply whose client stops reading is closed after --write-timeout, and one client (a key, or without
keys an address: the peer's, or the one --trusted-proxy forwards) holds at most --client-share of the server
(docs/serving.md "Under hostile load"). The server itself is nanochat/serving/: the app and its routes (serve.py),
the OpenAI protocol (protocol.py), the defences (guards.py), the worker processes (workers.py) and how they share
decode steps between clients (fair_share.py); request limits are the constants at the top of
nanochat/serving/chat.py.
"""

import argparse
import gc
import ipaddress
import os
import signal

import uvicorn

from nanochat.common import UserError, print0, run_main
from nanochat.serving.chat import MAX_TOKENS_RANGE, TEMPERATURE_RANGE, TOP_K_RANGE, RequestError, check_number
from nanochat.serving.guards import (HEADER_TIMEOUT, LOOPBACK, STALL_BYTES, WRITE_TIMEOUT, ConnectionGuard,
                                    allowed_host_names, bind_socket, default_max_connections, raise_open_file_limit)
from nanochat.serving.serve import create_app
from nanochat.serving.workers import CLIENT_SHARE, WorkerPool, load_workers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Serve a model: browser chat UI and OpenAI-compatible API.")
    p.add_argument("-i", "--source", default="sft", choices=["base", "mid", "sft", "rl"], help="which stage's model")
    p.add_argument("-g", "--model-tag", default=None, help="model tag (default: the latest)")
    p.add_argument("-s", "--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 serves every network: use --api-key)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--num-gpus", "--workers", dest="workers", type=int, default=0, metavar="N",
                   help="workers, one model replica each: on CUDA one per GPU (default: every GPU); on CPU they share "
                        "one copy of the weights (default: 1)")
    p.add_argument("-t", "--temperature", type=float, default=0.6, help="default temperature of a request")
    p.add_argument("-k", "--top-k", type=int, default=50, help="default top-k of a request")
    p.add_argument("--max-tokens", type=int, default=512, help="default reply length limit of a request")
    p.add_argument("--queue-timeout", type=float, default=30.0,
                   help="seconds a request may wait for a row of the batch before it gets a 503")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a row at once; more get a 503 "
                   "with Retry-After")
    p.add_argument("--max-connections", type=int, default=0, help="open connections at once (default: what the open-file "
                   "limit allows, at most 4096); when full, the longest-idle connection makes room")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT,
                   help="seconds a new connection has to send its request's headers")
    p.add_argument("--write-timeout", type=float, default=WRITE_TIMEOUT,
                   help=f"seconds a reply's client may take less than {STALL_BYTES // 1024} KiB of it (its bytes "
                        "waiting in the buffers) before the connection is closed and the reply cancelled")
    p.add_argument("--allowed-hosts", default="", metavar="NAMES",
                   help="more names a request's Host header may give, comma-separated (without --api-key the server "
                        "answers only to its own names and addresses; '*': to any, which a web page can then reach by "
                        "DNS rebinding)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="sequences each worker decodes together (fewer if their KV cache would not fit --kv-memory-gib)")
    p.add_argument("--int8", action="store_true",
                   help="int8 weights on a CPU: about a quarter of fp32's memory, the same reply nearly always")
    p.add_argument("--decode", default="eager", choices=["eager", "captured"],
                   help="captured: the decode step in static shapes, replayed as CUDA graphs on a GPU (eager elsewhere)")
    p.add_argument("--kv-memory-gib", type=float, default=None,
                   help="memory for each worker's KV cache (default: half the GPU's free memory; on a CPU a quarter "
                        "of the RAM, at most 4 GiB)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of each worker (default on a CPU: one fewer than its cores, at least 1, so the "
                        "server's event loop and the clients keep a core; with GPUs the cores shared among the "
                        "workers; $OMP_NUM_THREADS also sets it)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but / and /health (default: "
                        "$NANOCHAT_API_KEY); given several times, any of the keys, and each key is one client for "
                        "--client-share")
    p.add_argument("--client-share", type=float, default=CLIENT_SHARE,
                   help="the share of the server one client (its key, whatever its addresses; without --api-key its "
                        "address) may hold at once: of the rows, of --max-queue, of the prompt tokens waiting to be "
                        "scored and of the /tokenize and /detokenize requests in progress (1: no bound)")
    p.add_argument("--trusted-proxy", default="", metavar="ADDRESSES",
                   help="the reverse proxy in front of this server: its addresses or networks, comma-separated; a "
                        "request from it is its X-Forwarded-For client's (default: none, and no request may name "
                        "another address than its own)")
    args = p.parse_args(argv)
    if args.api_key is None:
        args.api_key = [os.environ["NANOCHAT_API_KEY"]] if os.environ.get("NANOCHAT_API_KEY") is not None else []
    try:
        check_number("--temperature", args.temperature, *TEMPERATURE_RANGE)
        check_number("--top-k", args.top_k, *TOP_K_RANGE, integer=True)
        check_number("--max-tokens", args.max_tokens, *MAX_TOKENS_RANGE, integer=True)
        check_number("--queue-timeout", args.queue_timeout, 0.0, 3600.0, low_open=True)
        check_number("--port", args.port, 0, 65535, integer=True)
        check_number("--max-batch", args.max_batch, 1, 4096, integer=True)
        check_number("--threads", args.threads, 0, 4096, integer=True)
        if args.kv_memory_gib is not None:
            check_number("--kv-memory-gib", args.kv_memory_gib, 0.0, 1e6, low_open=True)
        check_number("--max-queue", args.max_queue, 1, 1_000_000, integer=True)
        check_number("--max-connections", args.max_connections, 0, 1_000_000, integer=True)
        check_number("--header-timeout", args.header_timeout, 0.0, 3600.0, low_open=True)
        check_number("--write-timeout", args.write_timeout, 0.0, 3600.0, low_open=True)
        check_number("--client-share", args.client_share, 0.0, 1.0, low_open=True)
        args.trusted_proxy = trusted_proxies(args.trusted_proxy)
        for key in args.api_key:
            if not key.strip() or key != key.strip():
                raise RequestError("--api-key", "must be a non-empty key without surrounding spaces")
            if not (key.isascii() and key.isprintable()):
                raise RequestError("--api-key", "must be printable ASCII: HTTP headers cannot carry other characters, "
                                   "so no client could send it")
    except RequestError as e:
        raise UserError(str(e)) from None
    return args


def trusted_proxies(text):
    """--trusted-proxy's addresses and networks, normalised for uvicorn; a name or '*' is refused: anyone could then
    say they forward anyone."""
    proxies = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        try:
            proxies.append(str(ipaddress.ip_network(item, strict=False)) if "/" in item else
                           str(ipaddress.ip_address(item)))
        except ValueError:
            raise RequestError("--trusted-proxy", f"{item!r}: give the proxy's address or network (as 127.0.0.1, "
                               "::1 or 10.0.0.0/8), not a name or '*'") from None
    return proxies


def proxy_settings(args):
    """uvicorn's X-Forwarded-For handling: off unless --trusted-proxy names the proxy (uvicorn's default trusts the
    header from loopback, so any program on the machine, or a tunnel, could claim to be any client)."""
    if not args.trusted_proxy:
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": ",".join(args.trusted_proxy)}


def allowed_hosts(args):
    """The Host names the server answers to, said at start: without a key its own names and addresses on any bind
    (DNS rebinding), with one on loopback only the loopback names; None (any) with a key elsewhere, or '*'."""
    extra = [name.strip() for name in args.allowed_hosts.split(",") if name.strip()]
    if "*" in extra:
        print0("warning: --allowed-hosts '*': any Host name is answered, so a web page can reach this server by DNS "
               "rebinding" + ("" if args.api_key else " and use the model without a key"))
        return None
    if args.api_key and args.host not in LOOPBACK:
        return None  # the key guards it: a page cannot send it
    names = allowed_host_names(args.host, extra)
    print0(f"answering requests whose Host is {', '.join(names)} (--allowed-hosts adds names)")
    return names


LISTEN_BACKLOG = 4096  # connections the kernel holds until the server accepts them (at most net.core.somaxconn)


class StoppingServer(uvicorn.Server):
    """uvicorn, which on SIGTERM or Ctrl-C first ends every request (a stream with an error event and [DONE], a waiting
    or whole one with a 503), then shuts down: no reply is cut off mid-chunk after the grace period."""

    def __init__(self, config, pool):
        super().__init__(config)
        self.pool = pool

    def handle_exit(self, sig, frame):
        self.pool.stop_soon()
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        # asyncio listened with uvicorn's backlog, which is also how many connections it accepts in one go; the
        # kernel's queue may be longer: a connection that finds it full is dropped and tried again after a second
        # (a 3,000-socket flood made /health and a keyed chat take 1.1-1.3 s)
        for sock in sockets or []:
            sock.listen(LISTEN_BACKLOG)


def main(argv=None):
    args = parse_args(argv)
    open_files = raise_open_file_limit()  # every connection is a file: a flood must not run the process out of them
    sock = bind_socket(args.host, args.port)
    workers, tokenizer, info = load_workers(args.source, args.model_tag, args.step, args.device_type, args.workers,
                                            args.max_batch, args.kv_memory_gib, threads=args.threads,
                                            decode=args.decode, int8=args.int8)
    if args.source == "base":
        print0("note: a base model was never taught the chat format; expect it to ramble "
               "(chat_cli -i base continues plain text)")
    pool = WorkerPool(workers, args.queue_timeout, args.max_queue, args.client_share)
    defaults = {"temperature": args.temperature, "top_k": args.top_k, "max_tokens": args.max_tokens}
    guard = ConnectionGuard(args.max_connections or default_max_connections(open_files), args.header_timeout,
                            args.write_timeout)
    app = create_app(pool, tokenizer, info, defaults, api_keys=args.api_key, allowed_hosts=allowed_hosts(args),
                     connections=guard.stats)
    # what start-up made (the model's modules, the tokenizer's tables) is never garbage: out of the collector's way, so
    # a full collection while a big reply is built walks the reply, not them (gc.collect first: it stops tracking the
    # tuples of plain values, such as the token table's bytes, which a frozen object would keep tracked)
    gc.collect()
    gc.freeze()
    host, port = sock.getsockname()[:2]
    shown_host = {"0.0.0.0": "localhost", "::": "localhost"}.get(host, f"[{host}]" if ":" in host else host)
    if args.host not in LOOPBACK and not args.api_key:
        print0(f"warning: listening on {args.host} without --api-key: anyone who can reach this address can use the "
               "model")
    url = f"http://{shown_host}:{port}/"
    sock.listen(128)  # from the line below on, a connection waits in the kernel's queue while uvicorn starts: not refused
    print0(f"serving at {url} (open it in a browser; OpenAI API at {url}v1)")
    # backlog: also how many connections asyncio accepts in one go before the guard sees them (uvicorn's 2048 could
    # take more files than a 1,024 limit has)
    if args.trusted_proxy:
        print0(f"a request from {', '.join(args.trusted_proxy)} (--trusted-proxy) is the client its X-Forwarded-For "
               "names")
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, http=guard.protocol_class(),
                            timeout_keep_alive=5, backlog=128, **proxy_settings(args))
    # uvicorn raises the SIGTERM or Ctrl-C it caught again once it has shut down: a stop, not a crash (exit code 0)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        StoppingServer(config, pool).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    print0("server stopped")


if __name__ == "__main__":
    run_main(main)
