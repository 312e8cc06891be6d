"""The packing dataloader: BOS alignment, no padding, rank sharding, exact resume, bad input."""

import json
import subprocess
import sys

import pytest
import torch

from nanochat.common import UserError
from nanochat.dataloader import DataLoader, list_row_groups
from nanochat.tokenizer import get_tokenizer


def take(loader, n):
    return [next(loader) for _ in range(n)]


@pytest.mark.quick
def test_rows_start_with_bos_and_targets_shift(tiny_env):
    tok = get_tokenizer()
    loader = DataLoader(tok, B=4, T=64)
    bos = tok.get_bos_token_id()
    for x, y in take(loader, 20):
        assert x.shape == (4, 64) and y.shape == (4, 64)
        assert (x[:, 0] == bos).all()
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    s = loader.state_dict()
    assert s["tokens_kept"] == 20 * 4 * 65  # rows of T+1 tokens, no padding
    loader.close()


@pytest.mark.quick
def test_rows_are_whole_documents_then_one_crop(tiny_env):
    """Every BOS in a row starts a real document; each piece is a document's prefix (only the last may be cropped)."""
    tok = get_tokenizer()
    bos = tok.get_bos_token_id()
    from nanochat.dataset import parquets_iter_batched

    docs = {tuple(ids) for batch in parquets_iter_batched("train") for ids in tok.encode(batch, prepend=bos)}
    loader = DataLoader(tok, B=2, T=128)
    for x, y in take(loader, 10):
        rows = torch.cat([x, y[:, -1:]], dim=1).tolist()
        for row in rows:
            starts = [i for i, t in enumerate(row) if t == bos] + [len(row)]
            for k, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
                piece = tuple(row[a:b])
                if k < len(starts) - 2:
                    assert piece in docs, "a non-final piece must be a whole document"
                else:
                    assert any(d[:len(piece)] == piece for d in docs if len(d) >= len(piece))
    loader.close()


@pytest.mark.quick
def test_crop_fraction_is_small_on_builtin_corpus(tiny_env):
    tok = get_tokenizer()
    for T, bound in ((256, 0.06), (1024, 0.03)):
        loader = DataLoader(tok, B=8, T=T)
        take(loader, 30)
        frac = loader.crop_fraction()
        print(f"T={T}: cropped {100 * frac:.2f}% of tokens")
        assert frac < bound
        loader.close()


@pytest.mark.quick
def test_two_ranks_are_disjoint_and_cover_the_one_rank_stream(tiny_env):
    tok = get_tokenizer()
    from nanochat.dataset import read_row_group_texts

    row_groups = list_row_groups("train")
    every_doc = {(g, row) for g, (path, i) in enumerate(row_groups) for row in range(len(read_row_group_texts(path, i)))}

    def first_epoch_docs(rank, world):
        # run into the third epoch so every first-epoch document has left the buffer
        loader = DataLoader(tok, B=4, T=128, rank=rank, world_size=world, record_docs=True, buffer_size=50)
        while loader.epoch < 2:
            next(loader)
        loader.close()
        return [(pos * world + rank, row) for epoch, pos, row in loader.docs_seen if epoch == 0]

    single = first_epoch_docs(0, 1)
    r0, r1 = first_epoch_docs(0, 2), first_epoch_docs(1, 2)
    assert len(single) == len(set(single))  # nothing is served twice within an epoch
    assert set(r0).isdisjoint(r1)
    assert set(r0) | set(r1) == set(single) == every_doc


RESUME_SCRIPT = r"""
import json, sys, torch
from nanochat.dataloader import DataLoader
from nanochat.tokenizer import get_tokenizer
state = json.load(open(sys.argv[1]))
loader = DataLoader(get_tokenizer(), B=4, T=96, resume_state=state)
out = [next(loader)[0].tolist() for _ in range(int(sys.argv[2]))]
json.dump({"batches": out, "state": loader.state_dict()}, open(sys.argv[3], "w"))
"""


def test_resume_in_new_process_is_bitwise_identical(tiny_env, tmp_path):
    tok = get_tokenizer()
    k, n = 7, 12
    loader = DataLoader(tok, B=4, T=96, buffer_size=200)
    first = take(loader, k)
    state = json.loads(json.dumps(loader.state_dict()))  # must survive JSON (it goes into checkpoint meta)
    rest = [x.tolist() for x, _ in take(loader, n)]
    final_state = loader.state_dict()
    loader.close()
    assert len(state["buffer"]) > 0  # the interesting case: documents waiting in the buffer
    (tmp_path / "state.json").write_text(json.dumps(state))
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT.replace("resume_state=state)", "resume_state=state, buffer_size=200)"))
    subprocess.run([sys.executable, str(script), str(tmp_path / "state.json"), str(n), str(tmp_path / "out.json")],
                   check=True, timeout=120)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["batches"] == rest
    for key in ("epoch", "pos", "buffer", "tokens_kept", "tokens_cropped"):
        assert json.loads(json.dumps(final_state[key])) == out["state"][key]
    assert len(first) == k


@pytest.mark.quick
def test_resume_across_epoch_boundary(tiny_env):
    tok = get_tokenizer()
    loader = DataLoader(tok, B=8, T=256, buffer_size=30)
    while loader.epoch == 0:
        next(loader)
    state = loader.state_dict()
    expect = [x for x, _ in take(loader, 5)]
    loader.close()
    resumed = DataLoader(tok, B=8, T=256, buffer_size=30, resume_state=state)
    got = [x for x, _ in take(resumed, 5)]
    resumed.close()
    assert all(torch.equal(a, b) for a, b in zip(expect, got))


@pytest.mark.quick
def test_bad_input_is_a_clear_error(tiny_env):
    tok = get_tokenizer()
    with pytest.raises(UserError, match="positive"):
        DataLoader(tok, B=0, T=64)
    with pytest.raises(UserError, match="split"):
        DataLoader(tok, B=2, T=64, split="test")
    loader = DataLoader(tok, B=2, T=64)
    next(loader)
    state = loader.state_dict()
    loader.close()
    with pytest.raises(UserError, match="same number of ranks"):
        DataLoader(tok, B=2, T=64, rank=0, world_size=2, resume_state=state)
    with pytest.raises(UserError, match="sequence length"):
        DataLoader(tok, B=2, T=32, resume_state=state)
    with pytest.raises(UserError, match="ranks"):
        DataLoader(tok, B=2, T=64, rank=9_999, world_size=10_000)


@pytest.mark.quick
def test_a_single_pass_places_every_document_once_then_ends(tiny_env):
    """Evaluation's loader (eval_batches): each val document exactly once, the last batch padded with -1 targets, then
    StopIteration, and the same rows whatever the batch size (rows are packed one after another)."""
    from nanochat.dataset import read_row_group_texts

    tok = get_tokenizer()
    groups = list_row_groups("val")
    every_doc = {(0, pos, row) for pos, group in enumerate(groups) for row in range(len(read_row_group_texts(*group)))}
    rows_by_batch_size = {}
    for B in (3, 8):
        loader = DataLoader(tok, B=B, T=64, split="val", single_pass=True, record_docs=True)
        batches = list(loader)
        with pytest.raises(StopIteration):
            next(loader)
        assert sorted(loader.docs_seen) == sorted(every_doc) and len(loader.docs_seen) == len(every_doc)
        ys = torch.cat([y for _, y in batches])
        xs = torch.cat([x for x, _ in batches])
        padded = (ys == -1).nonzero()
        assert len(padded) and padded[:, 0].min() >= (len(batches) - 1) * B  # padding only in the last batch
        assert (xs >= 0).all()  # padding is never an input id the model could not embed
        real = ys[ys != -1]
        rows_by_batch_size[B] = (real.numel(), int(real.sum()))
    assert rows_by_batch_size[3] == rows_by_batch_size[8]
