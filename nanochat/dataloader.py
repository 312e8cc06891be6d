"""
The pretraining dataloader: parquet row groups (sharded across ranks) -> batch tokenization with BOS prepended ->
a buffer of whole documents -> BOS-aligned best-fit packing into (B, T+1) rows with no padding, all on a background
thread. Exactly resumable: a document is named by (epoch, pos, row), the row'th text of the pos'th row group this
rank reads, and a saved state names the buffered documents, so a resumed loader re-reads just those and yields the
batches an uninterrupted run would have.
"""

import atexit
import bisect
import queue
import threading
import weakref
from collections import defaultdict

import torch

from nanochat.common import UserError
from nanochat.dataset import list_parquet_files, open_parquet, read_row_group_texts


_live_loaders = weakref.WeakSet()


@atexit.register
def _close_live_loaders():
    # A producer thread still inside the tokenizer's native threads at interpreter exit aborts the process.
    for loader in list(_live_loaders):
        loader.close()


def list_row_groups(split, source=None):
    """Every (path, row_group_index) of a split, in file order: the global row-group numbering."""
    return [(path, i) for path in list_parquet_files(split=split, source=source)
            for i in range(open_parquet(path).num_row_groups)]


class DataLoader:
    """Iterate to get (inputs, targets) int64 tensors of shape (B, T) on `device`. `state_dict()` after a batch says
    exactly where the stream stands; pass it back as `resume_state` to continue with the very next batch."""

    def __init__(self, tokenizer, B, T, split="train", device="cpu", rank=0, world_size=1, source=None,
                 resume_state=None, buffer_size=1000, tokenizer_threads=4, prefetch_batches=4, record_docs=False,
                 single_pass=False):
        if B <= 0 or T <= 0:
            raise UserError(f"batch size and sequence length must be positive (got B={B}, T={T})")
        self.tokenizer, self.B, self.T = tokenizer, B, T
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        self.buffer_size = buffer_size
        self.tokenizer_threads = tokenizer_threads
        self.bos = tokenizer.get_bos_token_id()
        self.record_docs = record_docs
        # Evaluation reads the split once: the last batch's unfilled positions have target -1 (and input 0), and
        # then the iteration ends, rather than wrapping around to documents it already saw.
        self.single_pass = single_pass
        self._finished = False

        all_row_groups = list_row_groups(split, source)
        self.row_groups = all_row_groups[rank::world_size]
        if not self.row_groups:
            raise UserError(f"the {split} split has {len(all_row_groups)} row groups, fewer than the {world_size} "
                            "ranks; use fewer ranks or more data")

        if resume_state is not None:
            if resume_state.get("world_size", 1) != world_size or resume_state.get("rank", 0) != rank:
                raise UserError(f"dataloader state was saved by rank {resume_state.get('rank')} of "
                                f"{resume_state.get('world_size')}, cannot resume it as rank {rank} of {world_size}; "
                                "resume with the same number of ranks")
            if resume_state.get("T") != T or resume_state.get("num_row_groups") != len(self.row_groups):
                raise UserError("dataloader state does not match this data or sequence length; "
                                "resume with the same data and --max-seq-len, or start fresh")
        self._state = resume_state or {"epoch": 0, "pos": 0, "buffer": [], "tokens_read": 0, "tokens_kept": 0,
                                       "tokens_cropped": 0, "docs_read": 0}
        self._queue = queue.Queue(maxsize=prefetch_batches)
        self._stop = threading.Event()
        self._thread = None
        self.docs_seen = []  # (epoch, pos, row) of every document placed in a row, when record_docs

    # -- public API ----------------------------------------------------------------------

    def state_dict(self):
        state = dict(self._state)
        state["buffer"] = [list(ref) for ref in state["buffer"]]
        state.update(T=self.T, rank=self.rank, world_size=self.world_size, num_row_groups=len(self.row_groups))
        return state

    @property
    def epoch(self):
        return self._state["epoch"]

    def crop_fraction(self):
        s = self._state
        used = s["tokens_kept"] + s["tokens_cropped"]
        return s["tokens_cropped"] / max(1, used)

    def __iter__(self):
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, daemon=True)
            self._thread.start()
            _live_loaders.add(self)
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._finished = isinstance(item, StopIteration)
            self.close()
            raise item
        rows, state, docs = item
        if self.device.type == "cuda":
            rows = rows.to(self.device, non_blocking=True)  # one host-to-device copy per batch, from pinned memory
        self._state = state
        if self.record_docs:
            self.docs_seen.extend(docs)
        inputs = rows[:, :-1].clamp(min=0) if self.single_pass else rows[:, :-1].contiguous()
        return inputs, rows[:, 1:].contiguous()

    def close(self):
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():  # drain so a producer blocked on put() can see the stop flag
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread = None

    # -- background producer ---------------------------------------------------------------

    def _tokenize(self, texts):
        return self.tokenizer.encode(texts, prepend=self.bos, num_threads=self.tokenizer_threads)

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self):
        try:
            self._produce_batches()
        except BaseException as e:  # hand the error to the consumer thread instead of dying silently
            self._put(e)

    def _restore_buffer(self, refs):
        """Re-read and re-tokenize exactly the documents named in a saved buffer."""
        wanted = defaultdict(list)
        for epoch, pos, row in refs:
            wanted[pos].append(row)
        tokens_of = {}
        for pos, rows in wanted.items():
            texts = read_row_group_texts(*self.row_groups[pos])
            tokens_of.update({(pos, r): doc for r, doc in zip(rows, self._tokenize([texts[r] for r in rows]))})
        return [(tuple(ref), tokens_of[(ref[1], ref[2])]) for ref in refs]

    def _produce_batches(self):
        state = self._state
        epoch, pos = state["epoch"], state["pos"]
        counters = {k: state[k] for k in ("tokens_read", "tokens_kept", "tokens_cropped", "docs_read")}
        row_len = self.T + 1

        # The buffer is kept sorted by (length, arrival number) so best fit is a bisect.
        # Arrival numbers restart from 0 on resume, which preserves the saved relative order.
        seq = 0
        keys, docs = [], []  # keys[i] = (len, seq); docs[i] = (ref, tokens)

        def add(ref, tokens):
            nonlocal seq
            key = (len(tokens), seq)
            seq += 1
            i = bisect.bisect_left(keys, key)
            keys.insert(i, key)
            docs.insert(i, (ref, tokens))

        for ref, tokens in self._restore_buffer(state["buffer"]):
            add(ref, tokens)

        exhausted = False  # single pass: every row group has been read once

        def refill():
            nonlocal epoch, pos, exhausted
            while len(docs) < self.buffer_size and not exhausted:
                texts = read_row_group_texts(*self.row_groups[pos])
                for row, tokens in enumerate(self._tokenize(texts)):
                    add((epoch, pos, row), tokens)
                    counters["tokens_read"] += len(tokens)
                    counters["docs_read"] += 1
                pos += 1
                if pos == len(self.row_groups):
                    epoch, pos = epoch + 1, 0
                    exhausted = self.single_pass

        pin = self.device.type == "cuda"
        while not self._stop.is_set():
            batch = torch.empty((self.B, row_len), dtype=torch.long, pin_memory=pin)
            placed = []
            for b in range(self.B):
                row, filled = batch[b], 0
                while filled < row_len:
                    refill()
                    if not keys:  # a single pass has placed every document: the rest of the batch is padding
                        row[filled:] = -1
                        break
                    space = row_len - filled
                    if filled == 0:
                        # The oldest document opens each row, so none can starve in the buffer (best fit alone
                        # keeps passing over mid-sized documents); it is cropped only if longer than a row.
                        i = min(range(len(keys)), key=lambda j: keys[j][1])
                    else:
                        i = bisect.bisect_right(keys, (space, float("inf"))) - 1
                        if i < 0:
                            i = 0  # nothing fits: crop the shortest document, losing the fewest tokens
                    keys.pop(i)
                    ref, tokens = docs.pop(i)
                    take = min(len(tokens), space)
                    row[filled:filled + take] = torch.tensor(tokens[:take], dtype=torch.long)
                    filled += take
                    counters["tokens_kept"] += take
                    counters["tokens_cropped"] += len(tokens) - take
                    placed.append(ref)
            # Save the buffer in arrival order: re-adding it in that order on resume gives the same
            # relative (length, arrival) keys, hence the same choices.
            arrival = sorted(range(len(keys)), key=lambda j: keys[j][1])
            snapshot = {"epoch": epoch, "pos": pos, "buffer": [docs[j][0] for j in arrival], **counters}
            if not placed:  # the single pass is over
                self._put(StopIteration())
                return
            if not self._put((batch, snapshot, placed)):
                return


def eval_batches(tokenizer, B, T, split, device, rank, world_size, source=None):
    """(loader, batches): a world-size-invariant stream of per-rank (B, T) batches for evaluation, one pass over the
    split at most (then it ends; every rank gets the same number of batches). Every rank packs the same global batch
    and keeps its own slice: evaluation sees the same tokens whatever the number of ranks, so val_bpb does not move
    when you add GPUs."""
    loader = DataLoader(tokenizer, B * world_size, T, split=split, device=device, source=source, single_pass=True)
    return loader, ((x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]) for x, y in loader)
