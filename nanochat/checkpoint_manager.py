"""
Checkpoints: save, rotate, resume and load models for every stage. A checkpoint is a directory
`<base_dir>/<stage>_checkpoints/<tag>/step_XXXXXX/`: model.safetensors (rank 0's weights), optim_rank{R}.safetensors
and .json (each rank's optimizer state: tensors, and the rest), meta.json (step, model config, flags, dataloader and
loop state, metrics, tokenizer fingerprint, the sha256 of every other file). It is written in a temp directory renamed
into place when complete, so a kill at any instant leaves the previous checkpoint loadable; nothing is unpickled.
"""

import json
import os
import re
import shutil
import socket
import time

import torch
import torch.distributed as dist
from filelock import FileLock, Timeout
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nanochat.common import (UserError, dist_rank_world, ensure_writable, get_base_dir, get_dist_info, json_load_file,
                             print0, sha256_of)
from nanochat.gpt import OPTIONAL_FIELDS, config_from_dict

STAGE_DIRS = {"base": "base_checkpoints", "mid": "mid_checkpoints", "sft": "chatsft_checkpoints", "rl": "chatrl_checkpoints"}
STEP_DIR_RE = re.compile(r"^step_(\d{6,})$")
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MODEL_CONFIG_FIELDS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
_warned_about = set()  # step dirs already reported as unusable: a listing warns once per dir


def checkpoints_root(stage):
    if stage not in STAGE_DIRS:
        raise UserError(f"unknown checkpoint stage {stage!r}; expected one of {sorted(STAGE_DIRS)}")
    return os.path.join(get_base_dir(), STAGE_DIRS[stage])


def checkpoint_dir(stage, tag):
    if not isinstance(tag, str) or not TAG_RE.fullmatch(tag):  # fullmatch: '$' alone lets 'd4\n' through
        raise UserError(f"model tag {tag!r} must be a plain name: letters, digits, '_', '-' or '.', not starting with "
                        "'.' (no slashes, no '..')")
    return os.path.join(checkpoints_root(stage), tag)


_claims = []  # the checkpoint directories' locks this process holds: referenced, so none is released before it ends


def claim_checkpoint_dir(ckpt_dir):
    """Take an exclusive lock on a checkpoint directory for the rest of this process (rank 0, for the run): two runs
    writing one model tag would overwrite each other's saves. filelock's lock: an flock on POSIX, a LockFileEx on
    Windows, both dropped by the kernel when their holder dies; where neither exists, a file naming its holder, which
    the next claim removes once no process of that pid lives on this host. The holder's identity goes into a file
    beside the lock (Windows forbids reading a locked byte) so that the refusal can name it."""
    if get_dist_info()[1] != 0:
        return
    ensure_writable(ckpt_dir, "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    lock, holder_path = FileLock(os.path.join(ckpt_dir, ".lock"), timeout=0), os.path.join(ckpt_dir, ".holder")
    try:
        lock.acquire()
    except Timeout:
        try:
            with open(holder_path, errors="replace") as f:
                holder = f.read().strip()
        except OSError:  # not written yet: the holder took the lock an instant ago
            holder = ""
        raise UserError(f"{ckpt_dir} is in use by another run ({holder or 'another process'}); wait for it to finish "
                        "or stop it, or write to another --model-tag") from None
    _claims.append(lock)
    with open(holder_path, "w") as f:
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")


def refuse_to_overwrite(ckpt_dir, other_dir="write to another --model-tag"):
    """A fresh run (no --resume) must not mix its checkpoints with an earlier run's under the same tag: the earlier
    run's later steps would pass for this run's latest."""
    steps = list_steps(ckpt_dir)
    if steps:
        raise UserError(f"{ckpt_dir} already holds checkpoints of an earlier run (steps {steps[0]}..{steps[-1]}); continue "
                        f"it with --resume, or delete that directory, or {other_dir}")


def refuse_later_checkpoints(ckpt_dir, step):
    """A run resumed from an older step would write its steps over the later checkpoints', and pruning (which keeps the
    highest steps) would then keep theirs over its own: refused, before any compute."""
    later = [s for s in list_steps(ckpt_dir) if s > step]
    if later:
        raise UserError(f"{ckpt_dir} holds checkpoints after step {step} (steps {later[0]}..{later[-1]}): a run resumed "
                        f"from step {step} would overwrite them, and pruning would keep theirs over its own. To go on from "
                        f"step {step}, copy step_{step:06d} into another --model-tag's directory and resume there, or "
                        "delete the later step directories")


def validate_meta(meta):
    """The reason a checkpoint's meta.json cannot be trusted, or None if it has everything loading relies on."""
    if not isinstance(meta, dict):
        return "meta.json is not a JSON object"
    if not isinstance(meta.get("step"), int) or meta["step"] < 0:
        return "no integer 'step'"
    config = meta.get("model_config")
    if not isinstance(config, dict) or not set(MODEL_CONFIG_FIELDS) <= set(config) <= set(MODEL_CONFIG_FIELDS + OPTIONAL_FIELDS):
        return (f"'model_config' must have the fields {', '.join(MODEL_CONFIG_FIELDS)} and may name components "
                f"{', '.join(OPTIONAL_FIELDS)}")
    if not all(isinstance(config[k], int) and not isinstance(config[k], bool) and config[k] > 0 for k in MODEL_CONFIG_FIELDS):
        return "'model_config' shape values must be positive integers"
    try:
        config_from_dict(config)  # every field's type and range, as building the model would check them
    except (TypeError, ValueError) as e:
        return f"'model_config' is not a model this code can build ({e})"
    files = meta.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return "no 'files' list with the sha256 of model.safetensors (every file is verified against it on load)"
    if not all(isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h) for h in files.values()):
        return "'files' holds something other than sha256 hex digests"
    if not isinstance(meta.get("world_size", 1), int) or meta.get("world_size", 1) < 1:
        return "'world_size' must be a positive integer"
    return None


def scan_steps(ckpt_dir):
    """(steps of the usable checkpoints in ckpt_dir ascending, {step dir: why it is not usable}). Temp dirs of
    interrupted saves are ignored; a step dir with a missing, unreadable or invalid meta.json is named in a warning
    (once) and skipped, and its reason kept: when nothing is usable, the refusal says why rather than "train first"."""
    if not os.path.isdir(ckpt_dir):
        return [], {}
    steps, unusable = [], {}
    for name in sorted(os.listdir(ckpt_dir)):
        m = STEP_DIR_RE.match(name)
        if not m:
            continue
        step_dir = os.path.join(ckpt_dir, name)
        try:
            reason = validate_meta(json_load_file(os.path.join(step_dir, "meta.json")))
        except FileNotFoundError:
            reason = "it has no meta.json (a save from before atomic saves, or files deleted by hand)"
        except (OSError, ValueError) as e:
            reason = f"its meta.json is unreadable ({e})"
        if reason is None:
            steps.append(int(m.group(1)))
            continue
        unusable[step_dir] = reason
        if step_dir not in _warned_about:
            _warned_about.add(step_dir)
            print0(f"warning: skipping checkpoint {step_dir}: {reason}; delete it or restore its files")
    return sorted(steps), unusable


def list_steps(ckpt_dir):
    """Steps of the usable checkpoints in ckpt_dir, ascending (scan_steps)."""
    return scan_steps(ckpt_dir)[0]


def unusable_note(unusable):
    """What a refusal for want of a checkpoint adds when step dirs were skipped: the first one and its reason."""
    if not unusable:
        return ""
    step_dir, reason = next(iter(unusable.items()))
    more = f" (and {len(unusable) - 1} more)" if len(unusable) > 1 else ""
    return f": {step_dir}{more} is skipped because {reason}; delete it or restore its files, or"


# -----------------------------------------------------------------------------
# Optimizer state <-> (tensors, json) without pickle


def _flatten_optimizer_state(optimizers):
    tensors, rest = {}, []
    for i, opt in enumerate(optimizers):
        sd = opt.state_dict()
        state_json = {}
        for pid, pstate in sd["state"].items():
            entry = {}
            for name, value in pstate.items():
                if torch.is_tensor(value):
                    tensors[f"{i}/{pid}/{name}"] = value.detach().contiguous().cpu()
                else:
                    entry[name] = value
            state_json[str(pid)] = entry
        rest.append({"state": state_json, "param_groups": sd["param_groups"]})
    return tensors, rest


def _unflatten_optimizer_state(tensors, rest):
    state_dicts = []
    for i, entry in enumerate(rest):
        state = {int(pid): dict(values) for pid, values in entry["state"].items()}
        for key, value in tensors.items():
            opt_i, pid, name = key.split("/", 2)
            if int(opt_i) == i:
                state.setdefault(int(pid), {})[name] = value
        state_dicts.append({"state": state, "param_groups": entry["param_groups"]})
    return state_dicts


# -----------------------------------------------------------------------------
# Saving


def save_checkpoint(ckpt_dir, step, model, optimizers, meta, keep_last=2):
    """Collective: every rank calls it. Rank 0 writes weights and meta, every rank writes its optimizer shard, then
    rank 0 renames the finished temp dir into place and prunes all but the newest `keep_last`."""
    rank, world_size = dist_rank_world()
    final_dir = os.path.join(ckpt_dir, f"step_{step:06d}")
    tmp_dir = os.path.join(ckpt_dir, f".tmp_step_{step:06d}")
    barrier = dist.barrier if world_size > 1 else (lambda: None)
    t0 = time.time()
    try:
        if rank == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
            shutil.rmtree(tmp_dir, ignore_errors=True)  # leftovers of a save that was killed
            os.makedirs(tmp_dir)
        barrier()
        if optimizers:
            tensors, rest = _flatten_optimizer_state(optimizers)
            save_file(tensors, os.path.join(tmp_dir, f"optim_rank{rank}.safetensors"))
            with open(os.path.join(tmp_dir, f"optim_rank{rank}.json"), "w") as f:
                json.dump(rest, f)
        barrier()
        if rank == 0:
            state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
            save_file(state, os.path.join(tmp_dir, "model.safetensors"))
            meta = dict(meta, step=step, world_size=world_size, saved_at=time.strftime("%Y-%m-%d %H:%M:%S"))
            meta["files"] = {name: sha256_of(os.path.join(tmp_dir, name)) for name in sorted(os.listdir(tmp_dir))}
            with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2)
            for name in os.listdir(tmp_dir):  # make the bytes durable before the rename makes them visible
                with open(os.path.join(tmp_dir, name), "rb") as f:
                    os.fsync(f.fileno())
            if os.path.exists(final_dir):  # re-saving the same step (e.g. after a resume): swap it out
                shutil.rmtree(final_dir)
            os.replace(tmp_dir, final_dir)
            for old in list_steps(ckpt_dir)[:-keep_last] if keep_last and keep_last > 0 else []:  # the newest stays
                shutil.rmtree(os.path.join(ckpt_dir, f"step_{old:06d}"), ignore_errors=True)
        barrier()
        print0(f"saved checkpoint step {step} to {final_dir} ({time.time() - t0:.1f}s)")
    except (OSError, SafetensorError) as e:  # a full disk, a quota, a lost mount: the previous checkpoint survives
        if rank == 0:  # rank 0 owns the temp dir: another rank removing it would break rank 0's half of the save
            shutil.rmtree(tmp_dir, ignore_errors=True)
        previous = [s for s in list_steps(ckpt_dir) if s != step]
        kept = f"the previous checkpoint (step {previous[-1]}) is intact" if previous else "there is no earlier checkpoint"
        reason = getattr(e, "strerror", None) or str(e)
        raise UserError(f"could not write checkpoint step {step} to {ckpt_dir} ({reason}); {kept}. "
                        "Free some space, then --resume") from None
    return final_dir


# -----------------------------------------------------------------------------
# Loading


def resolve_step(ckpt_dir, step=None, fix="train one first, or drop --resume"):
    steps, unusable = scan_steps(ckpt_dir)
    if not steps:
        raise UserError(f"no checkpoint found in {ckpt_dir}{unusable_note(unusable) or ';'} {fix}")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise UserError(f"no checkpoint for step {step} in {ckpt_dir}; available steps: {steps}")
    return step


def load_meta(ckpt_dir, step):
    path = os.path.join(ckpt_dir, f"step_{step:06d}", "meta.json")
    try:
        meta = json_load_file(path)
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint metadata {path} is unreadable ({e}); delete that step directory and use an older one") from e
    reason = validate_meta(meta)
    if reason:
        raise UserError(f"checkpoint metadata {path} is not valid ({reason}); delete that step directory and use an older one")
    return meta


def _verified_path(step_dir, name, meta):
    path = os.path.join(step_dir, name)
    if not os.path.isfile(path):
        raise UserError(f"checkpoint file {path} is missing; delete {step_dir} and resume from an older step")
    expected = meta["files"].get(name)
    if expected is None:
        raise UserError(f"checkpoint file {path} is not listed in {step_dir}/meta.json, so it cannot be verified; "
                        "delete that step directory and use an older one")
    if sha256_of(path) != expected:
        raise UserError(f"checkpoint file {path} is corrupt (sha256 mismatch); delete {step_dir} and resume from an older step")
    return path


def load_checkpoint(ckpt_dir, step, device, rank=0, load_optimizer=True):
    """Returns (model_state, optimizer_state_dicts or None, meta), every file verified against meta's hashes."""
    meta = load_meta(ckpt_dir, step)
    step_dir = os.path.join(ckpt_dir, f"step_{step:06d}")
    try:
        model_state = load_file(_verified_path(step_dir, "model.safetensors", meta), device=str(device))
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot read {step_dir}/model.safetensors ({e}); delete {step_dir} and use an older step") from e
    if not load_optimizer:
        return model_state, None, meta
    if meta.get("imported_from"):
        raise UserError(f"{step_dir} was imported from {meta['imported_from'].get('source')}: it has no optimizer state "
                        "or data position to resume; train a chat stage from it instead (-i this stage, and --out-tag when "
                        "that stage is its own), which starts its own")
    tensors_path = _verified_path(step_dir, f"optim_rank{rank}.safetensors", meta)
    json_path = _verified_path(step_dir, f"optim_rank{rank}.json", meta)
    try:
        rest = json_load_file(json_path)
    except (OSError, ValueError) as e:  # its hash matched: written so, not damaged since
        raise UserError(f"checkpoint file {json_path} is unreadable ({e}); delete {step_dir} and resume from an older "
                        "step") from None
    return model_state, _unflatten_optimizer_state(load_file(tensors_path, device=str(device)), rest), meta


def check_compatible(meta, model_config, tokenizer_hash, ckpt_dir):
    """A checkpoint of another shape or tokenizer cannot be resumed: say so before any compute (the tokenizer first:
    another vocabulary also shows as another shape)."""
    _check_tokenizer(ckpt_dir, meta, tokenizer_hash, "train from scratch with another --model-tag")
    saved = meta.get("model_config", {})
    if saved != model_config:
        diff = {k: (saved.get(k), model_config.get(k)) for k in set(saved) | set(model_config) if saved.get(k) != model_config.get(k)}
        raise UserError(f"checkpoint in {ckpt_dir} is for a different model (saved vs requested: {diff}); "
                        "use the same --depth/--max-seq-len/--components, or another --model-tag")


def _check_tokenizer(ckpt_dir, meta, current_hash, alternative):
    """Refuse a checkpoint trained with another tokenizer than the base dir's, saying what to do: naming the copy
    tok_train kept of it when it replaced it, and where the current one goes first (so swapping back loses neither)."""
    saved_hash = meta.get("tokenizer_hash")
    if not saved_hash or not current_hash or saved_hash == current_hash:
        return
    from nanochat.tokenizer import get_tokenizer_dir, set_aside_dir

    aside, current_aside = set_aside_dir(saved_hash), set_aside_dir(current_hash)
    keep_current = f"copy the current one's files to {current_aside} (checkpoints trained with it need them)"
    if os.path.isdir(aside):
        fix = f"tok_train kept that one in {aside}: {keep_current}, then copy {aside}'s files into {get_tokenizer_dir()}"
    else:
        fix = f"{keep_current}, then put that tokenizer's files in {get_tokenizer_dir()}"
    raise UserError(f"checkpoint {ckpt_dir} was trained with another tokenizer than the one in {get_tokenizer_dir()}; "
                    f"to use it, {fix}; or {alternative}")


def find_latest_tag(stage):
    root = checkpoints_root(stage)
    tags, unusable = [], {}
    for tag in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        steps, skipped = scan_steps(os.path.join(root, tag))
        tags += [tag] if steps else []
        unusable.update(skipped)
    if not tags:
        raise UserError(f"no {'usable ' if unusable else ''}{stage} checkpoints under {root}"
                        f"{unusable_note(unusable) or ';'} train that stage first")
    return max(tags, key=lambda t: os.path.getmtime(os.path.join(root, t)))


def load_model(source, device, phase="eval", model_tag=None, step=None):
    """Build a trained model for inference or further training: returns (model, tokenizer, meta). `source` is the
    checkpoint's stage (base, mid, sft, rl): karpathy/nanochat's name for this argument, and the stage scripts' -i."""
    model_tag = model_tag or find_latest_tag(source)
    model, tokenizer, meta = load_model_from_dir(checkpoint_dir(source, model_tag), device, phase, step)
    meta["model_tag"] = model_tag
    return model, tokenizer, meta


def check_weights_fit(model_state, model_config, where):
    """The checkpoint's tensors must be the parameters its model_config describes, name for name and shape for shape,
    compared on the meta device: a meta.json that claims a far larger model is refused before allocating it."""
    from nanochat.gpt import GPT

    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in GPT(config_from_dict(model_config)).state_dict().items()}
    found = {name: tuple(t.shape) for name, t in model_state.items()}
    if found == expected:
        return
    unknown, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
    wrong = [f"{name} {found[name]} (its config needs {expected[name]})" for name in sorted(set(found) & set(expected))
             if found[name] != expected[name]]
    raise UserError(f"{where} does not fit the model its meta.json describes"
                    + (f"; unknown parameters: {', '.join(unknown[:4])}" if unknown else "")
                    + (f"; missing parameters: {', '.join(missing[:4])}" if missing else "")
                    + (f"; shapes: {', '.join(wrong[:4])}" if wrong else "")
                    + "; delete that step directory and use an older one")


def count_not_finite(tensor, chunk=1 << 24):
    """The NaN and infinite values in a tensor, counted a slice at a time: isfinite's mask takes a byte per value."""
    if not tensor.is_floating_point():
        return 0
    return sum(int(piece.numel() - torch.isfinite(piece).sum()) for piece in tensor.reshape(-1).split(chunk))


def check_weights_finite(model_state, where, fix):
    """Every weight a number: a NaN or inf one loads and serves without a word (the text may never reach it)."""
    for name, tensor in model_state.items():
        bad = count_not_finite(tensor)
        if bad:
            raise UserError(f"{where}: {name} holds {bad:,} NaN or infinite values; the weights are damaged (a run "
                            f"that diverged, or a broken copy): {fix}")


def load_model_from_dir(ckpt_dir, device, phase="eval", step=None, fix="train that stage first, or check -i / -g"):
    """load_model for a checkpoint directory named by its path (a stage resuming its own checkpoints)."""
    from nanochat.gpt import build_model
    from nanochat.tokenizer import get_tokenizer

    device = torch.device(device)
    step = resolve_step(ckpt_dir, step, fix=fix)
    model_state, _, meta = load_checkpoint(ckpt_dir, step, device, load_optimizer=False)
    check_weights_fit(model_state, meta["model_config"], f"checkpoint {ckpt_dir} step {step}")
    check_weights_finite(model_state, f"checkpoint {ckpt_dir} step {step}",
                         "delete that step directory and use an older one")
    model = build_model(meta["model_config"], device)
    model.load_state_dict(model_state, strict=True)
    model.train(phase == "train")
    tokenizer = get_tokenizer()
    _check_tokenizer(ckpt_dir, meta, tokenizer.fingerprint(), "use a checkpoint trained with the current one")
    return model, tokenizer, meta
