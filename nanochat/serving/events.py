"""
What chat_web's server and its worker processes say to each other (nanochat/serving/workers.py), and the events of one
request's replies, which the endpoints (serve.py, openai_api.py) and chat_cli (chat.generate_replies) read. Each is a
dataclass, pickled down the pipe and matched by its type at the other end.

    server -> worker   Add (decode a request's replies), Score (score its prompts), Cancel, Stop
    worker -> server   Ready or Failure once, at start; then Events: requests' new events, and the Occupancy
    a request's events Admitted, Token, Piece, Finish, Scored, Failure; Ended last
"""

from dataclasses import dataclass, field

# -----------------------------------------------------------------------------
# The server to a worker


@dataclass
class Add:
    """Decode a request's replies: one Sampling a reply (Sampling.per_sample), chat markup or plain completion text.
    owner: the number of the client that asked (ClientShare.number): its rows share decode steps with other clients'."""

    key: int
    prompt_ids: list
    samplings: list
    chat: bool
    owner: int = 0


@dataclass
class Score:
    """Score prompts (their tokens' log probabilities, `top` alternatives each), a slice between two decode steps; for
    each Sampling, also the one token that follows each prompt (a max_tokens 1 request needs no decode step)."""

    key: int
    prompts: list
    top: int
    samplings: list = field(default_factory=list)


@dataclass
class Cancel:
    """Withdraw a request (its client left): its rows are freed, its unscored slices never run."""

    key: int


@dataclass
class Stop:
    """End the worker process."""


# -----------------------------------------------------------------------------
# A worker to the server


@dataclass
class Ready:
    """The model is loaded: what it is (chat.model_info), the rows its engine batches, its KV cache's bytes, and what
    its decode step was measured to cost (DecodeCost.summary; "" with one row, which nobody shares)."""

    info: dict
    rows: int
    cache_bytes: int
    decode_cost: str = ""


@dataclass
class Occupancy:
    """A worker's batch, for /stats: its rows, those decoding and those waiting for one, the decode steps that carried
    more than one row, and the row-steps a row waited because clients shared the step."""

    rows: int
    active: int = 0
    waiting: int = 0
    shared_steps: int = 0
    rows_passed_by: int = 0


@dataclass
class Events:
    """The new events of some requests [(key, [event, ...])], and the worker's Occupancy."""

    ready: list
    occupancy: Occupancy


# -----------------------------------------------------------------------------
# The events of one request


@dataclass
class Admitted:
    """A request's samples have rows of the batch: it no longer counts against the queue timeout."""


@dataclass
class Token:
    """A reply's token with its log probability and the most likely alternatives [(id, log p)], for a request that
    asked for logprobs (sent before the text it adds)."""

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
    """A prompt's tokens' log probabilities: ((log p or None, ((id, log p), ...)), ...) a token, for /v1/completions'
    echo."""

    index: int
    tokens: tuple


@dataclass
class Failure:
    """What could not be done, and why: a request (its worker failed or exited, or the server is stopping: an error
    event, a 500 or a 503; Ended follows), or at a worker's start its model's loading (the server stops)."""

    reason: str


@dataclass
class Ended:
    """A request's last event, with what it cost (for the server's log and /stats)."""

    tokens: int
    seconds: float
    replies_finished: int
