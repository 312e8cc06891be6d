"""
The DCLM CORE metric (https://arxiv.org/abs/2406.11794): a base model's in-context-learning accuracy on a bundle of
tasks, each centred against its random baseline, averaged. An example is one forward pass: multiple_choice picks the
continuation of lowest mean loss, schema the context that makes the shared continuation least surprising, and
language_modeling is right only if greedy decoding reproduces the continuation. A bundle is core.yaml (the tasks),
eval_meta_data.csv (baselines in percent) and eval_data/**.jsonl; resolve_eval_bundle picks one.
"""

import csv
import json
import os
import random
import re
import shutil
import tempfile
import time
import zipfile
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from filelock import FileLock
from tqdm import tqdm

from nanochat.common import UserError, dist_rank_world, get_base_dir, json_loads, print0
from nanochat.download import DownloadError, download_file

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
# sha256 of the published zip as recorded in a public download manifest (2026-06); not re-derived here, since
# this project's machines cannot reach S3. A mismatch means upstream changed the file: check, then set
# NANOCHAT_EVAL_BUNDLE_SHA256 to the new value (or to "none" to skip the check).
EVAL_BUNDLE_SHA256 = "90a7c19e28ee7a52b4f6e1f87658deb9fde7f63deba2379045bdb1fe9ea5d200"
EVAL_BUNDLE_MAX_BYTES = 2 * 2**30  # the published zip is a few hundred MB; anything this big is not it
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")

# Fixed seeds so every run (and every rank) sees the same task order and the same few-shot examples.
TASK_SHUFFLE_SEED = 2406
FEWSHOT_SEED = 11794

# -----------------------------------------------------------------------------
# The eval bundle: download, verify, extract, cache


BUILTIN_BUNDLE_NAME = "eval_bundle_builtin"


def builtin_eval_bundle_dir():
    """Where `python -m nanochat.corpus` writes the CORE bundle about its built-in world."""
    return os.path.join(get_base_dir(), BUILTIN_BUNDLE_NAME)


def eval_bundle_sha256(url):
    """The sha256 the downloaded zip must have: $NANOCHAT_EVAL_BUNDLE_SHA256 ("none" skips), else the pinned one
    for the published URL; a mirror without a given hash is checked only for size and zip integrity."""
    value = os.environ.get("NANOCHAT_EVAL_BUNDLE_SHA256", "").strip().lower()
    if value == "none":
        return None
    if value:
        if not re.fullmatch(r"[0-9a-f]{64}", value):
            raise UserError(f"NANOCHAT_EVAL_BUNDLE_SHA256={value!r} is not a sha256 hex digest (or 'none')")
        return value
    return EVAL_BUNDLE_SHA256 if url == EVAL_BUNDLE_URL else None


def _extract(url, zip_path, extract_dir):
    """Check the zip end to end (CRC of every member), unpack it, return the folder holding core.yaml."""
    not_a_bundle = f"the file downloaded from {url} is not a valid eval bundle zip"
    if not zipfile.is_zipfile(zip_path):
        raise UserError(f"{not_a_bundle} (not a zip archive); check NANOCHAT_EVAL_BUNDLE_URL or run again")
    try:
        with zipfile.ZipFile(zip_path) as zf:
            broken = zf.testzip()
            if broken is not None:
                raise UserError(f"{not_a_bundle} (member {broken!r} is corrupt); run again to re-download")
            zf.extractall(extract_dir)  # zipfile drops absolute paths and '..' so nothing lands outside
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as e:
        raise UserError(f"{not_a_bundle} ({e}); run again to re-download") from e
    # The published zip holds a top-level eval_bundle/ folder; accept a zip of its contents too.
    for root in (os.path.join(extract_dir, "eval_bundle"), extract_dir):
        if os.path.isfile(os.path.join(root, "core.yaml")):
            return root
    raise UserError(f"{not_a_bundle} (no core.yaml in it, expected eval_bundle/core.yaml)")


def ensure_eval_bundle():
    """Return <base_dir>/eval_bundle, downloading and unpacking it first if it is not there yet."""
    base_dir = get_base_dir()
    bundle_dir = os.path.join(base_dir, "eval_bundle")
    if os.path.isfile(os.path.join(bundle_dir, "core.yaml")):
        return bundle_dir
    # Under torchrun every rank gets here; the lock lets one download while the others wait.
    with FileLock(os.path.join(base_dir, "eval_bundle.lock")):
        if os.path.isfile(os.path.join(bundle_dir, "core.yaml")):
            return bundle_dir
        if os.path.exists(bundle_dir):
            raise UserError(f"{bundle_dir} exists but has no core.yaml; move it away and run again to re-download")
        url = os.environ.get("NANOCHAT_EVAL_BUNDLE_URL") or EVAL_BUNDLE_URL
        print0(f"Downloading the CORE eval bundle from {url}")
        fd, zip_path = tempfile.mkstemp(prefix="eval_bundle.", suffix=".zip.tmp", dir=base_dir)
        os.close(fd)
        extract_dir = tempfile.mkdtemp(prefix="eval_bundle.", suffix=".tmp", dir=base_dir)
        try:
            bar = tqdm(total=None, unit="B", unit_scale=True, desc="eval_bundle.zip")
            try:
                download_file(url, zip_path, max_attempts=3, on_bytes=bar.update, expected_sha256=eval_bundle_sha256(url),
                              max_bytes=EVAL_BUNDLE_MAX_BYTES)
            except DownloadError as e:
                raise UserError(f"could not download the CORE eval bundle: {e} "
                                "(check the network, or point NANOCHAT_EVAL_BUNDLE_URL at a mirror)") from e
            finally:
                bar.close()
            root = _extract(url, zip_path, extract_dir)
            os.rename(root, bundle_dir)  # same filesystem, so readers see all of it or none of it
        finally:
            os.remove(zip_path)
            shutil.rmtree(extract_dir, ignore_errors=True)
    print0(f"CORE eval bundle ready at {bundle_dir}")
    return bundle_dir


def resolve_eval_bundle(name_or_path="dclm", all_ranks=False):
    """
    The folder of the --eval-bundle a user named: "dclm" (downloaded on first use), "builtin" (the built-in world's,
    written by `python -m nanochat.corpus`) or a folder holding core.yaml. all_ranks: rank 0 downloads, others wait.
    """
    if all_ranks and dist_rank_world()[1] > 1:
        if dist_rank_world()[0] == 0:
            resolve_eval_bundle(name_or_path)
        dist.barrier()
    if name_or_path == "dclm":
        return ensure_eval_bundle()
    if name_or_path == "builtin":
        bundle_dir = builtin_eval_bundle_dir()
        if not os.path.isfile(os.path.join(bundle_dir, "core.yaml")):
            raise UserError(f"no built-in CORE eval bundle at {bundle_dir}; write it with `python -m nanochat.corpus`")
        return bundle_dir
    bundle_dir = os.path.expanduser(name_or_path or "")
    if not bundle_dir or not os.path.isfile(os.path.join(bundle_dir, "core.yaml")):
        raise UserError(f"--eval-bundle={name_or_path!r} must be 'dclm', 'builtin' or a folder holding core.yaml")
    return bundle_dir


# -----------------------------------------------------------------------------
# Reading the bundle


def load_core_tasks(bundle_dir):
    """The tasks of core.yaml, each with its data path and random baseline (a fraction) attached."""
    config_path = os.path.join(bundle_dir, "core.yaml")
    meta_path = os.path.join(bundle_dir, "eval_meta_data.csv")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        with open(meta_path, encoding="utf-8", newline="") as f:
            baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}
    except (OSError, yaml.YAMLError, KeyError, ValueError) as e:
        raise UserError(f"broken CORE eval bundle in {bundle_dir} ({e}); delete it to re-download") from e
    if not isinstance(config, dict) or not isinstance(config.get("icl_tasks"), list):
        raise UserError(f"{config_path} has no icl_tasks list; delete {bundle_dir} to re-download")
    tasks = []
    for entry in config["icl_tasks"]:
        label = entry.get("label")
        task_type = entry.get("icl_task_type")
        if task_type not in TASK_TYPES:
            raise UserError(f"{config_path}: task {label!r} has icl_task_type {task_type!r}, expected one of {TASK_TYPES}")
        if label not in baselines:
            raise UserError(f"{meta_path} has no 'Random baseline' for task {label!r}")
        if not 0 <= baselines[label] < 100:
            raise UserError(f"{meta_path}: random baseline of {label!r} must be a percentage in [0, 100)")
        if not entry.get("dataset_uri"):
            raise UserError(f"{config_path}: task {label!r} has no dataset_uri")
        num_fewshot = entry.get("num_fewshot", 0)
        if isinstance(num_fewshot, list):  # llm-foundry lets a task list several shot counts; CORE uses the first
            num_fewshot = num_fewshot[0]
        # dataset_uri is relative to eval_data/ in the published bundle; also accept it relative to the bundle.
        data_path = os.path.join(bundle_dir, "eval_data", entry["dataset_uri"])
        if not os.path.isfile(data_path):
            data_path = os.path.join(bundle_dir, entry["dataset_uri"])
        root = os.path.realpath(bundle_dir)
        if os.path.commonpath([root, os.path.realpath(data_path)]) != root:
            raise UserError(f"{config_path}: task {label!r} has dataset_uri {entry['dataset_uri']!r}, which points outside "
                            f"the bundle folder {bundle_dir}; a bundle may only read its own files")
        tasks.append(dict(label=label, task_type=task_type, num_fewshot=int(num_fewshot),
                          continuation_delimiter=entry.get("continuation_delimiter", " "), data_path=data_path,
                          random_baseline=baselines[label] / 100))
    return tasks


def load_task_data(path):
    """One example per non-empty jsonl line."""
    data = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if line.strip():
                    data.append(json_loads(line))
    except OSError as e:
        raise UserError(f"cannot read CORE task data {path} ({e}); delete the eval bundle to re-download") from e
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{line_number} is not valid JSON ({e.msg})") from e
    if not data:
        raise UserError(f"CORE task data {path} has no examples")
    return data


# -----------------------------------------------------------------------------
# Rendering an example into prompts, and prompts into scored token spans


def sample_fewshot(data, idx, num_fewshot):
    """num_fewshot other examples, the same ones every time this example is scored."""
    k = min(num_fewshot, len(data) - 1)
    if k <= 0:
        return []
    picks = random.Random(FEWSHOT_SEED + idx).sample(range(len(data) - 1), k)
    return [data[i + 1 if i >= idx else i] for i in picks]  # indices skip over the example itself


def render_prompts(task_type, item, delimiter, shots):
    """The text of each candidate: the solved few-shot examples, each followed by a blank line, then the item
    (language_modeling: [context only, context + continuation])."""
    if task_type == "multiple_choice":
        prefix = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{prefix}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        prefix = "".join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n" for s in shots)
        return [f"{prefix}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]
    if task_type == "language_modeling":
        prefix = "".join(f"{s['context'].strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
        context = f"{prefix}{item['context'].strip()}{delimiter}"
        # A trailing space would be a lone token here, while in the full text it merges into the
        # continuation's first token; dropping it keeps the context a token prefix of the full text.
        return [context.rstrip(), context + item["continuation"]]
    raise ValueError(f"unknown CORE task type {task_type!r}")


def _common_prefix_len(rows):
    """How many leading tokens every row shares."""
    return next((i for i, column in enumerate(zip(*rows)) if len(set(column)) > 1), min(map(len, rows)))


def tokenize_prompts(tokenizer, task_type, prompts):
    """Token rows (each starting with BOS) and each row's span [start, end) to score: at least one token, never BOS."""
    rows = tokenizer.encode(prompts, prepend=tokenizer.get_bos_token_id())
    shortest = min(len(row) for row in rows)
    if shortest < 2:
        raise UserError(f"a CORE example renders to no text at all: {prompts!r}")
    if task_type == "multiple_choice":
        # The choices differ only at the end: score from where they first diverge.
        start = min(_common_prefix_len(rows), shortest - 1)
        return rows, [(start, len(row)) for row in rows]
    if task_type == "schema":
        # The contexts differ, the continuation is shared: score the common tail.
        suffix = max(1, min(_common_prefix_len([row[::-1] for row in rows]), shortest - 1))
        return rows, [(len(row) - suffix, len(row)) for row in rows]
    if task_type == "language_modeling":
        context_row, full_row = rows
        start = min(_common_prefix_len([context_row, full_row]), len(full_row) - 1)
        return [full_row], [(start, len(full_row))]
    raise ValueError(f"unknown CORE task type {task_type!r}")


def crop_to_window(rows, spans, max_len):
    """Fit rows into the model's context by dropping tokens just after BOS (every row the model saw starts with it)."""
    cropped_rows, cropped_spans = [], []
    for row, (start, end) in zip(rows, spans):
        excess = len(row) - max_len
        if excess > 0:
            row = row[:1] + row[1 + excess:]
            start, end = max(start - excess, 1), end - excess
        cropped_rows.append(row)
        cropped_spans.append((start, end))
    return cropped_rows, cropped_spans


@torch.no_grad()
def score_rows(model, rows, spans, pad_id, device):
    """One forward pass over the rows (right-padded: causal attention never reads the padding): each row's mean loss
    over its span, and whether greedy argmax predicts every token of the span."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([list(row) + [pad_id] * (width - len(row)) for row in rows], dtype=torch.long, device=device)
    logits = model(ids)
    mean_losses, exact = [], []
    for i, (start, end) in enumerate(spans):
        predicted = logits[i, start - 1:end - 1].float()  # position t predicts token t+1
        targets = ids[i, start:end]
        mean_losses.append(F.cross_entropy(predicted, targets))
        exact.append((predicted.argmax(dim=-1) == targets).all())
    return torch.stack(mean_losses).tolist(), torch.stack(exact).tolist()


def evaluate_example(model, tokenizer, data, idx, device, task_meta):
    """True if the model gets data[idx] right."""
    item = data[idx]
    task_type = task_meta["task_type"]
    shots = sample_fewshot(data, idx, task_meta["num_fewshot"])
    prompts = render_prompts(task_type, item, task_meta["continuation_delimiter"], shots)
    rows, spans = tokenize_prompts(tokenizer, task_type, prompts)
    max_len = getattr(getattr(model, "config", None), "sequence_len", None)
    if max_len:
        rows, spans = crop_to_window(rows, spans, max_len)
    mean_losses, exact = score_rows(model, rows, spans, tokenizer.get_bos_token_id(), device)
    if task_type == "language_modeling":
        return exact[0]
    prediction = min(range(len(mean_losses)), key=lambda i: mean_losses[i])  # first one wins ties
    return prediction == item["gold"]


def evaluate_task(model, tokenizer, data, device, task_meta, num_examples=None):
    """Accuracy on the first num_examples of data (all if None or < 0), the same on every rank; few-shot examples may
    come from all of data."""
    n = len(data) if num_examples is None or num_examples < 0 else min(num_examples, len(data))
    rank, world_size = dist_rank_world()
    correct = sum(bool(evaluate_example(model, tokenizer, data, idx, device, task_meta))
                  for idx in range(rank, n, world_size))
    counts = torch.tensor([correct, len(range(rank, n, world_size))], dtype=torch.long, device=device)
    if world_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct, total = counts.tolist()
    return correct / max(total, 1)


def evaluate_core(model, tokenizer, device, max_per_task=-1, bundle_dir=None, verbose=True):
    """
    {"results": {label: accuracy}, "centered_results": {label: centred accuracy}, "core_metric": their mean} over the
    bundle's tasks. max_per_task > 0 evaluates a fixed random subset of each (a quick look, not comparable).
    """
    bundle_dir = bundle_dir or ensure_eval_bundle()
    tasks = load_core_tasks(bundle_dir)
    if not tasks:
        raise UserError(f"{os.path.join(bundle_dir, 'core.yaml')} lists no tasks")
    datas = [load_task_data(task["data_path"]) for task in tasks]  # a broken file is found before any task runs
    results, centered_results = {}, {}
    for task, data in zip(tasks, datas):
        t0 = time.time()
        random.Random(TASK_SHUFFLE_SEED).shuffle(data)  # so a max_per_task subset is a fair sample
        accuracy = evaluate_task(model, tokenizer, data, device, task, num_examples=max_per_task)
        baseline = task["random_baseline"]
        centered = (accuracy - baseline) / (1.0 - baseline)
        results[task["label"]] = accuracy
        centered_results[task["label"]] = centered
        if verbose:
            print0(f"{task['label']:<36} accuracy {accuracy:.4f} | centered {centered:+.4f} | "
                   f"{task['num_fewshot']}-shot {task['task_type']} | {time.time() - t0:.1f}s")
    core_metric = sum(centered_results.values()) / len(centered_results)
    return {"results": results, "centered_results": centered_results, "core_metric": core_metric}
