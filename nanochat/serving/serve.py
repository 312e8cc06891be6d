"""
The HTTP side of chat_web: the FastAPI app over a pool of worker processes (workers.py), the browser UI and its
endpoint, /health and /stats, the API keys, the OpenAI API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`)
and vLLM's tokenizer endpoints, every field read or refused with a 400 that names it; then the defences against
hostile load: bounded connections, stalled readers, Host and JSON checks (docs/serving.md has the story).
"""

import asyncio
import codecs
import dataclasses
import fcntl
import hmac
import itertools
import ipaddress
import json
import os
import re
import resource
import secrets
import socket
import struct
import termios
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanochat.common import UserError, print0
from nanochat.engine import Sampling
from nanochat.serving.chat import (MAX_TOKENS_RANGE, MAX_TOTAL_CHARS, MODEL_MARKUP, NUM_SAMPLES_RANGE, READABLE_MARKUP,
                                   SEED_MODULUS, TEMPERATURE_RANGE, TOP_K_RANGE, TOP_P_RANGE, TURN_TOKENS, Failure,
                                   Finish, MarkupWriter, Piece, RequestError, Token, check_number, fit_conversation,
                                   prompt_budget, validate_messages, whole_conversation)
from nanochat.serving.workers import NoWorkerAlive, QueueTimeout, ServerStopping

MAX_BODY_BYTES = 1_000_000  # a request within every limit of nanochat/serving/chat.py is well under this, JSON-escaped
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 100  # OpenAI allows 4 and vLLM any number; harnesses add their own end string
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_CHOICES = 64  # prompts x n of one /v1/completions request: what one reply may hold
COMPLETION_MAX_TOKENS = 16  # a completion's max_tokens when the request has none, as in OpenAI's API and vLLM's
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
PENALTY_RANGE, BIAS_RANGE = (-2.0, 2.0), (-100.0, 100.0)
CHAT_TOP_LOGPROBS, COMPLETION_LOGPROBS = 20, 5  # the most alternatives per token each endpoint gives, as OpenAI's

# The fields each endpoint reads; any other is refused, REFUSED's with their reason (docs/serving.md lists them)
COMMON_FIELDS = {"model", "temperature", "top_p", "top_k", "n", "max_tokens", "stream", "stream_options", "stop", "seed",
                 "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "metadata", "store", "service_tier",
                               "tools", "tool_choice", "parallel_tool_calls", "response_format", "modalities",
                               "prompt_cache_key", "safety_identifier", "nanochat_markup"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "echo", "best_of"}
REFUSED = {
    "functions": "this model calls no user tools", "function_call": "this model calls no user tools",
    "audio": "this model reads and writes text only", "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model has no hidden reasoning to tune", "verbosity": "this model has no verbosity setting",
    "web_search_options": "this server does not search the web",
}


# -----------------------------------------------------------------------------
# Requests


class HTTPProblem(Exception):
    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


MODEL_ALIASES = ("nanochat",)  # what a client may call the one served model besides its id (docs/serving.md)


def check_model(body, model_id):
    """A request's model: absent, or the served model's id or an alias; any other name is the API's 404."""
    if "model" not in body:
        return
    name = body["model"]
    if not isinstance(name, str):
        raise RequestError("model", f"must be a string: the served model's id ({model_id!r}) or {MODEL_ALIASES[0]!r}")
    if name not in (model_id,) + MODEL_ALIASES:
        raise HTTPProblem(404, f"model {name!r:.100} is not served here; this server serves {model_id!r} (also "
                          f"called {MODEL_ALIASES[0]!r})", param="model", code="model_not_found")


async def read_json_body(request):
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
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HTTPProblem(400, f"request body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(body, dict):
        raise HTTPProblem(400, "request body must be a JSON object")
    return {name: value for name, value in body.items() if value is not None}  # null is how clients say "absent"


CLIENT_SCOPE_KEY = "nanochat.client"  # set by RequireKey where the server has several keys


def client_of(request):
    """Who a request comes from (workers.CLIENT_SHARE): its key where the server has several, else its peer address;
    an IPv6 peer by its /64, what one host is usually given."""
    if request.scope.get(CLIENT_SCOPE_KEY):
        return request.scope[CLIENT_SCOPE_KEY]
    host = (request.scope.get("client") or ("",))[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a Unix socket's path, or no address at all
        return host
    if address.version == 6 and address.ipv4_mapped:
        return str(address.ipv4_mapped)
    if address.version == 6 and not address.is_loopback:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def check_fields(body, known, endpoint):
    for name in body:
        if name not in known:
            raise RequestError(name, REFUSED.get(name) or f"is not a field of the {endpoint} request this server "
                               "reads (docs/serving.md lists every field)")


def check_bool(body, name):
    if name in body and not isinstance(body[name], bool):
        raise RequestError(name, "must be true or false")
    return body.get(name, False)


def check_chat_extras(body):
    """The chat fields that ask for what this model cannot do, refused, or that say nothing, accepted."""
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        raise RequestError("tools", "must be a list")
    if tools:
        raise RequestError("tools", "this model calls no user tools (its only tool is its own calculator)")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise RequestError("tool_choice", "this model calls no user tools: only \"none\" or \"auto\" (with no tools)")
    response_format = body.get("response_format", {"type": "text"})
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind in ("json_object", "json_schema"):
        raise RequestError("response_format", f"{kind}: this model cannot be held to JSON output; ask for text")
    if kind != "text":
        raise RequestError("response_format", "must be {\"type\": \"text\"}")
    if check_bool(body, "store"):
        raise RequestError("store", "this server keeps no completions")
    if body.get("modalities", ["text"]) != ["text"]:
        raise RequestError("modalities", "this model writes text only: [\"text\"]")
    for name in ("user", "service_tier", "prompt_cache_key", "safety_identifier"):
        if name in body and not isinstance(body[name], str):
            raise RequestError(name, "must be a string")
    if not isinstance(body.get("metadata", {}), dict):
        raise RequestError("metadata", "must be an object")
    check_bool(body, "parallel_tool_calls")


def validate_stop(value):
    """The OpenAI API's stop: None, a string or a list of strings -> a list of non-empty strings."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings (got {len(stops)})")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise RequestError("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters (got {len(s)})")
    return stops


def validate_seed(value):
    """None (a fresh random seed) or any integer (1.0 reads as 1), folded into the range torch accepts."""
    if value is None:
        return secrets.randbelow(SEED_MODULUS)  # not the random module: a library may have seeded it
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError("seed", f"must be an integer (got {value!r:.40})")
    return value % SEED_MODULUS


def validate_logit_bias(value, vocab_size):
    """{"token id": bias in [-100, 100]} -> {id: bias}."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise RequestError("logit_bias", f"must be an object of at most {MAX_LOGIT_BIAS} \"token id\": bias entries")
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10 and int(key) < vocab_size):
            raise RequestError("logit_bias", f"{key!r:.20} is not a token id of this model (0 to {vocab_size - 1})")
        bias[int(key)] = check_number(f"logit_bias[{key}]", number, *BIAS_RANGE)
    return bias or None


def read_sampling(body, temperature, top_k, max_tokens, vocab_size=None, min_tokens=1):
    """A request's sampling fields checked, absent ones the defaults given (top_p 1, n 1, a fresh seed); min_tokens 0
    where a request may ask for no reply (a completion that only scores its prompt)."""
    temperature = check_number("temperature", body.get("temperature", temperature), *TEMPERATURE_RANGE)
    top_k = check_number("top_k", body.get("top_k", top_k), *TOP_K_RANGE, integer=True)
    top_p = check_number("top_p", body.get("top_p", 1.0), *TOP_P_RANGE)
    if top_p == 0:  # a nucleus of no mass would hold no token: the limit is the most likely one
        top_k, top_p = 1, 1.0
    max_field = reply_length_field(body)
    max_tokens = check_number(max_field, body.get(max_field, max_tokens), min_tokens, MAX_TOKENS_RANGE[1], integer=True)
    num_samples = check_number("n", body.get("n", 1), *NUM_SAMPLES_RANGE, integer=True)
    penalties = [check_number(name, body.get(name, 0.0), *PENALTY_RANGE) for name in ("presence_penalty", "frequency_penalty")]
    return Sampling(temperature=temperature, top_k=top_k, top_p=None if top_p == 1 else top_p, max_tokens=max_tokens,
                    seed=validate_seed(body.get("seed")), presence_penalty=penalties[0], frequency_penalty=penalties[1],
                    logit_bias=validate_logit_bias(body.get("logit_bias"), vocab_size or 2**31),
                    num_samples=num_samples, stop=validate_stop(body.get("stop")))


def reply_length_field(body):
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def reply_room(body, max_tokens, prompt_tokens, context, what):
    """A reply's max_tokens for a prompt of prompt_tokens: one the client gave must fit the context with the prompt (a
    400 context_length_exceeded otherwise, as vLLM answers); the default yields to the context."""
    room = context - prompt_tokens
    if body.get(reply_length_field(body)) is None:
        return min(max_tokens, room)
    if max_tokens > room:
        raise RequestError(reply_length_field(body), f"this model's context is {context} tokens and {what} take "
                           f"{prompt_tokens}: at most {room} tokens of reply fit (got {max_tokens})",
                           code="context_length_exceeded")
    return max_tokens


def read_stream_options(body):
    """Whether a streamed reply ends with a usage chunk: stream_options.include_usage (only with stream true)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise RequestError("stream_options", "is only allowed with \"stream\": true")
    if not isinstance(options, dict) or not set(options) <= {"include_usage", "include_obfuscation"}:
        raise RequestError("stream_options", "must be {\"include_usage\": true or false}")
    if check_bool(options, "include_obfuscation"):
        raise RequestError("stream_options.include_obfuscation", "this server does not pad its stream chunks: false, or "
                           "leave it out")
    return check_bool(options, "include_usage")


def read_prompts(value, tokenizer):
    """OpenAI's prompt: a string, a list of strings, a list of token ids, or a list of such lists -> [(ids, text)],
    text None for token ids. Each is checked: ids of this vocabulary, at most MAX_PROMPTS, MAX_TOTAL_CHARS of text."""
    vocab = tokenizer.get_vocab_size()
    is_ids = lambda v: isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)  # noqa: E731
    if isinstance(value, str) or (is_ids(value) and value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or is_ids(p) for p in value):
        items = value
    else:
        raise RequestError("prompt", "must be a string, a list of strings, a list of token ids, or a list of lists of them")
    if len(items) > MAX_PROMPTS:
        raise RequestError("prompt", f"at most {MAX_PROMPTS} prompts per request (got {len(items)})")
    if sum(len(p) for p in items if isinstance(p, str)) > MAX_TOTAL_CHARS:
        raise RequestError("prompt", f"at most {MAX_TOTAL_CHARS} characters of prompts together")
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            prompts.append((tokenizer.encode(item), item))
            continue
        bad = next((t for t in item if not 0 <= t < vocab), None)
        if bad is not None or not item:
            raise RequestError(f"prompt[{i}]", f"token ids must be 0 to {vocab - 1} (got {bad})" if item else "is empty")
        prompts.append((list(item), None))
    return prompts


# -----------------------------------------------------------------------------
# Replies: the API's shapes


def openai_error(message, kind, param=None, code=None):
    """The API's error shape, so its clients show the message."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status, message, kind="invalid_request_error", param=None, code=None, headers=None):
    return JSONResponse(openai_error(message, kind, param, code), status_code=status, headers=headers)


def openai_usage(prompt_tokens, completion_tokens):
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def openai_head(model_id, completion_id, created):
    """What every response and chunk of one completion repeats."""
    return {"id": completion_id, "created": created, "model": model_id, "system_fingerprint": None}


def openai_chunk(head, index, delta, finish_reason=None, logprobs=None):
    """One streamed chunk: a delta of choice `index` (its role first, then content), or its finish reason."""
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
    return {**head, "object": "chat.completion.chunk", "choices": [choice]}


def openai_usage_chunk(head, usage, kind="chat.completion.chunk"):
    """The last chunk of a stream that asked for stream_options.include_usage."""
    return {**head, "object": kind, "choices": [], "usage": usage}


def openai_model_card(model_id, created, context):
    return {"id": model_id, "object": "model", "created": created, "owned_by": "nanochat", "context_length": context,
            "max_model_len": context}


def sse(payload):
    return f"data: {json.dumps(payload)}\n\n"


def sse_response(chunks):
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class TokenTable:
    """Every token's bytes and its text decoded alone (U+FFFD for part of a character), read once at start: decoding
    the thousands a long prompt's logprobs name on the event loop stalled every other client."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        enc = tokenizer.enc
        self.bytes = [token_bytes(enc, i) for i in range(enc.n_vocab)]
        self.byte_values = [tuple(b) for b in self.bytes]  # a chat logprob's "bytes", one per token (chat_logprob)
        self.text = [b.decode("utf-8", errors="replace") for b in self.bytes]
        self.special = {tokenizer.encode_special(t) for t in tokenizer.get_special_tokens()}


def token_bytes(enc, token):
    try:
        return enc.decode_single_token_bytes(token)
    except KeyError:  # an id no token has (some tiktoken vocabularies have gaps): never sampled, never sent
        return b""


def chat_logprob(table, token, logprob, top):
    """One token of a chat reply's logprobs.content, with its alternatives. Tuples, not lists: the garbage collector
    stops tracking those of plain values (docs/serving.md, "Under hostile load")."""
    def entry(t, lp):
        return {"token": table.text[t], "logprob": lp, "bytes": table.byte_values[t]}
    return {**entry(token, logprob), "top_logprobs": tuple(entry(t, lp) for t, lp in top)}


class CompletionLogprobs:
    """A completion choice's logprobs in OpenAI's shape, token by token; take() gives what is new. text_offset counts
    characters of the decoded bytes, so the offsets index the text the reply returns."""

    def __init__(self, table):
        self.table, self.offset = table, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.fields = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.taken = 0

    def add(self, token, logprob, top, in_text=True):
        """in_text: the token's text is part of the choice's text (not a special token that ended the reply)."""
        text = self.table.text
        self.fields["tokens"].append(text[token])
        self.fields["token_logprobs"].append(logprob)
        self.fields["top_logprobs"].append(None if logprob is None else {text[t]: lp for t, lp in top})
        self.fields["text_offset"].append(self.offset)
        if in_text:
            self.offset += len(self.decoder.decode(self.table.bytes[token]))

    def take(self):
        new = {name: values[self.taken:] for name, values in self.fields.items()}
        self.taken = len(self.fields["tokens"])
        return new


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
        body = await read_json_body(request)
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
        budget = prompt_budget(self.context, sampling.max_tokens)
        prompt = await asyncio.to_thread(fit_conversation, self.tokenizer, messages, budget)  # trimmed, and told so
        generation = await until_disconnect(request, self.pool.submit(prompt.ids, sampling, client=client_of(request)))
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
        body = await read_json_body(request)
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
        generation = await until_disconnect(request, self.pool.submit(prompt.ids, sampling, client=client_of(request)))
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
                                 "usage": openai_usage(len(prompt.ids), tokens)})

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
        body = await read_json_body(request)
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
            scored, drawn = await until_disconnect(request, self.pool.score(
                model_prompts, sampling.logprobs, sampling.per_sample() if one_token else [], client_of(request)))
            await in_reply_thread(choices.add_scores, scored, drawn)  # thousands of entries: off the event loop
        generations = []
        try:
            for ids, limit in ([] if choices.done() else zip(model_prompts, limits)):
                generations.append(await until_disconnect(request, self.pool.submit(
                    ids, dataclasses.replace(sampling, max_tokens=limit), chat=False, client=client_of(request))))
        except BaseException:  # the rest will not be asked for: free the rows of those that were
            for generation in generations:
                generation.cancel()
            raise
        if body.get("stream"):
            return sse_response(self.completion_stream(generations, choices, head, include_usage))
        failure = await collect(request, generations, choices.take)
        if failure or not choices.done():
            return self.failed(failure)
        return await json_reply({**head, "object": "text_completion", "choices": choices.whole(),
                                 "usage": choices.usage()})

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

    async def completion_stream(self, generations, choices, head, include_usage):
        def render():
            return [sse({**head, "object": "text_completion", "choices": [
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]})
                for index, text, reason, logprobs in choices.deltas()]

        def end():
            return [sse(openai_usage_chunk(head, choices.usage(), "text_completion"))] if include_usage else []

        start = await in_reply_thread(render)  # echoed prompts and their scores, one-token replies: off the event loop
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
        body = await read_json_body(request)
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
        ids = await in_reply_thread(tokens)  # a 1 MB prompt is ~990,000 ids: encoded, then written, off the loop
        return await json_reply({"count": len(ids), "max_model_len": self.context, "tokens": ids})

    async def detokenize(self, request: Request):
        """POST /detokenize (vLLM's): {"tokens": ids} -> {"prompt": text}, as many ids as the request body holds."""
        body = await read_json_body(request)
        check_fields(body, {"model", "tokens"}, "detokenize")
        check_model(body, self.model_id)
        ids, vocab = body.get("tokens"), self.tokenizer.get_vocab_size()

        def decode():  # checked and decoded off the event loop: the body may hold ~990,000 ids
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                    for t in ids):
                raise RequestError("tokens", f"must be a list of token ids, 0 to {vocab - 1}")
            return self.tokenizer.decode(ids)

        return await json_reply({"prompt": await in_reply_thread(decode)})

    async def tokenizer_info(self):
        """GET /tokenizer_info (vLLM's): what lm-evaluation-harness's remote tokenizer reads."""
        from nanochat.interop.hf_export import CHAT_TEMPLATE

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


REPLY_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanochat-replies", initializer=lower_priority)
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


async def in_reply_thread(function, *args):
    """function(*args) in REPLY_THREAD: work on a reply's Python objects that can take seconds."""
    return await asyncio.get_running_loop().run_in_executor(REPLY_THREAD, function, *args)


async def json_reply(payload):
    pieces, written, started = json_pieces(payload), [], time.perf_counter()
    for piece in pieces:
        written.append(piece)
        if time.perf_counter() - started > INLINE_SECONDS:
            def write_the_rest():  # the same generator, taken up where the event loop left it
                written.extend(pieces)
                return "".join(written).encode()
            body = await in_reply_thread(write_the_rest)
            break
    else:
        body = "".join(written).encode()
    return Response(body, media_type="application/json")


class ClientGone(Exception):
    """The client left while its request waited for a row: it was withdrawn."""


async def until_disconnect(request, awaitable):
    """The awaitable's result, unless the client leaves first: then it is cancelled and ClientGone raised."""
    task, watcher = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


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


class ChatReplies:
    """The n replies of a chat request as their events come in: content as readable text (or markup), logprobs,
    finish reasons; deltas() gives what is new since the last call, for a stream."""

    def __init__(self, table, n, markup, logprobs):
        self.table, self.n, self.logprobs = table, n, logprobs
        self.writers = [MarkupWriter(markup) for _ in range(n)]
        # what content.logprobs leaves out: the token that ends the turn, and in readable text the markers
        self.left_out = table.special if markup is READABLE_MARKUP else {
            table.tokenizer.encode_special(t) for t in TURN_TOKENS}
        self.text = [""] * n
        self.entries = [[] for _ in range(n)]
        self.finished = {}
        self.new = {}  # index -> [text, reason, logprob entries] since the last deltas()

    def take(self, events):
        failure = None
        for event in events:
            if isinstance(event, Token):
                if event.token not in self.left_out:
                    entry = chat_logprob(self.table, event.token, event.logprob, event.top)
                    self.entries[event.index].append(entry)
                    self._new(event.index)[2].append(entry)
            elif isinstance(event, Piece):
                text = self.writers[event.index].write(event.kind, event.text)
                self.text[event.index] += text
                self._new(event.index)[0] += text
            elif isinstance(event, Finish):
                text = self.writers[event.index].close()
                self.text[event.index] += text
                new = self._new(event.index)
                new[0], new[1] = new[0] + text, event.reason
                self.finished[event.index] = event
            elif isinstance(event, Failure):
                failure = event.reason
        return failure

    def _new(self, index):
        return self.new.setdefault(index, ["", None, []])

    def deltas(self):
        out = [(index, text, reason, {"content": entries, "refusal": None} if self.logprobs else None)
               for index, (text, reason, entries) in sorted(self.new.items())]
        self.new = {}
        return out

    def whole(self):
        return [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": self.finished[i].reason,
                 "logprobs": {"content": self.entries[i], "refusal": None} if self.logprobs else None}
                for i, text in enumerate(self.text)]


class Completions:
    """The choices of a /v1/completions request (choice i * n + j: sample j of prompt i) as their parts come in: the
    echoed prompt and its scores, the reply's pieces, tokens and finish; deltas() gives what is new, for a stream."""

    def __init__(self, table, prompts, model_prompts, sampling, echo):
        self.table, self.n = table, sampling.num_samples
        self.prompts, self.model_prompts = prompts, model_prompts
        count = len(prompts) * self.n
        self.text, self.reason = [""] * count, [None] * count
        self.logprobs = [CompletionLogprobs(table) for _ in range(count)] if sampling.logprobs is not None else None
        self.completion_tokens = 0
        self.new = {}  # choice -> text since the last deltas()
        if echo:
            for i, (ids, text) in enumerate(prompts):
                for j in range(self.n):
                    self._add_text(i * self.n + j, text if text is not None else table.tokenizer.decode(ids))
        if sampling.max_tokens == 0:
            self.reason = ["length"] * count

    def _add_text(self, choice, text):
        self.text[choice] += text
        self.new[choice] = self.new.get(choice, "") + text

    def add_scores(self, scored, drawn):
        """The prompts' token scores (their implicit <|bos|> left out) and, for a one-token reply, its token."""
        for i, (ids, _) in enumerate(self.prompts):
            entries = scored[i][len(self.model_prompts[i]) - len(ids):]
            for j in range(self.n):
                for token, (logprob, top) in zip(ids, entries):
                    self.logprobs[i * self.n + j].add(token, logprob, top)
                self.new.setdefault(i * self.n + j, "")
        for choice, (token, logprob, top) in enumerate(drawn):
            self.completion_tokens += 1
            special = token in self.table.special  # a base model ends its text with one: no text, but its logprob
            self.logprobs[choice].add(token, logprob, top, in_text=not special)  # (lm-eval reads the prompt's as
            if not special:  # all but the last)
                self._add_text(choice, self.table.text[token])
            self.reason[choice] = "stop" if special else "length"

    def done(self):
        return all(reason is not None for reason in self.reason)

    def take(self, prompt_index, events):
        failure = None
        for event in events:
            choice = prompt_index * self.n + getattr(event, "index", 0)
            if isinstance(event, Token) and self.logprobs is not None:
                self.logprobs[choice].add(event.token, event.logprob, event.top,
                                          in_text=event.token not in self.table.special)
                self.new.setdefault(choice, "")
            elif isinstance(event, Piece):
                self._add_text(choice, event.text)
            elif isinstance(event, Finish):
                self.reason[choice] = event.reason
                self.completion_tokens += event.completion_tokens
                self.new.setdefault(choice, "")
            elif isinstance(event, Failure):
                failure = event.reason
        return failure

    def deltas(self):
        out = [(choice, text, self.reason[choice], self.logprobs[choice].take() if self.logprobs else None)
               for choice, text in sorted(self.new.items())]
        self.new = {}
        return out

    def whole(self):
        return [{"index": c, "text": self.text[c], "logprobs": self.logprobs[c].fields if self.logprobs else None,
                 "finish_reason": self.reason[c]} for c in range(len(self.text))]

    def usage(self):
        return openai_usage(sum(len(ids) for ids in self.model_prompts), self.completion_tokens)


# -----------------------------------------------------------------------------
# The app: the UI's page, the keys, the routes

UI_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui.html")
# The page may not be framed by another site (clickjacking), reads and sends only to this server, and runs only its
# own inline script and style
UI_HEADERS = {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
              "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                         "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                         "form-action 'none'; frame-ancestors 'none'"}
OPEN_PATHS = ("/", "/health")  # the UI's page (it holds no model access: it asks for the key) and monitoring
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RequireKey:
    """ASGI wrapper: every request but OPEN_PATHS needs `Authorization: Bearer KEY` with one of the keys (a 401, and a
    400 for two such headers); with several keys, the key names the client (client_of). Plain ASGI: an HTTP
    middleware would buffer the streams and hide a client's disconnect from them."""

    def __init__(self, app, keys):
        self.app, self.keys = app, [key.encode() for key in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(headers) > 1:
                response = error_response(400, f"{len(headers)} Authorization headers: send one")
                return await response(scope, receive, send)
            header = headers[0] if headers else b""
            scheme, _, given = header.partition(b" ")
            # every key compared, whatever matched: the time taken says nothing of which key came close
            matches = [hmac.compare_digest(given.strip(), key) for key in self.keys]
            if scheme.lower() != b"bearer" or not any(matches):
                reason = "missing" if not header else "wrong"
                response = error_response(401, f"{reason} API key: send the header `Authorization: Bearer <key>` "
                                          "with a key the server was started with (--api-key)", code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
            if len(self.keys) > 1:
                scope[CLIENT_SCOPE_KEY] = f"key {matches.index(True) + 1}"
        return await self.app(scope, receive, send)


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


# -----------------------------------------------------------------------------
# Starting up


def bind_socket(host, port):
    """Bound before the model loads, so a busy port is reported at once; a forked worker closes its copy, or a server
    that died would leave its port held until every worker noticed."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host") from None
    os.register_at_fork(after_in_child=sock.close)
    return sock


# -----------------------------------------------------------------------------
# Hostile load: connections, open files, what a browser's page cannot send

HEADER_TIMEOUT = 10.0  # seconds a new connection has to send a whole request's headers
WRITE_TIMEOUT = 30.0  # seconds a reply may go without its client taking STALL_BYTES before the connection is closed
# A reply "moves" while its client takes this many bytes per window (--write-timeout, or EVICT_WINDOW when a new
# connection needs its slot), counted as its TCP acknowledges them (docs/serving.md, "Under hostile load")
STALL_BYTES = 16384
EVICT_WINDOW = 5.0
OVER_BOUND_SCOPE_KEY = "nanochat.over_bound"  # set on a request that came in past --max-connections


def raise_open_file_limit():
    """The open-file limit raised to the hard limit (each connection is a file); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections(open_files):
    """Connections kept open at once: half the open-file limit, at least 256 files, is kept for the model's files, the
    pipes, those let in past the bound and the backlog asyncio accepts before the guard sees it."""
    return max(16, min(4096, open_files - max(256, open_files // 2)))


class CountingTransport:
    """A connection's transport that counts what was written to it: less waiting(), what the client has taken."""

    def __init__(self, transport):
        self.transport, self.written = transport, 0

    def write(self, data):
        self.written += len(data)
        self.transport.write(data)

    def waiting(self):
        """Bytes written that the client has not taken: in asyncio's buffer, or unacknowledged in the kernel's (Linux's
        SIOCOUTQ, where the system says)."""
        unsent, sock = 0, self.transport.get_extra_info("socket")
        if sock is not None and hasattr(termios, "TIOCOUTQ"):
            try:
                unsent = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
            except OSError:
                pass
        return self.transport.get_write_buffer_size() + unsent

    def __getattr__(self, name):  # everything else is the transport's own
        return getattr(self.transport, name)


class ConnectionGuard:
    """
    The open connections, at most max_connections: header_timeout seconds to send a whole request; then judged by what
    the client takes of its reply (fewer than STALL_BYTES in write_timeout seconds: closed). When all are open, a new
    one closes the longest idle, else the longest stalled; if every reply moves it is let in past the bound to be
    answered once (AnswerOverBound). docs/serving.md, "Under hostile load", has the story.
    """

    def __init__(self, max_connections, header_timeout=HEADER_TIMEOUT, write_timeout=WRITE_TIMEOUT):
        self.max_connections, self.header_timeout, self.write_timeout = max_connections, header_timeout, write_timeout
        self.max_over_bound = max(16, max_connections // 16)  # let in past the bound, each answered once and closed
        self.evict_window = min(EVICT_WINDOW, write_timeout)
        self.idle = OrderedDict()  # protocol -> since when it has waited for a complete request, oldest first
        self.busy = set()  # a request in, or its reply still going out
        self.moved = {}  # busy protocol -> (when its client last took STALL_BYTES or had nothing waiting, bytes taken)
        self.over_bound = set()  # let in past max_connections, to be answered once
        self.closed_idle = self.closed_stalled = self.let_in_over_bound = 0
        self.ticking = False

    def protocol_class(self):
        guard = self

        class GuardedH11Protocol(H11Protocol):
            def connection_made(self, transport):
                super().connection_made(transport)
                self.transport = CountingTransport(transport)  # uvicorn writes every response through it
                guard.opened(self)

            def data_received(self, data):
                super().data_received(data)
                if self in guard.over_bound and self.scope is not None:  # the app has not seen the request yet
                    self.scope[OVER_BOUND_SCOPE_KEY] = True
                if guard.serving(self):
                    guard.started(self)

            def on_response_complete(self):
                super().on_response_complete()
                guard.response_complete(self)

            def connection_lost(self, exc):
                guard.lost(self)
                super().connection_lost(exc)

        return GuardedH11Protocol

    @staticmethod
    def serving(protocol):
        """A whole request (headers and body) is in and its response not complete yet."""
        cycle = protocol.cycle
        return cycle is not None and not cycle.more_body and not cycle.response_complete

    @staticmethod
    def delivered(protocol):
        """Its response is complete and none of it waits in asyncio's buffer (the kernel sends the rest anyway)."""
        cycle = protocol.cycle
        return cycle is not None and cycle.response_complete and not protocol.transport.get_write_buffer_size()

    def opened(self, protocol):
        if len(self.idle) + len(self.busy) >= self.max_connections:
            if self.idle:  # closed at once: its file is what the new connection needs
                self.closed_idle += 1
                self.close(next(iter(self.idle)))
            elif (stalled := self.longest_stalled()) is not None:
                self.closed_stalled += 1
                self.close(stalled)
            elif len(self.over_bound) < self.max_over_bound:
                self.over_bound.add(protocol)
                self.let_in_over_bound += 1
            else:  # as many let in past the bound as it allows, each with its request in: no file to spare
                self.close(protocol)
                return
        self.wait_for_request(protocol)

    def stats(self):
        """For /stats: connections open, busy and stalled, and how many were closed or let in past the bound."""
        now = self.progress()
        stalled = sum(now - since >= self.evict_window for since, _ in self.moved.values())
        return {"open": len(self.idle) + len(self.busy), "busy": len(self.busy), "stalled": stalled,
                "closed_idle": self.closed_idle, "closed_stalled": self.closed_stalled,
                "let_in_over_bound": self.let_in_over_bound}

    def close(self, protocol):
        self.lost(protocol)
        protocol.transport.abort()

    # -- requests ---------------------------------------------------------------------------------

    def wait_for_request(self, protocol):
        since = time.monotonic()
        self.idle[protocol] = since
        self.idle.move_to_end(protocol)
        protocol.loop.call_later(self.header_timeout, self.expire, protocol, since)

    def expire(self, protocol, since):
        """Still no complete request since `since`: closed (a flood's socket, slow headers, a slow body)."""
        if self.idle.get(protocol) == since:
            self.close(protocol)
            self.closed_idle += 1

    def started(self, protocol):
        """A whole request is in: the connection is busy, and its client's progress is watched."""
        self.idle.pop(protocol, None)
        self.busy.add(protocol)
        transport = protocol.transport
        self.moved.setdefault(protocol, (time.monotonic(), transport.written - transport.waiting()))
        if not self.ticking:
            self.ticking = True
            protocol.loop.call_later(self.tick_seconds(), self.tick, protocol.loop)

    def response_complete(self, protocol):
        """The whole response written: the connection waits for a request once its last bytes left asyncio's buffer."""
        if protocol.transport.is_closing() or self.serving(protocol):  # closing, or a pipelined request began
            return
        if self.delivered(protocol):
            self.busy.discard(protocol)
            self.moved.pop(protocol, None)
            self.wait_for_request(protocol)

    def lost(self, protocol):
        self.idle.pop(protocol, None)
        self.busy.discard(protocol)
        self.moved.pop(protocol, None)
        self.over_bound.discard(protocol)

    # -- what clients take of their replies -------------------------------------------------------

    def tick_seconds(self):
        return min(1.0, self.write_timeout / 2)

    def progress(self):
        """Moves the mark of each busy connection with nothing waiting or STALL_BYTES taken since; returns now."""
        now = time.monotonic()
        for protocol, (since, taken) in list(self.moved.items()):
            waiting = protocol.transport.waiting()
            taken_now = protocol.transport.written - waiting
            if not waiting or taken_now - taken >= STALL_BYTES:
                self.moved[protocol] = (now, taken_now)
        return now

    def tick(self, loop):
        """Every second while connections are busy: a delivered one waits for its next request, a stalled one past
        write_timeout is closed (the app then cancels its generation)."""
        now = self.progress()
        for protocol, (since, _) in list(self.moved.items()):
            if self.delivered(protocol):
                self.response_complete(protocol)
            elif now - since >= self.write_timeout:
                self.close(protocol)
                self.closed_stalled += 1
                print0(f"closed a connection whose client took less than {STALL_BYTES // 1024} KiB of its reply in "
                       f"{self.write_timeout:g} s (--write-timeout)")
        self.ticking = bool(self.moved)
        if self.ticking:
            loop.call_later(self.tick_seconds(), self.tick, loop)

    def longest_stalled(self):
        """The reply whose client has gone longest without taking STALL_BYTES, if at least evict_window; else None."""
        now = self.progress()
        stalled = [(since, id(p), p) for p, (since, _) in self.moved.items() if now - since >= self.evict_window]
        return min(stalled)[2] if stalled else None


class AnswerOverBound:
    """ASGI wrapper for a connection let in past --max-connections: /health answered, anything else a 503 with
    Retry-After, and the connection closed: the client is told to come back, not cut off."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get(OVER_BOUND_SCOPE_KEY):
            return await self.app(scope, receive, send)

        async def send_and_close(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        if scope["path"] == "/health":
            return await self.app(scope, receive, send_and_close)
        response = error_response(503, "every connection this server keeps open (--max-connections) holds a request "
                                  "in progress; try again shortly", "server_busy", headers={"Retry-After": "1"})
        return await response(scope, receive, send_and_close)


def local_addresses():
    """This machine's addresses, without asking the network: its host name's, and on Linux every interface's."""
    addresses = set()
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            addresses |= {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    try:
        with open("/proc/net/fib_trie") as f:
            last = None
            for line in f:
                if "|--" in line:
                    last = line.split("|--")[1].strip()
                elif "/32 host LOCAL" in line and last:
                    addresses.add(last)
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as f:
            addresses |= {ipaddress.IPv6Address(int(line.split()[0], 16)).compressed for line in f if line.strip()}
    except (OSError, ValueError):
        pass
    return addresses


def allowed_host_names(host, extra=()):
    """The names a Host header may give for a server bound to `host`: loopback, the bound address, off loopback this
    machine's names and addresses, plus `extra` (--allowed-hosts); a page that rebinds its name still sends it."""
    names = set(LOOPBACK) | {host.strip("[]").lower()} | {name.strip("[]").lower() for name in extra}
    if host not in LOOPBACK:
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()} | local_addresses()
    return sorted(names - {"", "0.0.0.0", "::"})


HOST_HEADER = re.compile(r"\[(?P<address>[0-9a-f:.]+)\](:\d*)?|(?P<name>[^\[\]:]+)(:\d*)?")


def host_name(header):
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "Example.org:80" -> "example.org"; None
    for a header that is not a name or a bracketed address with an optional port ("[::1].evil.com", "::1")."""
    match = HOST_HEADER.fullmatch(header.lower())
    return match and (match["address"] or match["name"])


class RequireJSONAndHost:
    """ASGI wrapper against a web page the user visits: a POST's body must be JSON (a page cannot send that across
    origins unasked; 415) and the Host header must name this server (allowed_hosts, None for any; 421)."""

    def __init__(self, app, allowed_hosts):
        self.app = app
        self.allowed = None if allowed_hosts is None else set(allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            problem = None
            if self.allowed is not None:
                host = headers.get(b"host", b"").decode("latin-1")
                if host_name(host) not in self.allowed or sum(name == b"host" for name, _ in scope["headers"]) > 1:
                    problem = (421, f"Host {host!r:.100} is not this server: it answers to "
                                    f"{', '.join(sorted(self.allowed))} (a web page may not reach it under another name; "
                                    "chat_web --allowed-hosts adds names)")
            if problem is None and scope["method"] == "POST":
                kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
                if kind != b"application/json":
                    problem = (415, f"the body must be JSON, sent with Content-Type: application/json (got "
                                    f"{kind.decode('latin-1') or 'none'!r})")
            if problem:
                return await error_response(*problem)(scope, receive, send)
        return await self.app(scope, receive, send)
