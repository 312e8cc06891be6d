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
import hmac
import json
import os
import queue
import secrets
import socket
import threading
import time
import traceback
import uuid
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from nanochat.batch_engine import BatchEngine, Sampling, kv_budget_bytes, kv_row_bytes
from nanochat.chat import (MODEL_MARKUP, SEED_MODULUS, Finish, MarkupWriter, Piece, ReplyStream, RequestError,
                           fit_conversation,
                           model_summary, openai_chunk, openai_completion, openai_error, openai_head,
                           openai_model_card, openai_usage, openai_usage_chunk, parts_as_markup, prompt_budget,
                           read_sampling, validate_messages)
from nanochat.checkpoint_manager import load_model
from nanochat.common import UserError, compute_init, print0

FLUSH_SECONDS = 0.015  # a worker hands its tokens to the event loop at most this often (and at once when idle)
MAX_BODY_BYTES = 1_000_000  # a request within every limit of nanochat/chat.py is well under this, JSON-escaped
UI_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui.html")

# -----------------------------------------------------------------------------
# Workers: each runs continuous batching on its own thread


class Worker:
    """
    A model replica and the thread that runs its BatchEngine: between two decode steps it admits new requests (their
    samples become rows of the running batch as rows free up), drops cancelled ones, and hands every row's new text
    to its request.
    """

    def __init__(self, index, engine, device):
        self.index, self.engine, self.device = index, engine, device
        self.inbox = queue.Queue()  # Generations to admit, and None to stop
        self.generations = []  # admitted to the engine (waiting for rows, or running)
        self.ended = []  # ended since the last flush: their last events are still to be delivered
        self.flushed = 0.0  # when events were last handed to the event loop
        self.owner = {}  # id(Sequence) -> (Generation, sample index)
        self.thread = threading.Thread(target=self._run, name=f"worker{index}", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        self.inbox.put(None)

    def load(self):
        """Rows this worker has taken or been asked for: where the next request goes is the least loaded worker."""
        occupancy = self.engine.occupancy()
        return occupancy["active"] + occupancy["waiting"] + self.inbox.qsize()

    def _run(self):
        if self.device.type == "cuda":  # CUDA ops default to the thread's current device: this replica's GPU
            torch.cuda.set_device(self.device)
        while True:
            self._flush(force=not self.generations)
            try:
                item = self.inbox.get(block=not self.generations)
                while True:
                    if item is None:
                        return
                    self._admit(item)
                    item = self.inbox.get_nowait()
            except queue.Empty:
                pass
            for generation in [g for g in self.generations if g.cancelled.is_set()]:
                self._drop(generation)
            if not self.engine.busy():
                continue
            try:
                steps = self.engine.step()
            except Exception as e:  # a bug, or the device failing: every request in flight gets a 500
                traceback.print_exc()
                for generation in list(self.generations):
                    generation.emit(f"generation failed: {type(e).__name__}: {e}")
                    self._drop(generation)
                continue
            for generation in self.generations:
                generation.note_admission()
            for seq, token, _ in steps:
                generation, index = self.owner[id(seq)]
                generation.push(index, token, seq)
                if generation.streams[index].finish_reason is not None and seq.finished is None:
                    self.engine.cancel(seq)  # a stop string, or a turn token the engine does not end on
            for generation in [g for g in self.generations if g.done()]:
                self._drop(generation)

    def _flush(self, force=False):
        """
        Hand the generations' new events to the event loop, every FLUSH_SECONDS, or at once when a request was just
        admitted or ended or the worker is about to wait: one wake-up of the loop, and one write per client, for
        several steps' tokens, which is what the event loop's thread can keep up with at dozens of streams.
        """
        now = time.perf_counter()
        urgent = force or self.ended or any(g.outbox and g.outbox[0] is _ADMITTED for g in self.generations)
        if not urgent and now - self.flushed < FLUSH_SECONDS:
            return
        self.flushed = now
        ready = [(g, g.take_outbox()) for g in self.generations + self.ended if g.outbox]
        self.ended = []
        if ready:
            try:
                ready[0][0].pool.loop.call_soon_threadsafe(deliver, ready)
            except RuntimeError:  # the event loop is gone: the server is shutting down
                for generation, _ in ready:
                    generation.cancelled.set()

    def _admit(self, generation):
        if generation.cancelled.is_set():
            generation.end()
            self.ended.append(generation)
            return
        try:
            seqs = self.engine.add_group(generation.prompt_ids, generation.samplings)
        except ValueError as e:  # a prompt the engine cannot take (the server fits it first, so a bug)
            generation.emit(f"generation failed: {e}")
            generation.end()
            self.ended.append(generation)
            return
        generation.seqs = seqs
        for index, seq in enumerate(seqs):
            self.owner[id(seq)] = (generation, index)
        self.generations.append(generation)

    def _drop(self, generation):
        for seq in generation.seqs:
            self.engine.cancel(seq)
            self.owner.pop(id(seq), None)
        self.generations.remove(generation)
        generation.end()
        self.ended.append(generation)


class QueueTimeout(Exception):
    pass


class WorkerPool:
    """The workers, where each request goes, and what was served (for /stats)."""

    def __init__(self, workers, queue_timeout):
        self.workers = workers
        self.tokenizer = workers[0].engine.tokenizer
        self.queue_timeout = queue_timeout
        self.loop = None
        self.active = set()  # generations in flight, cancelled when the server stops
        self.requests_served = 0
        self.requests_cancelled = 0
        self.requests_rejected = 0
        self.tokens_generated = 0
        self.generation_seconds = 0.0
        self.started = time.time()

    def start(self):
        self.loop = asyncio.get_running_loop()
        for worker in self.workers:
            worker.start()

    def stop(self):
        for generation in list(self.active):  # let worker threads end now rather than at max_tokens
            generation.cancel()
        for worker in self.workers:
            worker.stop()

    async def submit(self, prompt_ids, sampling, chat=True):
        """A Generation on the least loaded worker, once the engine has given its samples rows; a request that waits
        longer than the queue timeout for them is withdrawn and gets a 503."""
        worker = min(self.workers, key=lambda w: w.load())
        generation = Generation(self, prompt_ids, sampling, chat)
        worker.inbox.put(generation)
        try:
            await asyncio.wait_for(generation.admitted.wait(), self.queue_timeout)
        except asyncio.TimeoutError:
            generation.cancel()
            self.requests_rejected += 1
            rows = sum(w.engine.max_batch for w in self.workers)
            raise QueueTimeout(f"all {rows} rows of the batch stayed busy for {self.queue_timeout:g} s "
                               "(--queue-timeout); try again shortly") from None
        return generation

    def finished(self, generation):
        """Called in the event loop when a generation's last event is out."""
        self.active.discard(generation)
        if not generation.was_admitted:
            return
        outcome = "cancelled" if generation.replies_finished < generation.num_samples else "done"
        print0(f"{generation.num_samples} repl{'ies' if generation.num_samples > 1 else 'y'}, {generation.tokens} tokens "
               f"in {generation.seconds:.2f}s, {outcome}")
        if outcome == "cancelled":
            self.requests_cancelled += 1
        else:
            self.requests_served += 1
            self.tokens_generated += generation.tokens
            self.generation_seconds += generation.seconds

    def stats(self):
        occupancy = [w.engine.occupancy() for w in self.workers]
        busy = sum(1 for o in occupancy if o["active"])
        rows, active = sum(o["rows"] for o in occupancy), sum(o["active"] for o in occupancy)
        return {
            "queue_depth": sum(o["waiting"] for o in occupancy) + sum(w.inbox.qsize() for w in self.workers),
            "workers": {"total": len(self.workers), "busy": busy, "free": len(self.workers) - busy},
            "batch": {"rows": rows, "active": active, "occupancy": round(active / rows, 3),
                      "shared_steps": sum(o["shared_steps"] for o in occupancy)},
            "requests_served": self.requests_served,
            "requests_cancelled": self.requests_cancelled,
            "requests_rejected": self.requests_rejected,
            "tokens_generated": self.tokens_generated,
            "tokens_per_second": round(self.tokens_generated / max(self.generation_seconds, 1e-9), 1),
            "uptime_seconds": round(time.time() - self.started, 1),
        }


_ADMITTED, _END = object(), object()  # a generation's samples have rows; its last event


def deliver(ready):
    """In the event loop: [(generation, events)] from a worker's step."""
    for generation, events in ready:
        generation.receive(events)


class Generation:
    """
    One request's replies. Its worker's thread feeds tokens in (push) and its events (Piece, Finish, or an error
    string) come out of `events()` in the event loop. cancel() withdraws it before its next step.
    """

    def __init__(self, pool, prompt_ids, sampling, chat):
        self.pool, self.prompt_ids, self.chat = pool, prompt_ids, chat
        self.num_samples = sampling.num_samples
        seed = secrets.randbelow(SEED_MODULUS) if sampling.seed is None else sampling.seed
        self.samplings = [Sampling(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                   max_tokens=sampling.max_tokens, seed=seed + i) for i in range(self.num_samples)]
        self.streams = [ReplyStream(pool.tokenizer, sampling.stop, chat) for _ in range(self.num_samples)]
        self.seqs = []
        self.cancelled = threading.Event()
        self.queue = asyncio.Queue()  # lists of events, one list per worker step
        self.outbox = []  # the worker thread's events of this step, not yet delivered
        self.admitted = asyncio.Event()
        self.was_admitted = False
        self.tokens = 0
        self.replies_finished = 0
        self.started = None
        self.seconds = 0.0
        self.ended = False
        pool.active.add(self)

    # -- on the worker's thread --

    def emit(self, event):
        self.outbox.append(event)

    def take_outbox(self):
        events, self.outbox = self.outbox, []
        return events

    def note_admission(self):
        if not self.was_admitted and self.seqs and all(seq.row is not None for seq in self.seqs):
            self.was_admitted, self.started = True, time.perf_counter()
            self.emit(_ADMITTED)

    def push(self, index, token, seq):
        stream = self.streams[index]
        for kind, text in stream.push(token):
            self.emit(Piece(index, kind, text))
        if stream.finish_reason is None and seq.finished == "length":
            for kind, text in stream.finish("length"):
                self.emit(Piece(index, kind, text))
        if stream.finish_reason is not None:
            self.tokens += stream.num_tokens
            self.replies_finished += 1
            self.emit(Finish(index, stream.finish_reason, stream.num_tokens, stream.parts))

    def done(self):
        return self.replies_finished == self.num_samples

    def end(self):
        if self.ended:
            return
        self.ended = True
        self.seconds = time.perf_counter() - self.started if self.started else 0.0
        self.emit(_END)

    # -- in the event loop --

    def receive(self, events):
        if any(e is _ADMITTED for e in events):
            self.admitted.set()
            events = [e for e in events if e is not _ADMITTED]
        if events:
            self.queue.put_nowait(events)
        if events and events[-1] is _END:
            self.pool.finished(self)

    def cancel(self):
        self.cancelled.set()
        if not self.was_admitted:  # still in a worker's inbox or the engine's queue: end it here too
            self.admitted.set()

    async def event_batches(self):
        """Lists of events as the worker's steps make them (a stream writes each list in one piece)."""
        while True:
            events = await self.queue.get()
            if events[-1] is _END:
                if len(events) > 1:
                    yield events[:-1]
                return
            yield events

    async def events(self):
        async for events in self.event_batches():
            for event in events:
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
        return body, sampling, prompt, await self.pool.submit(prompt.ids, sampling)

    async def ui_completion(self, request: Request):
        """POST /chat/completions: the UI's stream of {"token"}, {"python"}, {"python_output"} ..., then {"done"}."""
        _, _, prompt, generation = await self.start_generation(request, openai=False)
        kinds = {"text": "token", "python": "python", "python_output": "python_output"}

        def as_sse(events):
            """One write for a batch of events; consecutive pieces of one kind go out as one event."""
            out, kind, text = [], None, ""
            for event in events + [None]:
                if isinstance(event, Piece) and (event.kind == kind or kind is None):
                    kind, text = event.kind, text + event.text
                    continue
                if kind is not None:
                    out.append(sse({kinds[kind]: text}))
                    kind, text = None, ""
                if isinstance(event, Piece):
                    kind, text = event.kind, event.text
                elif isinstance(event, Finish):
                    usage = openai_usage(len(prompt.ids), event.completion_tokens)
                    out.append(sse({"done": True, "finish_reason": event.reason, "usage": usage}))
                elif event is not None:
                    out.append(sse({"error": event}))
            if kind is not None:
                out.append(sse({kinds[kind]: text}))
            return "".join(out)

        async def stream():
            # A client that leaves mid-stream makes the response stop this generator (Starlette watches for the
            # disconnect); the finally then frees its row at the worker's next step.
            try:
                if prompt.note:
                    yield sse({"note": prompt.note})
                async for events in generation.event_batches():
                    yield as_sse(events)
            finally:
                generation.cancel()

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
            async for events in generation.event_batches():  # one write per batch the worker hands over
                out, pending = [], {}  # a choice's text of this batch goes out as one chunk

                def write_pending(index):
                    if pending.get(index):
                        out.append(sse(openai_chunk(head, index, {"content": pending.pop(index)})))

                for event in events:
                    if isinstance(event, Piece):
                        pending[event.index] = pending.get(event.index, "") + \
                            writers[event.index].write(event.kind, event.text)
                    elif isinstance(event, Finish):
                        pending[event.index] = pending.get(event.index, "") + writers[event.index].close()
                        write_pending(event.index)
                        out.append(sse(openai_chunk(head, event.index, {}, event.reason)))
                        tokens += event.completion_tokens
                    else:
                        for index in list(pending):
                            write_pending(index)
                        yield "".join(out) + sse(openai_error(event, "server_error"))
                        return
                for index in list(pending):
                    write_pending(index)
                if out:
                    yield "".join(out)
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


OPEN_PATHS = ("/", "/health")  # the UI's page (it holds no model access: it asks for the key) and monitoring


class RequireKey:
    """
    ASGI wrapper: every request but OPEN_PATHS needs `Authorization: Bearer KEY`, compared in constant time; others get
    a 401 in the API's error shape. Plain ASGI rather than an HTTP middleware, which would buffer the streamed replies
    and hide a client's disconnect from them.
    """

    def __init__(self, app, key):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                reason = "missing" if not header else "wrong"
                error = openai_error(f"{reason} API key: send the header `Authorization: Bearer <key>` with the key the "
                                     "server was started with (--api-key)", "invalid_request_error")
                error["error"]["code"] = "invalid_api_key"
                response = JSONResponse(error, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(pool, tokenizer, model_info, defaults, api_key=None):
    """
    The app around a pool of workers. defaults: temperature, top_k, max_tokens of requests that omit them; api_key:
    a key every route but OPEN_PATHS requires (RequireKey), or None.
    """
    server = ChatServer(pool, tokenizer, model_info, defaults)
    with open(UI_PATH, encoding="utf-8") as f:
        ui_html = f.read()

    @asynccontextmanager
    async def lifespan(app):
        pool.start()
        yield
        pool.stop()

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
        return {"status": "ok", "workers": len(pool.workers), "auth_required": api_key is not None, "model": model_info}

    async def stats():
        return pool.stats()

    app.get("/")(ui)
    app.get("/health")(health)
    app.get("/stats")(stats)
    app.post("/chat/completions")(server.ui_completion)
    app.post("/v1/chat/completions")(server.openai_completion)
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{name}")(server.model)
    return RequireKey(app, api_key) if api_key else app


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


def serving_threads(device, threads):
    """torch's intra-op threads for serving: the flag, else $OMP_NUM_THREADS, else on a CPU one fewer than its cores.
    A small model's decode step is many small ops that a second thread barely speeds up (measured: 2 threads 25 %
    slower at 16 rows on a 2-core CPU), while the event loop, tokenization and the clients need a core."""
    if threads:
        return threads
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 2) - 1) if device.type == "cpu" else torch.get_num_threads()


def load_workers(source, model_tag, step, device_type, num_workers, max_batch, kv_memory_gib=None, prefill_chunk=256,
                 threads=0):
    """
    (workers, tokenizer, model info) for a stage's checkpoint: one replica per GPU on CUDA (num_workers 0: every GPU);
    on CPU every worker shares one model (num_workers 0: one worker). Each worker batches up to max_batch sequences,
    fewer if their KV cache would not fit the memory budget.
    """
    _, _, _, _, device = compute_init(device_type)
    torch.set_num_threads(serving_threads(device, threads))
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
    workers, model, tokenizer, meta, rows = [], None, None, None, max_batch
    for index, worker_device in enumerate(devices):
        if model is None or worker_device.type == "cuda":
            print0(f"loading the {source} model on {worker_device} ...")
            model, tokenizer, meta = load_model(source, worker_device, model_tag=model_tag, step=step)
            model.cast_linears_for_inference()  # generation only: bf16 weights once on a bf16 CPU
            row_bytes = kv_row_bytes(model.config, worker_device)
            budget = kv_budget_bytes(worker_device, kv_memory_gib) // (count if worker_device.type != "cuda" else 1)
            rows = min(max_batch, budget // row_bytes)
            if rows < 1:
                raise UserError(f"one sequence's KV cache needs {row_bytes / 2**20:.0f} MiB, more than the "
                                f"{budget / 2**20:.0f} MiB budget; give --kv-memory-gib more")
        workers.append(Worker(index, BatchEngine(model, tokenizer, rows, prefill_chunk), worker_device))
    info, line = model_summary(meta, model, ", ".join(sorted({str(d) for d in devices})), source)
    info["id"] = f"nanochat-{source}-{info['tag']}"
    cache_mib = workers[0].engine.cache.nbytes() / 2**20
    print0(f"loaded {line}; {len(workers)} worker{'s' if len(workers) > 1 else ''}, each batching up to {rows} "
           f"sequences (KV cache {cache_mib:,.0f} MiB{'' if rows == max_batch else f', fewer than --max-batch {max_batch}: the memory budget'}"
           f"; prompts prefilled {prefill_chunk} tokens a step; {torch.get_num_threads()} torch thread"
           f"{'s' if torch.get_num_threads() > 1 else ''})")
    return workers, tokenizer, info
