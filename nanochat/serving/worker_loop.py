"""
The worker process of chat_web: it holds a model replica (or, on a CPU, shares the server's copy of the weights) and
runs continuous batching over its requests (nanochat/batch_engine.py), taking the server's messages between two decode
steps (messages.py: Add, Cancel, Score, Stop) and sending back every request's events in batches. The server's
side of it, and the pool of them, is nanochat/serving/workers.py.

A process, not a thread: a small model's decode step is hundreds of small ops, each of which takes Python's lock
back from the event loop, whose own Python (every client's stream) it then waits for. Measured at 16 clients on a
2-core CPU: 6.9 ms a step in a thread beside the server, 4.7 ms for the same load with nothing beside it; served
tok/s went from ~2,000 to ~2,800 (BENCHMARKS.md "Serving").
"""

import time
import traceback
from collections import OrderedDict

import torch

from nanochat.batch_engine import BatchEngine, kv_budget_bytes, kv_row_bytes, steer
from nanochat.checkpoint_manager import load_model
from nanochat.common import UserError, return_freed_memory, use_cuda_device
from nanochat.engine import GREEDY_BELOW, sample_next_tokens, token_logprobs
from nanochat.serving.chat import Finish, Piece, ReplyStream, model_info
from nanochat.serving.messages import (Add, Admitted, Cancel, Ended, Events, Failed, Ready, Score, Scored, Stop,
                                       Token)

FLUSH_SECONDS = 0.015  # a worker hands its tokens to the event loop at most this often (and at once when idle)
IDLE_TRIM_SECONDS = 1.0  # a worker idle this long hands its freed memory back (not between back-to-back requests)
# Prompt tokens (padded to the slice's longest) scored between two decode steps: a request scoring 64 prompts of a
# 2,048-token context runs as 64 slices, and every stream decoding beside it waits at most one slice for its next token
SCORE_SLICE_TOKENS = 2048


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


class Job:
    """A request as its worker process sees it: its sequences in the engine and its replies' text so far."""

    def __init__(self, key, samplings, stop, chat, tokenizer):
        self.key, self.samplings = key, samplings
        self.streams = [ReplyStream(tokenizer, stop, chat) for _ in samplings]
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
        self.jobs = {}  # key -> Job, given to the engine (waiting for rows, or running)
        self.scorings = OrderedDict()  # key -> ScoringJob, served a slice each in turn
        self.ended = []  # ended since the last flush: their last events are still to be sent
        self.owner = {}  # id(Sequence) -> (Job, sample index)
        self.flushed = 0.0  # when events were last sent
        self.trimmed = True  # nothing allocated since the last malloc_trim

    def run(self):
        try:
            while True:
                self._flush(force=not self.jobs and not self.scorings)
                if not self.jobs and not self.scorings:  # idle: wait for the next message
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
                    self._step()
                if self.scorings:  # one slice between two decode steps: generation keeps its pace
                    self._score_slice()
        except (EOFError, OSError):  # the server process is gone: nobody is left to answer
            return

    def _handle(self, message):
        match message:
            case Stop():
                return False
            case Add():
                self._add(message)
            case Score():
                self.scorings[message.key] = ScoringJob(message.key, message.prompts, message.top, message.samplings)
            case Cancel(key=key) if key in self.jobs:
                self._drop(self.jobs[key])
            case Cancel(key=key) if key in self.scorings:  # its client left: the slices not yet run never run
                job = self.scorings.pop(key)
                self.conn.send(Events([(job.key, [Ended(0, time.perf_counter() - job.started, 0)])],
                                      self.engine.occupancy()))
        return True

    def _step(self):
        self.trimmed = False
        try:
            steps = self.engine.step()
        except Exception as e:  # a bug, or the device failing: every request in flight gets a 500
            traceback.print_exc()
            for job in list(self.jobs.values()):
                job.emit(f"generation failed: {type(e).__name__}: {e}")
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
            self.conn.send(Events(ready, self.engine.occupancy()))

    def _add(self, add):
        job = Job(add.key, add.samplings, add.samplings[0].stop, add.chat, self.engine.tokenizer)
        try:
            job.seqs = self.engine.add_group(add.prompt_ids, add.samplings)
        except ValueError as e:  # a prompt the engine cannot take (the server fits it first, so a bug)
            job.emit(f"generation failed: {e}")
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
        key, job = next(iter(self.scorings.items()))
        events, indices = [], job.next_slice()
        try:
            scored = self.engine.score([job.prompts[i] for i in indices], job.top)
            for i, (tokens, last) in zip(indices, scored):
                events.append(Scored(i, tokens))
                for j, s in enumerate(job.samplings):
                    generator = torch.Generator(device=last.device)
                    generator.manual_seed(s.seed)
                    logits = steer(last, s, {}) if s.steers() else last
                    token = int(logits.argmax()) if s.temperature < GREEDY_BELOW else \
                        int(sample_next_tokens(logits, generator, s.temperature, s.top_k, s.top_p))
                    events.append(Token(i * len(job.samplings) + j, token, *token_logprobs(last, token, job.top)))
            job.next = indices[-1] + 1
        except Exception as e:  # a bug, or the device failing: this request gets a 500
            traceback.print_exc()
            events.append(f"scoring failed: {type(e).__name__}: {e}")
            job.next = len(job.prompts)
        self.scorings.move_to_end(key)
        if job.next == len(job.prompts):
            del self.scorings[key]
            events.append(Ended(len(job.prompts) * len(job.samplings), time.perf_counter() - job.started,
                                len(job.prompts)))
        self.trimmed = False
        self.conn.send(Events([(key, events)], self.engine.occupancy()))

    def _drop(self, job):
        for seq in job.seqs:
            self.engine.cancel(seq)
            self.owner.pop(id(seq), None)
        del self.jobs[job.key]
        job.end()
        self.ended.append(job)


def worker_main(conn, inherited, device, settings, preloaded):
    """
    A worker process: load the model (or take the one the server forked with), make its engine, report Ready
    (model info, rows, KV cache bytes) or Failed, then run the EngineLoop until the server stops it or
    goes away. settings: load_workers' arguments. inherited: what a fork copied from the server that this process
    must not hold: the server's ends of the pipes (a server that dies must read as end-of-file to every worker).
    It starts with SIGINT and SIGTERM ignored (load_workers): Ctrl-C or a service manager's SIGTERM reach every
    process of the group, and the server, which stops its workers itself, must outlive them to end its requests.
    """
    for connection in inherited:
        connection.close()
    try:
        torch.set_num_threads(settings["threads"])
        if device.type == "cuda":
            use_cuda_device(device)  # CUDA ops go to the process's current GPU: this replica's
        if preloaded is None:
            model, tokenizer, meta = load_model(settings["source"], device, model_tag=settings["model_tag"],
                                                step=settings["step"])
            model.prepare_for_inference()  # generation only: q, k, v in one matmul, bf16 weights once on a bf16 CPU
        else:
            model, tokenizer, meta = preloaded
        row_bytes = kv_row_bytes(model.config, device)
        budget = kv_budget_bytes(device, settings["kv_memory_gib"])
        budget //= settings["num_workers"] if device.type != "cuda" else 1  # CPU workers share the memory
        rows = min(settings["max_batch"], budget // row_bytes)
        if rows < 1:
            raise UserError(f"one sequence's KV cache needs {row_bytes / 2**20:.0f} MiB, more than the "
                            f"{budget / 2**20:.0f} MiB budget; give --kv-memory-gib more")
        engine = BatchEngine(model, tokenizer, rows, settings["prefill_chunk"], decode=settings.get("decode", "eager"))
    except Exception as e:  # reported by the server, which stops before serving anything
        conn.send(Failed(str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"))
        return
    conn.send(Ready(model_info(meta, model, str(device), settings["source"]), rows, engine.cache.nbytes()))
    EngineLoop(conn, engine).run()
