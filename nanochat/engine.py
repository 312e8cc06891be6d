"""
Fast inference: talk to a model. A preallocated key/value cache lets generation prefill a prompt
once and then decode one token at a time without recomputing the past; several samples of one
prompt decode together as one batch; a safe calculator runs the model's tool calls.

    engine = Engine(model, tokenizer)
    for token_column, token_masks in engine.generate(prompt_ids, num_samples=4, max_tokens=64, temperature=0.8):
        ...                                   # one token per sample per step (mask 0: forced by the tool)
    results, masks = engine.generate_batch(prompt_ids, num_samples=4, max_tokens=64)

The engine needs only this from the model: `config` (n_layer, n_head, n_kv_head, n_embd, sequence_len),
`get_device()` and `forward(ids, kv_cache=cache, logits_at=positions)` returning the logits (B, 1, V) at those
positions of each row (B, T) and advancing the cache by T; and from the tokenizer: `encode_special`, `get_bos_token_id`, `encode(text, prepend=)`, `decode`.
Prompt plus generated tokens never exceed `config.sequence_len`. StreamDecoder turns the tokens
of one row into text pieces for a chat UI without splitting a UTF-8 character.
"""

import ast
import inspect
import math
import time
from collections import deque

import torch

from nanochat.common import autocast_for, kv_cache_dtype


class KVCache:
    """
    Keys and values of every layer for a batch of sequences: `k_cache` and `v_cache` of shape
    (num_layers, batch_size, seq_len, num_heads, head_dim), where num_heads is the number of kv heads.

    The model's forward(ids, kv_cache=cache) writes each layer's new keys/values into
    get_layer_cache(i) at get_pos(), reads everything up to there, and calls advance(T) once.
    """

    def __init__(self, batch_size, num_heads, seq_len, head_dim, num_layers, device, dtype):
        self.batch_size, self.num_heads, self.seq_len = batch_size, num_heads, seq_len
        self.head_dim, self.num_layers = head_dim, num_layers
        shape = (num_layers, batch_size, seq_len, num_heads, head_dim)
        # empty, not zeros: nothing beyond the current position is ever read
        self.k_cache = torch.empty(shape, device=device, dtype=dtype)
        self.v_cache = torch.empty(shape, device=device, dtype=dtype)
        self.pos = 0
        self.last_embedding = None  # (B, 1, n_embd): the last token's embedding, for a model with smear

    def reset(self):
        self.pos = 0
        self.last_embedding = None

    def get_pos(self):
        return self.pos

    def get_layer_cache(self, layer_idx):
        """(k, v) of one layer: (batch_size, seq_len, num_heads, head_dim) views into the cache."""
        return self.k_cache[layer_idx], self.v_cache[layer_idx]

    def advance(self, n):
        if self.pos + n > self.seq_len:
            raise ValueError(f"KVCache: advancing to {self.pos + n} overflows its {self.seq_len} positions")
        self.pos += n

    def prefill(self, other):
        """
        Copy another cache's contents and position into this one: typically a batch-1 prompt
        prefill broadcast to batch_size samples, into a cache with room for their continuations.
        Shapes must agree except that other's batch may be 1 and its seq_len may be shorter.
        """
        same_shape = (other.num_layers, other.num_heads, other.head_dim) == (self.num_layers, self.num_heads, self.head_dim)
        if not same_shape:
            raise ValueError("KVCache.prefill: layers, kv heads and head_dim of both caches must match")
        if other.batch_size not in (1, self.batch_size):
            raise ValueError(f"KVCache.prefill: source batch {other.batch_size} is neither 1 nor {self.batch_size}")
        if other.pos > self.seq_len:
            raise ValueError(f"KVCache.prefill: source holds {other.pos} positions, this cache only {self.seq_len}")
        n = other.pos
        self.k_cache[:, :, :n] = other.k_cache[:, :, :n]  # broadcasts a batch of 1 over all rows
        self.v_cache[:, :, :n] = other.v_cache[:, :, :n]
        self.pos = n
        if other.last_embedding is not None:
            self.last_embedding = other.last_embedding.expand(self.batch_size, -1, -1).clone()


# -----------------------------------------------------------------------------
# The calculator tool: what the model may run between <|python_start|> and <|python_end|>.

CALCULATOR_MAX_CHARS = 1000  # longer expressions are refused before parsing
CALCULATOR_MAX_EXPONENT = 100
CALCULATOR_MAX_DIGITS = 1000  # no integer (intermediate or final) may have more digits
CALCULATOR_SECONDS = 0.1

_BINARY_OPS = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a ** b,
}


class _Refused(Exception):
    pass


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checked(value):
    """Refuse results that are not plain finite numbers or that grew past the digit cap."""
    if not _is_number(value):
        raise _Refused
    if isinstance(value, float) and not math.isfinite(value):
        raise _Refused
    if isinstance(value, int) and value.bit_length() > CALCULATOR_MAX_DIGITS * math.log2(10):
        raise _Refused
    return value


def _evaluate(node, deadline):
    """Walk a whitelisted expression tree; anything not named here is refused."""
    # Every operation below is bounded by the digit and exponent caps, so checking the clock between
    # operations is a hard limit on the whole evaluation.
    if time.monotonic() > deadline:
        raise _Refused
    if isinstance(node, ast.Constant) and _is_number(node.value):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand, deadline)
        return _checked(-operand if isinstance(node.op, ast.USub) else +operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left, deadline), _evaluate(node.right, deadline)
        if isinstance(node.op, ast.Pow):
            if abs(right) > CALCULATOR_MAX_EXPONENT:
                raise _Refused
            # predict the size of an integer power instead of computing a huge one and then refusing it
            if isinstance(left, int) and right > 0 and right * left.bit_length() > CALCULATOR_MAX_DIGITS * math.log2(10) + 64:
                raise _Refused
        return _checked(_BINARY_OPS[type(node.op)](left, right))
    is_count_call = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count"
                     and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
                     and len(node.args) == 1 and not node.keywords
                     and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))
    if is_count_call:
        return node.func.value.value.count(node.args[0].value)
    raise _Refused


def _format_number(value):
    if isinstance(value, float):
        value = float(f"{value:.12g}")  # hide binary noise such as 0.1 + 0.2 = 0.30000000000000004
        if value.is_integer():
            return str(int(value))
    return str(value)


def use_calculator(expr):
    """
    The result of a calculator expression as text, or None when it is not one we evaluate.
    Accepted: numbers with + - * / // % ** and parentheses, unary minus, and 'literal'.count('literal').
    Everything else (names, other calls or attributes, lambdas, comprehensions, huge powers or numbers)
    gives None. The text is parsed with `ast` and walked by a whitelist: nothing is ever eval'd.
    """
    if not isinstance(expr, str) or len(expr) > CALCULATOR_MAX_CHARS:
        return None
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        value = _evaluate(tree.body, time.monotonic() + CALCULATOR_SECONDS)
    except (_Refused, SyntaxError, ValueError, TypeError, ArithmeticError, RecursionError, MemoryError):
        return None
    return _format_number(value)


# -----------------------------------------------------------------------------
# Sampling


GREEDY_BELOW = 1e-4  # a temperature below this is greedy: the distribution is one token anyway, and logits / 1e-300
# overflow to inf (whose softmax is NaN, which sampled nothing and spent every max_tokens step)


def sample_next_tokens(logits, generator, temperature=1.0, top_k=None, top_p=None):
    """
    One token id per row of (B, V) logits: argmax at temperature 0 (below GREEDY_BELOW), else a draw from the
    softmax of logits / temperature, restricted to the top_k most likely tokens and then to the smallest
    set whose probability reaches top_p (nucleus). Returns a (B,) long tensor.
    """
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    if top_k:
        values, indices = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, indices, values)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        # keep a token while the mass before it is still short of top_p: the most likely token always stays
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    # Inverse-CDF draw, one uniform number per row: torch.multinomial draws one random number per vocabulary
    # entry, which was 2 ms of a batch-16 decode step at d4 on a CPU (this takes 0.16 ms).
    cdf = probs.cumsum(dim=-1)
    targets = torch.rand(probs.size(0), 1, generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp_(max=probs.size(-1) - 1)


def token_logprobs(logits, token, top):
    """(log p of `token`, [(id, log p)] of the `top` most likely) under one row's (1, V) or (V,) logits: the model's
    own distribution, before temperature, penalties or bias (what the OpenAI API's logprobs report)."""
    logprobs = torch.log_softmax(logits.float().reshape(-1), dim=-1)
    alternatives = []
    if top:
        values, indices = torch.topk(logprobs, min(top, logprobs.numel()))
        alternatives = list(zip(indices.tolist(), values.tolist()))
    return float(logprobs[token]), alternatives


# -----------------------------------------------------------------------------
# The engine


class ChatTokens:
    """The special token ids generation acts on: the two that end a reply and the calculator's four."""

    def __init__(self, tokenizer):
        special = tokenizer.encode_special
        self.terminals = {special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
        self.python_start, self.python_end = special("<|python_start|>"), special("<|python_end|>")
        self.output_start, self.output_end = special("<|output_start|>"), special("<|output_end|>")


class ToolState:
    """
    Where one sample stands: finished or not, the tool call it is writing, the tokens still to force. take() turns the
    token the model sampled into the one the sample gets: a forced one (the calculator's answer) while any is waiting.
    """

    def __init__(self):
        self.finished_with = None  # the terminal token once the row has stopped
        self.python_tokens = None  # a list while inside <|python_start|> ... <|python_end|>
        self.forced = deque()

    def take(self, sampled, ids, tokenizer):
        """(token, mask): mask 1 for a sampled token, 0 for a forced one; the row finishes on a terminal token."""
        token, mask = (self.forced.popleft(), 0) if self.forced else (sampled, 1)
        if token in ids.terminals:
            self.finished_with = token
        elif token == ids.python_start:
            self.python_tokens = []
        elif token == ids.python_end and self.python_tokens is not None:
            result = use_calculator(tokenizer.decode(self.python_tokens))
            self.python_tokens = None
            if result is not None:
                self.forced.extend([ids.output_start, *tokenizer.encode(result), ids.output_end])
        elif self.python_tokens is not None:
            self.python_tokens.append(token)
        return token, mask


class Engine:
    """
    Generation from a model and tokenizer that follow a small protocol (see the module docstring):
    prefill the prompt once, decode all samples together, sample, run calculator tool calls.
    """

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        # our GPT computes only the last position's logits when asked; a model of the reference's protocol,
        # forward(ids, kv_cache=None), gives every position's and the engine takes the last itself
        self.takes_logits_at = "logits_at" in inspect.signature(model.forward).parameters

    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, top_p=None, seed=42):
        """
        Yield (token_column, token_masks) once per step: one token per sample, mask 1 where the model
        sampled it, 0 where the engine forced it (a tool's output). A row stops after yielding
        <|assistant_end|> or <|bos|>; from then on its column entries repeat that terminal token with
        mask 0. Generation ends when every row has stopped, after max_tokens steps, or when prompt plus
        generated tokens fill the model's sequence_len. A prompt that already fills it yields nothing; a
        longer one raises ValueError (callers trim conversations). `seed` seeds a generator private to
        this call, so the output does not depend on, or change, torch's global random state.
        """
        tokens = [int(t) for t in tokens]
        context = self.model.config.sequence_len
        if not tokens:
            raise ValueError("Engine.generate needs a prompt of at least one token (start it with <|bos|>)")
        if len(tokens) > context:
            raise ValueError(f"prompt of {len(tokens)} tokens is longer than the model's context of {context} tokens; "
                             f"trim it (drop the oldest turns) before generating")
        if num_samples < 1 or temperature < 0 or (max_tokens is not None and max_tokens < 0):
            raise ValueError(f"need num_samples >= 1, temperature >= 0, max_tokens >= 0 "
                             f"(got {num_samples}, {temperature}, {max_tokens})")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {top_p})")
        ids = ChatTokens(self.tokenizer)

        steps = context - len(tokens) if max_tokens is None else min(max_tokens, context - len(tokens))
        if steps == 0:
            return
        device = self.model.get_device()
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        with torch.inference_mode():
            prompt_cache = self._new_cache(1, len(tokens), device)
            logits = self._forward(torch.tensor([tokens], dtype=torch.long, device=device), prompt_cache, device)
            # the last generated token is never fed back, so the cache needs one position less than the total
            cache = self._new_cache(num_samples, len(tokens) + steps - 1, device)
            cache.prefill(prompt_cache)
            del prompt_cache
            logits = logits.expand(num_samples, -1)  # each row then draws its own first token

        rows = [ToolState() for _ in range(num_samples)]
        for step in range(steps):
            with torch.inference_mode():
                sampled = sample_next_tokens(logits, generator, temperature, top_k, top_p).tolist()
            column, masks = [], []
            for row, sampled_token in zip(rows, sampled):
                token, mask = (row.finished_with, 0) if row.finished_with is not None else \
                    row.take(sampled_token, ids, self.tokenizer)
                column.append(token)
                masks.append(mask)
            yield column, masks
            if step == steps - 1 or all(row.finished_with is not None for row in rows):
                return
            with torch.inference_mode():
                column_ids = torch.tensor(column, dtype=torch.long, device=device).unsqueeze(1)
                logits = self._forward(column_ids, cache, device)

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """
        Run generate to the end: (results, masks), one list per sample. A result is the prompt followed
        by the generated tokens without the terminal token; its mask is 0 over the prompt, then the
        per-token masks (1 sampled, 0 forced).
        """
        terminals = {self.tokenizer.encode_special("<|assistant_end|>"), self.tokenizer.get_bos_token_id()}
        results = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        finished = [False] * num_samples
        for column, column_masks in self.generate(tokens, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if finished[i]:
                    continue
                if token in terminals:
                    finished[i] = True
                    continue
                results[i].append(token)
                masks[i].append(mask)
        return results, masks

    def _new_cache(self, batch_size, seq_len, device):
        c = self.model.config
        return KVCache(batch_size=batch_size, num_heads=c.n_kv_head, seq_len=seq_len, head_dim=c.n_embd // c.n_head,
                       num_layers=c.n_layer, device=device, dtype=kv_cache_dtype(device))

    def _forward(self, ids, cache, device):
        """Logits (B, V) for the position after ids, the cache advanced past them."""
        # autocast is entered per call, never held across a yield, where it would leak into the caller
        with autocast_for(device):
            if not self.takes_logits_at:
                return self.model.forward(ids, kv_cache=cache)[:, -1, :]
            last = torch.full((ids.size(0),), ids.size(1) - 1, dtype=torch.long, device=ids.device)
            return self.model.forward(ids, kv_cache=cache, logits_at=last)[:, -1, :]


# -----------------------------------------------------------------------------
# Streaming text


class StreamDecoder:
    """
    Token ids in, text pieces out, for chat UIs that print as the model writes. A token can end
    in the middle of a UTF-8 character (its bytes continue in the next token), so push() holds such
    tokens back and returns "" until the character is complete. For valid UTF-8, the pieces plus flush()
    concatenate to tokenizer.decode of all the ids. Special tokens decode to their names: stop before
    pushing them.
    """

    MAX_HELD = 4  # a UTF-8 character has at most 4 bytes: after that many held tokens the bytes are just invalid

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.held = []

    def push(self, token):
        self.held.append(int(token))
        text = self.tokenizer.decode(self.held)
        if text.endswith("\ufffd") and len(self.held) < self.MAX_HELD:
            return ""
        self.held = []
        return text

    def flush(self):
        """Whatever is still held (an unfinished character decodes as U+FFFD)."""
        text = self.tokenizer.decode(self.held) if self.held else ""
        self.held = []
        return text
