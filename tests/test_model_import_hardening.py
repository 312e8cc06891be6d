"""
scripts.import_model, hardened: a karpathy/nanochat checkpoint's era is told from its files or refused, never
guessed, and a --era its files rule out is refused; a hub listing cannot write outside the cache; a hub repo without
its meta is one line; a hub repo and a local folder find the tokenizer alike; and the documented first use (a
checkpoint in the reference's base dir, ~/.cache/nanochat, which is ours by default too) works.

The reference-format files, the reference forward and the stand-in hub come from test_model_import.
"""

import json
import os

import pytest
import torch

from nanochat.common import UserError
from test_model_import import ModelHub, long_ids, our_model, source_logits, target, write_base_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# The training config (user_config) base_train wrote from 3 February 2026 to 8 March: its arguments, at their defaults.
BASE_TRAIN_CONFIG = {
    "run": "d4", "device_type": "", "fp8": False, "fp8_recipe": "tensorwise", "depth": 4, "aspect_ratio": 64,
    "head_dim": 128, "max_seq_len": 64, "window_pattern": "SSSL", "num_iterations": -1, "target_flops": -1.0,
    "target_param_data_ratio": 10.5, "device_batch_size": 32, "total_batch_size": -1, "embedding_lr": 0.3,
    "unembedding_lr": 0.004, "weight_decay": 0.2, "matrix_lr": 0.02, "scalar_lr": 0.5, "adam_beta1": 0.8,
    "adam_beta2": 0.95, "warmup_ratio": 0.0, "warmdown_ratio": 0.5, "final_lr_frac": 0.0, "resume_from_step": -1,
    "eval_every": 250, "eval_tokens": 41943040, "core_metric_every": 2000, "core_metric_max_per_task": 500,
    "sample_every": 2000, "save_every": -1, "model_tag": None,
}
# chat_sft's, from 16 February 2026 on.
CHAT_SFT_CONFIG = {
    "run": "sft", "device_type": "", "model_tag": None, "model_step": None, "load_optimizer": 1, "num_iterations": -1,
    "max_seq_len": 64, "device_batch_size": 32, "total_batch_size": 524288, "embedding_lr": None,
    "unembedding_lr": None, "matrix_lr": None, "init_lr_frac": 0.8, "warmup_ratio": 0.0, "warmdown_ratio": 0.5,
    "final_lr_frac": 0.0, "eval_every": 200, "eval_tokens": 41943040, "chatcore_every": 200, "chatcore_max_cat": -1,
    "chatcore_max_sample": 24, "mmlu_epochs": 3, "gsm8k_epochs": 4,
}


def set_user_config(folder, user_config, step=20):
    """Give a written checkpoint's meta this training config (None: none at all, as chat_rl's meta has)."""
    path = os.path.join(folder, f"meta_{step:06d}.json")
    meta = json.load(open(path))
    meta.pop("user_config")
    if user_config is not None:
        meta["user_config"] = user_config
    json.dump(meta, open(path, "w"))


# -----------------------------------------------------------------------------
# 8: the era is told from the files or refused


@pytest.mark.quick
@pytest.mark.parametrize("user_config", [BASE_TRAIN_CONFIG, CHAT_SFT_CONFIG, None], ids=["base_train", "chat_sft", "none"])
def test_a_checkpoint_that_may_be_january_or_early_march_is_refused_without_era(tmp_path, target, user_config):
    """January's files and those of 2-8 March are alike; a training config written by the scripts of both periods (or
    none) cannot tell them apart, so the import names the --era values instead of taking January's math."""
    from nanochat.interop.model_import import import_model

    folder, *_ = write_base_dir(str(tmp_path / "theirs"), "2026-01", sequence_len=64)
    set_user_config(folder, user_config)
    with pytest.raises(UserError, match=r"pass the --era .* 2026-01 .*, 2026-03-02 .* or 2026-03-04 "):
        import_model(folder, "base")
    assert not os.path.exists(target)


@pytest.mark.quick
def test_a_training_config_older_than_march_tells_january(tmp_path, target, capsys):
    """base_train of 11 January to 2 February saved no fp8 fields: its checkpoint is January's, and the summary
    line says how that was told."""
    from nanochat.interop.model_import import import_model

    folder, *_ = write_base_dir(str(tmp_path / "theirs"), "2026-01", sequence_len=64)
    set_user_config(folder, {k: v for k, v in BASE_TRAIN_CONFIG.items() if k not in ("fp8", "fp8_recipe")})
    import_model(folder, "base")
    assert "era 2026-01 (its training config lacks fields every script of 2-8 March 2026 saved)" in capsys.readouterr().out


@pytest.mark.quick
@pytest.mark.parametrize("era_written, era_given, message", [
    ("2026-03-09", "2026-01", "12-channel value-embedding gates, which the 2026-01 model never had"),
    ("2026-01", "2026-03-14", "32-channel value-embedding gates, which the 2026-03-14 model never had"),
    ("2025-10", "2026-03-04", "a model_config without window_pattern, which the 2026-03-04 model never had"),
])
def test_an_era_the_files_contradict_is_refused(tmp_path, target, era_written, era_given, message):
    from nanochat.interop.model_import import import_model

    folder, *_ = write_base_dir(str(tmp_path / "theirs"), era_written, sequence_len=64)
    with pytest.raises(UserError, match=message):
        import_model(folder, "base", era=era_given)
    assert not os.path.exists(target)


# -----------------------------------------------------------------------------
# 9, 10: the hub path


def hub_files(tmp_path, layout):
    """A 2026-03-14 checkpoint's files under the repo paths `layout` gives: {"model": .., "meta": .., "tokenizer": ..}
    (a tokenizer of None is left out)."""
    folder, state, model_config, enc = write_base_dir(str(tmp_path / "theirs"), "2026-03-14", step=650)
    root = os.path.dirname(os.path.dirname(folder))
    sources = {"model": os.path.join(folder, "model_000650.pt"), "meta": os.path.join(folder, "meta_000650.json"),
               "tokenizer": os.path.join(root, "tokenizer", "tokenizer.pkl")}
    files = {layout[kind]: open(path, "rb").read() for kind, path in sources.items() if layout.get(kind)}
    return files, state, model_config, enc


@pytest.fixture
def hub(monkeypatch):
    hubs = []

    def start(files):
        hubs.append(ModelHub("someone/nanochat-d4", files))
        monkeypatch.setenv("HF_ENDPOINT", hubs[-1].endpoint)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        return hubs[-1]

    yield start
    for h in hubs:
        h.close()


@pytest.mark.quick
@pytest.mark.parametrize("folder", ["../../../../../tokenizer", "/abs/d4", "linked"])
def test_a_hub_listing_cannot_write_outside_the_cache(tmp_path, target, hub, folder):
    """A listed path with '..' parts or an absolute path is refused with the whole listing; one that resolves outside
    the cache through a link there is refused before anything is fetched."""
    from nanochat.data.hub import model_cache_dir
    from nanochat.interop.model_import import import_model

    outside = tmp_path / "outside"
    outside.mkdir()
    if folder == "linked":  # a link left in the cache folder, pointing elsewhere
        cache = model_cache_dir("someone/nanochat-d4", "main")
        os.makedirs(cache)
        os.symlink(outside, os.path.join(cache, "linked"))
    layout = {kind: f"{folder}/{name}" for kind, name in (("model", "model_000650.pt"), ("meta", "meta_000650.json"),
                                                          ("tokenizer", "tokenizer.pkl"))}
    server = hub(hub_files(tmp_path, layout)[0])
    with pytest.raises(UserError, match=r"refusing hub repo someone/nanochat-d4@main: .*outside its download folder"):
        import_model("someone/nanochat-d4", "sft")
    assert not [r for r in server.requests if "/resolve/" in r]  # nothing was fetched
    assert os.listdir(outside) == [] and not os.path.exists(os.path.join(target, "tokenizer"))
    assert not os.path.exists(os.path.join(target, "hub_cache", "models", "someone", "nanochat-d4", "main", "abs"))


@pytest.mark.quick
def test_a_hub_repo_without_its_meta_is_refused_in_one_line(tmp_path, target, hub):
    from nanochat.interop.model_import import import_model

    hub(hub_files(tmp_path, {"model": "model_000650.pt", "tokenizer": "tokenizer.pkl"})[0])
    with pytest.raises(UserError, match=r"has model_000650.pt but no meta_000650.json beside it"):
        import_model("someone/nanochat-d4", "sft")


@pytest.mark.quick
@pytest.mark.parametrize("tokenizer", ["models/tokenizer/tokenizer.pkl", "tokenizer/tokenizer.pkl"])
def test_a_hub_repo_and_a_local_folder_find_the_tokenizer_alike(tmp_path, target, hub, tokenizer):
    """A checkpoint one folder deep, its tokenizer in its own tokenizer/ or in the repo's: the same search finds it in
    the hub repo and in the same files as a local folder, and both imports give the source's logits."""
    from nanochat.interop.model_import import import_model

    layout = {"model": "models/model_000650.pt", "meta": "models/meta_000650.json", "tokenizer": tokenizer}
    files, state, model_config, enc = hub_files(tmp_path, layout)
    hub(files)
    local = tmp_path / "local"
    for name, data in files.items():
        os.makedirs(os.path.dirname(local / name), exist_ok=True)
        (local / name).write_bytes(data)
    import_model("someone/nanochat-d4", "sft", model_tag="from-hub")
    import_model(str(local / "models"), "sft", model_tag="from-folder")
    idx = long_ids(enc.n_vocab)
    for tag in ("from-hub", "from-folder"):
        with torch.no_grad():
            assert (our_model("sft", tag)[0](idx) - source_logits(state, model_config, "2026-03-14", idx)).abs().max() <= 1e-4


@pytest.mark.quick
def test_the_tokenizer_search_of_a_hub_download_stays_in_its_folder(tmp_path, target, hub):
    """A flat hub repo without a tokenizer: a tokenizer.pkl two folders above its download (where a local folder's
    base-dir search would look) is not picked up; the import asks for --tokenizer."""
    from nanochat.data.hub import model_cache_dir
    from nanochat.interop.model_import import import_model

    files, *_ = hub_files(tmp_path, {"model": "model_000650.pt", "meta": "meta_000650.json"})
    hub(files)
    stray = os.path.join(model_cache_dir("someone/nanochat-d4", "main"), "..", "..", "tokenizer")
    os.makedirs(stray)
    with open(os.path.join(stray, "tokenizer.pkl"), "wb") as f:
        f.write((tmp_path / "theirs" / "tokenizer" / "tokenizer.pkl").read_bytes())
    with pytest.raises(UserError, match=r"no tokenizer.pkl for .*pass --tokenizer PATH"):
        import_model("someone/nanochat-d4", "sft")


# -----------------------------------------------------------------------------
# 11: the documented first use


@pytest.mark.quick
def test_the_documented_first_use_imports_from_the_reference_base_dir(tmp_path, monkeypatch, capsys):
    """docs/import.md's first example, as written: the default base dir (~/.cache/nanochat) is the reference's, and
    the source is its own chatsft_checkpoints/d32. The import goes to sft/d32-imported, leaves the reference's files
    as they were, and is then the stage's latest model; the same command again is a no-op, and --model-tag d32 (the
    reference's folder) is refused."""
    from scripts.import_model import main

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("NANOCHAT_BASE_DIR", raising=False)
    base = home / ".cache" / "nanochat"
    folder, state, model_config, enc = write_base_dir(str(base), "2026-03-14", tag="d32")
    theirs = {p: (base / p).read_bytes() for p in ("chatsft_checkpoints/d32/model_000020.pt",
                                                   "chatsft_checkpoints/d32/meta_000020.json", "tokenizer/tokenizer.pkl")}
    main(["~/.cache/nanochat/chatsft_checkpoints/d32", "--as", "sft"])
    out = capsys.readouterr().out
    assert "-> sft/d32-imported (sft/d32 is karpathy/nanochat's own folder)" in out
    assert sorted(os.listdir(folder)) == ["meta_000020.json", "model_000020.pt"]
    assert all((base / p).read_bytes() == data for p, data in theirs.items())
    model, _, meta = our_model("sft", None)
    assert meta["model_tag"] == "d32-imported"
    idx = long_ids(enc.n_vocab)
    with torch.no_grad():
        assert (model(idx) - source_logits(state, model_config, "2026-03-14", idx)).abs().max() <= 1e-4
    main(["~/.cache/nanochat/chatsft_checkpoints/d32", "--as", "sft"])
    assert "already imported" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"--model-tag d32: .* pick another --model-tag \(the default is d32-imported\)"):
        main(["~/.cache/nanochat/chatsft_checkpoints/d32", "--as", "sft", "--model-tag", "d32"])


# -----------------------------------------------------------------------------
# Hardening IV, 2: what a hub repo names is read from its download folder only


def transformers_files(folder):
    """A tiny transformers NanoChat as save_pretrained writes it (config.json, model.safetensors), with its
    tokenizer.json; the files' bytes by name."""
    import transformers
    from test_model_import import hf_tokenizer_file, source_encoding

    enc = source_encoding()
    config = transformers.NanoChatConfig(vocab_size=enc.n_vocab, hidden_size=64, intermediate_size=256,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=None)
    torch.manual_seed(0)
    transformers.NanoChatForCausalLM(config).save_pretrained(folder)
    hf_tokenizer_file(enc, os.path.join(folder, "tokenizer.json"))
    return {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)}


@pytest.mark.quick
@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_a_hub_weights_index_cannot_import_a_local_file(tmp_path, target, hub, where):
    """The attack: a repo of config.json, tokenizer.json and a model.safetensors.index.json whose weight_map points at
    a .safetensors file of this machine (here a real model's, so the import would succeed, its sha256 in
    imported_from). The index is refused in one line and nothing is written."""
    from nanochat.interop.model_import import import_model

    files = transformers_files(str(tmp_path / "victim"))
    victim = tmp_path / "victim" / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(victim), "pt") as f:
        keys = list(f.keys())
    # the cache folder is <target>/hub_cache/models/someone/nanochat-d4/main: six levels below tmp_path
    pointer = str(victim) if where == "absolute" else "../../../../../../victim/model.safetensors"
    files = {"config.json": files["config.json"], "tokenizer.json": files["tokenizer.json"],
             "model.safetensors.index.json": json.dumps({"metadata": {}, "weight_map": {k: pointer for k in keys}}).encode()}
    hub(files)
    with pytest.raises(UserError, match=r"refusing weights index .*model.safetensors.index.json: it names "
                                        r".*victim/model.safetensors', not a plain file path inside"):
        import_model("someone/nanochat-d4", "base")
    assert not os.path.exists(os.path.join(target, "base_checkpoints")) and \
        not os.path.exists(os.path.join(target, "tokenizer"))


@pytest.mark.quick
def test_a_weights_index_that_is_not_a_map_of_names_is_one_line(tmp_path, target):
    from nanochat.interop.model_import import import_model

    folder = tmp_path / "hf"
    transformers_files(str(folder))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(UserError, match=r"weight_map must be an object from parameter names to file names"):
        import_model(str(folder), "base")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}))
    with pytest.raises(UserError, match=rf"names gone.safetensors, which is not in {folder}"):
        import_model(str(folder), "base")
    assert not os.path.exists(os.path.join(target, "base_checkpoints"))


@pytest.mark.quick
@pytest.mark.parametrize("folder, problem", [("a\0b", "control character"), ("x" * 300, "too long to write"),
                                             ("bad\ud800", "not valid Unicode")], ids=["nul", "long", "surrogate"])
def test_a_listing_with_a_nul_an_overlong_or_an_invalid_name_is_one_line(tmp_path, target, hub, folder, problem):
    from nanochat.interop.model_import import import_model

    layout = {kind: f"{folder}/{name}" for kind, name in (("model", "model_000650.pt"), ("meta", "meta_000650.json"),
                                                          ("tokenizer", "tokenizer.pkl"))}
    server = hub(hub_files(tmp_path, layout)[0])
    with pytest.raises(UserError, match=rf"refusing hub repo someone/nanochat-d4@main: its listing names .*{problem}"):
        import_model("someone/nanochat-d4", "sft")
    assert not [r for r in server.requests if "/resolve/" in r]
    assert not os.path.exists(os.path.join(target, "chatsft_checkpoints"))


# -----------------------------------------------------------------------------
# Hardening VI, 4: memory grows with a file's size, not with what it unpacks to or describes


@pytest.mark.quick
def test_a_pt_whose_records_unpack_past_its_size_is_refused_before_inflating(tmp_path, target):
    """The attack: a .pt re-zipped with its pickle deflated, 128 MiB of zeros after the pickle's end, in a file of a
    few hundred KB. torch.load inflates the record whole (twice over, here ~256 MiB) and then loads the model as if
    nothing were wrong; the import now sums the sizes the zip declares and refuses it before torch reads a byte."""
    import zipfile

    from conftest import rss_growth
    from nanochat.interop.model_import import import_model

    folder, *_ = write_base_dir(str(tmp_path / "theirs"), "2025-10", sequence_len=64)
    model_file = os.path.join(folder, "model_000020.pt")
    with zipfile.ZipFile(model_file) as archive:
        records = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(model_file, "w", compresslevel=1) as archive:
        for name, data in records:
            info = zipfile.ZipInfo(name)
            if not name.endswith("/data.pkl"):
                archive.writestr(info, data)
                continue
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as record:
                record.write(data)
                zeros = bytes(1 << 20)
                for _ in range(128):
                    record.write(zeros)
    assert os.path.getsize(model_file) < 2 << 20
    with rss_growth() as grew, pytest.raises(UserError, match=r"refusing .*model_000020\.pt: its records unpack to "
                                                              r"1\d\d,\d{3},\d{3} bytes, more than the file's own"):
        import_model(folder, "base")
    assert grew["bytes"] < 48 << 20, grew
    assert not os.path.exists(target)


@pytest.mark.quick
def test_a_model_of_a_long_context_and_one_head_is_refused_before_its_rotary_tables(tmp_path, target):
    """The attack: a model of a few hundred KB, one head of 64 channels and a 2^18 context, every weight consistent.
    Its rotary tables (ten times the context x head_dim) took ~1 GiB to build and it imported; the meta is now refused,
    naming the shapes, before the tokenizer or the weights are read."""
    from conftest import rss_growth
    from nanochat.interop.model_import import import_model
    from test_model_import import source_state

    folder, _, model_config, enc = write_base_dir(str(tmp_path / "theirs"), "2025-10", sequence_len=64)
    torch.save(source_state("2025-10", enc.n_vocab, n_head=1, n_kv_head=1), os.path.join(folder, "model_000020.pt"))
    meta_file = os.path.join(folder, "meta_000020.json")
    meta = json.load(open(meta_file))
    meta["model_config"].update(sequence_len=2**18, n_head=1, n_kv_head=1)
    json.dump(meta, open(meta_file, "w"))
    with rss_growth() as grew, pytest.raises(UserError, match=r"meta_000020\.json: the model it describes cannot be built "
                                                              r"\(GPTConfig: sequence_len 262144 x head_dim 64 needs "
                                                              r"rotary tables of 640 MiB") as excinfo:
        import_model(folder, "base")
    assert "\n" not in str(excinfo.value) and grew["bytes"] < 48 << 20, grew
    assert not os.path.exists(target)


# -----------------------------------------------------------------------------
# Hardening VI, 6: JSON nested 200,000 deep in any file the import reads is one line


@pytest.mark.quick
@pytest.mark.parametrize("which", ["meta", "config.json", "tokenizer.json"])
def test_json_nested_200000_deep_in_an_imported_file_is_one_line(tmp_path, target, which):
    """json.load raises RecursionError there, which no `except ValueError` caught: a traceback."""
    from nanochat.interop.model_import import import_model
    from test_model_import_bad_files import transformers_dir

    deep = "[" * 200_000 + "]" * 200_000
    if which == "meta":
        folder, *_ = write_base_dir(str(tmp_path / "theirs"), "2025-10", sequence_len=64)
        path = os.path.join(folder, "meta_000020.json")
    else:
        folder = transformers_dir(str(tmp_path / "hf"))
        path = os.path.join(folder, which)
    with open(path, "w") as f:
        f.write(deep)
    with pytest.raises(UserError, match=rf"{path} is unreadable \(JSON nested too deep to read\)") as excinfo:
        import_model(folder, "base")
    assert "\n" not in str(excinfo.value)
    assert not os.path.exists(os.path.join(target, "base_checkpoints"))


# -----------------------------------------------------------------------------
# Hardening VI, 7: a revision is its own cache folder


@pytest.mark.quick
def test_revisions_x_slash_y_and_x_dashes_y_have_folders_of_their_own(target):
    """'x/y' was written 'x--y': the other revision's cached files were imported as this one's."""
    from nanochat.data.hub import model_cache_dir, parse_repo_id

    folders = {model_cache_dir("someone/nanochat-d4", revision) for revision in ("x/y", "x--y", "x-y", "x_y")}
    assert len(folders) == 4 and all(os.path.dirname(f) == os.path.dirname(next(iter(folders))) for f in folders)
    assert parse_repo_id("someone/nanochat-d4@" + "/".join(["ab"] * 60)) is None  # as one folder, over 200 bytes
    assert parse_repo_id("someone/nanochat-d4@" + "/".join(["ab"] * 40)) == ("someone/nanochat-d4", "/".join(["ab"] * 40))
