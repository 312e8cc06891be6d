"""
KVCache: karpathy/nanochat's KV cache interface (SPEC §2), on which Engine.generate runs a model written against it.
Such a model does the cache work itself: per layer it writes the new keys and values into get_layer_cache(i) at
cache_seqlens (one position for the whole batch), calls advance(T) after its last layer and keeps the last token's
embedding in prev_embedding for smear. Our own GPT takes engine.RowKVCache instead (a length per row).
"""

import torch


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
