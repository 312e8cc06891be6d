"""
scripts.import_model against files that lie about themselves ("Hardening IV"): a .pt whose storage record is shorter
than its tensor, shapes no model of this kind has (n_layer 10^6 hung GPT(config), n_embd 2^40 overflowed), numbers
that are not numbers in a config.json, NaN or infinite weights, a tensor with fewer dimensions than its kind has, and
tied embeddings without the embedding. Each is one line naming the file and what is wrong in it, and nothing is
written.

The reference-format files and the transformers tokenizer come from test_model_import.
"""

import json
import os
import zipfile

import pytest
import torch
from safetensors.torch import save_file

from nanochat.common import UserError
from test_model_import import hf_tokenizer_file, source_encoding, target, write_base_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def import_refused(source, message, target):
    from nanochat.interop.model_import import import_model

    with pytest.raises(UserError, match=message) as excinfo:
        import_model(source, "base")
    assert "\n" not in str(excinfo.value)
    assert not os.path.exists(target)  # not even the base dir was made


@pytest.mark.quick
def test_a_pt_whose_storage_record_is_shorter_than_its_tensor_is_refused(tmp_path, target):
    """Mapped (torch.load's mmap), such a tensor was read on into the next records' bytes and imported."""
    folder, *_ = write_base_dir(str(tmp_path / "theirs"), "2026-01", sequence_len=64)
    model_file = os.path.join(folder, "model_000020.pt")
    with zipfile.ZipFile(model_file) as archive:
        records = [(name, archive.read(name)) for name in archive.namelist()]
    with zipfile.ZipFile(model_file, "w") as archive:  # the same records, the first tensor's cut to a quarter
        for name, data in records:
            archive.writestr(name, data[:len(data) // 4] if name.endswith("/data/0") else data)
    import_refused(folder, r"cannot read .*model_000020\.pt .*record size", target)


@pytest.mark.quick
@pytest.mark.parametrize("field, value, bound", [("n_layer", 10**6, "1,024"), ("n_embd", 2**40, "65,536"),
                                                 ("sequence_len", 10**9, "262,144")])
def test_a_karpathy_meta_with_a_shape_past_any_model_is_refused_by_field(tmp_path, target, field, value, bound):
    folder, *_ = write_base_dir(str(tmp_path / "theirs"), "2026-01", sequence_len=64)
    meta_file = os.path.join(folder, "meta_000020.json")
    meta = json.load(open(meta_file))
    meta["model_config"][field] = value
    json.dump(meta, open(meta_file, "w"))
    import_refused(folder, rf"meta_000020\.json: .*GPTConfig\.{field} must be at most {bound} \(got {value}\)", target)


def transformers_dir(root, **config):
    """A transformers directory whose config.json has these fields over a small valid one (the weights never matter:
    the config is refused first)."""
    os.makedirs(root)
    hf_tokenizer_file(source_encoding(), os.path.join(root, "tokenizer.json"))
    save_file({"lm_head.weight": torch.zeros(1)}, os.path.join(root, "model.safetensors"))
    fields = dict(model_type="nanochat", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({**fields, **config}, f)
    return root


@pytest.mark.quick
@pytest.mark.parametrize("config, message", [
    (dict(num_hidden_layers=10**6), r"GPTConfig\.n_layer must be at most 1,024"),
    (dict(hidden_size=2**40), r"GPTConfig\.n_embd must be at most 65,536"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "abc"}), r"rope_theta must be a positive number \(got 'abc'\)"),
    (dict(rope_theta="abc"), r"rope_theta must be a positive number \(got 'abc'\)"),
    (dict(rope_theta=float("inf")), r"rope_theta must be a positive number \(got inf\)"),
    (dict(rope_parameters="abc"), r"rope_type 'abc'"),
    (dict(model_type="nanochat_recipe", qk_scale="abc"), r"qk_scale must be a positive number \(got 'abc'\)"),
    (dict(model_type="nanochat_recipe", attention_windows=["x", 0]), r"attention_windows must list n_layer=2"),
    (dict(model_type="nanochat_recipe", value_embeds=True, value_embed_layers=5), r"value_embed_layers must be"),
], ids=["n_layer", "n_embd", "rope_parameters", "rope_theta", "inf", "rope_not_a_dict", "qk_scale", "windows",
        "ve_layers"])
def test_a_transformers_config_that_describes_no_model_is_one_line(tmp_path, target, config, message):
    source = transformers_dir(str(tmp_path / "hf"), **config)
    import_refused(source, rf"config\.json: .*{message}", target)


@pytest.mark.quick
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_are_refused_by_the_tensors_name(tmp_path, target, bad):
    """A NaN in the embedding row of a token the import's probe text never uses loaded and served without a word."""
    folder, _, model_config, _ = write_base_dir(str(tmp_path / "theirs"), "2026-01", sequence_len=64)
    model_file = os.path.join(folder, "model_000020.pt")
    state = torch.load(model_file, weights_only=True)
    state["transformer.wte.weight"][model_config["vocab_size"] - 1, 3] = bad
    torch.save(state, model_file)
    import_refused(folder, r"theirs.*: transformer\.wte\.weight holds 1 NaN or infinite value", target)


@pytest.mark.quick
@pytest.mark.parametrize("name, shape", [("value_embeds.1.weight", ()), ("transformer.h.1.attn.ve_gate.weight", (4,)),
                                         ("smear_gate.weight", ())], ids=["value_embed", "ve_gate", "smear_gate"])
def test_a_tensor_with_too_few_dimensions_is_refused_by_its_name(tmp_path, target, name, shape):
    """A 0-d value embedding or a 1-D gate met an index past its shape: an IndexError, not the file and tensor named."""
    folder, _, _, _ = write_base_dir(str(tmp_path / "theirs"), "2026-03-14", sequence_len=64)
    model_file = os.path.join(folder, "model_000020.pt")
    state = torch.load(model_file, weights_only=True)
    assert name in state
    state[name] = torch.zeros(shape)
    torch.save(state, model_file)
    import_refused(folder, rf"theirs.*: {name.replace('.', '[.]')} has shape \(", target)


@pytest.mark.quick
def test_tied_embeddings_without_the_embedding_are_refused_as_missing(tmp_path, target):
    """tie_word_embeddings copied model.embed_tokens.weight to the head without asking whether it was there (KeyError)."""
    source = transformers_dir(str(tmp_path / "hf"), tie_word_embeddings=True)
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}, os.path.join(source, "model.safetensors"))
    import_refused(source, r"hf: the state dict does not fit .*missing parameters: lm_head\.weight", target)
