"""
The HTTP side of chat_web: the FastAPI app over a pool of worker processes (workers.py), its routes (the browser UI
and its endpoint, /health and /stats, the OpenAI API's `/v1/chat/completions`, `/v1/completions` and `/v1/models`,
vLLM's tokenizer endpoints), streaming, and whole replies written off the event loop. What a request's fields mean
and what a reply looks like is protocol.py; the defences around the app and its connections are guards.py.
"""

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import os
import sys
import threading
import time
import uuid
from collections import OrderedDict, deque
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nanochat.common import json_loads, print0, return_freed_memory
from nanochat.serving.chat import (MODEL_MARKUP, READABLE_MARKUP, Failure, Finish, Piece, RequestError, check_number,
                                   fit_conversation, prompt_token_limit, validate_messages, whole_conversation)
from nanochat.serving.guards import AnswerOverBound, LOOPBACK, RequireJSONAndHost, RequireKey, client_of
from nanochat.serving.protocol import (CHAT_FIELDS, CHAT_TOP_LOGPROBS, COMPLETION_FIELDS, COMPLETION_LOGPROBS,
                                       COMPLETION_MAX_TOKENS, MAX_CHOICES, SURROGATE_ESCAPE, ChatReplies, Completions,
                                       HTTPProblem, TokenTable, check_bool, check_chat_extras, check_fields,
                                       check_model, check_unicode, error_response, openai_chunk, openai_error,
                                       openai_head, openai_model_card, openai_usage, openai_usage_chunk, read_prompts,
                                       read_sampling, read_stream_options, reply_length_field, reply_room)
from nanochat.serving.workers import IDLE_TRIM_SECONDS, NoWorkerAlive, QueueTimeout, ServerStopping
from nanochat.tokenizer import CHAT_TEMPLATE

MAX_BODY_BYTES = 1_000_000  # a request within every limit of nanochat/serving/chat.py is well under this, JSON-escaped


async def read_json_body(request, parser):
    """The request's body as a JSON object, fields sent as null left out; a large body is parsed in `parser` (a
    ReplyThread) in its client's turn (json.loads takes up to ~0.1 s on a megabyte, and the event loop parsed every
    body that came in before it answered anyone else: /health waited 2.4 s behind 16 connections sending them)."""
    size, chunks = 0, []
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise HTTPProblem(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # cut off mid-body: nobody to answer, and one line in the log rather than a traceback
        print0(f"a client left in the middle of its request's body ({size} bytes in)")
        raise ClientGone() from None
    raw = b"".join(chunks)
    if len(raw) <= PARSE_INLINE_BYTES:
        return parse_json_body(raw)
    return await parser.run(client_of(request), parse_json_body, raw)


PARSE_INLINE_BYTES = 65536  # a body up to this size is parsed on the event loop (~3 ms at most)
# Of the time the body thread works, the share it may parse: while it parses, every other thread waits for Python's
# lock, and the event loop needs it several times to answer anyone (parsing back to back, /health waited 1.5-2.6 s;
# half the time, ~0.6 s)
BODY_PARSE_SHARE = 0.25


def parse_json_body(raw):
    try:
        body = json_loads(raw)
    except ValueError as e:  # JSONDecodeError (nested too deep included) and UnicodeDecodeError are ValueErrors
        raise HTTPProblem(400, f"request body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(body, dict):
        raise HTTPProblem(400, "request body must be a JSON object")
    if SURROGATE_ESCAPE.search(raw):  # rare: the walk over every string only then
        check_unicode(body)
    return {name: value for name, value in body.items() if value is not None}  # null is how clients say "absent"


def sse(payload):
    return f"data: {json.dumps(payload)}\n\n"


def sse_response(chunks):
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -----------------------------------------------------------------------------
# The endpoints


class Routes:
    """The UI's and the API's endpoints over a pool of workers; defaults: temperature, top_k, max_tokens of requests
    without."""

    def __init__(self, pool, tokenizer, model_info, defaults):
        self.pool, self.tokenizer, self.defaults = pool, tokenizer, defaults
        self.context, self.model_id = model_info["context"], model_info["id"]
        self.bos = tokenizer.get_bos_token_id()
        self.table = TokenTable(tokenizer)
        self.replies = ReplyThread(nice=True)  # work that can take seconds, off the event loop
        # large request bodies: json.loads never lets go of Python's lock (up to ~0.1 s a megabyte), so the thread
        # parses a quarter of the time at most, and at the event loop's priority (a niced thread holding the lock
        # while the system runs others holds the event loop too)
        self.bodies = ReplyThread(nice=False, share=BODY_PARSE_SHARE)
        pool.on_stop += [self.replies.stop, self.bodies.stop]

    def mount(self, app):
        app.post("/chat/completions")(self.ui_completion)
        app.post("/v1/chat/completions")(self.chat_completion)
        app.post("/v1/completions")(self.completion)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{name}")(self.model)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/tokenizer_info")(self.tokenizer_info)

    def failed(self, failure):
        """A whole reply that did not complete: 503 when the server is stopping, else 500 (a worker failed)."""
        status = 503 if self.pool.stopping else 500
        return error_response(status, failure or "generation was cancelled", "server_error")

    def read_common(self, body, endpoint, fields):
        check_fields(body, fields, endpoint)
        check_model(body, self.model_id)
        check_bool(body, "stream")
        return read_stream_options(body)

    async def ui_completion(self, request: Request):
        """POST /chat/completions, the UI's: its conversation trimmed to fit the context (and told so), a stream of
        {"token"}, {"python"}, {"python_output"} ..., then {"done"}."""
        body = await read_json_body(request, self.bodies)
        unknown = sorted(set(body) - {"messages", "temperature", "top_k", "top_p", "max_tokens", "seed", "stop", "n",
                                      "model", "stream"})
        if unknown:
            raise RequestError(unknown[0], "is not a field of this endpoint (the OpenAI API is at /v1)")
        check_model(body, self.model_id)
        check_bool(body, "stream")  # it always streams; a client that says so must say it as a boolean
        messages = validate_messages(body.get("messages"))
        sampling = read_sampling(body, **self.defaults)
        if sampling.num_samples != 1:
            raise RequestError("n", "this endpoint streams one reply; ask /v1/chat/completions for several")
        prompt_limit = prompt_token_limit(self.context, sampling.max_tokens)
        # trimmed to fit, and told so: a conversation re-rendered a dozen times, in the reply thread in the client's
        # turn (in the thread pool every chat's prompt is rendered in, a client looping long ones held the others')
        prompt = await self.replies.run(client_of(request), fit_conversation, self.tokenizer, messages, prompt_limit)
        async with withdrawn_if_client_leaves(request):
            generation = await self.pool.submit(prompt.ids, sampling, client=client_of(request))
        kinds = {"text": "token", "python": "python", "python_output": "python_output"}

        def as_sse(events):
            """One write for a batch of events; consecutive pieces of one kind go out as one event."""
            out = []
            for kind, run in itertools.groupby(events, lambda event: event.kind if isinstance(event, Piece) else None):
                if kind is not None:
                    out.append(sse({kinds[kind]: "".join(piece.text for piece in run)}))
                    continue
                for event in run:
                    if isinstance(event, Finish):
                        usage = openai_usage(len(prompt.ids), event.completion_tokens)
                        out.append(sse({"done": True, "finish_reason": event.reason, "usage": usage}))
                    elif isinstance(event, Failure):
                        out.append(sse({"error": event.reason}))
            return "".join(out)

        async def stream():
            # a client that leaves stops this generator (Starlette watches), and the finally frees its row
            try:
                if prompt.note:
                    yield sse({"note": prompt.note})
                async for events in generation.event_batches():
                    yield as_sse(events)
            finally:
                generation.cancel()

        return sse_response(stream())

    # -- chat --------------------------------------------------------------------------------

    async def chat_completion(self, request: Request):
        """POST /v1/chat/completions: the whole reply at once, or streamed."""
        body = await read_json_body(request, self.bodies)
        include_usage = self.read_common(body, "chat completions", CHAT_FIELDS)
        check_chat_extras(body)
        markup = check_bool(body, "nanochat_markup")
        messages = validate_messages(body.get("messages"), markup=markup)
        sampling = read_sampling(body, **self.defaults, vocab_size=self.tokenizer.get_vocab_size())
        if check_bool(body, "logprobs"):
            sampling.logprobs = check_number("top_logprobs", body.get("top_logprobs", 0), 0, CHAT_TOP_LOGPROBS, integer=True)
        elif "top_logprobs" in body:
            raise RequestError("top_logprobs", "needs \"logprobs\": true")
        # off the event loop; an API client keeps its own context, so its messages go in whole or not at all
        prompt = await asyncio.to_thread(whole_conversation, self.tokenizer, messages, self.context)
        sampling.max_tokens = reply_room(body, sampling.max_tokens, len(prompt.ids), self.context, "the messages")
        async with withdrawn_if_client_leaves(request):
            generation = await self.pool.submit(prompt.ids, sampling, client=client_of(request))
        head = openai_head(self.model_id, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
        replies = ChatReplies(self.table, sampling.num_samples, MODEL_MARKUP if markup else READABLE_MARKUP,
                              sampling.logprobs is not None)
        if body.get("stream"):
            return sse_response(self.chat_stream(generation, prompt, head, replies, include_usage))
        failure = await collect(request, [generation], lambda _, events: replies.take(events))
        if failure or len(replies.finished) < sampling.num_samples:
            return self.failed(failure)
        tokens = sum(f.completion_tokens for f in replies.finished.values())
        return await json_reply({**head, "object": "chat.completion", "choices": replies.whole(),
                                 "usage": openai_usage(len(prompt.ids), tokens)}, client_of(request), self.replies)

    def chat_stream(self, generation, prompt, head, replies, include_usage):
        def render():
            out = []
            for index, text, reason, logprobs in replies.deltas():  # the text, then the finish with no delta
                if text or logprobs and logprobs["content"]:
                    out.append(sse(openai_chunk(head, index, {"content": text}, None, logprobs)))
                if reason:
                    out.append(sse(openai_chunk(head, index, {}, reason)))
            return out

        def end():
            tokens = sum(f.completion_tokens for f in replies.finished.values())
            return [sse(openai_usage_chunk(head, openai_usage(len(prompt.ids), tokens)))] if include_usage else []

        start = [sse(openai_chunk(head, i, {"role": "assistant", "content": ""})) for i in range(replies.n)]
        return stream_events([generation], lambda _, events: replies.take(events), render, end, start)

    # -- completions ---------------------------------------------------------------------------

    async def completion(self, request: Request):
        """POST /v1/completions: for each prompt, n replies (or none, with max_tokens 0), the prompt echoed if asked,
        with logprobs of the prompt and of the reply."""
        body = await read_json_body(request, self.bodies)
        include_usage = self.read_common(body, "completions", COMPLETION_FIELDS)
        if body.get("suffix", "") != "":
            raise RequestError("suffix", "this model does not fill in the middle")
        best_of = body.get("best_of", 1)
        if isinstance(best_of, bool) or best_of != 1:
            raise RequestError("best_of", f"only 1: ask for n replies and choose among them (got {best_of!r:.20})")
        echo = check_bool(body, "echo")
        sampling = read_sampling(body, **{**self.defaults, "max_tokens": COMPLETION_MAX_TOKENS},
                                 vocab_size=self.tokenizer.get_vocab_size(), min_tokens=0)
        if "logprobs" in body:
            sampling.logprobs = check_number("logprobs", body["logprobs"], 0, COMPLETION_LOGPROBS, integer=True)
        scoring = echo and sampling.logprobs is not None
        one_token = scoring and sampling.max_tokens == 1 and not sampling.stop  # drawn from the scoring pass
        if sampling.max_tokens == 0 and sampling.num_samples > 1:
            raise RequestError("n", "a prompt scored with max_tokens 0 has one answer: n copies would only repeat it "
                               "(ask with n 1)")
        prompts = await asyncio.to_thread(read_prompts, body.get("prompt"), self.tokenizer)
        if len(prompts) * sampling.num_samples > MAX_CHOICES:
            raise RequestError("n", f"prompts x n may be at most {MAX_CHOICES} choices in one reply (got "
                               f"{len(prompts)} x {sampling.num_samples})")
        model_prompts, limits = [], []
        for i, (ids, _) in enumerate(prompts):
            field = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
            ids = self.read_after_bos(body, ids, 0 if sampling.max_tokens == 0 or one_token else
                                      1 if body.get(reply_length_field(body)) is None else sampling.max_tokens, field)
            model_prompts.append(ids)
            limits.append(sampling.max_tokens if sampling.max_tokens == 0 or one_token else
                          reply_room(body, sampling.max_tokens, len(ids), self.context, field))
        head = openai_head(self.model_id, f"cmpl-{uuid.uuid4().hex}", int(time.time()))
        choices = Completions(self.table, prompts, model_prompts, sampling, echo)
        if scoring:  # the prompts' log probabilities, in slices between decode steps; a one-token reply drawn from them
            async with withdrawn_if_client_leaves(request):
                scored, drawn = await self.pool.score(model_prompts, sampling.logprobs,
                                                      sampling.per_sample() if one_token else [], client_of(request))
            # thousands of entries: off the event loop
            await self.replies.run(client_of(request), choices.add_scores, scored, drawn)
        generations = []
        try:
            async with withdrawn_if_client_leaves(request):
                for ids, limit in ([] if choices.done() else zip(model_prompts, limits)):
                    generations.append(await self.pool.submit(ids, dataclasses.replace(sampling, max_tokens=limit),
                                                              chat=False, client=client_of(request)))
        except BaseException:  # the rest will not be asked for: free the rows of those that were
            for generation in generations:
                generation.cancel()
            raise
        if body.get("stream"):
            return sse_response(self.completion_stream(generations, choices, head, include_usage, client_of(request)))
        failure = await collect(request, generations, choices.take)
        if failure or not choices.done():
            return self.failed(failure)
        return await json_reply({**head, "object": "text_completion", "choices": choices.whole(),
                                 "usage": choices.usage()}, client_of(request), self.replies)

    def read_after_bos(self, body, ids, room, field):
        """A completion prompt after a <|bos|> (how every training document began; not echoed) unless it has one or
        the <|bos|> would push prompt and `room` past the context: no client is refused for a token it did not send."""
        with_bos = ids if ids[:1] == [self.bos] else [self.bos] + ids
        ids = with_bos if len(with_bos) + room <= self.context else ids
        if len(ids) + room > self.context:  # the reply asked for is at fault where the prompt alone would fit
            field = reply_length_field(body) if len(ids) < self.context and room > 1 else field
            raise RequestError(field, f"this model's context is {self.context} tokens and the prompt takes {len(ids)}"
                               + (f", with {room} of reply asked for" if room else ""), code="context_length_exceeded")
        return ids

    async def completion_stream(self, generations, choices, head, include_usage, client):
        def render():
            return [sse({**head, "object": "text_completion", "choices": [
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]})
                for index, text, reason, logprobs in choices.deltas()]

        def end():
            return [sse(openai_usage_chunk(head, choices.usage(), "text_completion"))] if include_usage else []

        # echoed prompts and their scores, one-token replies: off the event loop
        start = await self.replies.run(client, render)
        async for text in stream_events(generations, choices.take, render, end, start):
            yield text

    # -- the model and its tokenizer -------------------------------------------------------------

    async def models(self):
        return {"object": "list", "data": [openai_model_card(self.model_id, int(self.pool.started), self.context)]}

    async def model(self, name: str):
        check_model({"model": name}, self.model_id)
        return openai_model_card(self.model_id, int(self.pool.started), self.context)

    async def tokenize(self, request: Request):
        """POST /tokenize (vLLM's): a prompt (special tokens spelled in it are special; add_special_tokens puts <|bos|>
        first) or messages (add_generation_prompt ends them with <|assistant_start|>) -> ids, off the event loop."""
        return await self.tokenizer_request(request, self.read_tokenize)

    def read_tokenize(self, body):
        """/tokenize's fields -> the work on the reply thread: its payload."""
        check_fields(body, {"model", "prompt", "add_special_tokens", "messages", "add_generation_prompt"}, "tokenize")
        check_model(body, self.model_id)
        if "messages" in body:
            if "prompt" in body:
                raise RequestError("prompt", "give prompt or messages, not both")
            for_reply = check_bool(body, "add_generation_prompt") if "add_generation_prompt" in body else True
            messages = validate_messages(body["messages"], for_reply=for_reply)
            conversation = {"messages": messages}
            bos = [self.bos] if check_bool(body, "add_special_tokens") else []

            def tokens():
                if for_reply:
                    return bos + self.tokenizer.render_for_completion(conversation)
                return bos + self.tokenizer.render_conversation(conversation, max_tokens=None)[0]
        elif isinstance(body.get("prompt"), str):
            if "add_generation_prompt" in body:
                raise RequestError("add_generation_prompt", "is for messages; a prompt is tokenized as it is")
            bos = [self.bos] if check_bool({"add_special_tokens": True, **body}, "add_special_tokens") else []
            specials = self.tokenizer.get_special_tokens()

            def tokens():
                return bos + self.tokenizer.enc.encode(body["prompt"], allowed_special=specials)
        else:
            raise RequestError("prompt", "must be a string (or give messages)")

        def payload():  # a 1 MB prompt is ~990,000 ids
            ids = tokens()
            return {"count": len(ids), "max_model_len": self.context, "tokens": ids}
        return payload

    async def detokenize(self, request: Request):
        """POST /detokenize (vLLM's): {"tokens": ids} -> {"prompt": text}, as many ids as the request body holds."""
        return await self.tokenizer_request(request, self.read_detokenize)

    def read_detokenize(self, body):
        check_fields(body, {"model", "tokens"}, "detokenize")
        check_model(body, self.model_id)
        ids, vocab = body.get("tokens"), self.tokenizer.get_vocab_size()

        def payload():  # checked and decoded off the event loop: the body may hold ~990,000 ids
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                    for t in ids):
                raise RequestError("tokens", f"must be a list of token ids, 0 to {vocab - 1}")
            return {"prompt": self.tokenizer.decode(ids)}
        return payload

    async def tokenizer_request(self, request, read):
        """A /tokenize or /detokenize request within its client's share of them (WorkerPool.hold_tokenizer), held
        from before its body is read until its reply is written: read(body) checks the fields and returns the work,
        done in the reply thread in the client's turn."""
        client = client_of(request)
        self.pool.hold_tokenizer(client)
        try:
            work = read(await read_json_body(request, self.bodies))
            reply = await json_reply(await self.replies.run(client, work), client, self.replies)
        except BaseException:
            self.pool.release_tokenizer(client)
            raise
        reply.release = functools.partial(self.pool.release_tokenizer, client)
        return reply

    async def tokenizer_info(self):
        """GET /tokenizer_info (vLLM's): what lm-evaluation-harness's remote tokenizer reads."""

        return {"tokenizer_class": "nanochat", "bos_token": "<|bos|>", "eos_token": "<|bos|>", "pad_token": None,
                "model_max_length": self.context, "vocab_size": self.tokenizer.get_vocab_size(),
                "special_tokens": sorted(self.tokenizer.get_special_tokens()), "chat_template": CHAT_TEMPLATE}


async def stream_events(generations, take, render, end, start):
    """A streamed reply as SSE text: `start`, then for each batch of events of any generation take(index, events) (a
    failure or None) and render()'s chunks; end() and [DONE], or a failure's error. The generations end with it."""
    merged = asyncio.Queue()

    async def forward(index, generation):
        async for events in generation.event_batches():
            await merged.put((index, events))
        await merged.put((index, None))

    tasks = [asyncio.create_task(forward(i, g)) for i, g in enumerate(generations)]
    try:
        if start:
            yield "".join(start)
        running = len(generations)
        while running:
            index, events = await merged.get()
            if events is None:
                running -= 1
                continue
            failure, out = take(index, events), render()
            if failure:  # a stopping server, a worker that failed: the error, and the end a client waits for
                yield "".join(out) + sse(openai_error(failure, "server_error")) + "data: [DONE]\n\n"
                return
            if out:
                yield "".join(out)
        yield "".join(end()) + "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for generation in generations:
            generation.cancel()


# -----------------------------------------------------------------------------
# Whole replies as JSON, off the event loop: a reply of megabytes built in one piece held every other client for
# seconds, so it is written in pieces, the rest in one low-priority thread once INLINE_SECONDS have gone
# (docs/serving.md, "Under hostile load"; one thread: more would only take more turns from the event loop)


def lower_priority():
    """The reply thread yields the CPU to the workers' decode steps (Linux's nice is per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # a system without per-thread priorities: the same thread, at the same priority
        pass


class ReplyThread:
    """
    A thread for the work on requests' and replies' Python objects that can take seconds (the app has two: the replies
    below the workers' CPU priority, the bodies at the event loop's), its clients served in turn, a job each: a client
    with many jobs waiting delays another by one of them, not all (in first-come order, 150 unread /tokenize requests
    from one client held a neighbour's scoring reply for 13.9 s).
    A client's jobs run in the order it sent them. When the server stops, every job not finished fails (stop()), so
    its request is answered with a 503 rather than cut off (a /tokenize in flight was closed without a response).
    """

    def __init__(self, nice, share=1.0):
        self.nice = nice  # below the workers' priority (lower_priority)
        self.share = share  # of the time the thread works: after a job of s seconds, it rests s * (1 - share) / share
        self.queues = OrderedDict()  # client -> deque of (concurrent Future, function, args), the next turn first
        self.ready = threading.Condition()
        self.running = None  # the Future of the job in progress
        self.thread = None
        self.worked = False  # jobs ran since freed memory was last handed back
        self.stopping = None  # a ServerStopping, once stop() is called

    def submit(self, client, function, *args):
        future = concurrent.futures.Future()
        with self.ready:
            if self.stopping:
                future.set_exception(self.stopping)
                return future
            if self.thread is None:
                self.thread = threading.Thread(target=self._work, name="nanochat-replies", daemon=True)
                self.thread.start()
            self.queues.setdefault(client, deque()).append((future, function, args))
            self.ready.notify()
        return future

    async def run(self, client, function, *args):
        """function(*args) in the thread, in `client`'s turn."""
        return await asyncio.wrap_future(self.submit(client, function, *args))

    def stop(self, reason):
        """The server is stopping: every job not finished, and every one submitted later, raises ServerStopping (the
        job in progress runs on; nobody waits for it)."""
        with self.ready:
            self.stopping = ServerStopping(reason)
            futures = [job[0] for queue in self.queues.values() for job in queue] + [self.running]
            self.queues.clear()
        for future in futures:
            if future is not None and not future.done():
                future.set_exception(self.stopping)

    def _work(self):
        if self.nice:
            lower_priority()
        while True:
            with self.ready:
                while not self.queues:
                    # idle a while after big jobs: what their objects freed goes back to the system (it stayed in the
                    # process: 150 megabyte /tokenize requests left it ~1 GB larger for good)
                    if not self.ready.wait(IDLE_TRIM_SECONDS) and self.worked:
                        return_freed_memory()
                        self.worked = False
                client, queue = next(iter(self.queues.items()))
                future, function, args = queue.popleft()
                if queue:
                    self.queues.move_to_end(client)  # its next job after every other client's
                else:
                    del self.queues[client]
                if not future.set_running_or_notify_cancel():  # its request was cancelled meanwhile
                    continue
                self.running, self.worked = future, True
            started = time.perf_counter()
            try:
                result = function(*args)
                if not future.done():  # failed by stop() meanwhile: nobody waits for it
                    future.set_result(result)
            except BaseException as e:
                if not future.done():
                    future.set_exception(e)
            finally:
                self.running = future = result = None  # no reply kept alive while the thread waits
            if self.share < 1.0:
                time.sleep((time.perf_counter() - started) * (1 - self.share) / self.share)


INLINE_SECONDS = 0.002
# what one json.dumps writes of a long list or string: ~100 KB at most (a chat token with 20 alternatives is ~1.3 KB)
SLICE_OF_OBJECTS = 64  # items of a list of objects or lists
SLICE_OF_VALUES = 4096  # items of a list of numbers or strings
SLICE_OF_TEXT = 65536  # characters


def json_pieces(value):
    """value as compact JSON (as JSONResponse writes it), in pieces: long lists and strings a slice at a time."""
    if isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + json.dumps(key, ensure_ascii=False) + ":"
            yield from json_pieces(item)
        yield "}"
    elif isinstance(value, list) and value:
        nested = isinstance(value[0], (dict, list)) or isinstance(value[-1], (dict, list))
        if nested and len(value) <= SLICE_OF_OBJECTS:  # a few big items (a reply's choices): each its own pieces
            yield "["
            for i, item in enumerate(value):
                yield "," if i else ""
                yield from json_pieces(item)
            yield "]"
            return
        step = SLICE_OF_OBJECTS if nested else SLICE_OF_VALUES
        yield "["
        for start in range(0, len(value), step):
            yield ("," if start else "") + json.dumps(value[start:start + step], ensure_ascii=False,
                                                      separators=(",", ":"))[1:-1]
        yield "]"
    elif isinstance(value, str) and len(value) > SLICE_OF_TEXT:
        yield '"'
        for start in range(0, len(value), SLICE_OF_TEXT):
            yield json.dumps(value[start:start + SLICE_OF_TEXT], ensure_ascii=False)[1:-1]
        yield '"'
    else:
        yield json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class JSONReply(Response):
    """A whole JSON reply, written to the connection a WRITE_BYTES piece at a time, each once the client has taken
    most of the last (uvicorn waits for its buffer to drain before the next piece): `release`, if set, is called once
    all of it is written (or the connection is gone), so what the request holds is held while its reply waits for
    its client."""

    media_type = "application/json"
    release = None

    async def __call__(self, scope, receive, send):
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            body = memoryview(self.body)
            for start in range(0, len(body), WRITE_BYTES):
                await send({"type": "http.response.body", "body": bytes(body[start:start + WRITE_BYTES]),
                            "more_body": start + WRITE_BYTES < len(body)})
            if not body:
                await send({"type": "http.response.body", "body": b""})
        finally:
            if self.release is not None:
                self.release()


WRITE_BYTES = 65536


async def json_reply(payload, client, replies):
    pieces, written, started = json_pieces(payload), [], time.perf_counter()
    for piece in pieces:
        written.append(piece)
        if time.perf_counter() - started > INLINE_SECONDS:
            def write_the_rest():  # the same generator, taken up where the event loop left it
                written.extend(pieces)
                return "".join(written).encode()
            body = await replies.run(client, write_the_rest)
            break
    else:
        body = "".join(written).encode()
    return JSONReply(body)


class ClientGone(Exception):
    """The client left while its request waited for a row: it was withdrawn."""


@asynccontextmanager
async def withdrawn_if_client_leaves(request):
    """
    Runs the block (a request waiting for a row, or for its scores) unless the client leaves first: then the block is
    cancelled where it waits, which withdraws the request (WorkerPool.submit and .score see to it), and ClientGone is
    raised. The block runs in the route's own task, the request's way to its worker a call deeper, not a task away.
    """
    route, left = asyncio.current_task(), False

    async def watch():
        nonlocal left
        await disconnected(request)
        left = True
        route.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield  # a block that ends in the turn its client leaves may swallow the cancel (wait_for does): it goes on
    except asyncio.CancelledError:
        if not left:  # cancelled for another reason: the server is stopping
            raise
        raise ClientGone() from None
    finally:
        watcher.cancel()
        if left and sys.version_info >= (3, 11):  # from 3.11 a task counts its cancels: this one is handled
            route.uncancel()


async def disconnected(request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request, generations, take):
    """Whole replies' events fed to take(i, events) (a failure or None), cancelled if the client leaves; the first
    failure."""
    async def cancel_on_disconnect():
        await disconnected(request)
        for generation in generations:
            generation.cancel()

    watcher = asyncio.create_task(cancel_on_disconnect())

    async def one(i, generation):
        async for events in generation.event_batches():
            failure = take(i, events)
            if failure:
                return failure
        return None

    try:
        failures = await asyncio.gather(*[one(i, generation) for i, generation in enumerate(generations)])
    finally:
        watcher.cancel()
        for generation in generations:
            generation.cancel()
    return next((f for f in failures if f), None)


# -----------------------------------------------------------------------------
# The app: the UI's page, the keys, the routes

UI_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui.html")
# The page may not be framed by another site (clickjacking), reads and sends only to this server, and runs only its
# own inline script and style
UI_HEADERS = {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
              "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                         "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                         "form-action 'none'; frame-ancestors 'none'"}


def create_app(pool, tokenizer, model_info, defaults, api_keys=(), allowed_hosts=LOOPBACK, connections=None):
    """The app around a pool of workers. defaults: temperature, top_k, max_tokens of requests without; allowed_hosts:
    the Host header's names (allowed_host_names), None for any; connections: ConnectionGuard.stats for /stats."""
    with open(UI_PATH, encoding="utf-8") as f:
        ui_html = f.read()

    @asynccontextmanager
    async def lifespan(app):
        pool.start()
        yield
        pool.stop()

    app = FastAPI(title="nanochat", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    errors = {  # each in the API's error shape, an unknown path or method too (not {"detail": ...})
        RequestError: lambda e: error_response(400, str(e), param=e.field, code=e.code),
        HTTPProblem: lambda e: error_response(e.status, e.message, param=e.param, code=e.code),
        StarletteHTTPException: lambda e: error_response(e.status_code, str(e.detail),
                                                         headers=getattr(e, "headers", None)),
        QueueTimeout: lambda e: error_response(503, str(e), "server_busy", headers={"Retry-After": "1"}),
        NoWorkerAlive: lambda e: error_response(503, str(e), "server_error"),
        ServerStopping: lambda e: error_response(503, str(e), "server_error"),
        ClientGone: lambda e: Response(status_code=499),  # nobody reads it: the client left while its request waited
    }
    for kind, respond in errors.items():
        async def handler(request, e, respond=respond):
            return respond(e)
        app.add_exception_handler(kind, handler)

    async def ui():
        return HTMLResponse(ui_html, headers=UI_HEADERS)

    async def health():
        alive = sum(1 for w in pool.workers if w.alive)
        body = {"status": "ok" if alive else "no worker alive", "workers": alive, "auth_required": bool(api_keys),
                "model": model_info}
        return body if alive else JSONResponse(body, status_code=503)

    async def stats():
        return {**pool.stats(), **({"connections": connections()} if connections else {})}

    app.get("/")(ui)
    app.get("/health")(health)
    app.get("/stats")(stats)
    Routes(pool, tokenizer, model_info, defaults).mount(app)
    return AnswerOverBound(RequireJSONAndHost(RequireKey(app, api_keys) if api_keys else app, allowed_hosts))
