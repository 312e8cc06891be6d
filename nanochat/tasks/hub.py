"""
Fetch a hub dataset split as parquet files, without the `datasets` package.

The hub's parquet API lists a split's files: GET {endpoint}/api/datasets/{repo}/parquet/{config}/{split}
answers a JSON list of URLs. They are downloaded with nanochat.download into
<base_dir>/task_data/{repo}/{config}/{split}/ and a manifest (files.json) is written last, so a split
with a manifest is complete and later loads need no network. One rank at a time downloads a split (a
file lock); the others wait and then read what it fetched. $HF_ENDPOINT points at a mirror or test server.
"""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock

from nanochat.common import UserError, atomic_write_text, get_base_dir, print0
from nanochat.download import DownloadError, download_file
from nanochat.hub import fetch_json, hub_endpoint

MANIFEST = "files.json"
LIST_ATTEMPTS = 3
LIST_BACKOFF_SECONDS = 1.0  # doubled after each failed attempt to list a split


def listing_url(repo, config, split):
    return f"{hub_endpoint()}/api/datasets/{repo}/parquet/{config}/{split}"


def split_dir(repo, config, split):
    return os.path.join(get_base_dir(), "task_data", repo, config, split)


def _how_to_fix():
    return ("check the network, or set HF_ENDPOINT to a reachable mirror of huggingface.co; "
            "offline, use the built-in tasks (WorldQA, Identity, Arithmetic, SpellingBee, SimpleSpelling) "
            "as the CPU preset does")


def local_parquet_files(repo, config, split):
    """The split's parquet files if a complete download is on disk, else None. Never touches the network."""
    directory = split_dir(repo, config, split)
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            names = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return None
    paths = [os.path.join(directory, name) for name in names]
    return paths if all(os.path.exists(p) for p in paths) else None


def _list_parquet_urls(label, repo, config, split, how_to_fix):
    """The split's parquet URLs, from the hub's listing: fetched like every file (download_file's retries)."""
    url = listing_url(repo, config, split)
    try:
        urls, text = fetch_json(url, attempts=LIST_ATTEMPTS, backoff=LIST_BACKOFF_SECONDS)
        if not (isinstance(urls, list) and urls and all(isinstance(u, str) for u in urls)):
            raise DownloadError(f"expected a non-empty JSON list of parquet URLs, got {text[:200]!r}")
    except DownloadError as e:
        raise UserError(f"{label}: cannot list the parquet files of {repo} ({config}/{split}) at {url}: {e}; "
                        f"{how_to_fix}") from None
    return urls


def fetch_parquet_files(task_name, repo, config, split, label=None, how_to_fix=None):
    """Local paths of the split's parquet files, downloading whatever is missing. `label` and `how_to_fix` word the
    errors for a caller other than a task (default: "task NAME", and the offline tasks to use instead)."""
    label = label or f"task {task_name}"
    how_to_fix = how_to_fix or _how_to_fix()
    paths = local_parquet_files(repo, config, split)
    if paths is not None:
        return paths
    directory = split_dir(repo, config, split)
    os.makedirs(directory, exist_ok=True)
    with FileLock(os.path.join(directory, ".lock")):
        paths = local_parquet_files(repo, config, split)  # another rank may have finished while we waited
        if paths is not None:
            return paths
        urls = _list_parquet_urls(label, repo, config, split, how_to_fix)
        names = [f"part-{i:04d}.parquet" for i in range(len(urls))]
        print0(f"{label}: downloading {len(urls)} parquet file(s) of {repo} {config}/{split} -> {directory}")
        for url, name in zip(urls, names):
            path = os.path.join(directory, name)
            if os.path.exists(path):  # download_file renames only complete files into place
                continue
            try:
                download_file(url, path)
            except DownloadError as e:
                raise UserError(f"{label}: {e}; {how_to_fix}") from None
        atomic_write_text(os.path.join(directory, MANIFEST), json.dumps({"urls": urls, "files": names}, indent=2))
        return [os.path.join(directory, name) for name in names]


def load_table(task_name, repo, config, split):
    """The whole split as one pyarrow Table (downloaded first if needed)."""
    paths = fetch_parquet_files(task_name, repo, config, split)
    try:
        return pa.concat_tables([pq.read_table(p) for p in paths])
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"task {task_name}: cannot read the parquet files in {split_dir(repo, config, split)} ({e}); "
                        f"delete that directory to download them again") from None


def local_row_count(repo, config, split):
    """Rows of a downloaded split, from the parquet footers only; None when the split is not on disk."""
    paths = local_parquet_files(repo, config, split)
    if paths is None:
        return None
    return sum(pq.ParquetFile(p).metadata.num_rows for p in paths)


def table_row(table, index):
    """Row `index` of a table as a dict of plain Python values (nested structs become dicts and lists)."""
    return {name: table.column(name)[index].as_py() for name in table.column_names}
