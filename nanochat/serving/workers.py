"""
The worker processes behind chat_web, both sides of their pipe: the server's (a handle on each worker, the pool that
sends each request to the least loaded one and bounds what one client holds, starting them) and the worker's (the loop
that runs continuous batching with engine.BatchEngine, scoring in slices between decode steps). A request is a
GenerationRequest or ScoringRequest in the server, a GenerationJob or ScoringJob in the worker; their messages are in
chat.py. A worker is a process, not a thread, so its decode step never takes Python's lock from the event loop
(docs/serving.md has the measurements); on a CPU the workers share the server's copy of the weights (forked).
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
from nanochat.kernels.cpu import use_cpu_kernels
from nanochat.kernels.decode_dtype import checkpoint_config, use_fastest_decode_dtype
from nanochat.kernels.int8 import quantize_int8
from nanochat.common import (UserError, inference_threads, resolve_device_type, return_freed_memory,
                             use_cuda_device)
from nanochat.engine import BatchEngine, choose_tokens, kv_memory_bytes, kv_row_bytes, token_logprobs
from nanochat.kernels.decode_graphs import use_decode
from nanochat.serving.chat import (Add, Admitted, Cancel, Ended, Events, Failure, Occupancy, Ready, ReplyStream,
                                   RequestError, Score, Scored, Stop, StopStrings, Token, model_info, summary_line)
from nanochat.serving.fair_share import share_decode_steps
from nanochat.tokenizer import get_tokenizer

# Prompt tokens that may wait to be scored, over all workers (~40 MB on the server): 8 requests of 64 prompts of 2,048
MAX_SCORING_TOKENS = 8 * 64 * 2048
# /tokenize and /detokenize requests in progress at once, from before their body is read until their reply is written:
# each may hold a 1 MB body, ~990,000 ids (~36 MB while it is built) and a ~6 MB reply (docs/serving.md)
MAX_TOKENIZER_REQUESTS = 16
FLUSH_SECONDS = 0.015  # a worker hands its tokens to the event loop at most this often (and at once when idle)
IDLE_TRIM_SECONDS = 1.0  # a worker idle this long hands its freed memory back (not between back-to-back requests)
SCORE_SLICE_TOKENS = 2048  # prompt tokens (padded to the slice's longest) scored in one forward pass
SCORE_LOGITS_BYTES = 512 * 2**20  # fp32 logits one scoring pass may hold
# While rows decode, scoring gets at most this share of the worker's time: after a slice of s seconds, 2s of decoding
# (docs/serving.md has what was measured)
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


# Windows' event loops cannot watch a pipe (its selector takes sockets alone, its proactor has no add_reader): there a
# thread for each worker waits on its pipe and hands each message to the event loop, in order
READ_IN_THREAD = sys.platform == "win32"


class Worker:
    """The server's handle on a worker process: its requests, events and occupancy. Messages to it go out on a thread
    of their own: the event loop must never wait on a full pipe."""

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
        if READ_IN_THREAD:
            threading.Thread(target=self._receive, name=f"worker{self.index}-receiver", daemon=True).start()
        else:
            loop.add_reader(self.conn.fileno(), self._read)
        self.sender.start()

    def submit(self, generation):
        self.requests[generation.key] = generation
        add = Add(generation.key, generation.prompt_ids, generation.samplings, generation.chat, generation.owner)
        # send()'s line, not a call to it: a request's way to its token stays as docs/layout.md lists it
        self.outgoing.put(ForkingPickler.dumps(add))

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
                self._deliver(self.conn.recv())
        except (EOFError, OSError):
            self._lost()

    def _receive(self):
        """READ_IN_THREAD's thread: each message into the event loop, then the end of the pipe."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = None
            try:
                self.loop.call_soon_threadsafe(self._lost if message is None else self._deliver, message)
            except RuntimeError:  # the event loop has closed: the server has stopped
                return
            if message is None:
                return

    def _deliver(self, message):
        self.occupancy = message.occupancy
        for key, events in message.ready:
            if key in self.requests:
                self.requests[key].receive(events)

    def _lost(self, _=None):
        if not self.alive:  # stopped: its end was expected (READ_IN_THREAD's thread still reports it)
            return
        if not READ_IN_THREAD:
            self.loop.remove_reader(self.conn.fileno())
        self.alive = False
        self.occupancy = replace(self.occupancy, active=0, waiting=0)
        self.process.join(1)
        reason = (f"generation failed: worker {self.index} exited (exit code {self.process.exitcode}); "
                  "restart the server")
        print(reason, flush=True)
        for request in list(self.requests.values()):
            request.receive([Failure(reason), Ended(0, 0.0, 0)])

    def stop(self):
        """Tell the worker to stop; its end is expected, not a failure to report."""
        if self.loop is not None and self.alive and not READ_IN_THREAD:
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


# What one client (serve.client_of) may hold of the rows, of --max-queue and of MAX_SCORING_TOKENS (--client-share):
# a quarter leaves three quarters to the others (docs/serving.md, "Under hostile load")
CLIENT_SHARE = 0.25


class ClientShare:
    """What one client holds: rows, requests held back for its own rows, prompt tokens waiting to be scored, tokenizer
    requests in progress. `freed` is set (and replaced) whenever its rows go down; `number` names it to the workers'
    engines (not its key)."""

    def __init__(self, number):
        self.number = number
        self.rows, self.held_back, self.scoring_tokens, self.tokenizer_requests = 0, 0, 0, 0
        self.freed = asyncio.Event()

    def holds_nothing(self):
        return not (self.rows or self.held_back or self.scoring_tokens or self.tokenizer_requests)

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
        self.client_tokenizer_requests = max(1, int(client_share * MAX_TOKENIZER_REQUESTS))
        self.tokenizer_requests = 0  # /tokenize and /detokenize requests in progress
        self.clients = {}  # client -> ClientShare, while it holds anything
        self.client_numbers = itertools.count(1)
        self.held_back = 0  # requests waiting for their client's share of rows, not sent to a worker yet
        self.active = set()  # generations in flight, cancelled when the server stops
        self.keys = itertools.count()
        self.stopping = None  # the reason, once the server is stopping
        self.on_stop = []  # called with the reason when it is: what else must answer its requests now
        # withdrawn: their client left while they waited for a row
        self.requests_served = self.requests_cancelled = self.requests_rejected = self.requests_withdrawn = 0
        self.scorings, self.scoring_tokens = set(), 0  # scoring requests in flight, and their prompts' tokens
        self.tokens_generated, self.generation_seconds = 0, 0.0
        self.started = time.time()

    def start(self):
        self.loop = asyncio.get_running_loop()
        for worker in self.workers:
            worker.start(self.loop)

    def stop_soon(self, reason="the server is stopping"):
        """From a signal handler: end every request in the event loop's next turn (begin_stop), and say so once."""
        def end_requests():
            if self.stopping is None:
                print(f"stopping: {self.begin_stop(reason)} request(s) in flight or waiting ended with a 503 / an error "
                      "event", flush=True)
        if getattr(self, "loop", None) is not None:
            self.loop.call_soon_threadsafe(end_requests)

    def begin_stop(self, reason):
        """The server is stopping: every request in flight or waiting ends now with `reason` (an error event, a 503),
        none cut off later mid-reply. Returns how many."""
        self.stopping = reason
        ended = list(self.active) + list(self.scorings)
        for request in ended:
            request.cancel()
            request.receive([Failure(reason), Ended(getattr(request, "tokens", 0), 0.0, 0)])
        for share in self.clients.values():  # requests waiting for their client's share wake up to a 503
            share.freed.set()
        for callback in self.on_stop:
            callback(reason)
        return len(ended) + self.held_back

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
        """A GenerationRequest on the least loaded worker once its samples have rows. Past client_rows a request waits
        for its client's own requests to end (at most client_queue so); past the queue timeout in all, a 503."""
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
                               f"rows: --max-batch, or what the KV caches may take); got {sampling.num_samples}")
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
        """(per prompt [(log p or None, alternatives)], per choice (token, log p, alternatives)): the least loaded
        worker scores the prompts in slices between decode steps, and draws each of `samplings` (a max_tokens 1
        request) from the same pass. Bounded by MAX_SCORING_TOKENS and client_scoring_tokens (a 503 beyond)."""
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

    def hold_tokenizer(self, client):
        """A /tokenize or /detokenize request may start (release_tokenizer once its reply is written): at most
        MAX_TOKENIZER_REQUESTS at once, client_tokenizer_requests a client; beyond, a 503 at once, its body unread.
        (Unbounded, 150 of them from one client whose replies it never read took the server from 721 to 1,686 MiB.)"""
        if self.stopping:
            raise ServerStopping(self.stopping)
        held = self.clients[client].tokenizer_requests if client in self.clients else 0
        if held >= self.client_tokenizer_requests:
            self.requests_rejected += 1
            raise QueueFull(f"this client has {held} tokenizer requests in progress already (its share: "
                            f"{self.client_tokenizer_requests}, --client-share); try again shortly")
        if self.tokenizer_requests >= MAX_TOKENIZER_REQUESTS:
            self.requests_rejected += 1
            raise QueueFull(f"{self.tokenizer_requests} tokenizer requests are in progress (at most "
                            f"{MAX_TOKENIZER_REQUESTS}); try again shortly")
        self.tokenizer_requests += 1
        self.share_of(client).tokenizer_requests += 1

    def release_tokenizer(self, client):
        self.tokenizer_requests -= 1
        self.clients[client].tokenizer_requests -= 1
        self.forget_if_idle(client)

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
        print(f"{generation.num_samples} repl{'ies' if generation.num_samples > 1 else 'y'}, {generation.tokens} tokens "
              f"in {generation.seconds:.2f}s, {outcome}", flush=True)
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
            "tokenizer": {"requests": self.tokenizer_requests, "at_most": MAX_TOKENIZER_REQUESTS,
                          "client_share": self.client_tokenizer_requests},
            "clients": {"holding": len(self.clients), "held_back": self.held_back,
                        "most_rows": max((share.rows for share in self.clients.values()), default=0),
                        "share": {"rows": self.client_rows, "queue": self.client_queue,
                                  "scoring_tokens": self.client_scoring_tokens}},
            "tokens_generated": self.tokens_generated,
            "tokens_per_second": round(self.tokens_generated / max(self.generation_seconds, 1e-9), 1),
            "uptime_seconds": round(time.time() - self.started, 1),
        }


class GenerationRequest:
    """One request's replies on the server's side: its worker's events come out of event_batches(); cancel()
    withdraws it before the worker's next step."""

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


def load_workers(stage, model_tag, step, device_type, num_workers, max_batch, kv_memory_gib=None, prefill_chunk=256,
                 threads=0, start_method=None, decode="eager", int8=False):
    """
    (workers, tokenizer, model info), a process a worker: one per GPU (num_workers 0: every GPU), or on CPU sharing one
    copy of the weights (0: one), each batching up to max_batch sequences as the KV memory allows. On a Linux CPU
    this process loads the model and forks them; elsewhere (CUDA cannot fork, macOS not safely), or with start_method
    "spawn", each is spawned and loads its own. On a CPU the workers decode in the faster of fp32 and bf16, measured
    here first (kernels/decode_dtype.py), with int8 weights if asked (kernels/int8.py).
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
    if int8 and device.type != "cpu":
        raise UserError(f"--int8 runs on a CPU, not {device.type}: add --device-type=cpu")
    forking = device.type == "cpu" and sys.platform.startswith("linux") and start_method in (None, "fork")
    if device.type == "cpu":
        # one thread while forking: a child must not inherit an OpenMP pool whose threads did not come with it (a
        # child of a process whose team had two threads hung at its first parallel op: libgomp)
        torch.set_num_threads(1 if forking else threads)
        # the decode dtype, timed at one row and at a batch (on those threads); spawned workers inherit it
        use_fastest_decode_dtype(device, checkpoint_config(stage, model_tag, step), get_tokenizer(),
                                 rows=sorted({1, min(8, max_batch)}), int8=int8)
    settings = WorkerSettings(stage, model_tag, step, threads, max_batch, kv_memory_gib, count, prefill_chunk, decode,
                              int8)
    preloaded = None
    if forking:
        print(f"loading the {stage} model on cpu ...", flush=True)
        model, tokenizer, meta = load_model(stage, device, model_tag=model_tag, step=step)
        use_cpu_kernels(model, device)  # on a CPU, unless NANOCHAT_CPU_OPS=0
        model.prepare_for_inference()  # generation only (GPT.prepare_for_inference)
        preloaded = (quantize_int8(model) if int8 else model, tokenizer, meta)
        context = multiprocessing.get_context("fork")
        # what loading freed back to the kernel, or the workers' allocations would reuse those pages, copying on write
        gc.collect()
        return_freed_memory()
    else:
        print(f"loading the {stage} model on {', '.join(str(d) for d in devices)} (a process each) ...", flush=True)
        context = multiprocessing.get_context(start_method or "spawn")
    started = []
    # the workers start with SIGINT and SIGTERM ignored (worker_main says why), a spawned one while it imports torch
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
    # a server that exits without stopping them (a second Ctrl-C): multiprocessing's exit handler would SIGTERM them,
    # which they ignore, and wait for ever; this one, registered later, runs first
    atexit.register(stop_processes, [process for _, process, _ in started])
    workers = [Worker(index, process, conn, reply.rows) for (index, process, conn), reply in zip(started, replies)]
    info, rows, cache_bytes = replies[0].info, replies[0].rows, replies[0].cache_bytes
    info["device"] = ", ".join(sorted({str(d) for d in devices}))
    info["id"] = f"nanochat-{stage}-{info['tag']}"
    tokenizer = preloaded[1] if preloaded else get_tokenizer()
    print(f"loaded {summary_line(info)}; {len(workers)} worker process{'es' if len(workers) > 1 else ''}, each "
          f"batching up to {rows} sequences (KV cache {cache_bytes / 2**20:,.0f} MiB"
          f"{'' if rows == max_batch else f', fewer than --max-batch {max_batch}: what the KV memory holds'}"
          f"; prompts prefilled {prefill_chunk} tokens a step; {threads} torch thread{'s' if threads > 1 else ''})",
          flush=True)
    if replies[0].decode_cost:
        print(f"measured {replies[0].decode_cost} (worker 0): clients share the steps by it", flush=True)
    return workers, tokenizer, info


# -----------------------------------------------------------------------------
# The worker's side: its loop


class ScoringJob:
    """A scoring request as its worker process sees it: its prompts, scored a slice at a time from `next` on."""

    def __init__(self, score):
        self.key, self.prompts, self.top, self.samplings = score.key, score.prompts, score.top, score.samplings
        self.next, self.started = 0, time.perf_counter()

    def next_slice(self):
        """The prompts of the next slice: as many as fit SCORE_SLICE_TOKENS padded to their longest, at least one."""
        end, width = self.next + 1, len(self.prompts[self.next])
        prompts = self.prompts
        while end < len(prompts) and (end + 1 - self.next) * max(width, len(prompts[end])) <= SCORE_SLICE_TOKENS:
            width = max(width, len(prompts[end]))
            end += 1
        return range(self.next, end)


@torch.inference_mode()
def score_prompts(engine, prompts, top):
    """
    Per prompt, [(log p, [(id, log p)] of the `top` most likely)] of its tokens 1.. given those before (None for
    token 0), and its last position's (1, V) logits, by the engine's model; in as few padded forward passes as
    SCORE_LOGITS_BYTES allows. The engine's cache is not touched: rows that are decoding go on.
    """
    results, start = [], 0
    vocab = engine.model.config.vocab_size
    while start < len(prompts):
        rows = max(1, SCORE_LOGITS_BYTES // (4 * vocab * max(len(p) for p in prompts[start:start + 64])))
        results += _score_rows(engine, prompts[start:start + rows], top)
        start += rows
    return results


def _score_rows(engine, prompts, top):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([list(p) + [0] * (width - len(p)) for p in prompts], dtype=torch.long, device=engine.device)
    with engine.autocast():
        logits = engine.model.forward(ids).float()
    last = [logits[b, len(prompt) - 1][None].clone() for b, prompt in enumerate(prompts)]
    logprobs = logits.sub_(logits.logsumexp(dim=-1, keepdim=True))  # in place: one copy of (B, T, V) at a time
    chosen = logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].tolist()
    if top:
        values, indices = torch.topk(logprobs[:, :-1], min(top, logprobs.size(-1)), dim=-1)
        values, indices = values.tolist(), indices.tolist()
    results = []
    for b, prompt in enumerate(prompts):
        scored = [(None, [])] + [(chosen[b][i], list(zip(indices[b][i], values[b][i])) if top else [])
                                 for i in range(len(prompt) - 1)]
        results.append((scored, last[b]))
    return results


class GenerationJob:
    """A request as its worker process sees it: its sequences in the engine and its replies' text so far."""

    def __init__(self, add, tokenizer):
        self.key, self.samplings = add.key, add.samplings
        stops = StopStrings(add.samplings[0].stop)  # built once, read by each sample's stream
        self.streams = [ReplyStream(tokenizer, stops, add.chat) for _ in add.samplings]
        self.seqs = []
        self.outbox = []  # events not yet sent to the server
        self.admitted, self.started, self.tokens, self.replies_finished = False, None, 0, 0

    def take_outbox(self):
        events, self.outbox = self.outbox, []
        return events

    def note_admission(self):
        if not self.admitted and self.seqs and all(seq.row is not None for seq in self.seqs):
            self.admitted, self.started = True, time.perf_counter()
            self.outbox.append(Admitted())

    def push(self, index, token, seq):
        stream = self.streams[index]
        if seq.logprob is not None:  # the token that ends the reply too: the endpoints decide what to show
            self.outbox.append(Token(index, token, *seq.logprob))
        self.outbox += stream.events(index, token, length=seq.finished == "length")
        if stream.finish_reason is not None:
            self.tokens += stream.num_tokens
            self.replies_finished += 1

    def done(self):
        return self.replies_finished == len(self.samplings)

    def end(self):
        """Its last event; called once, as the job leaves the loop's jobs (or is refused)."""
        seconds = time.perf_counter() - self.started if self.started else 0.0
        self.outbox.append(Ended(self.tokens, seconds, self.replies_finished))


class EngineLoop:
    """The worker process: between two steps of the engine it takes the server's messages and sends the requests'
    events. run() hands a request to the engine and steps it itself: a request's path to its tokens is one call deep
    here (docs/layout.md counts it)."""

    def __init__(self, conn, engine):
        self.conn, self.engine = conn, engine
        self.jobs = {}  # key -> GenerationJob, given to the engine (waiting for rows, or running)
        self.scoring_jobs = OrderedDict()  # key -> ScoringJob, served a slice each in turn
        self.ended = []  # ended since the last flush: their last events are still to be sent
        self.sample_of = {}  # id(Sequence) -> (GenerationJob, sample index)
        self.flushed = 0.0  # when events were last sent
        self.trimmed = True  # nothing allocated since the last malloc_trim
        self.decode_owed = 0.0  # seconds of decoding due before the next scoring slice (SCORING_SHARE)

    def run(self):
        """Until Stop, or until the server is gone: the server's messages in, a step of the engine, a scoring slice
        when one is due, the requests' events out."""
        try:
            while True:
                idle = not self.jobs and not self.scoring_jobs
                self._flush(force=idle)
                if idle and not self.trimmed and not self.conn.poll(IDLE_TRIM_SECONDS):
                    return_freed_memory()  # a busy spell's freed temporaries back to the kernel, not kept for ever
                    self.trimmed = True
                while idle or self.conn.poll():  # idle: wait for the next message
                    idle, message = False, self.conn.recv()
                    match message:
                        case Stop():
                            return
                        case Add():
                            job = GenerationJob(message, self.engine.tokenizer)
                            try:  # the server fits every prompt first: one the engine refuses is a bug
                                job.seqs = self.engine.add_group(message.prompt_ids, message.samplings, message.owner)
                            except ValueError as e:
                                job.outbox.append(Failure(f"generation failed: {e}"))
                                self._end(job)
                            else:
                                self._track(job)
                        case Score():
                            self.scoring_jobs[message.key] = ScoringJob(message)
                        case Cancel(key=key):
                            self._cancel(key)
                if self.engine.busy():
                    started, self.trimmed = time.perf_counter(), False
                    try:
                        emitted = self.engine.step()
                    except Exception as e:  # a bug, or the device failing: every request in flight gets a 500
                        emitted = []
                        self._fail_jobs(e)
                    self._deliver(emitted)
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

    def _track(self, job):
        """A job the engine took: its samples' tokens go to it."""
        for index, seq in enumerate(job.seqs):
            self.sample_of[id(seq)] = (job, index)
        self.jobs[job.key] = job

    def _cancel(self, key):
        if key in self.jobs:
            self._drop(self.jobs[key])
        elif key in self.scoring_jobs:  # its client left: the slices not yet run never run
            job = self.scoring_jobs.pop(key)
            self.conn.send(Events([(job.key, [Ended(0, time.perf_counter() - job.started, 0)])], self._occupancy()))

    def _occupancy(self):
        share = self.engine.row_policy  # a FairShare, or None: every row fed, none passed by
        return Occupancy(**self.engine.occupancy(), rows_passed_by=share.rows_passed_by if share else 0)

    def _deliver(self, emitted):
        """A step's tokens to their replies' streams; a sample whose reply ended there (a stop string, a turn token the
        engine does not end on) is cancelled in the engine, and finished requests leave."""
        for job in self.jobs.values():
            job.note_admission()
        for seq, token, _ in emitted:
            job, index = self.sample_of[id(seq)]
            job.push(index, token, seq)
            if job.streams[index].finish_reason is not None and seq.finished is None:
                self.engine.cancel(seq)
        for job in [j for j in self.jobs.values() if j.done()]:
            self._drop(job)

    def _fail_jobs(self, error):
        traceback.print_exc()
        for job in list(self.jobs.values()):
            job.outbox.append(Failure(f"generation failed: {type(error).__name__}: {error}"))
            self._drop(job)

    def _flush(self, force=False):
        """The requests' new events and the occupancy, every FLUSH_SECONDS (one write per client for several steps:
        what the event loop keeps up with), or at once when one was admitted or ended or the worker is about to wait."""
        now = time.perf_counter()
        urgent = force or self.ended or any(j.outbox and isinstance(j.outbox[0], Admitted) for j in self.jobs.values())
        if not urgent and now - self.flushed < FLUSH_SECONDS:
            return
        self.flushed = now
        ready = [(job.key, job.take_outbox()) for job in list(self.jobs.values()) + self.ended if job.outbox]
        self.ended = []
        if ready or force:
            self.conn.send(Events(ready, self._occupancy()))

    def _score_slice(self):
        """The next slice of the first scoring request (one forward pass), with each Sampling's token after each
        prompt; then the request goes to the back of the line. The last slice ends it."""
        key, job = next(iter(self.scoring_jobs.items()))
        events, indices = [], job.next_slice()
        try:
            scored = score_prompts(self.engine, [job.prompts[i] for i in indices], job.top)
            for i, (tokens, _) in zip(indices, scored):
                # tuples, not lists: the garbage collector stops tracking those of plain numbers
                events.append(Scored(i, tuple((logprob, tuple(top)) for logprob, top in tokens)))
            # each Sampling's token after each prompt (choice i * n + j), chosen as a sequence's first token
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
            self.sample_of.pop(id(seq), None)
        del self.jobs[job.key]
        self._end(job)

    def _end(self, job):
        job.end()
        self.ended.append(job)


@dataclass
class WorkerSettings:
    """What a worker process is started with: load_workers' arguments, its threads, how many workers share the machine."""

    stage: str  # the checkpoint's: base, mid, sft or rl
    model_tag: str | None
    step: int | None
    threads: int
    max_batch: int
    kv_memory_gib: float | None
    num_workers: int
    prefill_chunk: int
    decode: str
    int8: bool = False  # int8 weights (kernels/int8.py)


def worker_main(conn, inherited, device, settings, preloaded):
    """
    A worker process: the model loaded (or the forked one), its engine, Ready or a Failure, then the EngineLoop.
    inherited: the server's pipe ends a fork copied, closed so a dead server reads as end-of-file. SIGINT and SIGTERM
    are ignored: they reach the whole group, and the server must outlive its workers to end its requests.
    """
    for connection in inherited:
        connection.close()
    try:
        torch.set_num_threads(settings.threads)
        if device.type == "cuda":
            use_cuda_device(device)  # CUDA ops go to the process's current GPU: this replica's
        if preloaded is None:
            model, tokenizer, meta = load_model(settings.stage, device, model_tag=settings.model_tag,
                                                step=settings.step)
            use_cpu_kernels(model, device)  # on a CPU, unless NANOCHAT_CPU_OPS=0
            model.prepare_for_inference()  # generation only: q, k, v in one matmul, bf16 weights once on a bf16 CPU
            if settings.int8:
                quantize_int8(model)
        else:
            model, tokenizer, meta = preloaded
        row_bytes = kv_row_bytes(model.config, device)
        memory = kv_memory_bytes(device, settings.kv_memory_gib)
        memory //= settings.num_workers if device.type != "cuda" else 1  # CPU workers share the memory
        rows = min(settings.max_batch, memory // row_bytes)
        if rows < 1:
            raise UserError(f"one sequence's KV cache needs {row_bytes / 2**20:.0f} MiB, more than the "
                            f"{memory / 2**20:.0f} MiB the KV caches may take; give --kv-memory-gib more")
        engine = BatchEngine(model, tokenizer, rows, settings.prefill_chunk)
        use_decode(engine, settings.decode)  # --decode: the engine's own step, or one captured as CUDA graphs
        # clients share its decode steps by what they cost here (fair_share.py), measured on the step just chosen
        share = share_decode_steps(engine) if rows > 1 else None
    except Exception as e:  # reported by the server, which stops before serving anything
        conn.send(Failure(str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"))
        return
    conn.send(Ready(model_info(meta, model, str(device), settings.stage), rows, engine.cache.nbytes(),
                    share.cost.summary() if share else ""))
    EngineLoop(conn, engine).run()
