"""
Fast inference: a preallocated key/value cache so generation prefills a prompt once and then
decodes one token at a time without recomputing the past.
"""

import torch


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

    def reset(self):
        self.pos = 0

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
