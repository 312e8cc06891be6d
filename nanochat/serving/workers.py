"""
The worker processes behind chat_web, from the server's side: its handle on each (nanochat/serving/worker_loop.py runs in them),
the pool that sends each request to the least loaded one, and starting them. The HTTP side is nanochat/serving/serve.py, the
OpenAI protocol nanochat/serving/openai_api.py.

A request goes to the least loaded worker and waits for rows of its batch; one that waits longer than the pool's
queue timeout gets a 503, as does one beyond --max-queue waiting requests. The worker sends the replies' text back in
batches, a few steps' worth at a time; a client that disconnects is cancelled and frees its rows at the worker's next
step (while it still waits, before it is ever prefilled). A scoring request (the log probabilities of prompts, for
/v1/completions' echo) needs no rows: the worker runs its forward pass between two decode steps. On a stop every
request ends at once, with its reason.
"""

import asyncio
import atexit
import gc
import itertools
import multiprocessing
import queue
import signal
import sys
import threading
import time
from multiprocessing.reduction import ForkingPickler

import torch

from nanochat.serving.chat import RequestError, summary_line
from nanochat.checkpoint_manager import load_model
from nanochat.common import UserError, inference_threads, print0, resolve_device_type, return_freed_memory
from nanochat.tokenizer import get_tokenizer
from nanochat.serving.messages import Add, Admitted, Cancel, Ended, Failed, Score, Scored, Stop, Token
from nanochat.serving.worker_loop import IDLE_TRIM_SECONDS, worker_main  # noqa: F401

# Prompt tokens that may wait to be scored at once, over all workers (a request past it gets a 503, unless nothing
# waits): ~40 bytes a token on the server while a request waits, so at most ~40 MB, and in work what 8 requests of 64
# prompts of a 2,048-token context ask for
MAX_SCORING_TOKENS = 8 * 64 * 2048


def stop_processes(processes, seconds=0.0):
    """Give the worker processes `seconds` in all to end, then kill those left (they ignore SIGTERM)."""
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)


class Worker:
    """
    The server's handle on a worker process: the requests it was given, and the events and occupancy it reports.
    Messages to the worker go out on a thread of their own: the event loop must never wait on a full pipe while the
    worker is busy with a step (or is itself waiting for the event loop to read its events).
    """

    def __init__(self, index, process, conn, rows):
        self.index, self.process, self.conn, self.rows = index, process, conn, rows
        self.generations = {}  # key -> Generation, not yet ended
        self.occupancy = {"rows": rows, "active": 0, "waiting": 0, "shared_steps": 0}
        self.alive = True
        self.loop = None
        self.outgoing = queue.Queue()  # messages for the worker; None ends the sender
        self.sender = threading.Thread(target=self._send_outgoing, name=f"worker{index}-sender", daemon=True)

    def start(self, loop):
        self.loop = loop
        loop.add_reader(self.conn.fileno(), self._read)
        self.sender.start()

    def submit(self, generation):
        self.generations[generation.key] = generation
        self.send(Add(generation.key, generation.prompt_ids, generation.samplings, generation.chat))

    def send(self, message):
        # pickled here, so a message that cannot be fails its request, not the sender thread
        self.outgoing.put(ForkingPickler.dumps(message))

    def _send_outgoing(self):
        while (data := self.outgoing.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the process is gone; _read reports it to every request in flight
                return

    def load(self):
        """Rows this worker has been asked for: where the next request goes is the least loaded worker."""
        return sum(g.num_samples for g in self.generations.values())

    def _read(self):
        """In the event loop, when the worker process has sent something."""
        try:
            while self.conn.poll():
                message = self.conn.recv()
                self.occupancy = message.occupancy
                for key, events in message.ready:
                    if key in self.generations:
                        self.generations[key].receive(events)
        except (EOFError, OSError):
            self._lost()

    def _lost(self):
        self.loop.remove_reader(self.conn.fileno())
        self.alive = False
        self.occupancy = {**self.occupancy, "active": 0, "waiting": 0}
        self.process.join(1)
        reason = (f"generation failed: worker {self.index} exited (exit code {self.process.exitcode}); "
                  "restart the server")
        print0(reason)
        for generation in list(self.generations.values()):
            generation.receive([reason, Ended(0, 0.0, 0)])

    def stop(self):
        """Tell the worker to stop; its end is expected, not a failure to report."""
        if self.loop is not None and self.alive:
            self.loop.remove_reader(self.conn.fileno())
        self.alive = False
        self.send(Stop())
        self.send(None)


class QueueTimeout(Exception):
    """A request waited longer than --queue-timeout for a row: 503, try again."""


class QueueFull(QueueTimeout):
    """--max-queue requests are waiting already: 503, try again."""


class ServerStopping(Exception):
    """The server is stopping: 503."""


class NoWorkerAlive(Exception):
    pass


class WorkerPool:
    """The workers, where each request goes, and what was served (for /stats)."""

    def __init__(self, workers, queue_timeout, max_queue=256):
        self.workers = workers
        self.queue_timeout, self.max_queue = queue_timeout, max_queue
        self.active = set()  # generations in flight, cancelled when the server stops
        self.keys = itertools.count()
        self.stopping = None  # the reason, once the server is stopping
        self.requests_served = 0
        self.requests_cancelled = 0
        self.requests_rejected = 0
        self.requests_withdrawn = 0  # their client left while they waited for a row
        self.scorings, self.scoring_tokens = set(), 0  # scoring requests in flight, and their prompts' tokens
        self.tokens_generated = 0
        self.generation_seconds = 0.0
        self.started = time.time()

    def start(self):
        self.loop = asyncio.get_running_loop()
        for worker in self.workers:
            worker.start(self.loop)

    def stop_soon(self, reason="the server is stopping"):
        """From a signal handler: end every request in the event loop's next turn (begin_stop), and say so once."""
        def end_requests():
            if self.stopping is None:
                print0(f"stopping: {self.begin_stop(reason)} request(s) in flight or waiting ended with a 503 / an error "
                       "event")
        if getattr(self, "loop", None) is not None:
            self.loop.call_soon_threadsafe(end_requests)

    def begin_stop(self, reason):
        """The server is stopping (SIGTERM, Ctrl-C): every request in flight or waiting ends now with `reason` as its
        failure (a stream's error event, a waiting or whole request's 503), so none is cut off later mid-reply.
        Returns how many were ended."""
        self.stopping = reason
        ended = list(self.active) + list(self.scorings)
        for generation in ended:
            generation.cancel()
            generation.receive([reason, Ended(getattr(generation, "tokens", 0), 0.0, 0)])
        return len(ended)

    def stop(self):
        for generation in list(self.active):  # let the workers end them now rather than at max_tokens
            generation.cancel()
        for worker in self.workers:
            worker.stop()
        stop_processes([worker.process for worker in self.workers], seconds=5)

    def waiting(self):
        return sum(1 for g in self.active if not g.was_admitted and not g.cancelled)

    async def submit(self, prompt_ids, sampling, chat=True):
        """A Generation on the least loaded worker, once the engine has given its samples rows; a request that waits
        longer than the queue timeout for them is withdrawn and gets a 503."""
        if self.stopping:
            raise ServerStopping(self.stopping)
        alive = self.alive()
        if self.waiting() >= self.max_queue:
            self.requests_rejected += 1
            raise QueueFull(f"{self.max_queue} requests are already waiting for a row (--max-queue); try again shortly")
        roomy = [w for w in alive if w.rows >= sampling.num_samples]  # a request's samples decode side by side
        if not roomy:
            rows = max(w.rows for w in alive)
            raise RequestError("n", f"at most {rows} replies per request on this server (a worker's batch has {rows} "
                               f"rows: --max-batch, or the KV cache's memory budget); got {sampling.num_samples}")
        worker = min(roomy, key=lambda w: w.load())
        generation = Generation(self, worker, next(self.keys), prompt_ids, sampling, chat)
        worker.submit(generation)
        try:
            await asyncio.wait_for(generation.admitted.wait(), self.queue_timeout)
        except asyncio.TimeoutError:
            generation.cancel()
            generation.rejected = True  # counted here; if a row came in the meantime, not as cancelled too
            self.requests_rejected += 1
            rows = sum(w.rows for w in alive)
            raise QueueTimeout(f"all {rows} rows of the batch stayed busy for {self.queue_timeout:g} s "
                               "(--queue-timeout); try again shortly") from None
        except BaseException:  # the request itself was cancelled (its client left, the server is stopping)
            generation.cancel()
            raise
        if self.stopping:
            raise ServerStopping(self.stopping)
        return generation

    def alive(self):
        alive = [w for w in self.workers if w.alive]
        if not alive:
            raise NoWorkerAlive("every worker process has exited (see the server's log); restart the server")
        return alive

    async def score(self, prompts, top, samplings=()):
        """
        (per prompt [(log p or None, alternatives)], per choice (token, log p, alternatives) for each of `samplings`
        after each prompt): the worker with the fewest rows asked of it scores the prompts in slices between its decode
        steps (no rows needed). samplings: engine Samplings of a max_tokens 1 request, whose one token comes from the
        same pass. At most MAX_SCORING_TOKENS of prompts wait to be scored at once (a 503 beyond); a request cancelled
        while it waits (its client left) is withdrawn from its worker, whose slices not yet run never run.
        """
        if self.stopping:
            raise ServerStopping(self.stopping)
        alive = self.alive()
        tokens = sum(len(p) for p in prompts)
        if self.scoring_tokens + tokens > MAX_SCORING_TOKENS and self.scoring_tokens:
            self.requests_rejected += 1
            raise QueueFull(f"{self.scoring_tokens:,} prompt tokens are already waiting to be scored (at most "
                            f"{MAX_SCORING_TOKENS:,}); try again shortly")
        worker = min(alive, key=lambda w: w.load())
        scoring = Scoring(self, worker, next(self.keys), tokens)
        worker.send(Score(scoring.key, prompts, top, list(samplings)))
        try:
            events = await scoring.done
        except BaseException:  # cancelled: the client left, or the server is stopping
            scoring.cancel()
            raise
        failure = next((e for e in events if isinstance(e, str)), None)
        if failure:
            raise ServerStopping(failure) if self.stopping else RuntimeError(failure)
        scored = [e.tokens for e in sorted((e for e in events if isinstance(e, Scored)), key=lambda e: e.index)]
        tokens = [(e.token, e.logprob, e.top) for e in sorted((e for e in events if isinstance(e, Token)),
                                                              key=lambda e: e.index)]
        return scored, tokens

    def finished(self, generation):
        """Called in the event loop when a generation's last event is in."""
        self.active.discard(generation)
        if not generation.was_admitted and generation.cancelled and not generation.rejected:
            self.requests_withdrawn += 1
        if not generation.was_admitted or generation.rejected:
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
        occupancy = [w.occupancy for w in self.workers]
        busy = sum(1 for o in occupancy if o["active"])
        rows, active = sum(o["rows"] for o in occupancy), sum(o["active"] for o in occupancy)
        return {
            "queue_depth": sum(o["waiting"] for o in occupancy),
            "workers": {"total": len(self.workers), "busy": busy, "free": len(self.workers) - busy},
            "batch": {"rows": rows, "active": active, "occupancy": round(active / rows, 3),
                      "shared_steps": sum(o["shared_steps"] for o in occupancy)},
            "requests_served": self.requests_served,
            "requests_cancelled": self.requests_cancelled,
            "requests_rejected": self.requests_rejected,
            "requests_withdrawn": self.requests_withdrawn,
            "scoring": {"requests": len(self.scorings), "prompt_tokens": self.scoring_tokens},
            "tokens_generated": self.tokens_generated,
            "tokens_per_second": round(self.tokens_generated / max(self.generation_seconds, 1e-9), 1),
            "uptime_seconds": round(time.time() - self.started, 1),
        }


_END = object()  # the end of a generation's events, in its queue


class Generation:
    """
    One request's replies, on the server's side: its worker process sends its events (Piece, Finish, or an error
    string), which come out of `events()` in the event loop. cancel() withdraws it before the worker's next step.
    """

    def __init__(self, pool, worker, key, prompt_ids, sampling, chat):
        self.pool, self.worker, self.key, self.prompt_ids, self.chat = pool, worker, key, prompt_ids, chat
        self.num_samples = sampling.num_samples
        self.samplings = sampling.per_sample()
        self.queue = asyncio.Queue()  # lists of events, one list per message of the worker
        self.admitted = asyncio.Event()
        self.was_admitted = False
        self.tokens, self.replies_finished, self.seconds = 0, 0, 0.0
        self.cancelled = self.ended = self.rejected = False
        pool.active.add(self)

    def receive(self, events):
        out = []
        for event in events:
            if isinstance(event, Admitted):
                self.was_admitted = True
                self.admitted.set()
            elif isinstance(event, Ended):
                self.tokens, self.seconds, self.replies_finished = event.tokens, event.seconds, event.replies_finished
                self.ended = True
                out.append(_END)
            else:
                out.append(event)
        if out:
            self.queue.put_nowait(out)
        if self.ended:
            self.admitted.set()
            self.worker.generations.pop(self.key, None)
            self.pool.finished(self)

    def cancel(self):
        if self.cancelled or self.ended:
            return
        self.cancelled = True
        self.worker.send(Cancel(self.key))
        if not self.was_admitted:  # still waiting for a row: end the wait here too
            self.admitted.set()

    async def event_batches(self):
        """Lists of events as the worker sends them (a stream writes each list in one piece)."""
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


class Scoring:
    """A scoring request on the server's side: its worker's events, a slice at a time, until its Ended (Worker._read
    hands them over); `done` then holds them all."""

    num_samples = 0  # it takes no rows

    def __init__(self, pool, worker, key, tokens):
        self.pool, self.worker, self.key, self.tokens = pool, worker, key, tokens
        self.events, self.ended = [], False
        self.done = asyncio.get_running_loop().create_future()
        worker.generations[key] = self
        pool.scorings.add(self)
        pool.scoring_tokens += tokens

    def receive(self, events):
        self.events += events
        if self.ended or not any(isinstance(e, Ended) for e in events):
            return
        self.ended = True
        if not self.done.done():
            self.done.set_result(self.events)
        self.worker.generations.pop(self.key, None)
        self.pool.scorings.discard(self)
        self.pool.scoring_tokens -= self.tokens

    def cancel(self):
        if not self.ended:
            self.worker.send(Cancel(self.key))


# -----------------------------------------------------------------------------
# Starting up


def load_workers(source, model_tag, step, device_type, num_workers, max_batch, kv_memory_gib=None, prefill_chunk=256,
                 threads=0, start_method=None, decode="eager"):
    """
    (workers, tokenizer, model info) for a stage's checkpoint, each worker a process: one replica per GPU on CUDA
    (num_workers 0: every GPU); on CPU every worker shares one copy of the weights (num_workers 0: one worker). Each
    worker batches up to max_batch sequences, fewer if their KV cache would not fit the memory budget.

    On a Linux CPU this process loads the model and forks the workers, which share its weights' memory and start at
    once. Elsewhere a worker is spawned and loads its own replica: a process that has touched CUDA cannot fork (and
    this one does not need the weights), and macOS does not fork safely. start_method "spawn" does that on a Linux
    CPU too (the tests run the GPU's path so).
    """
    device = torch.device(resolve_device_type(device_type))
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
    threads = inference_threads(device, threads, count)
    settings = {"source": source, "model_tag": model_tag, "step": step, "threads": threads, "max_batch": max_batch,
                "kv_memory_gib": kv_memory_gib, "num_workers": count, "prefill_chunk": prefill_chunk, "decode": decode}
    preloaded = None
    if device.type == "cpu" and sys.platform.startswith("linux") and start_method in (None, "fork"):
        # one thread while forking: a child must not inherit an OpenMP pool whose threads did not come with it
        torch.set_num_threads(1)
        print0(f"loading the {source} model on cpu ...")
        model, tokenizer, meta = load_model(source, device, model_tag=model_tag, step=step)
        preloaded = (model.prepare_for_inference(), tokenizer, meta)  # generation only (GPT.prepare_for_inference)
        context = multiprocessing.get_context("fork")
        # what loading freed (the checkpoint, the fp32 weights) back to the kernel: a worker's own allocations would
        # otherwise reuse those pages, copying them on write, and the server would keep its copy too (measured: the
        # server's and its worker's memory +12 % under load instead of +4 %)
        gc.collect()
        return_freed_memory()
    else:
        print0(f"loading the {source} model on {', '.join(str(d) for d in devices)} (a process each) ...")
        context = multiprocessing.get_context(start_method or "spawn")
    started = []
    # the workers start with SIGINT and SIGTERM ignored (worker_main says why); a spawned one keeps that while it
    # imports torch, so an early Ctrl-C gives the server's message, not a traceback per worker
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for index, worker_device in enumerate(devices):
            conn, child_conn = context.Pipe()
            inherited = [c for _, _, c in started] + [conn] if preloaded else []  # a fork copies them all
            process = context.Process(target=worker_main, name=f"nanochat-worker{index}", daemon=True,
                                      args=(child_conn, inherited, worker_device, settings, preloaded))
            process.start()
            child_conn.close()  # the worker's end lives in the worker: its exit then reads as end-of-file here
            started.append((index, process, conn))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    replies = []
    try:
        for index, process, conn in started:
            try:
                reply = conn.recv()
            except EOFError:
                process.join(5)
                raise UserError(f"worker {index} exited while loading the model (exit code {process.exitcode})") from None
            if isinstance(reply, Failed):
                raise UserError(reply.reason)
            replies.append(reply)
    except BaseException:  # one worker failed (or Ctrl-C): the others must not outlive the server
        stop_processes([process for _, process, _ in started])
        raise
    # a server that exits without stopping its workers (a second Ctrl-C skips uvicorn's shutdown): multiprocessing's
    # own exit handler would SIGTERM them, which they ignore, and wait for ever; this one, registered later, runs first
    atexit.register(stop_processes, [process for _, process, _ in started])
    workers = [Worker(index, process, conn, reply.rows) for (index, process, conn), reply in zip(started, replies)]
    info, rows, cache_bytes = replies[0].info, replies[0].rows, replies[0].cache_bytes
    info["device"] = ", ".join(sorted({str(d) for d in devices}))
    info["id"] = f"nanochat-{source}-{info['tag']}"
    tokenizer = preloaded[1] if preloaded else get_tokenizer()
    print0(f"loaded {summary_line(info)}; {len(workers)} worker process{'es' if len(workers) > 1 else ''}, each "
           f"batching up to {rows} sequences (KV cache {cache_bytes / 2**20:,.0f} MiB"
           f"{'' if rows == max_batch else f', fewer than --max-batch {max_batch}: the memory budget'}"
           f"; prompts prefilled {prefill_chunk} tokens a step; {threads} torch thread{'s' if threads > 1 else ''})")
    return workers, tokenizer, info
