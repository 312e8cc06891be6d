"""
The decode step captured as CUDA graphs (an add-on of nanochat/engine.py's BatchEngine, attached after it is built):
use_decode(engine, "captured") swaps the engine's decode_step and decode_rows for CapturedDecode's, which runs the
step in static shapes (rows rounded up to 1, 2, 4, ... max_batch, keys read up to the next of 32, 64, ... positions,
every input a device tensor) and on a GPU replays each shape as a CUDA graph, all captured when the engine is built:
one launch for the step's few hundred kernels, which on a GPU cost more than their work (docs/serving.md). "static"
runs the same static step uncaptured, the control for the graphs; without a GPU "captured" runs it eagerly as well.
"""

import torch

from nanochat.common import autocast_for
from nanochat.gpt import causal_mask

DECODE_MODES = ("eager", "captured", "static")  # chat_web's --decode and bench's; eager: the engine's own step


def use_decode(engine, mode):
    """Give a BatchEngine that decode step: the CapturedDecode now in its place, or None for "eager" (its own)."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)} (got {mode!r})")
    if mode == "eager":
        return None
    static = CapturedDecode(engine, capture=mode == "captured")
    engine.decode_step, engine.decode_rows = static.decode_step, static.decode_rows
    return static


class StaticDecodeView:
    """
    A decode step of rows 0..batch-1 whose shapes depend on (batch, extent) alone, its inputs loaded into device
    tensors, so that it can be captured as a CUDA graph (CapturedDecode). A row not fed this step writes its key at the
    cache's last position, which a sequence reads only after writing it itself, and keeps its smear embedding.
    """

    def __init__(self, cache, batch, extent):
        device = cache.device
        self.cache, self.batch, self.extent = cache, batch, extent
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.write_at = torch.full((batch,), cache.seq_len - 1, dtype=torch.long, device=device)
        self.fed = torch.zeros(batch, dtype=torch.bool, device=device)
        self.row_index = torch.arange(batch, device=device)
        self.key_positions = torch.arange(extent, device=device)
        self.masks = {}

    def load(self, inputs):
        """{row: token} of the rows fed this step into the static tensors."""
        ids, write_at, fed = [0] * self.batch, [self.cache.seq_len - 1] * self.batch, [False] * self.batch
        for row, token in inputs.items():
            ids[row], write_at[row], fed[row] = token, self.cache.lengths[row], True
        self.ids.copy_(torch.tensor(ids, dtype=torch.long)[:, None])
        self.write_at.copy_(torch.tensor(write_at, dtype=torch.long))
        self.fed.copy_(torch.tensor(fed))
        self.masks = {}  # an eager step computes them again; a captured one replays their kernels

    def positions(self, T):
        return self.write_at[:, None]

    def max_position(self, T):
        return self.cache.seq_len  # the last position, where unfed rows write

    def update(self, layer, k, v, window):
        k_cache, v_cache = self.cache.k_cache[layer], self.cache.v_cache[layer]
        k_cache.index_put_((self.row_index, self.write_at), k[:, :, 0].to(k_cache.dtype))
        v_cache.index_put_((self.row_index, self.write_at), v[:, :, 0].to(v_cache.dtype))
        if window not in self.masks:
            allowed = causal_mask(self.key_positions[None, None, None, :], self.write_at[:, None, None, None], window)
            # an unfed row's query sits past the extent: with a window it could see no key at all, and a fully masked
            # row can come out NaN, which its key at the last position would then keep
            self.masks[window] = allowed | ~self.fed[:, None, None, None]  # (batch, 1, 1, extent)
        keys, values = k_cache[:self.batch, :self.extent], v_cache[:self.batch, :self.extent]
        return keys.transpose(1, 2), values.transpose(1, 2), self.masks[window]

    def swap_last_embedding(self, x):
        stored = self.cache.last_embedding[:self.batch]
        previous = torch.where((self.write_at > 0)[:, None, None], stored, torch.zeros_like(stored))
        fed = self.fed[:, None, None]
        self.cache.last_embedding[:self.batch] = torch.where(fed, x[:, -1:].to(stored.dtype), stored)
        return previous

    def advance(self, T):
        pass  # the engine advances the fed rows' lengths on the host


def decode_buckets(max_batch, seq_len):
    """The static step's shapes: rows 1, 2, 4, ... up to max_batch, extents 32, 64, ... up to seq_len."""
    rows = sorted({min(max_batch, 1 << i) for i in range(max_batch.bit_length() + 1)})
    extents = sorted({min(seq_len, 32 << i) for i in range(max(1, seq_len.bit_length()))})
    return rows, extents


class CapturedDecode:
    """
    The decode step as CUDA graphs, one per (rows, extent) bucket, captured when the engine is built, sharing one
    memory pool. Where they cannot run (a CPU, a failed capture, capture=False: a control for the captured step), the
    same static step runs eagerly, and why_eager says why.
    """

    def __init__(self, engine, capture=True):
        self.model, self.cache, self.autocast = engine.model, engine.cache, engine.autocast
        device = self.cache.device
        self.rows, self.extents = decode_buckets(engine.max_batch, self.cache.seq_len)
        self.graphs, self.pool = {}, None
        self.capture = capture and device.type == "cuda"
        self.why_eager = None if self.capture else "asked for the static step uncaptured" if not capture else \
            f"CUDA graphs need a GPU (this is {device.type})"
        if self.capture:
            try:
                with torch.inference_mode(), torch.cuda.device(device):
                    for batch in self.rows:
                        for extent in self.extents:
                            self.graphs[(batch, extent)] = self._capture(batch, extent)
            except Exception as e:  # decoding goes on eagerly: a server must not fail on an optimisation
                self.graphs, self.capture = {}, False
                self.why_eager = f"capture failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                print(f"captured decode off: {self.why_eager}", flush=True)

    def bucket(self, fed_rows, fed_lengths):
        batch = next(b for b in self.rows if b > max(fed_rows))
        extent = next(e for e in self.extents if e > max(fed_lengths))  # the new token's key is at its length
        return batch, extent

    def decode_step(self, to_feed):
        """BatchEngine.decode_step in static shapes: each sequence of `to_feed` fed its next_input, its next logits
        kept, its row one position longer."""
        inputs = {seq.row: seq.next_input for seq in to_feed}
        batch, extent = self.bucket(list(inputs), [self.cache.lengths[row] for row in inputs])
        if self.capture:
            view, graph, logits = self.graphs[(batch, extent)]
            view.load(inputs)
            graph.replay()
        else:
            view = StaticDecodeView(self.cache, batch, extent)
            view.load(inputs)
            with self.autocast():
                logits = self.model.forward(view.ids, kv_cache=view)[:, -1, :]
        for seq in to_feed:  # copies: the next replay writes the same output tensor (a row's logits are at its index)
            seq.logits = logits[seq.row:seq.row + 1].clone()
            self.cache.lengths[seq.row] += 1

    def decode_rows(self, count):
        """BatchEngine.decode_rows: the bucket's rows, 1, 2, 4, ... (by row index; about the count)."""
        return next(b for b in self.rows if b >= count)

    def _capture(self, batch, extent):
        # bf16 autocast without its cache of cast weights (cache_enabled=False): a graph captured with it would keep
        # reading casts that are freed when the context exits (PyTorch's CUDA graphs notes)
        view = StaticDecodeView(self.cache, batch, extent)
        view.load({})  # every row unfed: the warm-up and capture steps write only the cache's last position
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), autocast_for(self.cache.device, cache_enabled=False):
            for _ in range(2):  # allocations and lazy initialisation happen outside the capture
                view.masks = {}
                self.model.forward(view.ids, kv_cache=view)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph, view.masks, error, logits = torch.cuda.CUDAGraph(), {}, None, None
        with torch.cuda.stream(side):  # begin and end by hand: a failure inside still ends the capture and the stream
            graph.capture_begin(pool=self.pool)
            try:
                with autocast_for(self.cache.device, cache_enabled=False):
                    logits = self.model.forward(view.ids, kv_cache=view)[:, -1, :]
            except Exception as e:
                error = e
            try:
                graph.capture_end()
            except Exception as e:
                error = error or e
        torch.cuda.current_stream().wait_stream(side)
        if error is not None:
            raise error
        self.pool = graph.pool()
        return view, graph, logits
