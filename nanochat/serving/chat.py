"""
A chat's messages: what chat_cli and chat_web share (request limits, validation, tool-call markup, a conversation
fitted to the context, a reply's text as the model writes it), and the events of a reply and the messages of the
worker pipe (workers.py). A reply is a list of parts, as in the tokenizer's chat format: "text", "python" (a
calculator call the model wrote) and "python_output" (the calculator's answer); each Piece carries its part's kind.
"""

import bisect
import math
import re
from collections import deque
from dataclasses import dataclass

from nanochat.engine import StreamDecoder

# -----------------------------------------------------------------------------
# Limits on what a client may ask for: no request holds a worker for long or fills memory

MAX_MESSAGES = 500  # messages in one request
MAX_MESSAGE_CHARS = 8000  # characters in one message (all its parts together)
MAX_TOTAL_CHARS = 32000  # characters in all messages of one request
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_K_RANGE = (1, 200)
TOP_P_RANGE = (0.0, 1.0)  # 0, as the OpenAI API allows: the most likely token only
MAX_TOKENS_RANGE = (1, 4096)
NUM_SAMPLES_RANGE = (1, 8)  # the OpenAI API's n: samples are decoded together as one batch
SEED_MODULUS = 2**63  # any integer is a valid seed; torch takes it modulo this

ROLES = ("system", "user", "assistant")
TURN_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>")  # end a reply
ASSISTANT_PART_TYPES = ("text", "python", "python_output")


class RequestError(ValueError):
    """A request the client must fix: `field` names what is wrong (e.g. "messages[2].role"), `reason` says why."""

    def __init__(self, field, reason, code=None):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason, self.code = field, reason, code  # code: the OpenAI API's, where it has one


# -----------------------------------------------------------------------------
# Checking requests


def check_number(field, value, low, high, integer=False, low_open=False):
    """value itself if it is a number in [low, high] ((low, high] with low_open), else RequestError."""
    kind = "an integer" if integer else "a number"
    bounds = f"{'above' if low_open else 'from'} {low:g} to {high:g}"
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if integer and isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON clients may write 50.0 for 50
    not_finite = isinstance(value, float) and not math.isfinite(value)
    if not is_number or (integer and not isinstance(value, int)) or not_finite:
        raise RequestError(field, f"must be {kind} {bounds} (got {value!r:.40})")
    if value > high or value < low or (low_open and value == low):
        raise RequestError(field, f"must be {kind} {bounds} (got {value})")
    return value


def _text_parts_only(field, content):
    """User and system content: a string, or OpenAI-style [{"type": "text", "text": ...}] parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text"
                                         and isinstance(p["text"], str) for p in content):
        return "".join(p["text"] for p in content)
    kinds = sorted({str(p.get("type")) for p in content if isinstance(p, dict)} - {"text"}) if isinstance(content, list) else []
    reason = f" ({', '.join(kinds)}: this model reads text only)" if kinds else ""
    raise RequestError(field, "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts" + reason)


def _assistant_parts(field, content, markup=False):
    """Assistant content as parts: a string (with markup, tool calls written in the model's markup are read back;
    without, it is text, whatever it spells), or parts."""
    if isinstance(content, str):
        return parse_markup(content) if markup else [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(field, "must be a string or a list of parts")
    parts = []
    for i, part in enumerate(content):
        well_formed = isinstance(part, dict) and part.get("type") in ASSISTANT_PART_TYPES and set(part) == {"type", "text"}
        if not (well_formed and isinstance(part.get("text"), str)):
            raise RequestError(f"{field}[{i}]", f"must be {{\"type\": one of {', '.join(ASSISTANT_PART_TYPES)}, "
                                                "\"text\": a string}")
        parts.append({"type": part["type"], "text": part["text"]})
    return parts


# What a message may carry besides role and content: nothing the model can read, so each is refused with its reason
# (null, and an empty list of tool calls, count as absent: what clients send back from a reply object)
MESSAGE_REFUSED = {"name": "this model's chat format has no participant names",
                   "tool_calls": "this model calls no user tools (its only tool is its own calculator)",
                   "function_call": "this model calls no user tools", "tool_call_id": "this model calls no user tools",
                   "audio": "this model reads and writes text only", "refusal": "this model writes no refusals",
                   "annotations": "this server writes no annotations"}
MESSAGE_ABSENT = (None, [], "")


def validate_messages(messages, markup=False, for_reply=True):
    """
    A client's messages checked and normalised for the tokenizer: user and system content as strings, assistant
    content as parts, consecutive messages of one role merged, a system message only first, the last from the user
    (unless for_reply is False). markup: an assistant string's MODEL_MARKUP tool calls become tool parts.
    """
    if not isinstance(messages, list):
        raise RequestError("messages", "must be a list of {\"role\": ..., \"content\": ...} objects")
    if not messages:
        raise RequestError("messages", "must not be empty")
    if len(messages) > MAX_MESSAGES:
        raise RequestError("messages", f"at most {MAX_MESSAGES} messages per request (got {len(messages)})")
    normalised, total_chars = [], 0
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(field, "must be an object with \"role\" and \"content\"")
        for key, value in message.items():
            if key not in ("role", "content") and not (key in MESSAGE_REFUSED and value in MESSAGE_ABSENT):
                raise RequestError(f"{field}.{key}", MESSAGE_REFUSED.get(key) or "is not a field of a message this "
                                   "server reads (role and content)")
        role = message.get("role")
        if role == "developer":  # what newer OpenAI clients send in place of "system"
            role = "system"
        if role not in ROLES:
            raise RequestError(f"{field}.role", f"must be one of {', '.join(ROLES)} or developer (got {role!r:.40})")
        if role == "system" and i != 0:
            raise RequestError(f"{field}.role", "a system message is only allowed as the first message")
        if "content" not in message:
            raise RequestError(f"{field}.content", "is missing")
        if role == "assistant":
            content = _assistant_parts(f"{field}.content", message["content"], markup)
        else:
            content = _text_parts_only(f"{field}.content", message["content"])
        chars = len(content) if isinstance(content, str) else sum(len(p["text"]) for p in content)
        if chars > MAX_MESSAGE_CHARS:
            raise RequestError(f"{field}.content", f"at most {MAX_MESSAGE_CHARS} characters per message (got {chars})")
        total_chars += chars
        if total_chars > MAX_TOTAL_CHARS:
            raise RequestError("messages", f"at most {MAX_TOTAL_CHARS} characters in all messages together")
        if normalised and normalised[-1]["role"] == role:
            gap = [{"type": "text", "text": "\n\n"}] if role == "assistant" else "\n\n"  # between parts, or strings
            normalised[-1]["content"] = normalised[-1]["content"] + gap + content
            continue
        normalised.append({"role": role, "content": content})
    if normalised[0]["role"] == "system" and len(normalised) == 1:
        raise RequestError("messages", "a system message must be followed by a user message")
    first_turn = normalised[1] if normalised[0]["role"] == "system" else normalised[0]
    if first_turn["role"] != "user":
        raise RequestError("messages", "the conversation must start with a user message (after an optional system one)")
    if for_reply and normalised[-1]["role"] != "user":
        raise RequestError("messages", "the last message must be from the user: the model writes the reply to it")
    return normalised


# -----------------------------------------------------------------------------
# Tool calls written as text: how an OpenAI client sees them, and how they are read back.

MODEL_MARKUP = {"python": ("<|python_start|>", "<|python_end|>"),
                "python_output": ("<|output_start|>", "<|output_end|>")}
TERMINAL_MARKUP = {"python": ("[python: ", "]"), "python_output": (" [output: ", "]")}
READABLE_MARKUP = {"python": ("", ""), "python_output": (" = ", "")}  # "37*48 = 1776": what an API reply says
_MARKUP_RE = re.compile(r"<\|python_start\|>(.*?)<\|python_end\|>|<\|output_start\|>(.*?)<\|output_end\|>", re.DOTALL)


def parse_markup(text):
    """Assistant text with tool calls in MODEL_MARKUP -> parts: a conversation sent back renders as it was written."""
    parts, position = [], 0
    for match in _MARKUP_RE.finditer(text):
        if match.start() > position:
            parts.append({"type": "text", "text": text[position:match.start()]})
        python = match.group(1) is not None
        parts.append({"type": "python" if python else "python_output", "text": match.group(1 if python else 2)})
        position = match.end()
    if position < len(text) or not parts:
        parts.append({"type": "text", "text": text[position:]})
    return parts


class MarkupWriter:
    """(kind, text) pieces -> flat text with markup opened and closed around tool parts (MODEL_ or TERMINAL_MARKUP)."""

    def __init__(self, markup):
        self.markup = markup
        self.kind = "text"

    def write(self, kind, text):
        if kind == self.kind:
            return text
        opening = self.close() + (self.markup[kind][0] if kind in self.markup else "")
        self.kind = kind
        return opening + text

    def close(self):
        """The closing markup of the part in progress, if any (call once the reply is complete)."""
        out = self.markup[self.kind][1] if self.kind in self.markup else ""
        self.kind = "text"
        return out


def parts_as_markup(parts, markup=MODEL_MARKUP):
    writer = MarkupWriter(markup)
    return "".join(writer.write(p["type"], p["text"]) for p in parts) + writer.close()


# -----------------------------------------------------------------------------
# Prompts that fit the context


@dataclass
class Prompt:
    ids: list  # token ids, ending where the model should continue
    messages: list  # the messages that are still in it (chat), or [] (plain text)
    note: str = ""  # what was dropped or cut to fit the context, "" when nothing was


def prompt_token_limit(context, max_tokens):
    """The prompt tokens a request may send: the context less max_tokens, but at most half of it (a long reply cannot
    squeeze the conversation out; it ends at the context, finish reason "length")."""
    return context - min(max_tokens, context // 2)


def fit_conversation(tokenizer, messages, max_prompt_tokens):
    """Validated messages rendered to fit max_prompt_tokens: the oldest turns dropped, then the system message, then
    the start of the last user message (its end, usually the question, is kept). Prompt.note says what went."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system):]  # user, assistant, ..., user

    def render(kept_system, kept_turns):
        return tokenizer.render_for_completion({"messages": kept_system + kept_turns})

    def fits(kept_system, kept_turns):
        return len(render(kept_system, kept_turns)) <= max_prompt_tokens

    ids = render(system, turns)
    if len(ids) <= max_prompt_tokens:
        return Prompt(ids, messages)
    # the fewest (user, assistant) pairs to drop, binary searched (the prompt only shrinks as more go)
    pairs = bisect.bisect_left(range(1, len(turns) // 2), True, key=lambda n: fits(system, turns[2 * n:]))
    dropped = 2 * min(1 + pairs, len(turns) // 2)  # the last user message stays
    turns = turns[dropped:]
    notes = [f"dropped the {dropped} oldest messages"] if dropped else []
    ids = render(system, turns)
    if len(ids) > max_prompt_tokens and system:
        system = []
        notes.append("dropped the system message")
        ids = render(system, turns)
    if len(ids) > max_prompt_tokens:
        text = turns[-1]["content"]
        low = bisect.bisect_left(range(1, len(text) + 1), True,  # the most characters of its end that fit
                                 key=lambda n: not fits([], [{"role": "user", "content": text[-n:]}]))
        if low == 0:
            raise RequestError("messages", f"the model's context ({max_prompt_tokens} prompt tokens) cannot hold "
                                           "even a one-character message")
        turns = [{"role": "user", "content": text[-low:]}]
        notes.append(f"kept only the last {low} of the {len(text)} characters of the last message")
        ids = render([], turns)
    note = "; ".join(notes) + f" to fit the model's context ({max_prompt_tokens} prompt tokens)"
    return Prompt(ids, system + turns, note)


def whole_conversation(tokenizer, messages, context):
    """Validated messages rendered whole, for a client that keeps its own context (the OpenAI API): a RequestError
    "context_length_exceeded" when they leave no room for a reply."""
    ids = tokenizer.render_for_completion({"messages": messages})
    if len(ids) >= context:
        raise RequestError("messages", f"this model's context is {context} tokens and the messages take {len(ids)}, "
                           "leaving no room for a reply: send fewer or shorter messages", code="context_length_exceeded")
    return Prompt(ids, messages)


def fit_text(tokenizer, text, max_prompt_tokens):
    """A base model's prompt: <|bos|> then the text, keeping only its end when it is too long."""
    ids = tokenizer.encode(text)
    if len(ids) + 1 <= max_prompt_tokens:
        return Prompt([tokenizer.get_bos_token_id()] + ids, [])
    kept = ids[len(ids) - (max_prompt_tokens - 1):]
    note = f"kept only the last {len(kept)} of the text's {len(ids)} tokens to fit the model's context"
    return Prompt([tokenizer.get_bos_token_id()] + kept, [], note)


# -----------------------------------------------------------------------------
# The events of a reply and the messages of the worker pipe (workers.py), a dataclass each, pickled and matched by
# type. Server -> worker: Add, Score, Cancel, Stop. Worker -> server: Ready or Failure at start, then Events.
# A request's events: Admitted, Token, Piece, Finish, Scored, Failure, and Ended last.


@dataclass
class Add:
    """Decode a request's replies (one Sampling each); owner: its client's number, whose rows share decode steps."""

    key: int
    prompt_ids: list
    samplings: list
    chat: bool  # chat markup, or plain completion text
    owner: int = 0


@dataclass
class Score:
    """Score prompts (`top` alternatives a token) a slice at a time; for each Sampling, also the token after each."""

    key: int
    prompts: list
    top: int
    samplings: list


@dataclass
class Cancel:
    """Withdraw a request (its client left): its rows are freed, its unscored slices never run."""

    key: int


@dataclass
class Stop:
    """End the worker process."""


@dataclass
class Ready:
    """The model is loaded: model_info, the engine's rows, its KV cache's bytes, DecodeCost.summary (or "")."""

    info: dict
    rows: int
    cache_bytes: int
    decode_cost: str = ""


@dataclass
class Occupancy:
    """A worker's batch, for /stats."""

    rows: int
    active: int = 0  # rows decoding
    waiting: int = 0  # sequences waiting for a row
    shared_steps: int = 0  # decode steps that carried more than one row
    rows_passed_by: int = 0  # row-steps a row waited because clients shared the step


@dataclass
class Events:
    """Some requests' new events [(key, [event, ...])], and the worker's Occupancy."""

    ready: list
    occupancy: Occupancy


@dataclass
class Admitted:
    """A request's samples have rows: it no longer counts against the queue timeout."""


@dataclass
class Token:
    """A reply's token, its log probability and top alternatives [(id, log p)], sent before the text it adds."""

    index: int
    token: int
    logprob: float
    top: list


@dataclass
class Piece:
    """Text a reply adds."""

    index: int  # which sample
    kind: str  # "text", "python" or "python_output"
    text: str  # may be "" when a tool part begins


@dataclass
class Finish:
    """A reply is complete."""

    index: int
    reason: str  # "stop" (end of turn, stop string) or "length" (max_tokens or the context ran out)
    completion_tokens: int  # tokens generated for this reply, the one that ended it included
    parts: list  # the whole reply as parts


@dataclass
class Scored:
    """A prompt's tokens' scores, ((log p or None, ((id, log p), ...)), ...), for /v1/completions' echo."""

    index: int
    tokens: tuple


@dataclass
class Failure:
    """What could not be done and why: a request (Ended follows), or at a worker's start its model's loading."""

    reason: str


@dataclass
class Ended:
    """A request's last event, with what it cost (for the log and /stats)."""

    tokens: int
    seconds: float
    replies_finished: int


# -----------------------------------------------------------------------------
# Replies, token by token


class StopStrings:
    """A request's stop strings as one automaton (Aho-Corasick) reading the reply's text a character at a time, however
    many strings there are. A state is the longest end of the text read that begins a stop string: its depth is how
    much text must be held back."""

    def __init__(self, strings):
        self.strings = list(strings)
        self.next = [{}]  # state -> {character: state}: the trie of the strings
        self.depth = [0]  # state -> the length of the text it stands for
        self.ends_one = [False]  # state -> its text ends with a whole stop string
        for string in self.strings:
            state = 0
            for character in string:
                if character not in self.next[state]:
                    self.next[state][character] = len(self.next)
                    self.next.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.ends_one.append(False)
                state = self.next[state][character]
            self.ends_one[state] = True
        # where a state falls back to when the next character does not continue it: the longest proper end of its
        # text that is a state too (breadth first, so every shorter state's fallback is known)
        self.fallback = [0] * len(self.next)
        frontier = deque(self.next[0].values())
        while frontier:
            state = frontier.popleft()
            for character, child in self.next[state].items():
                back = self.fallback[state]
                while back and character not in self.next[back]:
                    back = self.fallback[back]
                self.fallback[child] = self.next[back].get(character, 0) if state else 0
                self.ends_one[child] = self.ends_one[child] or self.ends_one[self.fallback[child]]
                frontier.append(child)

    def read(self, state, text):
        """(the state after `text`, whether a stop string ended in it)."""
        if not self.strings:
            return 0, False
        found = False
        for character in text:
            while state and character not in self.next[state]:
                state = self.fallback[state]
            state = self.next[state].get(character, 0)
            found = found or self.ends_one[state]
        return state, found


class ReplyStream:
    """
    One sample's reply as the model writes it: tokens in, (kind, text) pieces out, text held back while it may begin a
    stop string (looked for in text parts only) and cut where one begins. Chat mode follows the tool markup and ends at
    any turn token; plain mode (base models) ends at any special token.
    """

    def __init__(self, tokenizer, stop=(), chat=True):
        """stop: the stop strings, or a StopStrings the samples of one request share."""
        self.tokenizer = tokenizer
        self.stops = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self.stop_state = 0  # where the text since the last tool part stands in self.stops
        self.chat = chat
        special = tokenizer.encode_special
        self.turn_tokens = {special(t) for t in TURN_TOKENS}
        self.special_ids = {special(t) for t in tokenizer.get_special_tokens()}
        self.kind_after = {special("<|python_start|>"): "python", special("<|python_end|>"): "text",
                           special("<|output_start|>"): "python_output", special("<|output_end|>"): "text"}
        self.decoder = StreamDecoder(tokenizer)
        self.kind = "text"
        self.pending = ""  # text not yet given out: it may begin a stop string
        self.parts = []
        self.num_tokens = 0
        self.finish_reason = None

    def push(self, token):
        """Pieces for one more token; none once the reply is finished."""
        if self.finish_reason is not None:
            return []
        self.num_tokens += 1
        if token in self.special_ids:
            if not self.chat or token in self.turn_tokens:
                return self.finish("stop")
            pieces = self._flush()
            self.kind = self.kind_after[token]
            if self.kind != "text":
                pieces.append(self._add(self.kind, ""))  # a tool part begins, so readers can open a box for it
            return pieces
        text = self.decoder.push(token)
        if self.kind != "text":
            return [self._add(self.kind, text)] if text else []
        return self._text(text)

    def finish(self, reason):
        """End the reply (reason "stop" or "length"); returns the text still held."""
        if self.finish_reason is not None:
            return []
        pieces = self._flush()
        self.finish_reason = reason
        return pieces

    def events(self, index, token=None, length=False):
        """What one more token (or none) makes of sample `index`'s reply: a Piece for each piece of text, then a Finish
        if the reply ends; length: the engine ended it there (max_tokens, or the context ran out)."""
        was_open = self.finish_reason is None
        pieces = (self.push(token) if token is not None else []) + (self.finish("length") if length else [])
        events = [Piece(index, kind, text) for kind, text in pieces]
        if was_open and self.finish_reason is not None:
            events.append(Finish(index, self.finish_reason, self.num_tokens, self.parts))
        return events

    def _text(self, text):
        self.pending += text
        self.stop_state, found = self.stops.read(self.stop_state, text)
        if found:  # once a reply: cut where the earliest stop string in the held-back text begins
            cut = min(i for i in (self.pending.find(s) for s in self.stops.strings) if i >= 0)
            kept = self.pending[:cut]
            self.pending = ""
            self.finish_reason = "stop"
            return [self._add("text", kept)] if kept else []
        held = self.stops.depth[self.stop_state]  # the end of the text that may begin a stop string
        ready = self.pending[:len(self.pending) - held]
        self.pending = self.pending[len(ready):]
        return [self._add("text", ready)] if ready else []

    def _flush(self):
        """Everything held back (a character's first bytes, a possible stop-string start) as it is: the part ends."""
        text, self.pending, self.stop_state = self.pending + self.decoder.flush(), "", 0  # none pends in a tool part
        return [self._add(self.kind, text)] if text else []

    def _add(self, kind, text):
        if self.parts and self.parts[-1]["type"] == kind and text:
            self.parts[-1]["text"] += text
        elif text or kind != "text":
            self.parts.append({"type": kind, "text": text})
        return kind, text


def generate_replies(engine, prompt_ids, sampling, chat=True):
    """sampling.num_samples replies to a prompt sampled together on an Engine: a Piece as each grows, a Finish once
    each. Engine samples by temperature, top-k, top-p and seed; penalties, bias and logprobs are the server's."""
    s = sampling
    if s.steers() or s.logprobs is not None:
        raise ValueError("generate_replies samples without penalties, logit_bias or logprobs: serve those (workers.py)")
    streams = [ReplyStream(engine.tokenizer, s.stop, chat) for _ in range(s.num_samples)]
    steps = engine.generate(prompt_ids, num_samples=s.num_samples, max_tokens=s.max_tokens, temperature=s.temperature,
                            top_k=s.top_k, top_p=s.top_p, seed=s.seed)
    try:
        for column, _ in steps:
            for index, (stream, token) in enumerate(zip(streams, column)):
                yield from stream.events(index, token)
            if all(stream.finish_reason is not None for stream in streams):
                return
    finally:
        steps.close()  # frees the KV cache now, not when the generator is garbage collected
    # The engine stopped with replies still open: max_tokens, or prompt plus reply filled the context.
    for index, stream in enumerate(streams):
        yield from stream.events(index, length=True)


# -----------------------------------------------------------------------------
# Models


def model_info(meta, model, device, stage):
    """What was loaded, as a dict (for /health)."""
    return {"source": stage, "tag": meta.get("model_tag"), "step": meta.get("step"), "params": model.num_params(),
            "context": model.config.sequence_len, "device": str(device),
            # what the matmuls hold: int8 (--int8), or the dtype a CPU decodes in (kernels/decode_dtype.py)
            "weights": str(model.lm_head.weight.dtype).replace("torch.", "")}


def summary_line(info):
    """model_info's dict as a line for logs."""
    return (f"{info['source']} model '{info['tag']}' step {info['step']}: {info['params'] / 1e6:.2f}M params "
            f"({info['weights']}), context {info['context']} tokens, on {info['device']}")
