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
longer than --queue-timeout gets a 503. Generation runs on the worker's own thread so the event loop keeps
answering; between tokens the thread checks whether its client is still there, so a client that disconnects
frees its worker at once. Request limits are the constants at the top of nanochat/chat.py.
"""

import argparse
import asyncio
import json
import os
import socket
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

import nanochat.chat
from nanochat.chat import (MAX_TOKENS_RANGE, MODEL_MARKUP, TEMPERATURE_RANGE, TOP_K_RANGE, Finish, MarkupWriter, Piece,
                           RequestError, check_number, fit_conversation, generate_replies, model_summary,
                           parts_as_markup, prompt_budget, read_sampling, validate_messages)
from nanochat.checkpoint_manager import load_model
from nanochat.common import UserError, compute_init, print0, run_main
from nanochat.engine import Engine

MAX_BODY_BYTES = 1_000_000  # a request within every limit of nanochat/chat.py is well under this, JSON-escaped
UI_PATH = os.path.join(os.path.dirname(nanochat.chat.__file__), "ui.html")


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


# -----------------------------------------------------------------------------
# Workers and the queue in front of them


class Worker:
    """A model replica and the one thread that runs its generations."""

    def __init__(self, index, engine, device):
        self.index = index
        self.engine = engine
        self.device = device
        # CUDA ops default to the thread's current device: pin this worker's thread to its replica's GPU
        pin = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"worker{index}", initializer=pin)


class QueueTimeout(Exception):
    pass


class WorkerPool:
    """Free workers in an asyncio queue; what was served, for /stats."""

    def __init__(self, workers, queue_timeout):
        self.workers = workers
        self.queue_timeout = queue_timeout
        self.free = None  # an asyncio.Queue, made in the server's event loop (see start)
        self.waiting = 0
        self.active = set()  # generations in flight, cancelled when the server stops
        self.requests_served = 0
        self.requests_cancelled = 0
        self.requests_rejected = 0
        self.tokens_generated = 0
        self.generation_seconds = 0.0
        self.started = time.time()

    def start(self):
        self.free = asyncio.Queue()
        for worker in self.workers:
            self.free.put_nowait(worker)

    async def acquire(self):
        self.waiting += 1
        try:
            return await asyncio.wait_for(self.free.get(), self.queue_timeout)
        except asyncio.TimeoutError:
            self.requests_rejected += 1
            raise QueueTimeout(f"all {len(self.workers)} workers stayed busy for {self.queue_timeout:g} s "
                               "(--queue-timeout); try again shortly") from None
        finally:
            self.waiting -= 1

    def release(self, worker, generation):
        self.active.discard(generation)
        outcome = "cancelled" if generation.replies_finished < generation.num_samples else "done"
        print0(f"worker {worker.index}: {generation.num_samples} repl{'ies' if generation.num_samples > 1 else 'y'}, "
               f"{generation.tokens} tokens in {generation.seconds:.2f}s, {outcome}")
        if outcome == "cancelled":
            self.requests_cancelled += 1
        else:
            self.requests_served += 1
            self.tokens_generated += generation.tokens
            self.generation_seconds += generation.seconds
        self.free.put_nowait(worker)

    def stats(self):
        free = self.free.qsize() if self.free is not None else len(self.workers)
        return {
            "queue_depth": self.waiting,
            "workers": {"total": len(self.workers), "busy": len(self.workers) - free, "free": free},
            "requests_served": self.requests_served,
            "requests_cancelled": self.requests_cancelled,
            "requests_rejected": self.requests_rejected,
            "tokens_generated": self.tokens_generated,
            "tokens_per_second": round(self.tokens_generated / max(self.generation_seconds, 1e-9), 1),
            "uptime_seconds": round(time.time() - self.started, 1),
        }


_END = object()  # the last event of every generation


class Generation:
    """
    One request's replies, generated on its worker's thread. Events (Piece, Finish, or an error string) come out
    of `events()` in the event loop. cancel() makes the thread stop before its next token; either way the worker
    goes back to the pool as soon as the thread is done.
    """

    def __init__(self, pool, worker, prompt_ids, sampling, chat=True):
        self.cancelled = threading.Event()
        self.queue = asyncio.Queue()
        self.tokens = 0
        self.seconds = 0.0
        self.num_samples = sampling.num_samples
        self.replies_finished = 0
        pool.active.add(self)
        loop = asyncio.get_running_loop()
        worker.thread.submit(self._run, loop, pool, worker, prompt_ids, sampling, chat)

    def _run(self, loop, pool, worker, prompt_ids, sampling, chat):
        started = time.perf_counter()

        def hand_over(event):
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:  # the event loop is gone: the server is shutting down
                self.cancelled.set()

        try:
            replies = generate_replies(worker.engine, prompt_ids, num_samples=sampling.num_samples,
                                       max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                       top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed,
                                       stop=sampling.stop, chat=chat, cancelled=self.cancelled.is_set)
            for event in replies:
                if isinstance(event, Finish):
                    self.tokens += event.completion_tokens
                    self.replies_finished += 1
                hand_over(event)
        except Exception as e:  # a bug, or the device failing: the client gets a 500, the server lives on
            traceback.print_exc()
            hand_over(f"generation failed: {type(e).__name__}: {e}")
        finally:
            self.seconds = time.perf_counter() - started
            hand_over(_END)
            try:
                loop.call_soon_threadsafe(pool.release, worker, self)
            except RuntimeError:
                pass

    def cancel(self):
        self.cancelled.set()

    async def events(self):
        while True:
            event = await self.queue.get()
            if event is _END:
                return
            yield event


async def cancel_on_disconnect(request, generation):
    """For replies sent in one piece: watch the connection while the reply is written, stop it if the client leaves."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            generation.cancel()
            return


# -----------------------------------------------------------------------------
# Requests and responses


class HTTPProblem(Exception):
    def __init__(self, status, message, kind="invalid_request_error", param=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(message, kind, param=None):
    """The OpenAI API's error shape, so its clients show the message."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


async def read_json_body(request):
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HTTPProblem(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HTTPProblem(400, f"request body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(body, dict):
        raise HTTPProblem(400, "request body must be a JSON object")
    return body


def sse(payload):
    return f"data: {json.dumps(payload)}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(pool, tokenizer, model_info, defaults):
    """The FastAPI app around a pool of workers. defaults: temperature, top_k, max_tokens of requests that omit them."""
    context = model_info["context"]
    model_id = model_info["id"]
    with open(UI_PATH, encoding="utf-8") as f:
        ui_html = f.read()

    @asynccontextmanager
    async def lifespan(app):
        pool.start()
        yield
        for generation in list(pool.active):  # let worker threads end now rather than at max_tokens
            generation.cancel()

    app = FastAPI(title="nanochat", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def bad_request(request, e):
        return JSONResponse(error_body(str(e), "invalid_request_error", e.field), status_code=400)

    @app.exception_handler(HTTPProblem)
    async def http_problem(request, e):
        return JSONResponse(error_body(e.message, e.kind, e.param), status_code=e.status)

    @app.exception_handler(QueueTimeout)
    async def busy(request, e):
        return JSONResponse(error_body(str(e), "server_busy"), status_code=503, headers={"Retry-After": "1"})

    async def start_generation(request, openai):
        """Read and check a request, fit its conversation to the context and wait for a worker."""
        body = await read_json_body(request)
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise RequestError("model", "must be a string")
        if not isinstance(body.get("stream", False), bool):
            raise RequestError("stream", "must be true or false")
        messages = validate_messages(body.get("messages"))
        sampling = read_sampling(body, defaults["temperature"], defaults["top_k"], defaults["max_tokens"])
        if not openai and sampling.num_samples != 1:
            raise RequestError("n", "this endpoint streams one reply; ask /v1/chat/completions for several")
        # tokenizing up to MAX_TOTAL_CHARS a few times takes milliseconds: off the event loop
        budget = prompt_budget(context, sampling.max_tokens)
        prompt = await asyncio.to_thread(fit_conversation, tokenizer, messages, budget)
        worker = await pool.acquire()
        return body, sampling, prompt, Generation(pool, worker, prompt.ids, sampling)

    @app.get("/")
    async def ui():
        return HTMLResponse(ui_html)

    @app.get("/health")
    async def health():
        return {"status": "ok", "workers": len(pool.workers), "model": model_info}

    @app.get("/stats")
    async def stats():
        return pool.stats()

    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        _, _, prompt, generation = await start_generation(request, openai=False)
        kinds = {"text": "token", "python": "python", "python_output": "python_output"}

        async def stream():
            try:
                if prompt.note:
                    yield sse({"note": prompt.note})
                async for event in generation.events():
                    if await request.is_disconnected():
                        return
                    if isinstance(event, Piece):
                        yield sse({kinds[event.kind]: event.text})
                    elif isinstance(event, Finish):
                        usage = {"prompt_tokens": len(prompt.ids), "completion_tokens": event.completion_tokens,
                                 "total_tokens": len(prompt.ids) + event.completion_tokens}
                        yield sse({"done": True, "finish_reason": event.reason, "usage": usage})
                    else:
                        yield sse({"error": event})
            finally:
                generation.cancel()  # a client gone mid-stream ends up here: its worker is freed at the next token

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/chat/completions")
    async def openai_chat_completions(request: Request):
        body, sampling, prompt, generation = await start_generation(request, openai=True)
        n = sampling.num_samples
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_id,
                "system_fingerprint": None}

        def usage(completion_tokens):
            return {"prompt_tokens": len(prompt.ids), "completion_tokens": completion_tokens,
                    "total_tokens": len(prompt.ids) + completion_tokens}

        if not body.get("stream", False):
            watcher = asyncio.create_task(cancel_on_disconnect(request, generation))
            finished, failure = {}, None
            try:
                async for event in generation.events():
                    if isinstance(event, Finish):
                        finished[event.index] = event
                    elif isinstance(event, str):
                        failure = event
            finally:
                watcher.cancel()
                generation.cancel()
            if failure or len(finished) < n:
                return JSONResponse(error_body(failure or "generation was cancelled", "server_error"), status_code=500)
            choices = [{"index": i, "message": {"role": "assistant", "content": parts_as_markup(finished[i].parts)},
                        "finish_reason": finished[i].reason, "logprobs": None} for i in range(n)]
            tokens = sum(f.completion_tokens for f in finished.values())
            return {**head, "object": "chat.completion", "choices": choices, "usage": usage(tokens)}

        stream_options = body.get("stream_options") or {}
        include_usage = isinstance(stream_options, dict) and stream_options.get("include_usage") is True

        def chunk(index, delta, finish_reason=None):
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return sse({**head, "object": "chat.completion.chunk", "choices": [choice]})

        async def stream():
            writers = [MarkupWriter(MODEL_MARKUP) for _ in range(n)]
            tokens = 0
            try:
                for i in range(n):
                    yield chunk(i, {"role": "assistant", "content": ""})
                async for event in generation.events():
                    if await request.is_disconnected():
                        return
                    if isinstance(event, Piece):
                        text = writers[event.index].write(event.kind, event.text)
                        if text:
                            yield chunk(event.index, {"content": text})
                    elif isinstance(event, Finish):
                        tail = writers[event.index].close()
                        if tail:
                            yield chunk(event.index, {"content": tail})
                        yield chunk(event.index, {}, event.reason)
                        tokens += event.completion_tokens
                    else:
                        yield sse(error_body(event, "server_error"))
                        return
                if include_usage:
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(tokens)})
                yield "data: [DONE]\n\n"
            finally:
                generation.cancel()

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name != model_id:
            raise HTTPProblem(404, f"model {name!r} is not served here; this server has {model_id!r}",
                              kind="invalid_request_error", param="model")
        return model_card()

    def model_card():
        return {"id": model_id, "object": "model", "created": int(pool.started), "owned_by": "nanochat"}

    return app


# -----------------------------------------------------------------------------


def bind_socket(host, port):
    """Bind before loading the model, so a busy port is reported at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host") from None
    return sock


def load_workers(args):
    """(workers, tokenizer, model info): one replica per GPU on CUDA; on CPU every worker shares one model."""
    _, _, _, _, device = compute_init(args.device_type)
    if device.type == "cuda":
        count = args.workers or torch.cuda.device_count()
        if not 1 <= count <= torch.cuda.device_count():
            raise UserError(f"--num-gpus={args.workers}: this machine has {torch.cuda.device_count()} GPUs")
        devices = [torch.device("cuda", i) for i in range(count)]
    else:
        count = args.workers or 1
        if count < 1 or (device.type == "mps" and count != 1):
            raise UserError(f"--workers={args.workers}: must be >= 1 on CPU, and 1 on MPS")
        devices = [device] * count
    workers, model, tokenizer, meta = [], None, None, None
    for index, worker_device in enumerate(devices):
        if model is None or worker_device.type == "cuda":
            print0(f"loading the {args.source} model on {worker_device} ...")
            model, tokenizer, meta = load_model(args.source, worker_device, model_tag=args.model_tag, step=args.step)
        workers.append(Worker(index, Engine(model, tokenizer), worker_device))
    info, line = model_summary(meta, model, ", ".join(sorted({str(d) for d in devices})), args.source)
    info["id"] = f"nanochat-{args.source}-{info['tag']}"
    print0(f"loaded {line}; {len(workers)} worker{'s' if len(workers) > 1 else ''}")
    return workers, tokenizer, info


def main(argv=None):
    args = parse_args(argv)
    sock = bind_socket(args.host, args.port)
    workers, tokenizer, info = load_workers(args)
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
