"""
Inference: BatchEngine decodes many independent sequences together, one forward pass a step, joining and leaving
between steps (continuous batching; docs/serving.md), each in a row of a RowKVCache at its own length, so prompts of
any length mix. Engine, nanochat's interface for the samples of one prompt, runs on it. Add-ons attach to a built
BatchEngine (kernels/decode_graphs.py, serving/fair_share.py) by the seams its docstring names; this file knows none.
"""

import heapq
import inspect
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from nanochat.calculator import use_calculator
from nanochat.common import autocast_for, get_compute_dtype, kv_cache_dtype
from nanochat.gpt import causal_mask

# -----------------------------------------------------------------------------
# Tool use: the calculator's calls written into a sample (the calculator itself: nanochat/calculator.py)


class ChatTokens:
    """The special token ids generation acts on: the two that end a reply and the calculator's four."""

    def __init__(self, tokenizer):
        special = tokenizer.encode_special
        self.terminals = {special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
        self.python_start, self.python_end = special("<|python_start|>"), special("<|python_end|>")
        self.output_start, self.output_end = special("<|output_start|>"), special("<|output_end|>")


class ToolState:
    """Where one sample stands: finished or not, the tool call it is writing, the tokens still to force."""

    def __init__(self):
        self.finished_with = None  # the terminal token once the row has stopped
        self.python_tokens = None  # a list while inside <|python_start|> ... <|python_end|>
        self.forced = deque()

    def take(self, sampled, ids, tokenizer):
        """(token, mask) the sample gets: the sampled token (mask 1), or a forced one (mask 0) while any waits."""
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


# -----------------------------------------------------------------------------
# Sampling


GREEDY_BELOW = 1e-4  # below this a temperature is greedy: logits / 1e-300 overflow to inf, whose softmax is NaN


def sample_next_tokens(logits, generator, temperature=1.0, top_k=None, top_p=None):
    """
    One token id per row of (B, V) logits, a (B,) long tensor: argmax below GREEDY_BELOW, else a draw from the softmax
    of logits / temperature within the top_k tokens and then the top_p nucleus. `generator`: one for all rows, or a
    list of one per row, each row then drawing exactly the token it would draw alone.
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
    cdf = probs.cumsum(dim=-1)  # inverse-CDF draw, one uniform per row (torch.multinomial draws one per token)
    if isinstance(generator, torch.Generator):
        uniforms = torch.rand(probs.size(0), 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    else:
        uniforms = torch.cat([torch.rand(1, 1, generator=g, device=probs.device, dtype=cdf.dtype) for g in generator])
    targets = uniforms * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp_(max=probs.size(-1) - 1)


def token_logprobs(logits, token, top):
    """(log p of `token`, [(id, log p)] of the `top` most likely) under one row's logits, before temperature,
    penalties or bias (what the OpenAI API's logprobs report)."""
    logprobs = torch.log_softmax(logits.float().reshape(-1), dim=-1)
    alternatives = []
    if top:
        values, indices = torch.topk(logprobs, min(top, logprobs.numel()))
        alternatives = list(zip(indices.tolist(), values.tolist()))
    return float(logprobs[token]), alternatives


def steer(logits, sampling, counts):
    """A row's (1, V) logits with logit_bias added and the penalties taken off the tokens written (counts)."""
    logits = logits.clone()
    if sampling.logit_bias:
        ids = torch.tensor(list(sampling.logit_bias), dtype=torch.long, device=logits.device)
        logits[0, ids] += torch.tensor(list(sampling.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    if counts and (sampling.presence_penalty or sampling.frequency_penalty):
        ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        times = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits[0, ids] -= sampling.presence_penalty + sampling.frequency_penalty * times
    return logits


@dataclass
class Sampling:
    """
    How a request samples, from the HTTP handler down to each row. logit_bias {token id: added to its logit}; the
    presence / frequency penalties come off every token the reply has written (once, and once per time); logprobs:
    this many alternatives per token (Sequence.logprob). The stop strings are cut by the server (chat.ReplyStream).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    max_tokens: int = 256
    seed: int = 42
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    logprobs: int | None = None
    num_samples: int = 1
    stop: list = field(default_factory=list)

    def steers(self):
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def per_sample(self):
        """One Sampling a row for add_group, seeded seed, seed + 1, ..."""
        return [replace(self, seed=self.seed + i, num_samples=1) for i in range(self.num_samples)]


def choose_tokens(rows):
    """
    The token each of `rows` [(logits (1, V), Sampling, generator, counts {token: times written})] gets: steered, then
    one draw for all the rows of each (temperature, top_k, top_p), each row from its own generator. Every token the
    engine samples is chosen here.
    """
    groups = {}  # (temperature, top_k, top_p) -> [(row index, logits, generator)]
    for i, (logits, s, generator, counts) in enumerate(rows):
        key = (0.0, None, None) if s.temperature < GREEDY_BELOW else (s.temperature, s.top_k, s.top_p)
        groups.setdefault(key, []).append((i, steer(logits, s, counts) if s.steers() else logits, generator))
    tokens = [0] * len(rows)
    for key, members in groups.items():
        drawn = sample_next_tokens(torch.cat([logits for _, logits, _ in members]), [g for _, _, g in members], *key)
        for (i, _, _), token in zip(members, drawn.tolist()):
            tokens[i] = token
    return tokens


# -----------------------------------------------------------------------------
# karpathy/nanochat's KVCache (SPEC §2), on which Engine.generate runs a model written against that project. Such a
# model does the cache work itself: per layer it writes the new keys and values into get_layer_cache(i) at
# cache_seqlens (one position for the whole batch), calls advance(T) after its last layer and keeps the last token's
# embedding in prev_embedding for smear. Our own GPT takes RowKVCache instead (a length per row).

class KVCache:
    """Keys and values (num_layers, batch_size, seq_len, kv heads, head_dim) of sequences that share one position. The
    attribute names are the reference's, since its models read them."""

    def __init__(self, batch_size, num_heads, seq_len, head_dim, num_layers, device, dtype):
        self.batch_size, self.max_seq_len = batch_size, seq_len
        self.n_layers, self.n_heads, self.head_dim = num_layers, num_heads, head_dim
        shape = (num_layers, batch_size, seq_len, num_heads, head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        # a tensor, not an int: flash-attention's kvcache kernel reads the positions on the device (int32, per row)
        self.cache_seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.prev_embedding = None  # (batch_size, 1, n_embd): the last token's embedding, set by a model with smear

    def reset(self):
        self.cache_seqlens.zero_()
        self.prev_embedding = None

    def get_pos(self):
        """The position the next token is written at (every row is at the same one)."""
        return int(self.cache_seqlens[0])

    def get_layer_cache(self, layer_idx):
        """(k, v) views of one layer, which the model writes into."""
        return self.k_cache[layer_idx], self.v_cache[layer_idx]

    def advance(self, num_tokens):
        if self.get_pos() + num_tokens > self.max_seq_len:
            raise ValueError(f"KVCache: advancing to {self.get_pos() + num_tokens} overflows its {self.max_seq_len} "
                             f"positions")
        self.cache_seqlens += num_tokens

    def prefill(self, other):
        """Take another cache's keys, values, position and smear state into this empty one (a batch of 1: every row)."""
        if self.get_pos() != 0:
            raise ValueError("KVCache.prefill: this cache is not empty (reset() it first)")
        if (other.n_layers, other.n_heads, other.head_dim) != (self.n_layers, self.n_heads, self.head_dim):
            raise ValueError(f"KVCache.prefill: layers, kv heads and head_dim differ ({other.n_layers}, {other.n_heads}, "
                             f"{other.head_dim} into {self.n_layers}, {self.n_heads}, {self.head_dim})")
        if other.batch_size not in (1, self.batch_size):
            raise ValueError(f"KVCache.prefill: a batch of {other.batch_size} is neither 1 nor {self.batch_size}")
        length = other.get_pos()
        if length > self.max_seq_len:
            raise ValueError(f"KVCache.prefill: the source holds {length} positions, this cache only {self.max_seq_len}")
        self.k_cache[:, :, :length] = other.k_cache[:, :, :length]  # a batch of 1 broadcasts over every row
        self.v_cache[:, :, :length] = other.v_cache[:, :, :length]
        self.cache_seqlens.fill_(length)
        if other.prev_embedding is not None:
            self.prev_embedding = other.prev_embedding.expand(self.batch_size, -1, -1).clone()


# -----------------------------------------------------------------------------
# The KV cache: a row per sequence, each at its own length


def kv_row_bytes(config, device):
    """The KV cache of one sequence of the model's full context, in bytes: keys and values, every layer."""
    head_dim = config.n_embd // config.n_head
    return 2 * config.n_layer * config.sequence_len * config.n_kv_head * head_dim * \
        torch.finfo(kv_cache_dtype(device)).bits // 8


def kv_memory_bytes(device, kv_memory_gib=None):
    """What the KV caches may take: kv_memory_gib, else half the GPU's free memory, or a quarter of RAM (<= 4 GiB)."""
    if kv_memory_gib is not None:
        return int(kv_memory_gib * 2**30)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2  # free memory
    import psutil

    return min(4 * 2**30, psutil.virtual_memory().total // 4)


class RowKVCache:
    """Keys and values (num_layers, max_batch, seq_len, kv_heads, head_dim) of independent sequences, each row at its
    own length. The model's forward takes rows(indices), the cache protocol of nanochat/gpt.py."""

    def __init__(self, max_batch, num_heads, seq_len, head_dim, num_layers, n_embd, device, dtype):
        shape = (num_layers, max_batch, seq_len, num_heads, head_dim)
        # zeros, not empty: a row's attention reads up to the longest row and masks the rest with weight 0, and
        # 0 * (a NaN left in uninitialised memory) would still be NaN
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.last_embedding = torch.zeros(max_batch, 1, n_embd, device=device, dtype=dtype)  # for smear
        self.lengths = [0] * max_batch  # host-side: no device sync to read a row's length
        self.seq_len, self.device = seq_len, torch.device(device)

    def rows(self, indices, new_lengths=None):
        return RowView(self, list(indices), new_lengths)

    def reset(self, row):
        self.lengths[row] = 0

    def copy_row(self, source, target):
        """Give row `target` the cache of row `source` (n samples of one prompt share its prefill)."""
        n = self.lengths[source]
        self.k_cache[:, target, :n] = self.k_cache[:, source, :n]
        self.v_cache[:, target, :n] = self.v_cache[:, source, :n]
        self.last_embedding[target] = self.last_embedding[source]
        self.lengths[target] = n

    def nbytes(self):
        return 2 * self.k_cache.numel() * self.k_cache.element_size()


class RowView:
    """
    Some rows of a RowKVCache, as one forward pass sees them. The pass feeds T tokens per row, of which new_lengths[i]
    are real for row i (prompts padded at the end): only those are written and counted.
    """

    def __init__(self, cache, indices, new_lengths=None):
        self.cache, self.indices, self.new_lengths = cache, indices, new_lengths
        self.lengths = [cache.lengths[i] for i in indices]
        device = cache.device
        self.length_tensor = torch.tensor(self.lengths, dtype=torch.long, device=device)
        contiguous = indices == list(range(indices[0], indices[0] + len(indices)))
        # a run of rows is a slice (views, no copy); scattered rows are gathered
        self.select = slice(indices[0], indices[0] + len(indices)) if contiguous else \
            torch.tensor(indices, dtype=torch.long, device=device)
        self.plan, self.masks = None, {}  # worked out at the first layer, shared by the others

    def positions(self, T):
        return self.length_tensor[:, None] + torch.arange(T, device=self.length_tensor.device)[None, :]

    def max_position(self, T):
        """One past the last position written: padding is never written, so it needs no room."""
        return max(length + new for length, new in zip(self.lengths, self.new_lengths or [T] * len(self.lengths)))

    def update(self, layer, k, v, window):
        """Write the rows' new (B, H_kv, T, D) keys and values; return the keys and values up to the longest row,
        (B, H_kv, L, D), and the (B, 1, T, L) mask of what each new query may see."""
        B, H, T, D = k.shape
        if self.plan is None:
            self.plan = self._plan(B, T, k.device)
        write_rows, write_positions, real, end, positions = self.plan
        k_new, v_new = k.transpose(1, 2).reshape(B * T, H, D), v.transpose(1, 2).reshape(B * T, H, D)
        if real is not None:  # only the real tokens of padded prompts
            k_new, v_new = k_new[real], v_new[real]
        k_cache, v_cache = self.cache.k_cache[layer], self.cache.v_cache[layer]
        # under autocast the values can come out fp32 (a value embedding added in fp32) while the cache is bf16:
        # index_put_ does not convert, so round them to the cache's dtype
        k_cache.index_put_((write_rows, write_positions), k_new.to(k_cache.dtype))
        v_cache.index_put_((write_rows, write_positions), v_new.to(v_cache.dtype))
        if window not in self.masks:  # one mask per window size a forward pass uses, not one per layer
            self.masks[window] = causal_mask(torch.arange(end, device=k.device)[None, None, :], positions[:, :, None],
                                             window)[:, None]
        if isinstance(self.select, slice):
            keys, values = k_cache[self.select, :end], v_cache[self.select, :end]
        else:  # index_select of the positions read: 2-4x faster on a CPU than indexing rows and positions at once
            keys, values = k_cache[:, :end].index_select(0, self.select), v_cache[:, :end].index_select(0, self.select)
        return keys.transpose(1, 2), values.transpose(1, 2), self.masks[window]

    def _plan(self, B, T, device):
        """Once per pass: where the new tokens go (flattened), which are real, how far attention reads, positions."""
        end = self.max_position(T)
        if end > self.cache.seq_len:
            raise ValueError(f"RowKVCache holds {self.cache.seq_len} positions but {end} are needed")
        positions = self.positions(T)
        rows = torch.as_tensor(self.indices, device=device)[:, None].expand(B, T).reshape(-1)
        flat_positions, real = positions.reshape(-1), None
        if self.new_lengths is not None:
            real = (torch.arange(T, device=device)[None, :] <
                    torch.as_tensor(self.new_lengths, device=device)[:, None]).reshape(-1)
            rows, flat_positions = rows[real], flat_positions[real]
        return rows, flat_positions, real, end, positions

    def swap_last_embedding(self, x):
        """Each row's previous token embedding (for smear; zeros if empty); keep the last real one of x (B, T, C)."""
        stored = self.cache.last_embedding[self.select]
        previous = torch.where(self.length_tensor[:, None, None] > 0, stored, torch.zeros_like(stored))
        if self.new_lengths is None:
            last = x[:, -1:]
        else:
            last = x[torch.arange(x.size(0), device=x.device), torch.as_tensor(self.new_lengths, device=x.device) - 1][:, None]
        self.cache.last_embedding[self.select] = last.to(stored.dtype)
        return previous

    def advance(self, T):
        for i, new in zip(self.indices, self.new_lengths or [T] * len(self.indices)):
            self.cache.lengths[i] += new



# -----------------------------------------------------------------------------
# The batching engine


@dataclass
class Sequence:
    prompt: list
    sampling: Sampling
    row: int | None = None
    leader: "Sequence | None" = None  # n samples of one prompt: only the leader prefills, the others copy its row
    prefilled: int = 0
    generated: int = 0
    finished: str | None = None  # "stop" (it wrote <|assistant_end|> or <|bos|>), "length", or "cancelled"
    tool: ToolState = field(default_factory=ToolState)
    generator: torch.Generator | None = None
    logits: torch.Tensor | None = None  # the next token's logits, waiting to be sampled
    next_input: int | None = None  # the token to feed at the next decode step
    counts: dict = field(default_factory=dict)  # token -> times the reply wrote it (for the penalties)
    logprob: tuple | None = None  # the last token's (log p, [(id, log p)] alternatives), when sampling.logprobs asks
    owner: object = None  # whose it is (a server's client), for a row policy that shares steps between owners
    awaiting_feed: bool = False  # it has its next token and waits for a decode step to feed it (one may pass it by)
    last_fed: int = 0  # the decode step that last fed it: a row policy feeds the longest-waiting first


def rounded_batch(count, max_batch):
    """The rows a bf16 CPU's decode step computes for `count` fed ones: 1, 2, 4, 8, then a multiple of 8."""
    return min(max_batch, 1 << (count - 1).bit_length() if count <= 8 else -(-count // 8) * 8)


class BatchEngine:
    """
    Continuous batching (docs/serving.md):

        a = engine.add(prompt_ids, Sampling(temperature=0.0, max_tokens=64))  # waits for a free row
        while engine.busy():
            for seq, token, mask in engine.step():  # mask 0: a forced token; seq.finished: None, "stop", "length"
                ...

    A step prefills at most prefill_chunk prompt tokens, so a long prompt never stalls the rows decoding. max_len: the
    most positions a sequence may reach (default and at most the model's sequence_len). Add-ons attach once it is
    built: `row_policy` (None: a decode step feeds every sequence that has its next token; else its pick(ready) says
    which, its prefills(waiting, room) which prompts a step prefills and how many of their tokens, and it hears
    step_took(seconds): serving/fair_share.py), and `decode_step` with `decode_rows`, the step and the rows it
    computes for a count (kernels/decode_graphs.py swaps in a step captured as CUDA graphs).
    """

    def __init__(self, model, tokenizer, max_batch, prefill_chunk=256, max_len=None):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch and prefill_chunk must be >= 1 (got {max_batch}, {prefill_chunk})")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        c = model.config
        self.context = min(c.sequence_len, max_len or c.sequence_len)
        self.device = model.get_device()
        # a model of the reference's signature, forward(ids, kv_cache=...), gives every position's logits
        self.takes_logits_at = "logits_at" in inspect.signature(model.forward).parameters
        self.cache = RowKVCache(max_batch, c.n_kv_head, self.context, c.n_embd // c.n_head, c.n_layer, c.n_embd,
                                self.device, kv_cache_dtype(self.device))
        self.ids = ChatTokens(tokenizer)
        self.free_rows = list(range(max_batch))  # a heap: the lowest free row first, so running rows stay compact
        self.waiting = deque()  # groups (lists of sequences) not yet given rows; cancelled ones are dropped on the way
        self.num_waiting = 0  # sequences in self.waiting that are not cancelled
        self.running = []  # sequences holding a row, in admission order
        self.shared_steps = 0  # decode forwards that carried more than one sequence: batching really happened
        self.decode_steps = 0  # decode forwards so far (a sequence's last_fed is one of them)
        self.row_policy = None  # which sequences a decode step feeds: None, every one (the docstring has the seam)
        dtype = get_compute_dtype(self.device)
        # every forward's autocast, chosen once (common.autocast_for's choice): a step enters torch's context directly
        self.autocast = partial(torch.autocast, self.device.type, dtype=dtype) if dtype != torch.float32 else nullcontext
        self.round_batches = self.device.type == "cpu" and dtype == torch.bfloat16

    def add(self, prompt, sampling, owner=None):
        return self.add_group(prompt, [sampling], owner)[0]

    def add_group(self, prompt, samplings, owner=None):
        """n sequences of one prompt (one per Sampling): they get rows together, and the prompt is prefilled once.
        owner: whose they are (any hashable; chat_web's client), for a row policy that shares decode steps."""
        prompt = [int(t) for t in prompt]
        if not prompt or len(prompt) >= self.context:
            raise ValueError(f"a prompt needs 1 to {self.context - 1} tokens (got {len(prompt)}): the reply needs room")
        if len(samplings) > self.max_batch:
            raise ValueError(f"{len(samplings)} samples of one prompt need more than the {self.max_batch} rows")
        group = [Sequence(prompt, s, owner=owner) for s in samplings]
        for seq in group:
            seq.leader = group[0]
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.sampling.seed)
        self.waiting.append(group)
        self.num_waiting += len(group)
        return list(group)  # the caller's own list: what it appends to never joins the queued group

    def cancel(self, seq):
        """Stop a sequence now. A waiting one is only marked (O(1)): the queue drops it when it gets to it."""
        if seq.finished is None:
            seq.finished = "cancelled"
            if seq.row is None:
                self.num_waiting -= 1
        if seq.leader is seq and seq.prefilled < len(seq.prompt):  # its samples still need the prompt: one of them
            rest = [s for s in self.running if s.leader is seq and s is not seq and s.finished is None]
            for other in rest:  # prefills it instead
                other.leader = rest[0]
        self._release(seq)

    def busy(self):
        return bool(self.num_waiting or self.running)

    def occupancy(self):
        return {"rows": self.max_batch, "active": len(self.running), "waiting": self.num_waiting,
                "shared_steps": self.shared_steps}

    def step(self):
        """Admit, prefill a chunk, sample the ready sequences, decode those that go on: [(seq, token, mask)]. Every
        token the engine gives is drawn here, by choose_tokens, from logits a prefill or a decode step left."""
        started = time.perf_counter()
        self._admit()
        with torch.inference_mode():
            prefilled = self._prefill()
            ready = [seq for seq in self.running if seq.logits is not None and seq.finished is None]
            drawn = choose_tokens([(seq.logits, seq.sampling, seq.generator, seq.counts) for seq in ready])
            emitted = [self._emit(seq, token) for seq, token in zip(ready, drawn)]
            awaiting = [seq for seq in self.running if seq.awaiting_feed]
            to_feed = awaiting if self.row_policy is None else self.row_policy.pick(awaiting)
            if to_feed:
                self.decode_steps += 1
                self.shared_steps += len(to_feed) > 1
                for seq in to_feed:
                    seq.awaiting_feed, seq.last_fed = False, self.decode_steps
                # rows in order: often one run, which the cache reads without a copy
                self.decode_step(sorted(to_feed, key=lambda seq: seq.row))
                if self.row_policy is not None and not prefilled:  # a prompt's chunk is no decode step's cost
                    self.row_policy.step_took(time.perf_counter() - started)
        return emitted

    def decode_step(self, to_feed):
        """One forward pass feeding each sequence of `to_feed` (sorted by row) its next_input: their next logits."""
        fed = [seq.row for seq in to_feed]
        padding = self._padding_rows(fed) if self.round_batches else []
        rows = sorted(fed + padding)
        inputs = {seq.row: seq.next_input for seq in to_feed}
        ids = torch.tensor([[inputs.get(row, 0)] for row in rows], dtype=torch.long, device=self.device)
        with self.autocast():
            logits = self.model.forward(ids, kv_cache=self.cache.rows(rows))[:, -1, :]
        for row in padding:  # a free row wrote one position that nothing reads: it stays empty
            self.cache.reset(row)
        where = {row: i for i, row in enumerate(rows)}
        for seq in to_feed:
            seq.logits = logits[where[seq.row]:where[seq.row] + 1]

    def decode_rows(self, count):
        """The rows a decode step feeding `count` sequences computes (what it costs by)."""
        return rounded_batch(count, self.max_batch) if self.round_batches else count

    def _padding_rows(self, fed):
        """Free rows that round the decode batch `fed` (sorted) up to rounded_batch, so that oneDNN's bf16 kernels on a
        CPU see few shapes (each compiled once, in a bounded cache: common.bound_onednn_caches): gaps inside the run
        first, then rows after it, then before, so the rows stay one run where they can. A padding row writes one
        position of a free row, which is reset after."""
        count = len(fed)
        target = rounded_batch(count, self.max_batch)
        if target <= count:
            return []
        free = sorted(self.free_rows)
        after = [row for row in free if row > fed[-1]]
        before = [row for row in reversed(free) if row < fed[0]]
        return ([row for row in free if fed[0] < row < fed[-1]] + after + before)[:target - count]

    def _admit(self):
        while self.waiting:
            group = [seq for seq in self.waiting[0] if seq.finished is None]  # the rest were cancelled while waiting
            if len(group) > len(self.free_rows):
                break
            self.waiting.popleft()
            self.num_waiting -= len(group)
            if group and group[0].leader.finished is not None:  # its prefilling sample was cancelled: another one
                for seq in group:
                    seq.leader = group[0]
            for seq in group:
                seq.row = heapq.heappop(self.free_rows)
                self.cache.reset(seq.row)
                self.running.append(seq)

    def _prefill(self):
        """Up to prefill_chunk prompt tokens, oldest sequences first, in one forward pass; whether there were any. A
        row policy may choose the order and take fewer tokens (its prefills(waiting, room))."""
        waiting = [seq for seq in self.running
                   if seq.leader is seq and seq.prefilled < len(seq.prompt) and seq.finished is None]
        room, chunks = self.prefill_chunk, []  # room: prompt tokens this pass may still take
        if waiting and self.row_policy is not None:
            waiting, room = self.row_policy.prefills(waiting, room)
        for seq in waiting:
            if room <= 0:
                break
            chunk = seq.prompt[seq.prefilled:seq.prefilled + room]
            chunks.append((seq, chunk))
            room -= len(chunk)
        if not chunks:
            return False
        lengths = [len(chunk) for _, chunk in chunks]
        width = max(lengths)
        ids = torch.tensor([chunk + [0] * (width - len(chunk)) for _, chunk in chunks], dtype=torch.long,
                           device=self.device)
        with self.autocast():
            view = self.cache.rows([seq.row for seq, _ in chunks], new_lengths=lengths)
            at = torch.tensor(lengths, device=self.device) - 1
            last = self.model.forward(ids, kv_cache=view, logits_at=at)[:, 0] if self.takes_logits_at else \
                self.model.forward(ids, kv_cache=view)[torch.arange(len(chunks), device=self.device), at]
        for i, (seq, chunk) in enumerate(chunks):
            seq.prefilled += len(chunk)
            if seq.prefilled == len(seq.prompt):
                seq.logits = last[i:i + 1]
                for follower in self.running:  # the other samples of this prompt take a copy of its row
                    if follower.leader is seq and follower is not seq and follower.finished is None:
                        self.cache.copy_row(seq.row, follower.row)
                        follower.prefilled, follower.logits = seq.prefilled, seq.logits
        return True

    def _emit(self, seq, drawn):
        """(seq, token, mask) of a sequence that drew `drawn` (a tool may force another token); then it awaits a decode
        step, or its row is freed."""
        token, mask = seq.tool.take(drawn, self.ids, self.tokenizer)
        if seq.sampling.logprobs is not None:  # of the token the sequence gets (a forced one's too)
            seq.logprob = token_logprobs(seq.logits, token, seq.sampling.logprobs)
        seq.counts[token] = seq.counts.get(token, 0) + 1
        seq.generated += 1
        seq.logits = None
        if seq.tool.finished_with is not None:
            seq.finished = "stop"
        elif seq.generated >= seq.sampling.max_tokens or len(seq.prompt) + seq.generated >= self.context:
            seq.finished = "length"
        if seq.finished is None:
            seq.next_input, seq.awaiting_feed = token, True
        else:
            self._release(seq)
        return seq, token, mask

    def _release(self, seq):
        if seq in self.running:
            self.running.remove(seq)
            heapq.heappush(self.free_rows, seq.row)
            self.cache.reset(seq.row)


# -----------------------------------------------------------------------------
# One prompt's samples: nanochat's Engine


class Engine:
    """
    The samples of one prompt, prefilled once and decoded together (seeds seed, seed + 1, ...), on a BatchEngine of
    as many rows; a model without logits_at (written against karpathy/nanochat) on that project's KVCache instead,
    with the same sampling.
    """

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.on_rows = "logits_at" in inspect.signature(model.forward).parameters

    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, top_p=None, seed=42):
        """
        Yield (token_column, token_masks) once per step: one token per sample, mask 1 sampled, 0 forced (a tool's
        output). A row that has stopped (<|assistant_end|> or <|bos|>) repeats its terminal token with mask 0. Ends
        when every row has stopped, after max_tokens steps, or at the model's sequence_len; a prompt longer than that
        raises ValueError. `seed` seeds generators private to this call (torch's global state is untouched).
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
        steps = context - len(tokens) if max_tokens is None else min(max_tokens, context - len(tokens))
        if steps == 0:
            return
        if not self.on_rows:
            yield from self._generate_on_kv_cache(tokens, num_samples, steps, temperature, top_k, top_p, seed)
            return
        # a cache of the positions this call can reach (the last token is never fed back), the prompt in one chunk
        engine = BatchEngine(self.model, self.tokenizer, num_samples, prefill_chunk=len(tokens),
                             max_len=len(tokens) + steps)
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=steps, seed=seed,
                            num_samples=num_samples)
        rows = engine.add_group(tokens, sampling.per_sample())
        while engine.busy():
            emitted = {id(seq): (token, mask) for seq, token, mask in engine.step()}
            if emitted:  # every row that goes on gets a token each step; a stopped one repeats its terminal
                pairs = [emitted.get(id(seq), (seq.tool.finished_with, 0)) for seq in rows]
                yield [token for token, _ in pairs], [mask for _, mask in pairs]

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """(results, masks) per sample: the prompt and its generated tokens without the terminal one, masks 0 over the
        prompt."""
        terminals = ChatTokens(self.tokenizer).terminals
        results = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        finished = [False] * num_samples
        for column, column_masks in self.generate(tokens, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                finished[i] = finished[i] or token in terminals
                if not finished[i]:
                    results[i].append(token)
                    masks[i].append(mask)
        return results, masks

    def _generate_on_kv_cache(self, tokens, num_samples, steps, temperature, top_k, top_p, seed):
        """generate() on karpathy/nanochat's KVCache: the prompt prefilled into one row, copied to num_samples rows,
        then a forward a step for every row, stopped ones too (the rows share one position)."""
        device, ids = self.model.get_device(), ChatTokens(self.tokenizer)
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        generators = [torch.Generator(device=device).manual_seed(seed + i) for i in range(num_samples)]
        with torch.inference_mode():
            prompt_cache = self._new_kv_cache(1, len(tokens), device)
            logits = self._forward_last(torch.tensor([tokens], dtype=torch.long, device=device), prompt_cache)
            # the last generated token is never fed back: the prompt and steps - 1 tokens
            cache = self._new_kv_cache(num_samples, len(tokens) + steps - 1, device)
            cache.prefill(prompt_cache)
            del prompt_cache
        logits = logits.expand(num_samples, -1)  # each row then draws its own first token
        rows = [ToolState() for _ in range(num_samples)]
        for step in range(steps):
            live = [i for i, row in enumerate(rows) if row.finished_with is None]
            with torch.inference_mode():  # each row draws from its own generator, as alone
                drawn = dict(zip(live, choose_tokens([(logits[i:i + 1], sampling, generators[i], {}) for i in live])))
            pairs = [row.take(drawn[i], ids, self.tokenizer) if i in drawn else (row.finished_with, 0)
                     for i, row in enumerate(rows)]
            column = [token for token, _ in pairs]
            yield column, [mask for _, mask in pairs]
            if step == steps - 1 or all(row.finished_with is not None for row in rows):
                return
            with torch.inference_mode():
                logits = self._forward_last(torch.tensor(column, dtype=torch.long, device=device)[:, None], cache)

    def _new_kv_cache(self, batch_size, seq_len, device):
        """In the compute dtype, as the reference allocates it: its model writes its activations into it as they are."""
        c = self.model.config
        return KVCache(batch_size=batch_size, num_heads=c.n_kv_head, seq_len=seq_len, head_dim=c.n_embd // c.n_head,
                       num_layers=c.n_layer, device=device, dtype=get_compute_dtype(device))

    def _forward_last(self, ids, cache):
        """(B, V) logits of the token after ids. Autocast per call: held across a yield, it would leak to the caller."""
        with autocast_for(ids.device):
            return self.model.forward(ids, kv_cache=cache)[:, -1, :]


# -----------------------------------------------------------------------------
# Streaming text


class StreamDecoder:
    """
    Token ids in, text pieces out: push() holds back a token that ends inside a UTF-8 character and returns "" until
    the character is complete, so the pieces plus flush() concatenate to tokenizer.decode of all the ids.
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
