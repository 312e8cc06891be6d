"""
The OpenAI API as chat_web speaks it, apart from the engine and the HTTP plumbing: every field of the chat and
completions requests read and checked, or refused with a 400 that names it (docs/serving.md lists them), into one
Sampling and its prompts; and the replies' shapes, whole and in stream chunks, with their logprobs, built as a
request's events come in from its worker (ChatReplies, Completions).
"""

import codecs
import json
import re
import secrets

from fastapi.responses import JSONResponse

from nanochat.engine import Sampling
from nanochat.serving.chat import (MAX_TOKENS_RANGE, MAX_TOTAL_CHARS, NUM_SAMPLES_RANGE, READABLE_MARKUP, SEED_MODULUS,
                                   TEMPERATURE_RANGE, TOP_K_RANGE, TOP_P_RANGE, TURN_TOKENS, Failure, Finish,
                                   MarkupWriter, Piece, RequestError, Token, check_number)

MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 100  # OpenAI allows 4 and vLLM any number; harnesses add their own end string
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_CHOICES = 64  # prompts x n of one /v1/completions request: what one reply may hold
COMPLETION_MAX_TOKENS = 16  # a completion's max_tokens when the request has none, as in OpenAI's API and vLLM's
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
PENALTY_RANGE, BIAS_RANGE = (-2.0, 2.0), (-100.0, 100.0)
CHAT_TOP_LOGPROBS, COMPLETION_LOGPROBS = 20, 5  # the most alternatives per token each endpoint gives, as OpenAI's

# The fields each endpoint reads; any other is refused, REFUSED's with their reason (docs/serving.md lists them)
COMMON_FIELDS = {"model", "temperature", "top_p", "top_k", "n", "max_tokens", "stream", "stream_options", "stop",
                 "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "metadata", "store", "service_tier",
                               "tools", "tool_choice", "parallel_tool_calls", "response_format", "modalities",
                               "prompt_cache_key", "safety_identifier", "nanochat_markup"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "echo", "best_of"}
REFUSED = {
    "functions": "this model calls no user tools", "function_call": "this model calls no user tools",
    "audio": "this model reads and writes text only", "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model has no hidden reasoning to tune",
    "verbosity": "this model has no verbosity setting",
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
    penalties = [check_number(name, body.get(name, 0.0), *PENALTY_RANGE)
                 for name in ("presence_penalty", "frequency_penalty")]
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
        raise RequestError("stream_options.include_obfuscation", "this server does not pad its stream chunks: false, "
                           "or leave it out")
    return check_bool(options, "include_usage")


def read_prompts(value, tokenizer):
    """OpenAI's prompt: a string, a list of strings, a list of token ids, or a list of such lists -> [(ids, text)],
    text None for token ids. Each is checked: ids of this vocabulary, at most MAX_PROMPTS, MAX_TOTAL_CHARS of text."""
    vocab = tokenizer.get_vocab_size()

    def is_ids(v):
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str) or (is_ids(value) and value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or is_ids(p) for p in value):
        items = value
    else:
        raise RequestError("prompt", "must be a string, a list of strings, a list of token ids, or a list of lists of "
                           "them")
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
            reason = f"token ids must be 0 to {vocab - 1} (got {bad})" if item else "is empty"
            raise RequestError(f"prompt[{i}]", reason)
        prompts.append((list(item), None))
    return prompts


# -----------------------------------------------------------------------------
# Replies: the API's shapes


def openai_error(message, kind, param=None, code=None):
    """The API's error shape, so its clients show the message."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ErrorResponse(JSONResponse):
    def render(self, content):
        """As JSONResponse writes it, or, where the message quotes what cannot be UTF-8 (a lone surrogate), with every
        character past ASCII escaped: an error about a bad field is the 4xx, not a 500 of its own."""
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, separators=(",", ":")).encode()


def error_response(status, message, kind="invalid_request_error", param=None, code=None, headers=None):
    return ErrorResponse(openai_error(message, kind, param, code), status_code=status, headers=headers)


# a JSON escape of a UTF-16 surrogate (\ud800-\udfff): only a body with one can hold a lone surrogate
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def check_unicode(value, where="the body"):
    """Every string of a parsed JSON body, its keys too, is text: a lone surrogate (a JSON escape such as \\ud800 not
    paired with its other half) is no character, and no reply that quotes it (an echoed prompt, an error naming the
    field) can be written as UTF-8. A RequestError names where it is."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(where, f"holds a lone surrogate ({ascii(value[e.start])[1:-1]}), half of a UTF-16 "
                               "pair, which is no character: send text as valid Unicode") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, f"a field name in {where}")
            check_unicode(item, key if where == "the body" else f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{where}[{i}]")


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
# Replies as their events come in


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
        return [{"index": i, "message": {"role": "assistant", "content": text},
                 "finish_reason": self.finished[i].reason,
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
