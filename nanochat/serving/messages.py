"""
What chat_web's server and its worker processes say to each other over their pipe: the server's requests (Add, Score,
Cancel, Stop), the worker's answers (Ready or Failed once, then Events), and the events of one request (Admitted,
Token, Scored, Ended; the text comes as chat.Piece and chat.Finish, a failure as a string). The server's side is
workers.py, the worker's worker_loop.py.
"""

from dataclasses import dataclass, field

# -----------------------------------------------------------------------------
# The server to a worker


@dataclass
class Add:
    """Decode a request's replies: one Sampling a reply (Sampling.per_sample), chat markup or plain completion text."""

    key: int
    prompt_ids: list
    samplings: list
    chat: bool


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
    """The model is loaded: what it is (chat.model_info), the rows its engine batches, its KV cache's bytes."""

    info: dict
    rows: int
    cache_bytes: int


@dataclass
class Failed:
    """The model could not be loaded (the server stops before serving anything)."""

    reason: str


@dataclass
class Events:
    """The new events of some requests [(key, [event, ...])], and the engine's occupancy (for /stats)."""

    ready: list
    occupancy: dict


# -----------------------------------------------------------------------------
# The events of one request


@dataclass
class Admitted:
    """A request's samples have rows of the batch: it no longer counts against the queue timeout."""


@dataclass
class Ended:
    """A request's last event, with what it cost (for the server's log and /stats)."""

    tokens: int
    seconds: float
    replies_finished: int


@dataclass
class Token:
    """A reply's token with its log probability and the most likely alternatives [(id, log p)], for a request that
    asked for logprobs (sent before the text it adds)."""

    index: int
    token: int
    logprob: float
    top: list


@dataclass
class Scored:
    """A prompt's tokens' log probabilities: [(log p or None, [(id, log p)])] per token, for /v1/completions' echo."""

    index: int
    tokens: list
