"""
Fast inference: a preallocated key/value cache so generation prefills a prompt once and then
decodes one token at a time without recomputing the past.
"""

import torch


class KVCache:
    """
    Keys and values of every layer for a batch of sequences, written at the current position.

    The model calls update(layer_idx, k, v) in each layer with the new tokens' (B, H_kv, T, D)
    keys/values and gets back views of everything cached so far; after the last layer it calls
    advance(T) once. num_heads is the number of kv heads (n_kv_head), not query heads.
    """

    def __init__(self, batch_size, num_heads, seq_len, head_dim, num_layers, device, dtype):
        self.batch_size = batch_size
        self.num_heads = num_heads
        self.seq_len = seq_len
        self.head_dim = head_dim
        self.num_layers = num_layers
        shape = (num_layers, batch_size, num_heads, seq_len, head_dim)
        # empty, not zeros: nothing beyond the current position is ever read
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.pos = 0

    def reset(self):
        self.pos = 0

    def get_pos(self):
        return self.pos

    def advance(self, n):
        if self.pos + n > self.seq_len:
            raise ValueError(f"KVCache: advancing to {self.pos + n} overflows its {self.seq_len} positions")
        self.pos += n

    def update(self, layer_idx, k, v):
        """Store k, v (B, H_kv, T, D) at positions pos..pos+T-1; return all keys and values up to there."""
        end = self.pos + k.size(2)
        if end > self.seq_len:
            raise ValueError(f"KVCache: {end} positions needed but it holds {self.seq_len}; make a longer cache")
        self.k[layer_idx, :, :, self.pos:end] = k
        self.v[layer_idx, :, :, self.pos:end] = v
        return self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end]

    def prefill(self, other):
        """
        Copy another cache's contents and position into this one: typically a batch-1 prompt
        prefill broadcast to batch_size samples. Shapes must agree except other's batch may be 1.
        """
        same_shape = (other.num_layers, other.num_heads, other.head_dim) == (self.num_layers, self.num_heads, self.head_dim)
        if not same_shape:
            raise ValueError("KVCache.prefill: layers, kv heads and head_dim of both caches must match")
        if other.batch_size not in (1, self.batch_size):
            raise ValueError(f"KVCache.prefill: source batch {other.batch_size} is neither 1 nor {self.batch_size}")
        if other.pos > self.seq_len:
            raise ValueError(f"KVCache.prefill: source holds {other.pos} positions, this cache only {self.seq_len}")
        n = other.pos
        self.k[:, :, :, :n] = other.k[:, :, :, :n]  # broadcasts a batch of 1 over all rows
        self.v[:, :, :, :n] = other.v[:, :, :, :n]
        self.pos = n
