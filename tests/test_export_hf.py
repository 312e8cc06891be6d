"""
scripts/export_hf and nanochat/interop/hf_export: tiny random checkpoints exported and loaded back with transformers
(AutoModelForCausalLM, AutoTokenizer), checked against our model and tokenizer: logits, greedy generation,
token ids, the chat template, bf16, and the refusals (missing checkpoint, non-empty --out, unknown feature).
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers  # in the dev group: `uv run pytest` always has it, so a missing one fails rather than skips

from nanochat.checkpoint_manager import checkpoint_dir, load_model, save_checkpoint
from nanochat.engine import Engine
from nanochat.gpt import GPTConfig, build_model
from nanochat.tokenizer import SPECIAL_TOKENS, get_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQUENCE_LEN = 64
FP32_TOLERANCE = 1e-4
# bf16 keeps 8 bits of mantissa: a logit near the softcap (|x| up to 15) is rounded by up to 0.03, and the
# rounding of every weight and activation on the way adds up. Both sides run in bf16, in different op orders.
BF16_TOLERANCE = 0.15
TERMINALS = ("<|assistant_end|>", "<|bos|>")

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Numbers: 0 7 42 123 4567 89012 3.14159 -1e10 1,000,000 and 2024-06-01",
    "whitespace  runs   \t\ttabs\n\n\nnew lines   \r\n  trailing   ",
    "Unicode: naïve café Straße Ελληνικά русский 日本語 中文 한국어 ﬁ ligature",
    "emoji 🙂 👍🏽 👨‍👩‍👧 🇫🇷 ❤️",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))\n",
    "literal specials: <|bos|> then <|user_start|>hi<|user_end|><|assistant_end|> stay text",
    "",
]

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And 12 + 30?\n  Answer   in digits."},
]


def tiny_config(n_kv_head, vocab_size):
    return GPTConfig(sequence_len=SEQUENCE_LEN, vocab_size=vocab_size, n_layer=2, n_head=4, n_kv_head=n_kv_head,
                     n_embd=64)


@torch.no_grad()
def randomize(model, seed):
    """Weights of a realistic scale everywhere: our init zeroes the output projections and nearly zeroes lm_head."""
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1:  # a recipe component's scalars: away from their identity values
            std = 0.5
        elif name == "transformer.wte.weight":
            std = 1.0
        elif name == "lm_head.weight":
            std = 4.0 * p.size(1) ** -0.5  # logits of std ~4 on normalised inputs: the softcap does something
        else:
            std = p.size(1) ** -0.5
        p.copy_(torch.randn(p.shape, generator=generator) * std)


def save_tiny_checkpoint(tag, config, seed, meta_config=None, stop_early=False):
    """A random tiny model saved as base/<tag> step 1; meta_config overrides what meta.json says the config is."""
    tokenizer = get_tokenizer()
    model = build_model(config, "cpu")
    randomize(model, seed)
    if stop_early:
        # Give <|assistant_end|> a slightly larger copy of the lm_head row of the 6th token greedy decoding would
        # write: it then wins by a clear margin by that step at the latest, on both sides alike.
        sixth = our_greedy(model, tokenizer, chat_prompt(tokenizer), max_tokens=6)[-1]
        with torch.no_grad():
            model.lm_head.weight[tokenizer.encode_special("<|assistant_end|>")] = 1.1 * model.lm_head.weight[sixth]
    meta = {"model_config": meta_config or dataclasses.asdict(config), "tokenizer_hash": tokenizer.fingerprint()}
    save_checkpoint(checkpoint_dir("base", tag), 1, model, [], meta)


def chat_prompt(tokenizer):
    return tokenizer.render_for_completion({"messages": CONVERSATION[1:2]})


def our_greedy(model, tokenizer, prompt, max_tokens):
    """Plain greedy decoding with our model: prompt + new tokens, stopping (terminal left out) on a terminal."""
    terminals = {tokenizer.encode_special(name) for name in TERMINALS}
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            next_id = model(torch.tensor([ids]))[0, -1].argmax().item()
            if next_id in terminals:
                break
            ids.append(next_id)
    return ids


@pytest.fixture(scope="module")
def export_base(tiny_base_dir, tmp_path_factory):
    """A base dir with the shared tiny tokenizer (copied: the shared one is read-only) and our checkpoints."""
    base = str(tmp_path_factory.mktemp("export_base"))
    shutil.copytree(os.path.join(tiny_base_dir, "tokenizer"), os.path.join(base, "tokenizer"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", base)
        vocab = get_tokenizer().get_vocab_size()
        save_tiny_checkpoint("gqa", tiny_config(n_kv_head=2, vocab_size=vocab), seed=1)
        save_tiny_checkpoint("mha", tiny_config(n_kv_head=4, vocab_size=vocab), seed=2, stop_early=True)
        save_tiny_checkpoint("padded", tiny_config(n_kv_head=4, vocab_size=vocab + 64), seed=3)
        recipe = dataclasses.replace(tiny_config(n_kv_head=2, vocab_size=vocab), n_layer=3, value_embeds=True,
                                     residual_scalars=True, smear=True, backout=True, sliding_window=True)
        save_tiny_checkpoint("recipe", recipe, seed=5)
        unknown = dict(dataclasses.asdict(tiny_config(4, vocab)), window_pattern="SSSL")
        save_tiny_checkpoint("unknown", tiny_config(4, vocab), seed=4, meta_config=unknown)
        yield base


def run_export(base, *args):
    env = dict(os.environ, NANOCHAT_BASE_DIR=base, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "scripts.export_hf", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def exported(export_base, tmp_path_factory):
    """{tag: export dir}: gqa through the real script, the others by direct calls (same code, less startup)."""
    from nanochat.interop.hf_export import export_checkpoint

    root = tmp_path_factory.mktemp("exports")
    dirs = {}
    p = run_export(export_base, "-g", "gqa", "--out", str(root / "gqa"))
    assert p.returncode == 0, p.stderr
    assert "n_kv_head=2" in p.stdout and "model.safetensors" in p.stdout and "exported base/gqa step 1" in p.stdout
    dirs["gqa"] = str(root / "gqa")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", export_base)
        for tag, dtype in (("mha", "float32"), ("padded", "float32"), ("gqa_bf16", "bfloat16")):
            dirs[tag] = str(root / tag)
            export_checkpoint("base", dirs[tag], model_tag=tag.split("_")[0], dtype_name=dtype)
    return dirs


@pytest.fixture
def base_env(export_base, monkeypatch, single_torch_thread):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", export_base)
    return export_base


def load_hf_model(path, **kwargs):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), f"{kind}: {info[kind]}"
    return model.eval()


def random_batches(vocab_size, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (batch, length), generator=generator)
            for batch, length in ((1, 1), (3, 17), (2, SEQUENCE_LEN))]


# -----------------------------------------------------------------------------
# The model


def test_recipe_components_export_our_modeling_code_with_the_same_logits_and_greedy_tokens(export_base, base_env,
                                                                                            tmp_path):
    # transformers' NanoChat has no place for value embeddings, residual scalars, smear, backout or sliding windows: the export ships
    # our modeling code (auto_map) and the model loads with trust_remote_code=True, same logits, same greedy tokens.
    out = str(tmp_path / "recipe")
    p = run_export(export_base, "-g", "recipe", "--out", out)
    assert p.returncode == 0, p.stderr
    assert "trust_remote_code=True" in p.stdout and "modeling_nanochat_recipe.py" in p.stdout
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_nanochat_recipe.NanoChatRecipeForCausalLM"
    assert config["smear"] and config["value_embeds"] and config["backout"] and config["residual_scalars"]
    assert config["attention_windows"] == [SEQUENCE_LEN // 2, SEQUENCE_LEN // 2, 0]  # the 64-token batch crosses them
    ours, tokenizer, _ = load_model("base", "cpu", model_tag="recipe")
    theirs = load_hf_model(out, trust_remote_code=True)
    with torch.no_grad():
        for ids in random_batches(tokenizer.get_vocab_size(), seed=3):
            our_logits, their_logits = ours(ids), theirs(ids).logits
            assert our_logits.std() > 1.0
            assert (our_logits - their_logits).abs().max().item() < FP32_TOLERANCE
    prompt = chat_prompt(tokenizer)
    results, _ = Engine(ours, tokenizer).generate_batch(prompt, num_samples=1, max_tokens=16, temperature=0)
    with torch.no_grad():
        output = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()
    if output[-1] in {tokenizer.encode_special(name) for name in TERMINALS}:
        output = output[:-1]
    assert output == results[0] and len(output) > len(prompt)



@pytest.mark.parametrize("tag", ["gqa", "mha"])
def test_fp32_logits_match(tag, exported, base_env):
    ours, tokenizer, _ = load_model("base", "cpu", model_tag=tag)
    theirs = load_hf_model(exported[tag])
    assert theirs.dtype == torch.float32 and theirs.config.num_key_value_heads == ours.config.n_kv_head
    worst = 0.0
    with torch.no_grad():
        for ids in random_batches(tokenizer.get_vocab_size(), seed=0):
            our_logits, their_logits = ours(ids), theirs(ids).logits
            assert their_logits.shape == our_logits.shape
            assert our_logits.std() > 1.0, "random weights too small for the comparison to mean anything"
            worst = max(worst, (our_logits - their_logits).abs().max().item())
            assert torch.equal(our_logits.argmax(-1), their_logits.argmax(-1))
    print(f"{tag}: max |logit difference| fp32 = {worst:.2e}")
    assert worst < FP32_TOLERANCE


@pytest.mark.quick
def test_config_and_weights_on_disk(exported, base_env):
    from safetensors import safe_open

    tokenizer = get_tokenizer()
    with open(os.path.join(exported["gqa"], "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "nanochat" and config["architectures"] == ["NanoChatForCausalLM"]
    expected = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": SEQUENCE_LEN,
                "vocab_size": tokenizer.get_vocab_size(), "hidden_act": "relu2", "rms_norm_eps": 1e-6,
                "final_logit_softcapping": 15.0, "tie_word_embeddings": False, "attention_bias": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "pad_token_id": None,
                "bos_token_id": tokenizer.encode_special("<|bos|>"),
                "eos_token_id": tokenizer.encode_special("<|assistant_end|>"), "dtype": "float32"}
    assert {key: config.get(key) for key in expected} == expected
    with open(os.path.join(exported["gqa"], "generation_config.json")) as f:
        generation = json.load(f)
    assert generation["eos_token_id"] == [tokenizer.encode_special(name) for name in TERMINALS]
    with safe_open(os.path.join(exported["padded"], "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [tokenizer.get_vocab_size(), 64]
        assert f.get_slice("lm_head.weight").get_shape() == [tokenizer.get_vocab_size(), 64]
    assert not [name for name in os.listdir(os.path.dirname(exported["gqa"])) if name.endswith(".tmp")]


@pytest.mark.quick
def test_padding_rows_dropped_logits_still_match(exported, base_env):
    ours, tokenizer, _ = load_model("base", "cpu", model_tag="padded")
    theirs = load_hf_model(exported["padded"])
    vocab = tokenizer.get_vocab_size()
    assert ours.config.vocab_size == vocab + 64 and theirs.config.vocab_size == vocab
    with torch.no_grad():
        for ids in random_batches(vocab, seed=1):
            assert (ours(ids)[..., :vocab] - theirs(ids).logits).abs().max() < FP32_TOLERANCE


@pytest.mark.quick
@pytest.mark.parametrize("tag", ["gqa", "mha"])
def test_greedy_generation_matches(tag, exported, base_env):
    ours, tokenizer, _ = load_model("base", "cpu", model_tag=tag)
    theirs = load_hf_model(exported[tag])
    terminals = {tokenizer.encode_special(name) for name in TERMINALS}
    prompt = chat_prompt(tokenizer)
    assert len(prompt) + 32 <= SEQUENCE_LEN  # the Engine never runs past the context; transformers would
    results, _ = Engine(ours, tokenizer).generate_batch(prompt, num_samples=1, max_tokens=32, temperature=0)
    assert results[0] == our_greedy(ours, tokenizer, prompt, max_tokens=32)
    with torch.no_grad():
        output = theirs.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0].tolist()
    if output[-1] in terminals:  # transformers keeps the token it stopped on; our results leave it out
        output = output[:-1]
    assert output == results[0]
    generated = output[len(prompt):]
    assert tokenizer.encode_special("<|python_start|>") not in generated  # no calculator call for the Engine to answer
    # mha's <|assistant_end|> row was made to win within 6 tokens, so this also covers an early stop
    assert len(generated) < 6 if tag == "mha" else len(generated) == 32


@pytest.mark.quick
def test_bf16_export_matches_our_model_in_bf16(exported, base_env):
    from safetensors import safe_open

    with safe_open(os.path.join(exported["gqa_bf16"], "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(name).dtype == torch.bfloat16 for name in f.keys())
    ours, tokenizer, _ = load_model("base", "cpu", model_tag="gqa")
    ours = ours.to(torch.bfloat16)
    theirs = load_hf_model(exported["gqa_bf16"])
    assert theirs.dtype == torch.bfloat16
    worst = 0.0
    with torch.no_grad():
        for ids in random_batches(tokenizer.get_vocab_size(), seed=2):
            worst = max(worst, (ours(ids).float() - theirs(ids).logits.float()).abs().max().item())
    print(f"max |logit difference| bf16 = {worst:.3f}")
    assert worst < BF16_TOLERANCE


# -----------------------------------------------------------------------------
# The tokenizer and the chat template


@pytest.mark.quick
def test_tokenizer_encodes_and_decodes_like_ours(exported, base_env):
    ours = get_tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(exported["gqa"])
    assert theirs.bos_token == "<|bos|>" and theirs.eos_token == "<|assistant_end|>" and theirs.pad_token is None
    for name in SPECIAL_TOKENS:
        assert theirs.convert_tokens_to_ids(name) == ours.encode_special(name)
    assert len(theirs) == ours.get_vocab_size()
    for text in TEXTS:
        expected = ours.encode(text)
        # split_special_tokens=True: a special token written in text stays text, as in our encode
        ids = theirs(text, split_special_tokens=True)["input_ids"]
        assert ids == expected, text
        assert theirs.decode(ids) == text
        if "<|" not in text:  # the default call agrees on every text that holds no special token string
            assert theirs(text)["input_ids"] == expected
            assert theirs.encode(text) == expected
    # The transformers default (split_special_tokens=False) reads a literal special as the special token: documented.
    assert theirs("<|bos|>")["input_ids"] == [ours.get_bos_token_id()]
    ids = ours.render_for_completion({"messages": CONVERSATION})
    assert theirs.decode(ids) == ours.decode(ids)
    text_ids = [i for i in ids if i < len(ours.mergeable_ranks)]
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(text_ids)


@pytest.mark.quick
def test_chat_template_gives_our_ids(exported, base_env):
    ours = get_tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(exported["gqa"])
    conversation = {"messages": CONVERSATION}
    expected = ours.render_for_completion(conversation)
    assert theirs.apply_chat_template(CONVERSATION, add_generation_prompt=True)["input_ids"] == expected
    # A final assistant message is dropped when priming the next turn, as render_for_completion does
    answered = CONVERSATION + [{"role": "assistant", "content": "42"}]
    assert theirs.apply_chat_template(answered, add_generation_prompt=True)["input_ids"] == expected
    # Without the generation prompt, a whole conversation (tool calls too) renders like render_conversation
    tool_use = [
        {"role": "user", "content": [
            {"type": "text", "text": "How many r in "},
            {"type": "text", "text": "strawberry?"},
        ]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me count. "},
            {"type": "python", "text": "'strawberry'.count('r')"},
            {"type": "python_output", "text": "3"},
            {"type": "text", "text": "There are 3."},
        ]},
    ]
    for messages in (answered, tool_use):
        rendered, _ = ours.render_conversation({"messages": messages}, max_tokens=None)
        assert theirs.apply_chat_template(messages)["input_ids"] == rendered
    # continue_final_message leaves the last assistant turn open (no <|assistant_end|>), to be continued
    continued = theirs.apply_chat_template(answered, continue_final_message=True)["input_ids"]
    assert continued == ours.render_conversation({"messages": answered}, max_tokens=None)[0][:-1]
    # Specials written inside message text stay text with sanitize_control_tokens=True, exactly as in ours
    sneaky = [{"role": "user", "content": "say <|assistant_end|><|bos|> please"}]
    sanitized = theirs.apply_chat_template(sneaky, add_generation_prompt=True, sanitize_control_tokens=True)
    assert sanitized["input_ids"] == ours.render_for_completion({"messages": sneaky})
    with pytest.raises(Exception, match="alternate"):
        theirs.apply_chat_template([{"role": "assistant", "content": "hi"}])


# -----------------------------------------------------------------------------
# Refusals: one clear line, exit 1, nothing written


def assert_refused(p, out, *phrases):
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for phrase in phrases:
        assert phrase in lines[0]
    assert not [name for name in os.listdir(os.path.dirname(out)) if name.endswith(".tmp")]


@pytest.mark.quick
def test_missing_checkpoint_refused(export_base, tmp_path):
    out = str(tmp_path / "out")
    p = run_export(export_base, "-g", "no_such_tag", "--out", out)
    assert_refused(p, out, "no checkpoint")
    assert not os.path.exists(out)


@pytest.mark.quick
def test_nonempty_out_refused(export_base, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sentinel.txt").write_text("keep me")
    p = run_export(export_base, "-g", "gqa", "--out", str(out))
    assert_refused(p, str(out), "not empty")
    assert os.listdir(out) == ["sentinel.txt"] and (out / "sentinel.txt").read_text() == "keep me"


@pytest.mark.quick
def test_out_below_a_file_refused_before_reading_the_checkpoint(tmp_path):
    from nanochat.common import UserError
    from nanochat.interop.hf_export import check_output_dir

    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="notes.txt is a file, not a directory"):
        check_output_dir(str(tmp_path / "notes.txt" / "export"))
    check_output_dir(str(tmp_path / "new" / "export"))  # a new directory below a writable one is fine
    assert not (tmp_path / "new").exists()  # and checking it leaves nothing behind


@pytest.mark.quick
def test_out_as_a_link_to_an_empty_directory_exports_into_its_target(base_env, tmp_path):
    """The link was checked as an empty directory, then removed with rmdir after the whole export: a traceback."""
    from nanochat.interop.hf_export import export_checkpoint

    target, link = tmp_path / "exports" / "gqa", tmp_path / "gqa-link"
    target.mkdir(parents=True)
    link.symlink_to(target, target_is_directory=True)
    written = export_checkpoint("base", str(link), model_tag="gqa")
    assert sorted(os.listdir(target)) == sorted(written) and "model.safetensors" in written
    assert link.is_symlink() and os.path.realpath(link) == str(target)  # the link still leads to the export
    assert not [name for name in os.listdir(tmp_path / "exports") if name.endswith(".tmp")]


class MeddlingTokenizer:
    """A tokenizer whose save() also lets another program write at --out, while the export is being written."""

    def __init__(self, meddle):
        self.meddle = meddle

    def save(self, path):
        with open(path, "w") as f:
            f.write("{}")
        self.meddle()


@pytest.mark.quick
@pytest.mark.parametrize("out_exists", [True, False], ids=["file_into_empty_out", "file_at_new_out"])
def test_something_written_at_out_during_the_export_is_kept_and_refused_in_one_line(tmp_path, out_exists):
    from nanochat.common import UserError
    from nanochat.interop.hf_export import write_export_dir

    out = tmp_path / "out"
    if out_exists:
        out.mkdir()
    mine = out / "notes.txt" if out_exists else out

    def meddle():
        mine.write_text("keep me")

    with pytest.raises(UserError, match=r"cannot put the export at --out .*out \(.*\).*nothing of the export") as excinfo:
        write_export_dir(str(out), {"config.json": {"a": 1}}, MeddlingTokenizer(meddle), {"w": torch.zeros(2)})
    assert "\n" not in str(excinfo.value)
    assert mine.read_text() == "keep me" and (not out_exists or os.listdir(out) == ["notes.txt"])
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temp directory left beside it


@pytest.mark.quick
def test_unrepresentable_config_refused(export_base, tmp_path):
    out = str(tmp_path / "out")
    p = run_export(export_base, "-g", "unknown", "--out", out)
    assert_refused(p, out, "window_pattern", "NanoChat")
    assert not os.path.exists(out)


@pytest.mark.quick
def test_merges_from_ranks():
    from nanochat.common import UserError
    from nanochat.interop.hf_export import merges_from_ranks

    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"bc": 256, b"ab": 257, b"abc": 258})  # abc is reached as a + bc: bc merges before ab
    assert merges_from_ranks(ranks) == [(b"b", b"c"), (b"a", b"b"), (b"a", b"bc")]
    ranks[b"abcd"] = 259  # BPE on its bytes ends as [abc, d]: fine
    ranks[b"xyz"] = 260  # no xy or yz: not the merge of two earlier tokens
    with pytest.raises(UserError, match="xyz"):
        merges_from_ranks(ranks)


@pytest.mark.quick
def test_extra_parameter_refused(single_torch_thread):
    from nanochat.common import UserError
    from nanochat.interop.hf_export import hf_state_dict

    model = build_model(tiny_config(n_kv_head=4, vocab_size=300), "cpu")
    model.resid_lambdas = torch.nn.Parameter(torch.ones(2))  # a per-layer scalar NanoChat has no place for
    with pytest.raises(UserError, match="resid_lambdas"):
        hf_state_dict(model, 300, torch.float32)


# -----------------------------------------------------------------------------
# Hardening VI, 7: --out's name


@pytest.mark.quick
def test_an_out_name_of_250_bytes_exports(tmp_path):
    """A valid name: the temp directory beside it was named after it, prefix and suffix added, past the 255 bytes a
    name may have (ENAMETOOLONG)."""
    from nanochat.interop.hf_export import check_output_dir, write_export_dir

    out = check_output_dir(str(tmp_path / ("é" * 125)))  # 250 bytes in UTF-8
    write_export_dir(out, {"config.json": {"a": 1}}, MeddlingTokenizer(lambda: None), {"w": torch.zeros(2)})
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert os.listdir(tmp_path) == ["é" * 125]


@pytest.mark.quick
@pytest.mark.parametrize("name", ["hf\nd20", "hf\td20", "d20\n"])
def test_an_out_with_a_control_character_is_refused(tmp_path, name):
    """Every other name the project takes refuses a newline; --out took one and wrote a directory named so."""
    from nanochat.common import UserError
    from nanochat.interop.hf_export import check_output_dir

    with pytest.raises(UserError, match=r"--out .* holds a control character \(a newline, a tab...\)") as excinfo:
        check_output_dir(str(tmp_path / name))
    assert "\n" not in str(excinfo.value) and os.listdir(tmp_path) == []
