"""
checkpoint_manager on the real thing: a tiny GPT trained a few steps with the real optimizers and the real
BPE tokenizer, saved with save_checkpoint and read back with load_model / load_checkpoint. Loading must give
back the same function and an optimizer state that continues the run exactly; a checkpoint of another
tokenizer, or a damaged file, must be refused with a UserError that says which.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil

import pytest
import torch

from nanochat.checkpoint_manager import checkpoint_dir, load_checkpoint, load_model, save_checkpoint
from nanochat.common import UserError
from nanochat.gpt import GPTConfig, build_model
from nanochat.tokenizer import RustBPETokenizer, get_tokenizer
from nanochat.recipe import build_optimizers
from nanochat.loop import train_step

LRS = dict(unembedding_lr=0.02, embedding_lr=0.2, matrix_lr=0.03, weight_decay=0.1)
SAVED_STEP = 2


@pytest.fixture
def base_copy(tiny_base_dir, tmp_path, monkeypatch):
    """A private base dir holding (a copy of) the session's real tokenizer; checkpoints get written into it."""
    base = tmp_path / "base"
    shutil.copytree(os.path.join(tiny_base_dir, "tokenizer"), base / "tokenizer")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    return base


def tiny_config(tokenizer):
    # n_kv_head < n_head: grouped-query attention, so a config field that is easy to lose is exercised too
    return GPTConfig(sequence_len=32, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=1,
                     n_embd=32)


def text_batches(tokenizer, n, B=2, T=32):
    """n (x, y) batches of real text, BOS-separated documents, as the training loader would give."""
    docs = [f"Document {i}: the river {i} flows into the sea near the capital, {i * 7} miles away." for i in range(40)]
    stream = [t for ids in tokenizer.encode(docs, prepend=tokenizer.get_bos_token_id()) for t in ids]
    need = B * (T + 1)
    assert len(stream) >= n * need
    rows = torch.tensor(stream[:n * need]).view(n, B, T + 1)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


def one_step(model, optimizers, batch, lrm, momentum):
    return train_step(model, optimizers, [batch], lambda m, xy: m(*xy), lrm, momentum, contextlib.nullcontext())


def train_and_save(tokenizer):
    """A tiny GPT after SAVED_STEP real optimizer steps, saved as base/tiny.
    Returns (config, model, optimizers, batches)."""
    torch.manual_seed(0)
    config = tiny_config(tokenizer)
    model = build_model(config, "cpu")
    optimizers = build_optimizers(model, **LRS)
    batches = text_batches(tokenizer, SAVED_STEP + 1)
    for step in range(SAVED_STEP):
        one_step(model, optimizers, batches[step], lrm=1.0, momentum=0.85 + 0.05 * step)
    meta = {"model_config": dataclasses.asdict(config), "tokenizer_hash": tokenizer.fingerprint(),
            "dataloader_states": [{}]}
    save_checkpoint(checkpoint_dir("base", "tiny"), SAVED_STEP, model, optimizers, meta)
    return config, model, optimizers, batches


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def write_bytes(path, data):
    with open(path, "wb") as f:
        f.write(bytes(data))


def step_dir():
    return os.path.join(checkpoint_dir("base", "tiny"), f"step_{SAVED_STEP:06d}")


@pytest.mark.quick
def test_load_model_gives_back_the_trained_model(base_copy, single_torch_thread):
    """load_model rebuilds the saved model: same config, same weights, bitwise-equal logits, eval mode."""
    tokenizer = get_tokenizer()
    config, model, _, batches = train_and_save(tokenizer)

    loaded, loaded_tokenizer, meta = load_model("base", "cpu", model_tag="tiny")
    assert loaded.config == config
    assert not loaded.training
    assert meta["step"] == SAVED_STEP and meta["model_tag"] == "tiny"
    assert meta["tokenizer_hash"] == tokenizer.fingerprint() == loaded_tokenizer.fingerprint()
    assert meta["dataloader_states"] == [{}]
    saved = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, saved[name]), name
    x = batches[-1][0]
    with torch.no_grad():
        logits = loaded(x)
        assert torch.equal(logits, model(x))
        # ...and those are the trained weights, not a fresh init that happens to share the seed
        torch.manual_seed(0)
        assert not torch.allclose(logits, build_model(config, "cpu")(x))

    # phase="train" hands it back in training mode; no tag means the stage's latest tag
    assert load_model("base", "cpu", phase="train", model_tag="tiny")[0].training
    assert load_model("base", "cpu")[2]["model_tag"] == "tiny"


@pytest.mark.quick
def test_optimizer_state_continues_the_run_exactly(base_copy, single_torch_thread):
    """The saved optimizer state makes the next step identical to the original run's next step."""
    tokenizer = get_tokenizer()
    config, model, optimizers, batches = train_and_save(tokenizer)
    next_batch, lrm, momentum = batches[SAVED_STEP], 0.7, 0.9  # a scheduled step: lr and momentum both move

    model_state, optim_states, meta = load_checkpoint(checkpoint_dir("base", "tiny"), SAVED_STEP, "cpu",
                                                      load_optimizer=True)
    assert meta["model_config"] == dataclasses.asdict(config)
    resumed = build_model(meta["model_config"], "cpu")
    resumed.load_state_dict(model_state, strict=True)
    resumed_optimizers = build_optimizers(resumed, **LRS)
    assert len(optim_states) == len(resumed_optimizers)
    for opt, state in zip(resumed_optimizers, optim_states):
        assert state["state"], "every optimizer has per-parameter state after two steps"
        opt.load_state_dict(state)

    # the same weights with fresh optimizers: shows the state is what makes the difference
    fresh = build_model(config, "cpu")
    fresh.load_state_dict(model_state, strict=True)
    fresh_optimizers = build_optimizers(fresh, **LRS)

    for m, opts in ((model, optimizers), (resumed, resumed_optimizers), (fresh, fresh_optimizers)):
        one_step(m, opts, next_batch, lrm, momentum)
    continued = dict(model.named_parameters())
    for name, p in resumed.named_parameters():
        assert torch.equal(p, continued[name]), name
    gap = max((p - continued[name]).abs().max().item() for name, p in fresh.named_parameters())
    assert gap > 1e-4, gap


@pytest.mark.quick
def test_checkpoint_of_another_tokenizer_is_refused(base_copy, single_torch_thread):
    """A checkpoint whose tokenizer fingerprint differs from the base dir's tokenizer is a UserError."""
    tokenizer = get_tokenizer()
    torch.manual_seed(0)
    model = build_model(tiny_config(tokenizer), "cpu")
    meta = {"model_config": dataclasses.asdict(model.config), "tokenizer_hash": tokenizer.fingerprint(),
            "dataloader_states": [{}]}
    save_checkpoint(checkpoint_dir("base", "tiny"), SAVED_STEP, model, [], meta)
    load_model("base", "cpu", model_tag="tiny")  # loads while the tokenizer is the one it was saved with

    other = RustBPETokenizer.train_from_iterator(iter(["an entirely different little corpus"] * 20), 300)
    assert other.fingerprint() != tokenizer.fingerprint()
    shutil.rmtree(base_copy / "tokenizer")
    other.save(str(base_copy / "tokenizer"))
    with pytest.raises(UserError, match="tokenizer") as excinfo:
        load_model("base", "cpu", model_tag="tiny")
    assert checkpoint_dir("base", "tiny") in str(excinfo.value)


@pytest.mark.quick
def test_damaged_checkpoint_files_are_refused_by_name(base_copy, single_torch_thread):
    """A corrupted weights file is a UserError naming it, whether the hash or the parser catches it; a damaged
    optimizer shard only matters to a caller that loads the optimizer."""
    tokenizer = get_tokenizer()
    train_and_save(tokenizer)
    weights = os.path.join(step_dir(), "model.safetensors")
    optim = os.path.join(step_dir(), "optim_rank0.safetensors")
    meta_path = os.path.join(step_dir(), "meta.json")
    pristine = read_bytes(weights)

    # one flipped byte in the tensor data (past the header): the sha256 in meta.json catches it
    data = bytearray(pristine)
    data[len(data) - 100] ^= 0xFF
    write_bytes(weights, data)
    for load in (lambda: load_model("base", "cpu", model_tag="tiny"),
                 lambda: load_checkpoint(checkpoint_dir("base", "tiny"), SAVED_STEP, "cpu", load_optimizer=False)):
        with pytest.raises(UserError, match="corrupt") as excinfo:
            load()
        assert weights in str(excinfo.value)

    # a truncated file whose hash in meta.json was updated to match: the hash passes, safetensors itself fails
    truncated = pristine[: len(pristine) // 2]
    meta = json.loads(read_bytes(meta_path))
    pristine_hash = meta["files"]["model.safetensors"]
    meta["files"]["model.safetensors"] = hashlib.sha256(truncated).hexdigest()
    write_bytes(meta_path, json.dumps(meta).encode())
    write_bytes(weights, truncated)
    with pytest.raises(UserError) as excinfo:
        load_model("base", "cpu", model_tag="tiny")
    assert "model.safetensors" in str(excinfo.value) and step_dir() in str(excinfo.value)

    # weights restored, optimizer shard damaged: the model still loads, the optimizer state does not
    write_bytes(weights, pristine)
    meta["files"]["model.safetensors"] = pristine_hash
    write_bytes(meta_path, json.dumps(meta).encode())
    load_model("base", "cpu", model_tag="tiny")
    data = bytearray(read_bytes(optim))
    data[-1] ^= 0xFF
    write_bytes(optim, data)
    load_checkpoint(checkpoint_dir("base", "tiny"), SAVED_STEP, "cpu", load_optimizer=False)
    with pytest.raises(UserError, match="corrupt") as excinfo:
        load_checkpoint(checkpoint_dir("base", "tiny"), SAVED_STEP, "cpu", load_optimizer=True)
    assert optim in str(excinfo.value)


def save_untrained(tokenizer, step=1):
    """A tiny untrained GPT saved as base/tiny; returns its meta.json's path."""
    config = tiny_config(tokenizer)
    meta = {"model_config": dataclasses.asdict(config), "tokenizer_hash": tokenizer.fingerprint()}
    save_checkpoint(checkpoint_dir("base", "tiny"), step, build_model(config, "cpu"), [], meta)
    return os.path.join(checkpoint_dir("base", "tiny"), f"step_{step:06d}", "meta.json")


def edit_model_config(meta_path, **fields):
    meta = json.loads(read_bytes(meta_path))
    meta["model_config"].update(fields)
    write_bytes(meta_path, json.dumps(meta).encode())


@pytest.mark.quick
@pytest.mark.parametrize("field, value, bound", [("n_layer", 10**6, "1,024"), ("n_embd", 2**40, "65,536")])
def test_a_meta_with_a_shape_past_any_model_is_refused_by_field_before_building(base_copy, capsys, field, value, bound):
    """n_layer 10^6 in a meta.json hung chat_cli, chat_web and base_eval in GPT(config); n_embd 2^40 overflowed."""
    from nanochat.checkpoint_manager import load_meta

    meta_path = save_untrained(get_tokenizer())
    edit_model_config(meta_path, **{field: value})
    reason = rf"GPTConfig\.{field} must be at most {bound} \(got {value}\)"
    with pytest.raises(UserError, match=reason):
        load_meta(checkpoint_dir("base", "tiny"), 1)
    with pytest.raises(UserError, match="no checkpoint found"):
        load_model("base", "cpu", model_tag="tiny")
    assert f"{field} must be at most {bound}" in capsys.readouterr().out  # the skipped step's warning says why


@pytest.mark.quick
def test_weights_that_do_not_fit_the_meta_are_refused_in_one_line_before_building(base_copy, monkeypatch):
    """A meta.json that claims a larger model than its weights (here ~400 GB of it) is refused on the meta device,
    naming what does not fit, before the model is built for real."""
    meta_path = save_untrained(get_tokenizer())

    def build_model_refused(*args, **kwargs):
        raise AssertionError("the model was built before its weights were checked against its config")

    monkeypatch.setattr("nanochat.gpt.build_model", build_model_refused)
    edit_model_config(meta_path, n_embd=2**16, n_head=2**9, n_kv_head=2**9)
    with pytest.raises(UserError, match=r"step 1 does not fit the model its meta.json describes; shapes: ") as excinfo:
        load_model("base", "cpu", model_tag="tiny")
    assert "\n" not in str(excinfo.value) and "(its config needs (" in str(excinfo.value)
    edit_model_config(meta_path, n_embd=32, n_head=2, n_kv_head=1, n_layer=3)
    with pytest.raises(UserError, match=r"missing parameters: transformer\.h\.2\.") as excinfo:
        load_model("base", "cpu", model_tag="tiny")
    assert "\n" not in str(excinfo.value)


# -----------------------------------------------------------------------------
# Hardening VI, 6 and 7: a checkpoint's files, read by chat_cli, chat_web, the evaluations and --resume


@pytest.mark.quick
@pytest.mark.parametrize("damage", ["nested", "truncated"])
def test_a_bad_meta_json_is_refused_in_one_line_with_its_reason(base_copy, damage):
    """chat_cli (and chat_web, the evaluations) load the stage's latest checkpoint. A meta.json nested 200,000 deep was
    a RecursionError traceback; a truncated one ended as "no base checkpoints ...; train that stage first", its reason
    only in a warning above. Either is now the refusal's own line: the step directory, and why it is skipped."""
    meta_path = save_untrained(get_tokenizer())
    text = "[" * 200_000 + "]" * 200_000 if damage == "nested" else read_bytes(meta_path).decode()[:40]
    write_bytes(meta_path, text.encode())
    reason = r"JSON nested too deep to read" if damage == "nested" else r"(Unterminated string|Expecting)"
    skipped = rf"step_000001 is skipped because its meta.json is unreadable \({reason}.*; delete it or restore its files"
    with pytest.raises(UserError, match=rf"no usable base checkpoints under .*{skipped}, or train that stage first"
                       ) as excinfo:
        load_model("base", "cpu")
    assert "\n" not in str(excinfo.value)
    with pytest.raises(UserError, match=rf"no checkpoint found in .*tiny: .*{skipped}") as excinfo:
        load_model("base", "cpu", model_tag="tiny")
    assert "\n" not in str(excinfo.value)


@pytest.mark.quick
def test_an_optimizer_json_nested_200000_deep_is_one_line_on_resume(base_copy, single_torch_thread):
    """optim_rank0.json, hashed as written (meta.json vouches for it), read on --resume: a traceback before."""
    train_and_save(get_tokenizer())
    optim_json = os.path.join(step_dir(), "optim_rank0.json")
    write_bytes(optim_json, ("[" * 200_000 + "]" * 200_000).encode())
    meta_path = os.path.join(step_dir(), "meta.json")
    meta = json.loads(read_bytes(meta_path))
    meta["files"]["optim_rank0.json"] = hashlib.sha256(read_bytes(optim_json)).hexdigest()
    write_bytes(meta_path, json.dumps(meta).encode())
    with pytest.raises(UserError, match=r"optim_rank0\.json is unreadable \(JSON nested too deep to read\); delete "
                                        r".*step_000002 and resume from an older step") as excinfo:
        load_checkpoint(checkpoint_dir("base", "tiny"), SAVED_STEP, "cpu", load_optimizer=True)
    assert "\n" not in str(excinfo.value)


@pytest.mark.quick
def test_a_nan_weight_with_consistent_hashes_is_refused_naming_the_tensor(base_copy, single_torch_thread):
    """A run that diverged saves a checkpoint whose hashes are right: it loaded and served without a word wherever the
    text never reached the NaN (imports already refused such weights)."""
    tokenizer = get_tokenizer()
    config = tiny_config(tokenizer)
    model = build_model(config, "cpu")
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[3, 5] = float("nan")
        model.lm_head.weight[0, :2] = float("inf")
    meta = {"model_config": dataclasses.asdict(config), "tokenizer_hash": tokenizer.fingerprint()}
    save_checkpoint(checkpoint_dir("base", "tiny"), 1, model, [], meta)
    with pytest.raises(UserError, match=r"checkpoint .*tiny step 1: (transformer\.h\.1\.mlp\.c_fc\.weight holds 1|"
                                        r"lm_head\.weight holds 2) NaN or infinite values; .* delete that step") as excinfo:
        load_model("base", "cpu", model_tag="tiny")
    assert "\n" not in str(excinfo.value)
