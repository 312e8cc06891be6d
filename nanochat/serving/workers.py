"""
The worker processes behind chat_web, both sides of their pipe: the server's side (a handle on each worker, the pool
that sends each request to the least loaded one, starting them) and the worker's side (the loop that runs continuous
batching over its requests with nanochat/engine.py's BatchEngine). What they say to each other is in
nanochat/serving/chat.py; the HTTP side is nanochat/serving/serve.py.

A request goes to the least loaded worker and waits for rows of its batch; one that waits longer than the pool's
queue timeout gets a 503, as does one beyond --max-queue waiting requests. The worker takes the server's messages
between two decode steps and sends the replies' text back in batches, a few steps' worth at a time; a client that
disconnects is cancelled and frees its rows at the worker's next step (while it still waits, before it is ever
prefilled). A scoring request (the log probabilities of prompts, for /v1/completions' echo) needs no rows: the worker
scores it a slice at a time between two decode steps. On a stop every request ends at once, with its reason.

Each request has a name on either side of the pipe: a GenerationRequest or ScoringRequest in the server (what its
endpoint awaits), a GenerationJob or ScoringJob in the worker (what its loop runs).

A worker is a process, not a thread: a small model's decode step is hundreds of small ops, each of which takes
Python's lock back from the event loop, whose own Python (every client's stream) it then waits for (dev/LOG.md and
docs/serving.md have the measurements). On a CPU a worker shares the server's copy of the weights (forked); on a GPU
each loads its replica.
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
import traceback
from collections import OrderedDict
from dataclasses import dataclass, replace
from multiprocessing.reduction import ForkingPickler

import torch

from nanochat.checkpoint_manager import load_model
from nanochat.common import (UserError, inference_threads, print0, resolve_device_type, return_freed_memory,
                             use_cuda_device)
from nanochat.engine import BatchEngine, choose_tokens, kv_budget_bytes, kv_row_bytes, token_logprobs
from nanochat.serving.chat import (Add, Admitted, Cancel, Ended, Events, Failure, Occupancy, Ready, ReplyStream,
                                   RequestError, Score, Scored, Stop, StopStrings, Token, model_info, summary_line)
from nanochat.tokenizer import get_tokenizer

# Prompt tokens that may wait to be scored at once, over all workers (a request past it gets a 503, unless nothing
# waits): ~40 bytes a token on the server while a request waits, so at most ~40 MB, and in work what 8 requests of 64
# prompts of a 2,048-token context ask for
MAX_SCORING_TOKENS = 8 * 64 * 2048
FLUSH_SECONDS = 0.015  # a worker hands its tokens to the event loop at most this often (and at once when idle)
IDLE_TRIM_SECONDS = 1.0  # a worker idle this long hands its freed memory back (not between back-to-back requests)
# Prompt tokens (padded to the slice's longest) scored in one forward pass: a request scoring 64 prompts of a
# 2,048-token context runs as 64 slices, and a stream decoding beside it waits at most one slice for its next token
SCORE_SLICE_TOKENS = 2048
# While rows are decoding, scoring gets at most this share of the worker's time: after a slice that took s seconds the
# worker decodes for 2s before the next one. A slice between every two decode steps let eight maximal
# scoring requests slow a stream beside them ~25x (a slice of 2,048 tokens is ~100 decode steps of a small model);
# with a third, a stream keeps two thirds of its worker's steps (docs/serving.md has what was measured)
SCORING_SHARE = 1 / 3


# -----------------------------------------------------------------------------
# The server's side


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
        self.requests = {}  # key -> GenerationRequest or ScoringRequest, not yet ended
        self.occupancy = Occupancy(rows)
        self.alive = True
        self.loop = None
        self.outgoing = queue.Queue()  # messages for the worker; None ends the sender
        self.sender = threading.Thread(target=self._send_outgoing, name=f"worker{index}-sender", daemon=True)

    def start(self, loop):
        self.loop = loop
        loop.add_reader(self.conn.fileno(), self._read)
        self.sender.start()

    def submit(self, generation):
        self.requests[generation.key] = generation
        self.send(Add(generation.key, generation.prompt_ids, generation.samplings, generation.chat, generation.owner))

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
        return sum(r.num_samples for r in self.requests.values())

    def _read(self):
        """In the event loop, when the worker process has sent something."""
        try:
            while self.conn.poll():
                message = self.conn.recv()
                self.occupancy = message.occupancy
                for key, events in message.ready:
                    if key in self.requests:
                        self.requests[key].receive(events)
        except (EOFError, OSError):
            self._lost()

    def _lost(self):
        self.loop.remove_reader(self.conn.fileno())
        self.alive = False
        self.occupancy = replace(self.occupancy, active=0, waiting=0)
        self.process.join(1)
        reason = (f"generation failed: worker {self.index} exited (exit code {self.process.exitcode}); "
                  "restart the server")
        print0(reason)
        for request in list(self.requests.values()):
            request.receive([Failure(reason), Ended(0, 0.0, 0)])

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


# What one client (a key, or a peer address: serve.client_of) may hold at once, as a share of the server: of all
# the workers' rows, of --max-queue, and of MAX_SCORING_TOKENS (--client-share). A quarter: four clients can fill the
# server, and one that holds its whole share leaves three quarters of the rows to the others (560 streams nobody read
# held all 64 rows and the queue, and everyone else got 503s)
CLIENT_SHARE = 0.25


class ClientShare:
    """What one client holds: rows its requests were given or sent for, its requests held back until its own rows
    leave room, its prompt tokens waiting to be scored. `freed` is set (and replaced) whenever its rows go down.
    `number` names the client to the workers (not its key), whose engines share decode steps between clients."""

    def __init__(self, number):
        self.number = number
        self.rows, self.held_back, self.scoring_tokens = 0, 0, 0
        self.freed = asyncio.Event()

    def holds_nothing(self):
        return not (self.rows or self.held_back or self.scoring_tokens)

    def has_room(self, rows, client_rows):
        """A request of `rows` fits the client's share (or the client holds none: one request of any size goes)."""
        return not self.rows or self.rows + rows <= client_rows

    def free_rows(self, rows):
        self.rows -= rows
        self.freed.set()
        self.freed = asyncio.Event()


class WorkerPool:
    """The workers, where each request goes, what each client holds, and what was served (for /stats)."""

    def __init__(self, workers, queue_timeout, max_queue=256, client_share=CLIENT_SHARE):
        self.workers = workers
        self.queue_timeout, self.max_queue = queue_timeout, max_queue
        # one client's bounds (CLIENT_SHARE); a client that holds nothing may always send one request of any size
        self.client_rows = max(1, int(client_share * sum(w.rows for w in workers)))
        self.client_queue = max(1, int(client_share * max_queue))
        self.client_scoring_tokens = max(1, int(client_share * MAX_SCORING_TOKENS))
        self.clients = {}  # client -> ClientShare, while it holds anything
        self.client_numbers = itertools.count(1)
        self.held_back = 0  # requests waiting for their client's share of rows, not sent to a worker yet
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
        for request in ended:
            request.cancel()
            request.receive([Failure(reason), Ended(getattr(request, "tokens", 0), 0.0, 0)])
        held_back = self.held_back
        for share in self.clients.values():  # requests waiting for their client's share wake up to a 503
            share.freed.set()
        return len(ended) + held_back

    def stop(self):
        for generation in list(self.active):  # let the workers end them now rather than at max_tokens
            generation.cancel()
        for worker in self.workers:
            worker.stop()
        stop_processes([worker.process for worker in self.workers], seconds=5)

    def waiting(self):
        return self.held_back + sum(1 for g in self.active if not g.was_admitted and not g.cancelled)

    def share_of(self, client):
        if client not in self.clients:
            self.clients[client] = ClientShare(next(self.client_numbers))
        return self.clients[client]

    def forget_if_idle(self, client):
        if client in self.clients and self.clients[client].holds_nothing():
            del self.clients[client]

    async def submit(self, prompt_ids, sampling, chat=True, client=""):
        """
        A GenerationRequest on the least loaded worker, once the engine has given its samples rows. `client` (a key,
        or a peer address) may hold client_rows rows: a request beyond them waits here for the client's own requests to
        end (at most client_queue of them wait so; one more gets a 503 at once), and what the client holds never keeps
        another client's request from a row. A request that waits longer than the queue timeout in all is withdrawn and
        gets a 503.
        """
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
        share = self.share_of(client)
        if not share.has_room(sampling.num_samples, self.client_rows) and share.held_back >= self.client_queue:
            self.requests_rejected += 1
            raise QueueFull(f"this client has {share.held_back} requests waiting for its {self.client_rows} rows "
                            "already (--client-share); try again shortly")
        deadline = time.monotonic() + self.queue_timeout
        try:
            await self.wait_for_share(share, sampling.num_samples, deadline)
            worker = min(roomy, key=lambda w: w.load())
            generation = GenerationRequest(self, worker, next(self.keys), prompt_ids, sampling, chat)
            generation.client, share.rows = client, share.rows + sampling.num_samples  # given back in finished()
            generation.owner = share.number
            worker.submit(generation)
            try:
                await asyncio.wait_for(generation.admitted.wait(), max(0.0, deadline - time.monotonic()))
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
        finally:
            self.forget_if_idle(client)
        if self.stopping:
            raise ServerStopping(self.stopping)
        return generation

    async def wait_for_share(self, share, rows, deadline):
        """Until the client's rows leave room for `rows` more (or it holds none): its own requests end first."""
        if share.has_room(rows, self.client_rows):
            return
        self.held_back += 1
        share.held_back += 1
        try:
            while not share.has_room(rows, self.client_rows):
                if self.stopping:
                    raise ServerStopping(self.stopping)
                try:
                    await asyncio.wait_for(share.freed.wait(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    self.requests_rejected += 1
                    raise QueueTimeout(f"this client's requests held its {self.client_rows} rows (--client-share) for "
                                       f"{self.queue_timeout:g} s (--queue-timeout); try again shortly") from None
                except asyncio.CancelledError:  # its client left while it waited: it never reached a worker
                    self.requests_withdrawn += 1
                    raise
        finally:
            self.held_back -= 1
            share.held_back -= 1

    def alive(self):
        alive = [w for w in self.workers if w.alive]
        if not alive:
            raise NoWorkerAlive("every worker process has exited (see the server's log); restart the server")
        return alive

    async def score(self, prompts, top, samplings=(), client=""):
        """
        (per prompt [(log p or None, alternatives)], per choice (token, log p, alternatives) for each of `samplings`
        after each prompt): the worker with the fewest rows asked of it scores the prompts in slices between its decode
        steps (no rows needed). samplings: engine Samplings of a max_tokens 1 request, whose one token comes from the
        same pass. At most MAX_SCORING_TOKENS of prompts wait to be scored at once, client_scoring_tokens of them one
        `client`'s (a 503 beyond, unless nothing waits); a request cancelled while it waits (its client left) is
        withdrawn from its worker, whose slices not yet run never run.
        """
        if self.stopping:
            raise ServerStopping(self.stopping)
        alive = self.alive()
        tokens = sum(len(p) for p in prompts)
        if self.scoring_tokens + tokens > MAX_SCORING_TOKENS and self.scoring_tokens:
            self.requests_rejected += 1
            raise QueueFull(f"{self.scoring_tokens:,} prompt tokens are already waiting to be scored (at most "
                            f"{MAX_SCORING_TOKENS:,}); try again shortly")
        held = self.clients[client].scoring_tokens if client in self.clients else 0
        if held and held + tokens > self.client_scoring_tokens:
            self.requests_rejected += 1
            raise QueueFull(f"this client has {held:,} prompt tokens waiting to be scored already (its share: "
                            f"{self.client_scoring_tokens:,}, --client-share); try again shortly")
        worker = min(alive, key=lambda w: w.load())
        scoring = ScoringRequest(self, worker, next(self.keys), tokens, client)
        worker.send(Score(scoring.key, prompts, top, list(samplings)))
        try:
            events = await scoring.done
        except BaseException:  # cancelled: the client left, or the server is stopping
            scoring.cancel()
            raise
        failure = next((e.reason for e in events if isinstance(e, Failure)), None)
        if failure:
            raise ServerStopping(failure) if self.stopping else RuntimeError(failure)
        scored = [e.tokens for e in sorted((e for e in events if isinstance(e, Scored)), key=lambda e: e.index)]
        tokens = [(e.token, e.logprob, e.top) for e in sorted((e for e in events if isinstance(e, Token)),
                                                              key=lambda e: e.index)]
        return scored, tokens

    def finished(self, generation):
        """Called in the event loop when a generation's last event is in."""
        self.active.discard(generation)
        if generation.client is not None:  # its rows go back to its client's share
            self.clients[generation.client].free_rows(generation.num_samples)
            self.forget_if_idle(generation.client)
            generation.client = None
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
        busy = sum(1 for o in occupancy if o.active)
        rows, active = sum(o.rows for o in occupancy), sum(o.active for o in occupancy)
        return {
            "queue_depth": sum(o.waiting for o in occupancy) + self.held_back,
            "workers": {"total": len(self.workers), "busy": busy, "free": len(self.workers) - busy},
            "batch": {"rows": rows, "active": active, "occupancy": round(active / rows, 3),
                      "shared_steps": sum(o.shared_steps for o in occupancy),
                      "rows_passed_by": sum(o.rows_passed_by for o in occupancy)},
            "requests_served": self.requests_served,
            "requests_cancelled": self.requests_cancelled,
            "requests_rejected": self.requests_rejected,
            "requests_withdrawn": self.requests_withdrawn,
            "scoring": {"requests": len(self.scorings), "prompt_tokens": self.scoring_tokens},
            "clients": {"holding": len(self.clients), "held_back": self.held_back,
                        "most_rows": max((share.rows for share in self.clients.values()), default=0),
                        "share": {"rows": self.client_rows, "queue": self.client_queue,
                                  "scoring_tokens": self.client_scoring_tokens}},
            "tokens_generated": self.tokens_generated,
            "tokens_per_second": round(self.tokens_generated / max(self.generation_seconds, 1e-9), 1),
            "uptime_seconds": round(time.time() - self.started, 1),
        }


class GenerationRequest:
    """
    One request's replies, on the server's side: its worker process sends its events (Token, Piece, Finish, Failure),
    which come out of `event_batches()` in the event loop. cancel() withdraws it before the worker's next step.
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
        self.client = None  # whose share of rows it holds, until it ends (WorkerPool.submit)
        self.owner = 0  # that client's number, for its worker's engine
        pool.active.add(self)

    def receive(self, events):
        out = []
        for event in events:
            if isinstance(event, Admitted):
                self.was_admitted = True
                self.admitted.set()
                continue
            if isinstance(event, Ended):
                self.tokens, self.seconds, self.replies_finished = event.tokens, event.seconds, event.replies_finished
                self.ended = True
            out.append(event)
        if out:
            self.queue.put_nowait(out)
        if self.ended:
            self.admitted.set()
            self.worker.requests.pop(self.key, None)
            self.pool.finished(self)

    def cancel(self):
        if self.cancelled or self.ended:
            return
        self.cancelled = True
        self.worker.send(Cancel(self.key))
        if not self.was_admitted:  # still waiting for a row: end the wait here too
            self.admitted.set()

    async def event_batches(self):
        """Lists of events as the worker sends them (a stream writes each list in one piece), until Ended."""
        while True:
            events = await self.queue.get()
            if not isinstance(events[-1], Ended):
                yield events
                continue
            if len(events) > 1:
                yield events[:-1]
            return


class ScoringRequest:
    """A scoring request on the server's side: its worker's events, a slice at a time, until its Ended (Worker._read
    hands them over); `done` then holds them all."""

    num_samples = 0  # it takes no rows

    def __init__(self, pool, worker, key, tokens, client=""):
        self.pool, self.worker, self.key, self.tokens, self.client = pool, worker, key, tokens, client
        self.events, self.ended = [], False
        self.done = asyncio.get_running_loop().create_future()
        worker.requests[key] = self
        pool.scorings.add(self)
        pool.scoring_tokens += tokens
        pool.share_of(client).scoring_tokens += tokens

    def receive(self, events):
        self.events += events
        if self.ended or not any(isinstance(e, Ended) for e in events):
            return
        self.ended = True
        if not self.done.done():
            self.done.set_result(self.events)
        self.worker.requests.pop(self.key, None)
        self.pool.scorings.discard(self)
        self.pool.scoring_tokens -= self.tokens
        self.pool.share_of(self.client).scoring_tokens -= self.tokens
        self.pool.forget_if_idle(self.client)

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
    settings = WorkerSettings(source, model_tag, step, threads, max_batch, kv_memory_gib, count, prefill_chunk, decode)
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
            if isinstance(reply, Failure):
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
    if replies[0].decode_cost:
        print0(f"measured {replies[0].decode_cost} (worker 0): clients share the steps by it")
    return workers, tokenizer, info


# -----------------------------------------------------------------------------
# The worker's side: its loop


class ScoringJob:
    """A scoring request as its worker process sees it: its prompts, scored a slice at a time from `next` on."""

    def __init__(self, key, prompts, top, samplings):
        self.key, self.prompts, self.top, self.samplings = key, prompts, top, samplings
        self.next, self.started = 0, time.perf_counter()

    def next_slice(self):
        """The prompts of the next slice: as many as fit SCORE_SLICE_TOKENS padded to their longest, at least one."""
        end, width = self.next + 1, len(self.prompts[self.next])
        while end < len(self.prompts) and (end + 1 - self.next) * max(width, len(self.prompts[end])) <= SCORE_SLICE_TOKENS:
            width = max(width, len(self.prompts[end]))
            end += 1
        return range(self.next, end)


class GenerationJob:
    """A request as its worker process sees it: its sequences in the engine and its replies' text so far."""

    def __init__(self, key, samplings, stop, chat, tokenizer):
        self.key, self.samplings = key, samplings
        stops = StopStrings(stop)  # built once, read by each sample's stream
        self.streams = [ReplyStream(tokenizer, stops, chat) for _ in samplings]
        self.seqs = []
        self.outbox = []  # events not yet sent to the server
        self.admitted, self.started, self.tokens, self.replies_finished = False, None, 0, 0

    def emit(self, event):
        self.outbox.append(event)

    def take_outbox(self):
        events, self.outbox = self.outbox, []
        return events

    def note_admission(self):
        if not self.admitted and self.seqs and all(seq.row is not None for seq in self.seqs):
            self.admitted, self.started = True, time.perf_counter()
            self.emit(Admitted())

    def push(self, index, token, seq):
        stream = self.streams[index]
        if seq.logprob is not None:  # the token that ends the reply too: the endpoints decide what to show
            self.emit(Token(index, token, *seq.logprob))
        self.outbox += stream.events(index, token, length=seq.finished == "length")
        if stream.finish_reason is not None:
            self.tokens += stream.num_tokens
            self.replies_finished += 1

    def done(self):
        return self.replies_finished == len(self.samplings)

    def end(self):
        """Its last event; called once, as the job leaves the loop's jobs (or is refused)."""
        seconds = time.perf_counter() - self.started if self.started else 0.0
        self.emit(Ended(self.tokens, seconds, self.replies_finished))


class EngineLoop:
    """
    The worker process: between two decode steps of its BatchEngine it takes the server's messages (a request to add,
    one to cancel, stop), and it hands every request's new text to the server.
    """

    def __init__(self, conn, engine):
        self.conn, self.engine = conn, engine
        self.jobs = {}  # key -> GenerationJob, given to the engine (waiting for rows, or running)
        self.scoring_jobs = OrderedDict()  # key -> ScoringJob, served a slice each in turn
        self.ended = []  # ended since the last flush: their last events are still to be sent
        self.owner = {}  # id(Sequence) -> (GenerationJob, sample index)
        self.flushed = 0.0  # when events were last sent
        self.trimmed = True  # nothing allocated since the last malloc_trim
        self.decode_owed = 0.0  # seconds of decoding due before the next scoring slice (SCORING_SHARE)

    def run(self):
        try:
            while True:
                self._flush(force=not self.jobs and not self.scoring_jobs)
                if not self.jobs and not self.scoring_jobs:  # idle: wait for the next message
                    if not self.trimmed and not self.conn.poll(IDLE_TRIM_SECONDS):
                        return_freed_memory()  # a busy spell's freed temporaries back to the kernel, not kept for ever
                        self.trimmed = True
                    if not self._handle(self.conn.recv()):
                        return
                    continue
                while self.conn.poll():
                    if not self._handle(self.conn.recv()):
                        return
                if self.engine.busy():
                    started = time.perf_counter()
                    self._step()
                    # decoding beyond what is owed earns scoring nothing: a slice never waits on an idle stretch
                    self.decode_owed = max(0.0, self.decode_owed - (time.perf_counter() - started))
                else:
                    self.decode_owed = 0.0  # nothing decodes: scoring may take the whole worker
                if self.scoring_jobs and self.decode_owed == 0:
                    started = time.perf_counter()
                    self._score_slice()
                    if self.engine.busy():  # rows decode beside it: they get their share before the next slice
                        self.decode_owed += (time.perf_counter() - started) * (1 - SCORING_SHARE) / SCORING_SHARE
        except (EOFError, OSError):  # the server process is gone: nobody is left to answer
            return

    def _handle(self, message):
        match message:
            case Stop():
                return False
            case Add():
                self._add(message)
            case Score():
                self.scoring_jobs[message.key] = ScoringJob(message.key, message.prompts, message.top, message.samplings)
            case Cancel(key=key) if key in self.jobs:
                self._drop(self.jobs[key])
            case Cancel(key=key) if key in self.scoring_jobs:  # its client left: the slices not yet run never run
                job = self.scoring_jobs.pop(key)
                self.conn.send(Events([(job.key, [Ended(0, time.perf_counter() - job.started, 0)])],
                                      self._occupancy()))
        return True

    def _occupancy(self):
        return Occupancy(**self.engine.occupancy(), rows_passed_by=self.engine.rows_passed_by)

    def _step(self):
        self.trimmed = False
        try:
            steps = self.engine.step()
        except Exception as e:  # a bug, or the device failing: every request in flight gets a 500
            traceback.print_exc()
            for job in list(self.jobs.values()):
                job.emit(Failure(f"generation failed: {type(e).__name__}: {e}"))
                self._drop(job)
            return
        for job in self.jobs.values():
            job.note_admission()
        for seq, token, _ in steps:
            job, index = self.owner[id(seq)]
            job.push(index, token, seq)
            if job.streams[index].finish_reason is not None and seq.finished is None:
                self.engine.cancel(seq)  # a stop string, or a turn token the engine does not end on
        for job in [j for j in self.jobs.values() if j.done()]:
            self._drop(job)

    def _flush(self, force=False):
        """
        Send the requests' new events every FLUSH_SECONDS, or at once when a request was just admitted or ended or the
        worker is about to wait: one message, and one write per client, for several steps' tokens, which is what the
        server's event loop can keep up with at dozens of streams. The engine's occupancy goes along, for /stats.
        """
        now = time.perf_counter()
        urgent = force or self.ended or any(j.outbox and isinstance(j.outbox[0], Admitted) for j in self.jobs.values())
        if not urgent and now - self.flushed < FLUSH_SECONDS:
            return
        self.flushed = now
        ready = [(job.key, job.take_outbox()) for job in list(self.jobs.values()) + self.ended if job.outbox]
        self.ended = []
        if ready or force:
            self.conn.send(Events(ready, self._occupancy()))

    def _add(self, add):
        job = GenerationJob(add.key, add.samplings, add.samplings[0].stop, add.chat, self.engine.tokenizer)
        try:
            job.seqs = self.engine.add_group(add.prompt_ids, add.samplings, owner=add.owner)
        except ValueError as e:  # a prompt the engine cannot take (the server fits it first, so a bug)
            job.emit(Failure(f"generation failed: {e}"))
            job.end()
            self.ended.append(job)
            return
        for index, seq in enumerate(job.seqs):
            self.owner[id(seq)] = (job, index)
        self.jobs[add.key] = job

    def _score_slice(self):
        """
        The next slice of the first scoring request's prompts (BatchEngine.score: their log probabilities, one forward
        pass), and for each Sampling given, the one token that follows each prompt, drawn from the same pass (a
        max_tokens 1 request needs no decode step); then that request goes to the back of the line. Each slice's
        events go out at once; the last one ends the request.
        """
        key, job = next(iter(self.scoring_jobs.items()))
        events, indices = [], job.next_slice()
        try:
            scored = self.engine.score([job.prompts[i] for i in indices], job.top)
            for i, (tokens, _) in zip(indices, scored):
                # tuples, not lists: on the server, eight maximal requests' scores are ~1,000,000 of them, which the
                # garbage collector stops tracking once it sees they hold plain numbers (lists it walks every time)
                events.append(Scored(i, tuple((logprob, tuple(top)) for logprob, top in tokens)))
            # after each prompt, each Sampling's token (choice i * n + j: sample j of prompt i), chosen as the engine
            # chooses a sequence's first token
            rows = [(last, s, torch.Generator(device=last.device).manual_seed(s.seed), {}) for _, last in scored
                    for s in job.samplings]
            first = indices[0] * len(job.samplings)
            for choice, ((last, *_), token) in enumerate(zip(rows, choose_tokens(rows)), first):
                events.append(Token(choice, token, *token_logprobs(last, token, job.top)))
            job.next = indices[-1] + 1
        except Exception as e:  # a bug, or the device failing: this request gets a 500
            traceback.print_exc()
            events.append(Failure(f"scoring failed: {type(e).__name__}: {e}"))
            job.next = len(job.prompts)
        self.scoring_jobs.move_to_end(key)
        if job.next == len(job.prompts):
            del self.scoring_jobs[key]
            events.append(Ended(len(job.prompts) * len(job.samplings), time.perf_counter() - job.started,
                                len(job.prompts)))
        self.trimmed = False
        self.conn.send(Events([(key, events)], self._occupancy()))

    def _drop(self, job):
        for seq in job.seqs:
            self.engine.cancel(seq)
            self.owner.pop(id(seq), None)
        del self.jobs[job.key]
        job.end()
        self.ended.append(job)


@dataclass
class WorkerSettings:
    """What a worker process is started with: load_workers' arguments, its threads, and how many workers share the
    machine (on a CPU they share its memory)."""

    source: str
    model_tag: str | None
    step: int | None
    threads: int
    max_batch: int
    kv_memory_gib: float | None
    num_workers: int
    prefill_chunk: int
    decode: str


def worker_main(conn, inherited, device, settings, preloaded):
    """
    A worker process: load the model (or take the one the server forked with), make its engine, report Ready
    (model info, rows, KV cache bytes) or a Failure, then run the EngineLoop until the server stops it or
    goes away. settings: a WorkerSettings. inherited: what a fork copied from the server that this process
    must not hold: the server's ends of the pipes (a server that dies must read as end-of-file to every worker).
    It starts with SIGINT and SIGTERM ignored (load_workers): Ctrl-C or a service manager's SIGTERM reach every
    process of the group, and the server, which stops its workers itself, must outlive them to end its requests.
    """
    for connection in inherited:
        connection.close()
    try:
        torch.set_num_threads(settings.threads)
        if device.type == "cuda":
            use_cuda_device(device)  # CUDA ops go to the process's current GPU: this replica's
        if preloaded is None:
            model, tokenizer, meta = load_model(settings.source, device, model_tag=settings.model_tag,
                                                step=settings.step)
            model.prepare_for_inference()  # generation only: q, k, v in one matmul, bf16 weights once on a bf16 CPU
        else:
            model, tokenizer, meta = preloaded
        row_bytes = kv_row_bytes(model.config, device)
        budget = kv_budget_bytes(device, settings.kv_memory_gib)
        budget //= settings.num_workers if device.type != "cuda" else 1  # CPU workers share the memory
        rows = min(settings.max_batch, budget // row_bytes)
        if rows < 1:
            raise UserError(f"one sequence's KV cache needs {row_bytes / 2**20:.0f} MiB, more than the "
                            f"{budget / 2**20:.0f} MiB budget; give --kv-memory-gib more")
        engine = BatchEngine(model, tokenizer, rows, settings.prefill_chunk, decode=settings.decode)
        if rows > 1:  # clients share its decode steps by what they cost here (BatchEngine's docstring)
            engine.decode_cost = engine.measure_decode_cost()
    except Exception as e:  # reported by the server, which stops before serving anything
        conn.send(Failure(str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"))
        return
    conn.send(Ready(model_info(meta, model, str(device), settings.source), rows, engine.cache.nbytes(),
                    engine.decode_cost.summary() if engine.decode_cost else ""))
    EngineLoop(conn, engine).run()
