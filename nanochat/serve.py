"""
The chat server behind `python -m scripts.chat_web`: a pool of workers (one model replica per GPU, or one shared
model on CPU), each running its generations on its own thread, and a FastAPI app with the browser UI's streaming
endpoint and the OpenAI-compatible one.

Requests wait in a queue for a free worker; one that waits longer than the pool's queue timeout gets a 503.
Generation runs on the worker's thread so the event loop keeps answering; between tokens the thread checks whether
its client is still there, so a client that disconnects frees its worker at once. What a request may ask for, and
the OpenAI API's response shapes, are in nanochat/chat.py.
"""

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
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from nanochat.chat import (MODEL_MARKUP, Finish, MarkupWriter, Piece, RequestError, fit_conversation, generate_replies,
                           model_summary, openai_chunk, openai_completion, openai_error, openai_head,
                           openai_model_card, openai_usage, openai_usage_chunk, parts_as_markup, prompt_budget,
                           read_sampling, validate_messages)
from nanochat.checkpoint_manager import load_model
from nanochat.common import UserError, compute_init, print0
from nanochat.engine import Engine

MAX_BODY_BYTES = 1_000_000  # a request within every limit of nanochat/chat.py is well under this, JSON-escaped
UI_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui.html")

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


class ChatServer:
    """What the routes share: the pool, the tokenizer, the model's description and the defaults of a request."""

    def __init__(self, pool, tokenizer, model_info, defaults):
        self.pool, self.tokenizer, self.model_info, self.defaults = pool, tokenizer, model_info, defaults
        self.context, self.model_id = model_info["context"], model_info["id"]

    async def start_generation(self, request, openai):
        """Read and check a request, fit its conversation to the context and wait for a worker."""
        body = await read_json_body(request)
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise RequestError("model", "must be a string")
        if not isinstance(body.get("stream", False), bool):
            raise RequestError("stream", "must be true or false")
        messages = validate_messages(body.get("messages"))
        d = self.defaults
        sampling = read_sampling(body, d["temperature"], d["top_k"], d["max_tokens"])
        if not openai and sampling.num_samples != 1:
            raise RequestError("n", "this endpoint streams one reply; ask /v1/chat/completions for several")
        # tokenizing up to MAX_TOTAL_CHARS a few times takes milliseconds: off the event loop
        budget = prompt_budget(self.context, sampling.max_tokens)
        prompt = await asyncio.to_thread(fit_conversation, self.tokenizer, messages, budget)
        worker = await self.pool.acquire()
        return body, sampling, prompt, Generation(self.pool, worker, prompt.ids, sampling)

    async def ui_completion(self, request: Request):
        """POST /chat/completions: the UI's stream of {"token"}, {"python"}, {"python_output"} ..., then {"done"}."""
        _, _, prompt, generation = await self.start_generation(request, openai=False)
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
                        usage = openai_usage(len(prompt.ids), event.completion_tokens)
                        yield sse({"done": True, "finish_reason": event.reason, "usage": usage})
                    else:
                        yield sse({"error": event})
            finally:
                generation.cancel()  # a client gone mid-stream ends up here: its worker is freed at the next token

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def openai_completion(self, request: Request):
        """POST /v1/chat/completions: the OpenAI API, the whole reply at once or streamed."""
        body, sampling, prompt, generation = await self.start_generation(request, openai=True)
        head = openai_head(self.model_id, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
        if body.get("stream", False):
            stream_options = body.get("stream_options") or {}
            include_usage = isinstance(stream_options, dict) and stream_options.get("include_usage") is True
            return StreamingResponse(self.openai_stream(request, generation, prompt, head, sampling.num_samples,
                                                        include_usage),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
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
        n = sampling.num_samples
        if failure or len(finished) < n:
            return JSONResponse(openai_error(failure or "generation was cancelled", "server_error"), status_code=500)
        replies = [(parts_as_markup(finished[i].parts), finished[i].reason) for i in range(n)]
        tokens = sum(f.completion_tokens for f in finished.values())
        return openai_completion(head, replies, openai_usage(len(prompt.ids), tokens))

    async def openai_stream(self, request, generation, prompt, head, n, include_usage):
        writers = [MarkupWriter(MODEL_MARKUP) for _ in range(n)]
        tokens = 0
        try:
            for i in range(n):
                yield sse(openai_chunk(head, i, {"role": "assistant", "content": ""}))
            async for event in generation.events():
                if await request.is_disconnected():
                    return
                if isinstance(event, Piece):
                    text = writers[event.index].write(event.kind, event.text)
                    if text:
                        yield sse(openai_chunk(head, event.index, {"content": text}))
                elif isinstance(event, Finish):
                    tail = writers[event.index].close()
                    if tail:
                        yield sse(openai_chunk(head, event.index, {"content": tail}))
                    yield sse(openai_chunk(head, event.index, {}, event.reason))
                    tokens += event.completion_tokens
                else:
                    yield sse(openai_error(event, "server_error"))
                    return
            if include_usage:
                yield sse(openai_usage_chunk(head, openai_usage(len(prompt.ids), tokens)))
            yield "data: [DONE]\n\n"
        finally:
            generation.cancel()

    async def models(self):
        return {"object": "list", "data": [openai_model_card(self.model_id, int(self.pool.started))]}

    async def model(self, name: str):
        if name != self.model_id:
            raise HTTPProblem(404, f"model {name!r} is not served here; this server has {self.model_id!r}",
                              kind="invalid_request_error", param="model")
        return openai_model_card(self.model_id, int(self.pool.started))


def create_app(pool, tokenizer, model_info, defaults):
    """The FastAPI app around a pool of workers. defaults: temperature, top_k, max_tokens of requests that omit them."""
    server = ChatServer(pool, tokenizer, model_info, defaults)
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
        return JSONResponse(openai_error(str(e), "invalid_request_error", e.field), status_code=400)

    @app.exception_handler(HTTPProblem)
    async def http_problem(request, e):
        return JSONResponse(openai_error(e.message, e.kind, e.param), status_code=e.status)

    @app.exception_handler(QueueTimeout)
    async def busy(request, e):
        return JSONResponse(openai_error(str(e), "server_busy"), status_code=503, headers={"Retry-After": "1"})

    async def ui():
        return HTMLResponse(ui_html)

    async def health():
        return {"status": "ok", "workers": len(pool.workers), "model": model_info}

    async def stats():
        return pool.stats()

    app.get("/")(ui)
    app.get("/health")(health)
    app.get("/stats")(stats)
    app.post("/chat/completions")(server.ui_completion)
    app.post("/v1/chat/completions")(server.openai_completion)
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{name}")(server.model)
    return app


# -----------------------------------------------------------------------------
# Starting up


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


def load_workers(source, model_tag, step, device_type, num_workers):
    """
    (workers, tokenizer, model info) for a stage's checkpoint: one replica per GPU on CUDA (num_workers 0: every GPU);
    on CPU every worker shares one model (num_workers 0: one worker).
    """
    _, _, _, _, device = compute_init(device_type)
    if device.type == "cuda":
        count = num_workers or torch.cuda.device_count()
        if not 1 <= count <= torch.cuda.device_count():
            raise UserError(f"--num-gpus={num_workers}: this machine has {torch.cuda.device_count()} GPUs")
        devices = [torch.device("cuda", i) for i in range(count)]
    else:
        count = num_workers or 1
        if count < 1 or (device.type == "mps" and count != 1):
            raise UserError(f"--workers={num_workers}: must be >= 1 on CPU, and 1 on MPS")
        devices = [device] * count
    workers, model, tokenizer, meta = [], None, None, None
    for index, worker_device in enumerate(devices):
        if model is None or worker_device.type == "cuda":
            print0(f"loading the {source} model on {worker_device} ...")
            model, tokenizer, meta = load_model(source, worker_device, model_tag=model_tag, step=step)
        workers.append(Worker(index, Engine(model, tokenizer), worker_device))
    info, line = model_summary(meta, model, ", ".join(sorted({str(d) for d in devices})), source)
    info["id"] = f"nanochat-{source}-{info['tag']}"
    print0(f"loaded {line}; {len(workers)} worker{'s' if len(workers) > 1 else ''}")
    return workers, tokenizer, info
