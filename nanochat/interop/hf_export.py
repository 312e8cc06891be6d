"""
Export a checkpoint as a Hugging Face directory that transformers loads with its built-in NanoChat architecture and a
`tokenizers` tokenizer, with our logits and token ids (files and refusals: docs/export.md). A model with a recipe
component has no place in NanoChat: its export ships our modeling code (hf_recipe_model.py, as
modeling_nanochat_recipe.py) under auto_map, loaded with trust_remote_code=True.
"""

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time

import torch

from nanochat.checkpoint_manager import STEP_DIR_RE, checkpoint_dir, find_latest_tag, load_model, resolve_step
from nanochat.common import UserError, ensure_writable, print0, read_json_object
from nanochat.gpt import (COMPONENTS, OPTIONAL_FIELDS, VARIANT_DEFAULTS, GPTConfig, attention_window, config_from_dict,
                          has_value_embed)
from nanochat.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
RECIPE_MODULE = "modeling_nanochat_recipe"  # the name hf_recipe_model.py gets in an export
BOS_TOKEN = "<|bos|>"
# The chat models end their turn with <|assistant_end|>: it is the eos transformers' generate stops on.
# generation_config adds <|bos|>, which ends a document, so base and chat models stop where our Engine does.
EOS_TOKEN = "<|assistant_end|>"

INSTALL_HINT = "install the Hugging Face extra first: `uv sync --extra hf` (or `pip install transformers`)"

# Texts the converted tokenizer must encode exactly like ours before anything is written.
TOKENIZER_PROBES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "It's 2024: 1234567 apples cost $89.99 (we'll see; they're 3.5x pricier).",
    "   leading spaces, \t tabs,\n\nnew lines\r\n and   runs   of   spaces   \n",
    "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 🙂👍🏽 and 🇫🇷 flags",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}  # comment\n",
    "literal specials stay text: <|bos|> <|user_start|> <|assistant_end|>",
]


# -----------------------------------------------------------------------------
# Model: what transformers' NanoChat can represent, and the weights under its names


def raw_model_config(ckpt_dir, step=None):
    """The model_config in the meta.json of `step` (default: the newest), as plain JSON, or None: the checkpoint manager
    skips a config with unknown fields, and the export must name them rather than say "no checkpoint"."""
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    steps = [int(m.group(1)) for m in map(STEP_DIR_RE.match, names) if m]
    if step is None:
        if not steps:
            return None
        step = max(steps)
    meta = read_json_object(os.path.join(ckpt_dir, f"step_{step:06d}", "meta.json"))
    return None if meta is None else meta.get("model_config")  # None: the checkpoint manager reports what is wrong


def check_representable(model_config):
    """Raise UserError naming the first thing in a checkpoint's model config (a dict, as in meta.json) that
    transformers' NanoChat cannot represent, before the model is built."""
    known_fields = [field.name for field in dataclasses.fields(GPTConfig)]
    unknown = [name for name in model_config if name not in known_fields]
    if unknown:
        shown = ", ".join(f"{name}={model_config[name]!r}" for name in unknown)
        raise UserError(f"cannot export: config field(s) {shown} have no equivalent in transformers' NanoChat")
    missing = [name for name in known_fields if name not in model_config and name not in OPTIONAL_FIELDS]
    if missing:
        raise UserError(f"cannot export: the checkpoint's model_config lacks {', '.join(missing)}")
    try:
        config_from_dict(model_config)
    except ValueError as e:
        raise UserError(f"cannot export: {e}") from None
    # Everything else a valid GPTConfig expresses maps onto NanoChat (GQA groups heads alike, any sequence_len).


# Our parameter names -> transformers' NanoChat names: the two outside the blocks, and a block's linears (model_import
# reads the same tables backwards)
HF_OUTSIDE_BLOCKS = {"transformer.wte.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
HF_BLOCK_LINEARS = {"attn.c_q": "self_attn.q_proj", "attn.c_k": "self_attn.k_proj", "attn.c_v": "self_attn.v_proj",
                    "attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}


def hf_weight_name(name):
    """Our state-dict name -> transformers' NanoChat name, or None for a parameter it has no place for."""
    if name in HF_OUTSIDE_BLOCKS:
        return HF_OUTSIDE_BLOCKS[name]
    m = re.fullmatch(r"transformer\.h\.(\d+)\.(\w+\.\w+)\.weight", name)
    return f"model.layers.{m.group(1)}.{HF_BLOCK_LINEARS[m.group(2)]}.weight" if m and m.group(2) in HF_BLOCK_LINEARS \
        else None


# The exact-math variants (gpt.VARIANT_DEFAULTS) NanoChat's config has fields for; any other needs our modeling code.
NANOCHAT_VARIANTS = ("rope_theta", "norm_eps", "logit_softcap")


def uses_components(config):
    """Whether the export needs our modeling code: a recipe component, or a variant NanoChat has no field for."""
    return any(getattr(config, name) for name in COMPONENTS) or any(
        getattr(config, name) != default for name, default in VARIANT_DEFAULTS.items() if name not in NANOCHAT_VARIANTS)


def hf_state_dict(model, vocab_size, dtype):
    """The weights under transformers' names (ours for a model with components), on the CPU in `dtype`, each per-token
    table cut to the tokenizer's `vocab_size` (rows past it are padding no token id reaches)."""
    if model.config.vocab_size < vocab_size:
        raise UserError(f"cannot export: the model has {model.config.vocab_size} token rows but the tokenizer "
                        f"has {vocab_size} ids; this checkpoint was trained with another tokenizer")
    ours = uses_components(model.config)
    unmapped = [] if ours else [name for name in model.state_dict() if hf_weight_name(name) is None]
    if unmapped:
        raise UserError(f"cannot export: parameter(s) {', '.join(unmapped)} have no place in transformers' NanoChat")
    weights = {}
    for name, tensor in model.state_dict().items():
        if name in ("transformer.wte.weight", "lm_head.weight") or name.startswith("value_embeds."):
            tensor = tensor[:vocab_size]
        weights[name if ours else hf_weight_name(name)] = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
    return weights


def hf_model_config(config, bos_id, eos_id, vocab_size, dtype_name):
    """config.json for NanoChatForCausalLM. Every field that changes the math is explicit, never a default."""
    return {
        "architectures": ["NanoChatForCausalLM"],
        "model_type": "nanochat",
        "vocab_size": vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": 4 * config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.n_embd // config.n_head,
        "max_position_embeddings": config.sequence_len,
        "hidden_act": "relu2",
        # a number: None is torch's default, the fp32 machine epsilon in both models' fp32 norm
        "rms_norm_eps": torch.finfo(torch.float32).eps if config.norm_eps is None else config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "final_logit_softcapping": config.logit_softcap,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,  # there is no pad token (and NanoChat would make a pad id its embedding's padding_idx)
        "use_cache": True,
        "dtype": dtype_name,
    }


def hf_recipe_config(config, bos_id, eos_id, vocab_size, dtype_name):
    """config.json for our own modeling code (hf_recipe_model.py), for a model with recipe components."""
    return {
        "architectures": ["NanoChatRecipeForCausalLM"],
        "model_type": "nanochat_recipe",
        "auto_map": {"AutoConfig": f"{RECIPE_MODULE}.NanoChatRecipeConfig",
                     "AutoModelForCausalLM": f"{RECIPE_MODULE}.NanoChatRecipeForCausalLM"},
        "vocab_size": vocab_size,
        "hidden_size": config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "max_position_embeddings": config.sequence_len,
        "rms_norm_eps": config.norm_eps,  # null: torch's default for the dtype, as in the model it came from
        "rope_theta": config.rope_theta,
        "rotary_bf16": config.rotary_bf16,
        "qk_scale": config.qk_scale,
        "final_logit_softcapping": config.logit_softcap,
        "ve_gate_channels": config.ve_gate_channels,
        "ve_gate_scale": config.ve_gate_scale,
        "smear_gate_channels": config.smear_gate_channels,
        "backout_layer": config.n_layer // 2 - 1 if config.backout_layer is None else config.backout_layer,
        **{name: getattr(config, name) for name in COMPONENTS if name != "sliding_window"},
        # per layer, spelled out so the modeling code needs no rule of its own (nor a version of one)
        "value_embed_layers": [i for i in range(config.n_layer) if has_value_embed(config, i)],
        "attention_windows": [attention_window(config, i) or 0 for i in range(config.n_layer)],  # 0 = full
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": False,
        "dtype": dtype_name,
    }


def hf_generation_config(bos_id, eos_id, use_cache=True):
    """Plain greedy-or-sampled generation that stops on <|assistant_end|> or <|bos|>, like our Engine."""
    return {"bos_token_id": bos_id, "eos_token_id": [eos_id, bos_id], "pad_token_id": None,
            **({} if use_cache else {"use_cache": False})}


# -----------------------------------------------------------------------------
# Tokenizer: tiktoken ranks -> a byte-level BPE for the `tokenizers` library


def byte_to_unicode():
    """GPT-2's byte-level alphabet, as `tokenizers` uses it: printable Latin-1 bytes stand for themselves, the other 68
    take the characters from U+0100 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    others = iter(range(256, 512))  # the next character from U+0100 on, for each byte that is not printable
    return {byte: chr(byte) if byte in printable else chr(next(others)) for byte in range(256)}


def bpe_parts(token, ranks, max_rank):
    """tiktoken's BPE on `token` with the merges ranked below max_rank: join the lowest-ranked adjacent pair (leftmost
    on ties) until none is left."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while True:
        best_rank, best_index = None, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best_rank is None or rank < best_rank):
                best_rank, best_index = rank, i
        if best_index is None:
            return parts
        parts[best_index:best_index + 2] = [parts[best_index] + parts[best_index + 1]]


def merges_from_ranks(mergeable_ranks):
    """The BPE merge list, in rank order: BPE on a token's bytes with the merges ranked below it must end in exactly two
    parts, whose join is its merge; a vocabulary where this fails was not made by BPE merges."""
    missing_bytes = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
    if missing_bytes:
        raise UserError(f"cannot export the tokenizer: it lacks {len(missing_bytes)} of the 256 single-byte tokens")
    merges = []
    for token, rank in sorted(mergeable_ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = bpe_parts(token, mergeable_ranks, rank)
        if len(parts) != 2:
            raise UserError(f"cannot export the tokenizer: token {rank} ({token!r}) is not the merge of two earlier "
                            f"tokens (BPE on its bytes stops at {len(parts)} parts)")
        merges.append((parts[0], parts[1]))
    return merges


def build_hf_tokenizer(tokenizer):
    """A `tokenizers.Tokenizer` with our ids: our split regex, the byte-level alphabet, BPE with whole-piece lookup
    first (as tiktoken), the nine specials as added tokens at our ids; no normalizer, no post-processor."""
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise UserError(f"the `tokenizers` package is missing; {INSTALL_HINT}") from None
    names = sorted(tokenizer.special_ids, key=tokenizer.special_ids.get)
    first_special = len(tokenizer.mergeable_ranks)
    expected_ids = list(range(first_special, first_special + len(SPECIAL_TOKENS)))
    if names != SPECIAL_TOKENS or [tokenizer.special_ids[name] for name in names] != expected_ids:
        raise UserError(f"cannot export the tokenizer: its special tokens {names} are not nanochat's nine, in order, "
                        "right after the merges")
    to_char = byte_to_unicode()

    def as_text(token_bytes):
        return "".join(to_char[b] for b in token_bytes)

    vocab = {as_text(token): rank for token, rank in tokenizer.mergeable_ranks.items()}
    merges = [(as_text(left), as_text(right)) for left, right in merges_from_ranks(tokenizer.mergeable_ranks)]
    try:
        split_regex = Regex(tokenizer.pattern)
    except Exception as e:  # tokenizers raises a bare Exception for a pattern its regex engine rejects
        raise UserError(f"cannot export the tokenizer: `tokenizers` cannot compile its split pattern ({e})") from None
    # ignore_merges: a piece that is itself a token is taken whole before any merge, as tiktoken does.
    hf_tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    hf_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(split_regex, behavior="isolated", invert=False),
        # use_regex=False: the split above is ours; ByteLevel only maps bytes to its alphabet.
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    hf_tokenizer.decoder = decoders.ByteLevel()
    # normalized=False: specials are matched in the raw text, never in something a normalizer produced.
    hf_tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    ids_given = [hf_tokenizer.token_to_id(name) for name in names]
    if ids_given != [tokenizer.special_ids[name] for name in names]:
        raise UserError(f"cannot export the tokenizer: special tokens got ids {ids_given} instead of ours")
    return hf_tokenizer


def check_tokenizer_matches(hf_tokenizer, tokenizer):
    """Refuse a conversion that encodes any probe text differently from ours (regex or BPE mismatch)."""
    hf_tokenizer.encode_special_tokens = True  # the probes hold literal specials, which ours keeps as text
    try:
        for text in TOKENIZER_PROBES:
            ours = tokenizer.encode(text)
            theirs = hf_tokenizer.encode(text, add_special_tokens=False).ids
            if theirs != ours:
                raise UserError(f"cannot export the tokenizer: the converted tokenizer encodes {text!r} as {theirs}, "
                                f"ours as {ours}")
            if hf_tokenizer.decode(theirs, skip_special_tokens=False) != text:
                raise UserError(f"cannot export the tokenizer: the converted tokenizer does not decode {text!r} back")
    finally:
        hf_tokenizer.encode_special_tokens = False




def hf_tokenizer_config(sequence_len):
    """tokenizer_config.json: which specials are bos/eos, nothing added implicitly, and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": None,
        "unk_token": None,
        "extra_special_tokens": [name for name in SPECIAL_TOKENS if name not in (BOS_TOKEN, EOS_TOKEN)],
        # Our encode adds nothing; callers prepend <|bos|> themselves (the chat template writes it).
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # decode must return the exact text, not "fix" spaces before punctuation
        "model_max_length": sequence_len,
        "chat_template": CHAT_TEMPLATE,
    }


# -----------------------------------------------------------------------------
# The export


def check_output_dir(out_dir):
    """--out with a link resolved to its target (the export replaces the empty directory it names, which a link cannot
    be), new or empty, and writable; said before the checkpoint is read. A control character (a newline...) is refused
    as every name the project takes is: a directory named so is a mistake, and breaks whatever lists it."""
    if any(ord(c) < 32 or ord(c) == 127 for c in out_dir):
        raise UserError(f"--out {out_dir!r} holds a control character (a newline, a tab...); name a directory without one")
    out_dir = os.path.realpath(out_dir)
    if os.path.lexists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise UserError(f"--out {out_dir} already exists and is not empty; choose a new directory or remove it first")
    ensure_writable(out_dir, "the export", fix="choose another --out")
    return out_dir


def format_size(num_bytes):
    if num_bytes < 1024:
        return f"{num_bytes} B"
    for unit in ("KB", "MB", "GB"):
        num_bytes /= 1024
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.1f} {unit}"


def write_export_dir(out_dir, json_files, hf_tokenizer, weights, code=None):
    """Write everything into a temp dir next to out_dir, then rename it into place: never a partial export. The rename
    fails if out_dir is no longer free or empty, and then nothing of the export is left."""
    from safetensors.torch import save_file

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    # not named after out_dir: a name of 250 bytes is a valid --out, and it with a prefix and suffix is not
    tmp_dir = tempfile.mkdtemp(prefix=".export_hf.", suffix=".tmp", dir=parent)
    try:
        for name, content in json_files.items():
            with open(os.path.join(tmp_dir, name), "w", encoding="utf-8") as f:
                f.write(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
        hf_tokenizer.save(os.path.join(tmp_dir, "tokenizer.json"))
        for name, source in (code or {}).items():
            shutil.copyfile(source, os.path.join(tmp_dir, name))
        save_file(weights, os.path.join(tmp_dir, "model.safetensors"), metadata={"format": "pt"})
        written = {name: os.path.getsize(os.path.join(tmp_dir, name)) for name in sorted(os.listdir(tmp_dir))}
        try:
            os.rename(tmp_dir, out_dir)
        except OSError as e:
            raise UserError(f"cannot put the export at --out {out_dir} ({e.strerror}), new or empty when it began: "
                            "something was written there meanwhile; nothing of the export is left, run it again to a "
                            "new or empty --out") from None
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return written


def export_checkpoint(stage, out_dir, model_tag=None, step=None, dtype_name="float32", device="cpu"):
    """Export the checkpoint (stage, model_tag, step) to out_dir, every check before anything is written. Returns
    {file name: size in bytes}."""
    t0 = time.time()
    if dtype_name not in EXPORT_DTYPES:
        raise UserError(f"--dtype must be one of {sorted(EXPORT_DTYPES)} (got {dtype_name!r})")
    out_dir = check_output_dir(out_dir)
    model_tag = model_tag or find_latest_tag(stage)
    ckpt_dir = checkpoint_dir(stage, model_tag)
    model_config = raw_model_config(ckpt_dir, step)
    if isinstance(model_config, dict):
        check_representable(model_config)
    step = resolve_step(ckpt_dir, step, fix="check -i/-g, or train that stage first")
    model, tokenizer, _ = load_model(stage, device, model_tag=model_tag, step=step)

    c = model.config
    vocab_size = tokenizer.get_vocab_size()
    print0(f"export_hf | {stage}/{model_tag} step {step} | n_layer={c.n_layer} n_head={c.n_head} "
           f"n_kv_head={c.n_kv_head} n_embd={c.n_embd} sequence_len={c.sequence_len} vocab={vocab_size} | "
           f"{model.num_params():,} params | {dtype_name} -> {out_dir}")
    if c.vocab_size > vocab_size:
        print0(f"dropping {c.vocab_size - vocab_size} padding rows past the tokenizer's {vocab_size} ids")
    weights = hf_state_dict(model, vocab_size, EXPORT_DTYPES[dtype_name])
    hf_tokenizer = build_hf_tokenizer(tokenizer)
    check_tokenizer_matches(hf_tokenizer, tokenizer)
    bos_id, eos_id = tokenizer.encode_special(BOS_TOKEN), tokenizer.encode_special(EOS_TOKEN)
    recipe = uses_components(c)
    json_files = {
        "config.json": (hf_recipe_config if recipe else hf_model_config)(c, bos_id, eos_id, vocab_size, dtype_name),
        "generation_config.json": hf_generation_config(bos_id, eos_id, use_cache=not recipe),
        "tokenizer_config.json": hf_tokenizer_config(c.sequence_len),
    }
    code = {f"{RECIPE_MODULE}.py": os.path.join(os.path.dirname(__file__), "hf_recipe_model.py")} if recipe else {}
    if recipe:
        print0(f"components or exact-math variants transformers' NanoChat has no place for: writing our modeling code "
               f"({RECIPE_MODULE}.py), load with trust_remote_code=True")

    written = write_export_dir(out_dir, json_files, hf_tokenizer, weights, code)
    for name, size in written.items():
        print0(f"  {name:<24} {format_size(size):>10}")
    print0(f"exported {stage}/{model_tag} step {step} to {out_dir}: {len(written)} files, "
           f"{format_size(sum(written.values()))}, {time.time() - t0:.1f}s")
    return written
