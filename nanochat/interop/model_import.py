"""
Bring your model: a karpathy/nanochat checkpoint of any public era (model_XXXXXX.pt read with weights_only=True, its
meta_XXXXXX.json, a tokenizer.pkl read by an unpickler that accepts only a tiktoken Encoding's state) or a transformers
NanoChat directory (config.json, safetensors, tokenizer.json; our export_hf's included) becomes an ordinary checkpoint
of ours with the same logits. The reference's components and their sizes are read off the state dict; what each era's
forward did besides (ERAS) becomes GPTConfig's exact-math options. The files narrow the era down (era_candidates); a
January-looking checkpoint may be of 2-8 March 2026, which its training config or `--era` settles.
"""

import dataclasses
import json
import os
import pickle
import posixpath
import re
import time
import zipfile

import torch

from nanochat.checkpoint_manager import (STAGE_DIRS, TAG_RE, checkpoint_dir, count_not_finite, list_steps, load_meta,
                                         save_checkpoint, sha256_of)
from nanochat.common import UserError, get_base_dir, json_load_file, json_loads, print0
from nanochat.gpt import COMPONENTS, GPT, VALUE_EMBED_LAYERS, GPTConfig, has_value_embed, shape_problem
from nanochat.tokenizer import SPECIAL_TOKENS, RustBPETokenizer

KARPATHY_FORMAT, TRANSFORMERS_FORMAT, RECIPE_FORMAT = "karpathy/nanochat", "transformers NanoChat", "nanochat export (recipe)"
MODEL_FILE_RE = re.compile(r"^model_(\d+)\.pt$")
# the reference's short windows by sequence_len, a third and a quarter with its FA3-tile rounding as written
_HALF, _THIRD, _QUARTER = (lambda n: n // 2), (lambda n: -(-n // 3 // 128) * 128), (lambda n: -(-n // 4 // 128) * 128)
# The math of each era of karpathy/nanochat's gpt.py beyond what its files say, keyed by the date it took effect.
# Every era: RMSNorm with torch's default eps, rotary on split halves, QK-norm, ReLU^2, untied head, fp32 logits.
ERA_FIELDS = ("summary", "rope_theta", "rotary_bf16", "qk_scale", "logit_softcap", "ve_gate_scale", "short_window", "backout")
ERAS = {era: dict(zip(ERA_FIELDS, row)) for era, row in {
    # era: (summary, rope theta, rotary tables in bf16, q/k scale, logit softcap, value-embedding gate range,
    #       the short window's reach back from the query, backout's layer)
    "2025-10": ("the October 2025 release (plain GPT; a vocab padded to 64 from December)", 1e4, True, 1.0, 15.0, 2.0,
                None, None),
    "2026-01": ("January 2026 (window_pattern, residual lambdas, value embeddings with a 0..2 gate)", 1e4, True, 1.0, 15.0,
                2.0, _HALF, None),
    "2026-03-02": ("2-3 March 2026 (January's model with logit softcap 20)", 1e4, True, 1.0, 20.0, 2.0, _HALF, None),
    "2026-03-04": ("4-8 March 2026 (softcap 20, rotary tables in the compute dtype)", 1e4, False, 1.0, 20.0, 2.0, _HALF,
                   None),
    "2026-03-09": ("9-13 March 2026 (rope theta 100k, q/k x1.15, a 0..3 value-embedding gate on 12 channels)", 1e5, False,
                   1.15, 15.0, 3.0, _THIRD, None),
    "2026-03-14": ("from 14 March 2026 (smear, backout, q/k x1.2, quarter-context short windows)", 1e5, False, 1.2, 15.0,
                   3.0, _QUARTER, lambda n_layer: n_layer // 2),
}.items()}
KARPATHY_CONFIG_FIELDS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
LOOKS_LIKE_JANUARY = ("2026-01", "2026-03-02", "2026-03-04")  # same parameters, same model_config; other math
# The training config (the meta's user_config: the script's arguments) that karpathy/nanochat's scripts saved from 2
# to 8 March 2026: base_train's fields from 3 February, chat_sft's from 16 February (chat_rl saves none). A
# January-looking checkpoint whose user_config lacks some field of both was written by an older script: January's.
MARCH_2_TO_8_USER_CONFIGS = (
    frozenset({"adam_beta1", "adam_beta2", "aspect_ratio", "core_metric_every", "core_metric_max_per_task", "depth",
               "device_batch_size", "device_type", "embedding_lr", "eval_every", "eval_tokens", "final_lr_frac", "fp8",
               "fp8_recipe", "head_dim", "matrix_lr", "max_seq_len", "model_tag", "num_iterations", "resume_from_step",
               "run", "sample_every", "save_every", "scalar_lr", "target_flops", "target_param_data_ratio",
               "total_batch_size", "unembedding_lr", "warmdown_ratio", "warmup_ratio", "weight_decay",
               "window_pattern"}),
    frozenset({"chatcore_every", "chatcore_max_cat", "chatcore_max_sample", "device_batch_size", "device_type",
               "embedding_lr", "eval_every", "eval_tokens", "final_lr_frac", "gsm8k_epochs", "init_lr_frac",
               "load_optimizer", "matrix_lr", "max_seq_len", "mmlu_epochs", "model_step", "model_tag", "num_iterations",
               "run", "total_batch_size", "unembedding_lr", "warmdown_ratio", "warmup_ratio"}),
)
# Where a checkpoint folder's tokenizer.pkl may be, best first: beside it, in its tokenizer/, one folder up, and in a
# base dir's tokenizer/ (<base>/<stage>_checkpoints/<tag>/); local folders and hub repos alike (tokenizer_candidates).
TOKENIZER_SEARCH = ("tokenizer.pkl", "tokenizer/tokenizer.pkl", "../tokenizer.pkl", "../tokenizer/tokenizer.pkl",
                    "../../tokenizer/tokenizer.pkl")


# -----------------------------------------------------------------------------
# Files: safe reads, hashes


def check_record_sizes(path):
    """torch.save stores a .pt's records in its zip uncompressed, so together they are the file's size; torch.load
    inflates a compressed one whole before any check (a 1.5 MB file reached 2.2 GiB). The sizes the zip declares are
    summed first, and more than the file holds is refused. A file that is no zip is torch's legacy format, unpacked."""
    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return  # torch.load says what is wrong with it
    size = os.path.getsize(path)
    if declared > size:
        raise UserError(f"refusing {path}: its records unpack to {declared:,} bytes, more than the file's own {size:,}; "
                        "torch.save stores them uncompressed, so it is not a .pt as torch.save wrote it (re-save it "
                        "with torch.save, or copy the original)")


def load_torch_weights(path):
    """A state dict of tensors from a torch.save file, with weights_only=True (no code runs). Read whole, not mapped:
    torch.load(mmap=True) does not check a record's size against the pickle's: a short record read on into the next."""
    check_record_sizes(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, a short record, not a torch file, a pickle weights_only refuses
        raise UserError(f"cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}): "
                        "it is truncated, corrupt or not a model state dict; download or copy it again") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise UserError(f"{path} is not a model state dict (a dict of named tensors)")
    return {k.removeprefix("_orig_mod."): v for k, v in state.items()}  # a compiled model's keys carry that prefix


def load_safetensors_weights(paths):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state = {}
    for path in paths:
        try:
            state.update(load_file(path))
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {path} ({e}): it is truncated or corrupt; download or copy it again") from None
    return state


def read_json(path, what):
    try:
        value = json_load_file(path)
    except FileNotFoundError:
        raise UserError(f"{what} {path} is missing") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{what} {path} is unreadable ({e})") from None
    if not isinstance(value, dict):
        raise UserError(f"{what} {path} is not a JSON object")
    return value


# -----------------------------------------------------------------------------
# Tokenizers: a pickled tiktoken Encoding, or a transformers tokenizer.json, into ours


class _EncodingRecord:
    """What the restricted unpickler builds in place of tiktoken.core.Encoding: the pickled state, nothing run."""

    def __setstate__(self, state):
        self.state = state


class _TiktokenUnpickler(pickle.Unpickler):
    """Accepts exactly a pickled tiktoken Encoding (a class reference, then its state dict of plain values)."""

    def find_class(self, module, name):
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _EncodingRecord
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, and a tokenizer.pkl may hold only a tiktoken Encoding")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent reference, which a tokenizer.pkl never has")


def tokenizer_from_pickle(path):
    """Our tokenizer from karpathy/nanochat's tokenizer.pkl, read without running anything it names."""
    try:
        with open(path, "rb") as f:
            record = _TiktokenUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"tokenizer {path} is missing; pass --tokenizer PATH") from None
    except Exception as e:  # UnpicklingError, EOFError, a bad opcode...
        raise UserError(f"refusing tokenizer {path}: {e}") from None
    state = getattr(record, "state", None)
    if not isinstance(record, _EncodingRecord) or not isinstance(state, dict):
        raise UserError(f"refusing tokenizer {path}: it is not a pickled tiktoken Encoding with its own merges "
                        "(a named encoding such as cl100k_base would need a download)")
    ranks, pattern, specials = state.get("mergeable_ranks"), state.get("pat_str"), state.get("special_tokens")
    if not (isinstance(ranks, dict) and all(isinstance(k, bytes) and type(v) is int for k, v in ranks.items())
            and isinstance(pattern, str) and isinstance(specials, dict)
            and all(isinstance(k, str) and type(v) is int for k, v in specials.items())):
        raise UserError(f"refusing tokenizer {path}: its Encoding state is not the merges/pattern/specials of a tiktoken "
                        "encoding")
    return tokenizer_from_parts(ranks, pattern, specials, path)


def tokenizer_from_parts(ranks, pattern, specials, path):
    """Ours, from tiktoken ranks and special ids: the nine chat specials, right after the merges, as ours has them."""
    names = sorted(specials, key=specials.get)
    first = len(ranks)
    if sorted(names) != sorted(SPECIAL_TOKENS) or [specials[n] for n in names] != list(range(first, first + len(names))):
        raise UserError(f"tokenizer {path} has special tokens {names} at ids {sorted(specials.values())}; nanochat's "
                        f"chat format needs exactly {', '.join(SPECIAL_TOKENS)} right after the {first} merges")
    try:
        return RustBPETokenizer._from_parts(ranks, pattern, names)
    except ValueError as e:
        raise UserError(f"tokenizer {path} cannot be used: {e}") from None


def tokenizer_from_hf_json(path):
    """Ours, from a transformers byte-level BPE tokenizer.json; checked to encode the probe texts alike."""
    from nanochat.interop.hf_export import INSTALL_HINT, byte_to_unicode, check_tokenizer_matches

    data = read_json(path, "tokenizer")
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        raise UserError(f"tokenizer {path} is not a byte-level BPE (model.type {model.get('type')!r}); it cannot become "
                        "a tiktoken encoding")
    to_byte = {char: byte for byte, char in byte_to_unicode().items()}
    try:
        ranks = {bytes(to_byte[c] for c in token): rank for token, rank in vocab.items()}
    except KeyError:
        raise UserError(f"tokenizer {path} has tokens outside the byte-level alphabet; it cannot become a tiktoken "
                        "encoding") from None
    specials = {t["content"]: t["id"] for t in data.get("added_tokens", []) if isinstance(t, dict) and t.get("special")}
    patterns = re.findall(r'"Regex":\s*("(?:[^"\\]|\\.)*")', json.dumps(data.get("pre_tokenizer")))
    if len(patterns) != 1:
        raise UserError(f"tokenizer {path}: expected one split Regex in its pre_tokenizer, found {len(patterns)}")
    tokenizer = tokenizer_from_parts(ranks, json_loads(patterns[0]), specials, path)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(f"reading a transformers tokenizer needs the `tokenizers` package; {INSTALL_HINT}") from None
    try:
        check_tokenizer_matches(Tokenizer.from_file(path), tokenizer)
    except UserError as e:
        raise UserError(f"tokenizer {path} does not convert exactly: {str(e).removeprefix('cannot export the tokenizer: ')}") from None
    return tokenizer


# -----------------------------------------------------------------------------
# Formats: files -> (GPTConfig, our state dict, tokenizer, description)


def tokenizer_candidates(folder):
    """TOKENIZER_SEARCH from `folder`, a '/'-separated path under some root ('' or '.' = the root itself), as paths
    under that same root; the ones that would leave the root are left out."""
    paths = [posixpath.normpath(posixpath.join(folder or ".", relative)) for relative in TOKENIZER_SEARCH]
    return [path for path in paths if path != ".." and not path.startswith("../")]


def find_karpathy_tokenizer(model_dir, tokenizer_path, root=None):
    """The tokenizer.pkl for a checkpoint folder: --tokenizer, else the first of tokenizer_candidates that exists. A
    hub download is searched within its cache folder (`root`), so nothing outside what was fetched is picked up."""
    if tokenizer_path:
        path = os.path.join(tokenizer_path, "tokenizer.pkl") if os.path.isdir(tokenizer_path) else tokenizer_path
        if not os.path.isfile(path):
            raise UserError(f"--tokenizer {tokenizer_path}: no such file (give tokenizer.pkl or the folder holding it)")
        return path
    root = os.path.abspath(root or os.sep)
    folder = os.path.relpath(os.path.abspath(model_dir), root).replace(os.sep, "/")
    candidates = [os.path.join(root, *c.split("/")) for c in tokenizer_candidates(folder)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise UserError(f"no tokenizer.pkl for {model_dir} (looked at {', '.join(candidates)}); pass --tokenizer PATH")


def era_candidates(model_config, state):
    """The eras whose model these files fit, and what in them says so."""
    if "window_pattern" not in model_config:
        return ("2025-10",), "a model_config without window_pattern"
    if "smear_gate.weight" in state or "smear_lambda" in state or "backout_lambda" in state:
        return ("2026-03-14",), "smear/backout parameters"
    widths = sorted({v.shape[1] for k, v in state.items() if k.endswith(".attn.ve_gate.weight") and v.ndim == 2})
    if widths == [12]:
        return ("2026-03-09",), "12-channel value-embedding gates"
    if not widths:  # value embeddings came on 16 January 2026 and every later model has them
        return ("2026-01",), "a window_pattern but no value embeddings"
    return LOOKS_LIKE_JANUARY, f"{'/'.join(map(str, widths))}-channel value-embedding gates"


def choose_era(meta, state, era, where):
    """(era, how it was told): --era if the files allow it, else what the files and the training config say; a
    checkpoint they cannot place is refused, naming the --era values it may have."""
    candidates, evidence = era_candidates(meta["model_config"], state)
    if era is not None:
        if era not in candidates:
            raise UserError(f"{where} has {evidence}, which the {era} model never had: drop --era, or pass "
                            f"{', '.join(candidates)}")
        return era, "as --era says"
    if len(candidates) == 1:
        return candidates[0], "told by its files"
    user_config = meta.get("user_config")
    if isinstance(user_config, dict) and not any(fields <= set(user_config) for fields in MARCH_2_TO_8_USER_CONFIGS):
        return "2026-01", "its training config lacks fields every script of 2-8 March 2026 saved"
    why = "has no training config (user_config)" if not isinstance(user_config, dict) else \
        "has the training config fields base_train/chat_sft saved both before and during 2-8 March"
    raise UserError(f"{where}: January 2026's checkpoints and those of 2-8 March look alike (the same parameters, other "
                    f"math), and its meta {why}: pass the --era of the karpathy/nanochat code that trained it, "
                    "2026-01 (11 January to 1 March 2026), 2026-03-02 (2-3 March) or 2026-03-04 (4-8 March)")


def karpathy_windows(pattern, sequence_len, era, n_layer):
    """Our per-layer windows (positions seen, itself included; 0 = all) for a window_pattern of that era: the
    reference's query sees keys up to `left` positions back, left + 1 positions in all."""
    if not isinstance(pattern, str) or not pattern or set(pattern.upper()) - set("SL"):
        raise UserError(f"window_pattern {pattern!r} is not a string of S and L")
    short = ERAS[era]["short_window"](sequence_len)
    windows = []
    for i in range(n_layer):
        left = short if pattern.upper()[i % len(pattern)] == "S" and i < n_layer - 1 else sequence_len
        windows.append(left + 1 if left + 1 < sequence_len else 0)
    return windows if any(windows) else None


def gate_channels(state, name, where):
    """The channels a gate reads: its weight's second dimension (a gate is heads x channels)."""
    shape = tuple(state[name].shape)
    if len(shape) != 2:
        raise UserError(f"{where}: {name} has shape {shape}, where a gate's weight has two dimensions")
    return shape[1]


def read_karpathy(model_dir, step, tokenizer_path, era, root=None):
    steps = sorted(int(m.group(1)) for m in map(MODEL_FILE_RE.match, os.listdir(model_dir)) if m)
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"no model_{step:06d}.pt in {model_dir}; steps there: {steps}")
    model_path = os.path.join(model_dir, f"model_{step:06d}.pt")
    meta_path = os.path.join(model_dir, f"meta_{step:06d}.json")
    if not os.path.isfile(meta_path):
        raise UserError(f"{meta_path} is missing: the model's shape lives there; copy it from where {model_path} came from")
    meta = read_json(meta_path, "checkpoint metadata")
    model_config = meta.get("model_config")
    if not isinstance(model_config, dict):
        raise UserError(f"{meta_path} has no model_config")
    unknown = sorted(set(model_config) - set(KARPATHY_CONFIG_FIELDS) - {"window_pattern"})
    if unknown:
        raise UserError(f"{meta_path}: model_config field(s) {', '.join(unknown)} belong to no public era of "
                        "karpathy/nanochat; this model cannot be reproduced")
    missing = [f for f in KARPATHY_CONFIG_FIELDS if not (type(model_config.get(f)) is int and model_config[f] > 0)]
    if missing:
        raise UserError(f"{meta_path}: model_config lacks positive integers for {', '.join(missing)}")
    check_shapes(model_config, meta_path)
    tokenizer_file = find_karpathy_tokenizer(model_dir, tokenizer_path, root)
    tokenizer = tokenizer_from_pickle(tokenizer_file)  # before the weights: a refused pickle is the quicker answer
    state = load_torch_weights(model_path)
    era, era_told = choose_era(meta, state, era, model_path)
    mc, n_layer = model_config, model_config["n_layer"]
    vocab_size = mc["vocab_size"]
    if vocab_size != tokenizer.get_vocab_size():
        raise UserError(f"{meta_path} says vocab_size {vocab_size} but tokenizer {tokenizer_file} has "
                        f"{tokenizer.get_vocab_size()} tokens: they are not a pair; pass the model's own --tokenizer")
    numbers = ERAS[era]
    # Components, from the state dict
    ve_layers = sorted(int(k.split(".")[1]) for k in state if re.fullmatch(r"value_embeds\.\d+\.weight", k))
    gate_layers = sorted(int(k.split(".")[2]) for k in state if re.fullmatch(r"transformer\.h\.\d+\.attn\.ve_gate\.weight", k))
    if ve_layers != gate_layers:
        raise UserError(f"{model_path}: value embeddings on layers {ve_layers} but gates on {gate_layers}; value "
                        "embeddings without a gate (experiments of 16 January 2026) cannot be reproduced")
    residual = "resid_lambdas" in state or "x0_lambdas" in state
    smear, backout = "smear_gate.weight" in state or "smear_lambda" in state, "backout_lambda" in state
    if era == "2025-10" and (ve_layers or smear or backout):
        raise UserError(f"{model_path} has value embeddings or smear/backout parameters but its model_config has no "
                        "window_pattern: no era of karpathy/nanochat had both, so this model cannot be reproduced")
    fields = dict({name: mc[name] for name in KARPATHY_CONFIG_FIELDS}, residual_scalars=residual, smear=smear,
                  backout=backout, norm_eps=None,
                  **{name: numbers[name] for name in ("rope_theta", "rotary_bf16", "qk_scale", "logit_softcap")})
    if ve_layers:
        fields.update(value_embeds=True, value_embed_layers=",".join(map(str, ve_layers)),
                      ve_gate_channels=gate_channels(state, f"transformer.h.{ve_layers[0]}.attn.ve_gate.weight", model_path),
                      ve_gate_scale=numbers["ve_gate_scale"])
    if "smear_gate.weight" in state:
        fields["smear_gate_channels"] = gate_channels(state, "smear_gate.weight", model_path)
    if backout:
        fields["backout_layer"] = numbers["backout"](n_layer)
    if "window_pattern" in mc:
        fields["attention_windows"] = karpathy_windows(mc["window_pattern"], mc["sequence_len"], era, n_layer)
    config = make_config(fields, meta_path)
    files = {"model": model_path, "meta": meta_path, "tokenizer": tokenizer_file}
    description = {"format": KARPATHY_FORMAT, "era": era, "era_told": era_told, "step": step,
                   "summary": numbers["summary"]}
    return config, state, tokenizer, files, description


def check_shapes(fields, where):
    """A config's shape fields within GPTConfig's bounds, said before anything loops over n_layer or builds a model."""
    for name in KARPATHY_CONFIG_FIELDS:
        problem = shape_problem(name, fields[name])
        if problem:
            raise UserError(f"{where}: the model it describes cannot be built ({problem})")
    make_config({name: fields[name] for name in KARPATHY_CONFIG_FIELDS}, where)  # the shapes together: rotary tables


def as_float(value):
    """A config's number as a float; anything else as it is, for GPTConfig to refuse by the field's name."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except OverflowError:  # an integer past a float's range
        return float("inf")


def make_config(fields, where):
    try:
        config = GPTConfig(**fields)
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: the model it describes cannot be built ({e})") from None
    for rule in VALUE_EMBED_LAYERS:  # value embeddings placed by a rule of ours are named by it, not listed
        named = dataclasses.replace(config, value_embed_layers=rule)
        if config.value_embeds and all(has_value_embed(named, i) == has_value_embed(config, i) for i in range(config.n_layer)):
            return named
    return config


def hf_name_to_ours(name):
    """transformers' NanoChat parameter name -> ours (the inverse of hf_export.hf_weight_name), or None."""
    from nanochat.interop.hf_export import HF_BLOCK_LINEARS, HF_OUTSIDE_BLOCKS

    outside = {hf: ours for ours, hf in HF_OUTSIDE_BLOCKS.items()}
    m = re.fullmatch(r"model\.layers\.(\d+)\.(\w+\.\w+)\.weight", name)
    linear = {hf: ours for ours, hf in HF_BLOCK_LINEARS.items()}.get(m.group(2)) if m else None
    return outside.get(name) or (f"transformer.h.{m.group(1)}.{linear}.weight" if linear else None)


def safetensors_files(model_dir):
    """The weight files of a transformers directory: those its model.safetensors.index.json names (each a plain path
    inside model_dir: an index comes with the model), else every .safetensors file there."""
    from nanochat.data.hub import local_path_in

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index, "weights index").get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"weights index {index}: weight_map must be an object from parameter names to file names")
        paths = []
        for name in sorted(set(weight_map.values())):
            path = local_path_in(model_dir, name)
            if path is None:  # '..', absolute, a NUL, too long, or through a link that leads elsewhere
                raise UserError(f"refusing weights index {index}: it names {name[:100]!r}, not a plain file path "
                                f"inside {model_dir}; a model's weights are read from its own folder only")
            if not os.path.isfile(path):
                raise UserError(f"weights index {index} names {name}, which is not in {model_dir}")
            paths.append(path)
        return paths
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise UserError(f"no .safetensors weights in {model_dir}")
    return [os.path.join(model_dir, n) for n in names]


def read_transformers(model_dir):
    config_path = os.path.join(model_dir, "config.json")
    hf = read_json(config_path, "model config")
    model_type = hf.get("model_type")
    tokenizer_path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        raise UserError(f"{tokenizer_path} is missing: the model needs its tokenizer (save it with the model)")
    tokenizer = tokenizer_from_hf_json(tokenizer_path)
    weight_paths = safetensors_files(model_dir)
    state = load_safetensors_weights(weight_paths)
    try:
        n_embd, n_layer, n_head = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
        shape = dict(sequence_len=hf["max_position_embeddings"], vocab_size=tokenizer.get_vocab_size(), n_layer=n_layer,
                     n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=n_embd)
    except KeyError as e:
        raise UserError(f"{config_path} lacks {e.args[0]}") from None
    check_shapes(shape, config_path)
    if model_type == "nanochat":
        problems = []
        if hf.get("hidden_act", "relu2") != "relu2":
            problems.append(f"hidden_act {hf['hidden_act']!r} (only relu2)")
        if hf.get("intermediate_size", 4 * n_embd) != 4 * n_embd:
            problems.append(f"intermediate_size {hf['intermediate_size']} (only 4 x hidden_size)")
        if hf.get("attention_bias"):
            problems.append("attention_bias")
        rope = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
        if not isinstance(rope, dict):
            rope = {"rope_type": rope}  # refused just below, by what it is
        if rope.get("rope_type", "default") != "default":
            problems.append(f"rope_type {rope.get('rope_type')!r} (only default)")
        if problems:
            raise UserError(f"{config_path}: {'; '.join(problems)} cannot be reproduced by nanochat's model")
        if hf.get("tie_word_embeddings") and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        renamed = {}
        for name, tensor in state.items():
            ours = hf_name_to_ours(name)
            if ours is None:
                raise UserError(f"{weight_paths[0]}: parameter {name} has no place in nanochat's model")
            renamed[ours] = tensor
        state = renamed
        fields = dict(shape, rope_theta=as_float(rope.get("rope_theta", 10000.0)),
                      norm_eps=hf.get("rms_norm_eps", 1e-6), logit_softcap=hf.get("final_logit_softcapping", 15.0))
        fmt = TRANSFORMERS_FORMAT
    elif model_type == "nanochat_recipe":
        windows = hf.get("attention_windows") or [0] * n_layer  # GPTConfig checks what is in it
        ve_layers = hf.get("value_embed_layers") or []
        fields = dict(shape, **{name: bool(hf.get(name)) for name in COMPONENTS if name != "sliding_window"},
                      rope_theta=as_float(hf.get("rope_theta", 10000.0)),
                      rotary_bf16=bool(hf.get("rotary_bf16", False)), norm_eps=hf.get("rms_norm_eps", 1e-6),
                      qk_scale=as_float(hf.get("qk_scale", 1.0)), logit_softcap=hf.get("final_logit_softcapping", 15.0),
                      ve_gate_channels=hf.get("ve_gate_channels", hf.get("gate_channels", 32)),
                      ve_gate_scale=as_float(hf.get("ve_gate_scale", 2.0)),
                      smear_gate_channels=hf.get("smear_gate_channels", hf.get("gate_channels", 32)),
                      backout_layer=None if hf.get("backout_layer") in (None, n_layer // 2 - 1) else hf["backout_layer"],
                      attention_windows=windows if not isinstance(windows, list) or any(windows) else None)
        if ve_layers:
            fields["value_embed_layers"] = ",".join(map(str, ve_layers)) if isinstance(ve_layers, list) else ve_layers
        fmt = RECIPE_FORMAT
    else:
        raise UserError(f"{config_path}: model_type {model_type!r} is not nanochat's (nanochat or nanochat_recipe)")
    config = make_config(fields, config_path)
    files = {"config": config_path, "tokenizer": tokenizer_path, **{f"weights{i}": p for i, p in enumerate(weight_paths)}}
    description = {"format": fmt, "era": None, "step": 0, "summary": f"transformers model_type {model_type}"}
    return config, state, tokenizer, files, description


def detect_format(directory):
    """Which reader a local directory needs, from its files."""
    if not os.path.isdir(directory):
        raise UserError(f"{directory} is not a directory (give a checkpoint folder, or a hub repo as owner/name)")
    names = os.listdir(directory)
    if "config.json" in names:
        return TRANSFORMERS_FORMAT
    if any(MODEL_FILE_RE.match(n) for n in names):
        return KARPATHY_FORMAT
    raise UserError(f"{directory} holds neither model_XXXXXX.pt + meta_XXXXXX.json (karpathy/nanochat) nor "
                    "config.json + safetensors (transformers NanoChat)")


# -----------------------------------------------------------------------------
# Weights into our model


def to_our_state(state, expected, where):
    """Our model's state dict from the source's (names already ours): fp32, padding rows past the vocab dropped; the
    names and shapes checked against the model's (`expected`), and every value finite, before anything is written."""
    unknown, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
    if unknown or missing:
        raise UserError(f"{where}: the state dict does not fit the model its config describes"
                        + (f"; unknown parameters: {', '.join(unknown[:8])}" if unknown else "")
                        + (f"; missing parameters: {', '.join(missing[:8])}" if missing else ""))
    ours = {}
    for name, tensor in state.items():
        want = tuple(expected[name].shape)
        if tensor.ndim == 2 and (name in ("transformer.wte.weight", "lm_head.weight") or name.startswith("value_embeds.")):
            if tensor.shape[0] < want[0]:
                raise UserError(f"{where}: {name} has {tensor.shape[0]} rows for a vocab of {want[0]}")
            tensor = tensor[:want[0]]  # a vocab padded to a multiple of 64: its rows are never an input or an output
        if tuple(tensor.shape) != want:
            raise UserError(f"{where}: {name} has shape {tuple(tensor.shape)}, the model needs {want}")
        tensor = tensor.to(torch.float32).contiguous()
        # a NaN or inf weight loads and serves without a word (the probe's logits may never reach it): named here
        not_finite = count_not_finite(tensor)
        if not_finite:
            raise UserError(f"{where}: {name} holds {not_finite:,} NaN or infinite values; the weights are damaged "
                            "(a diverged run, or a broken copy): import a checkpoint from before, or copy it again")
        ours[name] = tensor
    return ours


# -----------------------------------------------------------------------------
# The import


def resolve_source(source, step):
    """(directory holding the source's files, hub repo@revision or None, root): the path itself, or a hub repo's
    files in the cache (root: the download's folder, which the tokenizer search does not leave)."""
    from nanochat.data.hub import fetch_model_files, model_cache_dir, parse_repo_id

    if os.path.exists(source) or source.startswith((".", "/", "~")):
        return os.path.abspath(os.path.expanduser(source)), None, None
    parsed = parse_repo_id(source)
    if parsed is None:
        raise UserError(f"{source} is neither a local directory nor a hub repo id (owner/name or owner/name@revision)")
    repo, revision = parsed

    def choose(listing):
        if "config.json" in listing:
            return sorted(n for n in listing if "/" not in n and (n.endswith(".safetensors") or n in (
                "config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json")))
        models = {n: MODEL_FILE_RE.match(posixpath.basename(n)) for n in listing}
        models = {n: int(m.group(1)) for n, m in models.items() if m}
        folders = sorted({posixpath.dirname(n) for n in models})
        if not models:
            raise UserError(f"hub repo {repo}@{revision} has neither config.json nor model_XXXXXX.pt files")
        if len(folders) > 1:
            raise UserError(f"hub repo {repo}@{revision} holds checkpoints in several folders ({', '.join(folders)}); "
                            "download the one you want and import its folder")
        folder = folders[0]
        steps = sorted(models.values())
        chosen = steps[-1] if step is None else step
        if chosen not in steps:
            raise UserError(f"hub repo {repo}@{revision} has no model_{chosen:06d}.pt; steps there: {steps}")
        model = posixpath.join(folder, f"model_{chosen:06d}.pt")
        meta = posixpath.join(folder, f"meta_{chosen:06d}.json")
        if meta not in listing:
            raise UserError(f"hub repo {repo}@{revision} has {model} but no {meta} beside it: the model's shape lives "
                            "there, and the import cannot go without it")
        tokenizers = [n for n in tokenizer_candidates(folder) if n in listing]  # the search a local folder gets
        return [model, meta] + tokenizers[:1]

    try:
        paths = fetch_model_files(repo, revision, choose)
    except UserError as e:
        raise UserError(f"{source} is no local directory, and as a hub repo: {e}") from None
    any_model = next((p for n, p in paths.items() if MODEL_FILE_RE.match(posixpath.basename(n)) or n == "config.json"), None)
    if any_model is None:
        raise UserError(f"the cached download of {repo}@{revision} holds no model files; delete "
                        f"{model_cache_dir(repo, revision)} to fetch it again")
    return os.path.dirname(any_model), f"{repo}@{revision}", model_cache_dir(repo, revision)


def default_tag(directory, repo):
    name = repo.split("@")[0].split("/")[-1] if repo else os.path.basename(os.path.normpath(directory))
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", name).lstrip(".") or "imported"
    return name if TAG_RE.fullmatch(name) else "imported"


def target_checkpoint(stage, model_tag, directory, repo):
    """(tag, checkpoint dir, a note or ''). Our base dir defaults to the reference's, so the default target may be a
    folder of karpathy/nanochat's files: the import then goes to TAG-imported beside it (an explicit --model-tag there
    is refused), leaving the reference's folder as it is."""
    tag = model_tag or default_tag(directory, repo)
    ckpt_dir = checkpoint_dir(stage, tag)
    theirs = os.path.isdir(ckpt_dir) and (os.path.realpath(ckpt_dir) == os.path.realpath(directory)
                                          or any(MODEL_FILE_RE.match(n) for n in os.listdir(ckpt_dir)))
    if not theirs:
        return tag, ckpt_dir, ""
    if model_tag:
        raise UserError(f"--model-tag {model_tag}: {ckpt_dir} is the source folder or holds karpathy/nanochat's own "
                        f"model_XXXXXX.pt files, which the import leaves alone; pick another --model-tag (the default "
                        f"is {tag}-imported)")
    return f"{tag}-imported", checkpoint_dir(stage, f"{tag}-imported"), f" ({stage}/{tag} is karpathy/nanochat's own folder)"


def base_dir_tokenizer(tokenizer):
    """The base dir's tokenizer, if it has one (it must be `tokenizer`), else None: ours is to be written, beside a
    karpathy/nanochat tokenizer.pkl there when it is the same tokenizer."""
    tokenizer_dir = os.path.join(get_base_dir(), "tokenizer")
    ours = [os.path.join(tokenizer_dir, name) for name in ("tokenizer.json", "tokenizer.tiktoken")]
    if not os.path.exists(tokenizer_dir):
        return None
    if not any(os.path.exists(p) for p in ours) and os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.pkl")):
        theirs = tokenizer_from_pickle(os.path.join(tokenizer_dir, "tokenizer.pkl"))
        if theirs.fingerprint() != tokenizer.fingerprint():
            raise UserError(f"the base dir's {tokenizer_dir} holds karpathy/nanochat's tokenizer.pkl of another "
                            "vocabulary than this model's, and every checkpoint there must share one: import into a "
                            "fresh NANOCHAT_BASE_DIR")
        return None
    try:
        existing = RustBPETokenizer.from_directory(tokenizer_dir)
    except UserError as e:
        raise UserError(f"the base dir's tokenizer {tokenizer_dir} is unreadable ({e}); import into a fresh "
                        "NANOCHAT_BASE_DIR") from None
    if existing.fingerprint() != tokenizer.fingerprint():
        raise UserError(f"the base dir already has a different tokenizer ({tokenizer_dir}), and every checkpoint there "
                        "must share it: import into a fresh NANOCHAT_BASE_DIR")
    return existing


def import_model(source, stage, model_tag=None, step=None, tokenizer_path=None, era=None):
    """Read `source`, check everything, then write the tokenizer (if the base dir has none) and the checkpoint.
    Returns the checkpoint directory."""
    t0 = time.time()
    if stage not in STAGE_DIRS:
        raise UserError(f"--as must be one of {', '.join(STAGE_DIRS)} (got {stage!r})")
    if era is not None and era not in ERAS:
        raise UserError(f"--era must be one of {', '.join(ERAS)} (got {era!r})")
    directory, repo, root = resolve_source(source, step)
    if detect_format(directory) == KARPATHY_FORMAT:
        config, state, tokenizer, files, description = read_karpathy(directory, step, tokenizer_path, era, root)
    else:
        if era is not None or tokenizer_path is not None or step is not None:
            raise UserError("--era, --tokenizer and --step apply to karpathy/nanochat checkpoints, not to a transformers "
                            "directory (its tokenizer.json is read)")
        config, state, tokenizer, files, description = read_transformers(directory)
    with torch.device("meta"):
        model = GPT(config)
    state = to_our_state(state, model.state_dict(), directory)
    model_tag, ckpt_dir, note = target_checkpoint(stage, model_tag, directory, repo)
    print0(f"import_model | {repo or directory} | {description['format']}"
           + (f", era {description['era']} ({description['era_told']}): {description['summary']}"
              if description["era"] else "")
           + f" | -> {stage}/{model_tag}{note}")
    hashes = {os.path.basename(path): sha256_of(path) for path in files.values()}

    # Nothing of the target base dir is overwritten: an existing checkpoint is this same import (a no-op) or a refusal.
    steps = list_steps(ckpt_dir)
    if steps:
        previous = load_meta(ckpt_dir, steps[-1]).get("imported_from", {})
        if previous.get("sha256") == hashes and previous.get("format") == description["format"]:
            print0(f"already imported: {ckpt_dir} step {steps[-1]} holds these same files; nothing to do")
            return ckpt_dir
        raise UserError(f"{ckpt_dir} already holds checkpoints (steps {steps[0]}..{steps[-1]}); import with another "
                        "--model-tag, or into a fresh NANOCHAT_BASE_DIR")
    existing = base_dir_tokenizer(tokenizer)

    model.load_state_dict(state, strict=True, assign=True)  # the tensors themselves, not copies
    model.init_rotary()
    model.eval()
    with torch.no_grad():  # a last look before writing: a forward pass that gives finite logits
        logits = model(torch.tensor([[tokenizer.get_bos_token_id()] + tokenizer.encode("Hello, world!")]))
    if not torch.isfinite(logits).all():
        raise UserError(f"{directory}: the imported model's logits are not finite; its weights are damaged")
    if existing is None:
        tokenizer_dir = os.path.join(get_base_dir(), "tokenizer")
        tokenizer.save(tokenizer_dir)
        print0(f"tokenizer: {tokenizer.get_vocab_size():,} tokens -> {tokenizer_dir}")
    from nanochat.recipe import config_dict

    model_config = config_dict(config)
    meta = {"model_config": model_config, "user_config": {}, "tokenizer_hash": tokenizer.fingerprint(),
            "imported_from": {"source": repo or directory, "format": description["format"], "era": description["era"],
                              "sha256": hashes}}
    save_checkpoint(ckpt_dir, description["step"], model, [], meta)
    variants = {k: v for k, v in model_config.items() if k not in KARPATHY_CONFIG_FIELDS}
    print0(f"imported {model.num_params():,} parameters, {config.n_layer} layers, width {config.n_embd}, context "
           f"{config.sequence_len}, vocab {config.vocab_size:,}" + (f" | {json.dumps(variants)}" if variants else "")
           + f" | {time.time() - t0:.1f}s -> {ckpt_dir}")
    return ckpt_dir
