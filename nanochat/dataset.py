"""
The pretraining corpus: parquet shards with one `text` column (one document per row), stored per source under
<base_dir>/base_data/<source>/ and read row group by row group. A source is a hub dataset (fineweb-edu, climbmix),
a corpus built offline (builtin, brown) or your own text imported (nanochat.data.text_import); each names a fixed
validation shard, and every other shard on disk is training data. The command line is scripts/dataset.py.
"""

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

import pyarrow.parquet as pq
from filelock import FileLock
from tqdm import tqdm

from nanochat.common import UserError, get_base_dir, read_json_object
from nanochat.download import AttemptFailed, DownloadError, download_file  # noqa: F401 (re-exported)

# -----------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class DataSource:
    name: str
    hf_repo: str | None  # "owner/name" of a Hugging Face dataset repo; None if built locally
    num_shards: int | None  # shards 0..num_shards-1 exist upstream; None when the builder decides
    val_index: int  # the one shard kept for validation
    build_command: str  # what to tell the user when the shards are missing


SOURCES = {
    "fineweb-edu": DataSource("fineweb-edu", "karpathy/fineweb-edu-100b-shuffle", 1823, 1822,
                              "python -m nanochat.dataset -n 8 --data-source fineweb-edu"),
    "climbmix": DataSource("climbmix", "karpathy/climbmix-400b-shuffle", 6543, 6542,
                           "python -m nanochat.dataset -n 8 --data-source climbmix"),
    "builtin": DataSource("builtin", None, None, 0, "python -m nanochat.corpus"),
    "brown": DataSource("brown", None, None, 0, "python -m scripts.brown"),  # real English offline, a yardstick
}

SHARD_RE = re.compile(r"^shard_(\d{5,})\.parquet$")
IMPORT_MANIFEST = "import.json"  # written last by an import of your own text (nanochat/data/text_import.py)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # with fullmatch: '$' would let "name\n" through


def is_plain_name(name):
    """Whether `name` can name a source: a directory under base_data/ and a flag's value, nothing to escape."""
    return bool(NAME_RE.fullmatch(name or ""))


def hub_endpoint():
    """The Hugging Face hub, or the mirror $HF_ENDPOINT names."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def imported_source(name):
    """The DataSource of a source imported into this base dir, or None."""
    if not is_plain_name(name) or name in SOURCES:
        return None
    path = os.path.join(get_base_dir(), "base_data", name, IMPORT_MANIFEST)
    if not os.path.isfile(path):
        return None
    manifest = read_json_object(path) or {}
    return DataSource(name, None, None, 0, manifest.get("command", f"python -m nanochat.dataset import {name} ..."))


def source_names_on_disk():
    """Every source with a directory under base_data/, built-in or imported."""
    root = os.path.join(get_base_dir(), "base_data")
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [n for n in names if os.path.isdir(os.path.join(root, n)) and (n in SOURCES or imported_source(n))]


def _unknown_source(name, what):
    imported = [n for n in source_names_on_disk() if n not in SOURCES]
    mine = f"; imported into {get_base_dir()}: {', '.join(imported)}" if imported else ""
    return (f"{what}{name!r} is not a data source; the built-in ones are {', '.join(SOURCES)}{mine}. "
            f"Import your own text with `python -m nanochat.dataset import {name if is_plain_name(name) else 'NAME'} "
            f"FILES_OR_FOLDERS...` (`python -m nanochat.dataset list` shows what is on disk)")


def get_default_source():
    """$NANOCHAT_DATA_SOURCE, else the offline built-in corpus."""
    name = os.environ.get("NANOCHAT_DATA_SOURCE", "builtin")
    if name not in SOURCES and imported_source(name) is None:
        raise UserError(_unknown_source(name, "NANOCHAT_DATA_SOURCE="))
    return name


def get_source(source=None):
    """The DataSource for a name (None means the default source): a built-in one, or one imported into the base dir."""
    name = source or get_default_source()
    if name in SOURCES:
        return SOURCES[name]
    src = imported_source(name)
    if src is None:
        raise UserError(_unknown_source(name, "data source "))
    return src


def data_dir_path(source=None):
    """Directory of a source's shards (not created)."""
    return os.path.join(get_base_dir(), "base_data", get_source(source).name)


def get_data_dir(source=None):
    """Directory holding a source's shards (created if missing)."""
    path = data_dir_path(source)
    os.makedirs(path, exist_ok=True)
    return path


def shard_filename(i):
    return f"shard_{i:05d}.parquet"


def shard_url(source, index):
    """Where a hub shard lives; $HF_ENDPOINT points at a mirror (or a test server) instead of the hub."""
    src = get_source(source)
    if src.hf_repo is None:
        raise UserError(f"source {src.name!r} has no URL: it is generated locally by `{src.build_command}`")
    return f"{hub_endpoint()}/datasets/{src.hf_repo}/resolve/main/{shard_filename(index)}"


# -----------------------------------------------------------------------------
# Reading


def list_parquet_files(split="train", source=None):
    """Sorted shard paths of one split: "val" is the source's fixed val shard, "train" is every other shard."""
    if split not in ("train", "val"):
        raise UserError(f"split must be 'train' or 'val' (got {split!r})")
    src = get_source(source)
    data_dir = data_dir_path(src.name)
    names = os.listdir(data_dir) if os.path.isdir(data_dir) else []
    shards = {int(m.group(1)): os.path.join(data_dir, m.string) for m in map(SHARD_RE.match, names) if m}
    if not shards:
        raise UserError(f"no parquet shards in {data_dir}; create them with `{src.build_command}`")
    if split == "val":
        if src.val_index not in shards:
            raise UserError(f"validation shard {shard_filename(src.val_index)} is missing from {data_dir}; "
                            f"get it with `{src.build_command}`")
        return [shards[src.val_index]]
    train = [shards[i] for i in sorted(shards) if i != src.val_index]
    if not train:
        raise UserError(f"{data_dir} holds only the validation shard, no training shards; "
                        f"get some with `{src.build_command}`")
    return train


def _rebuild_hint(path):
    # Shards live in base_data/<source>/, so the directory name tells us how the file was made.
    name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    src = SOURCES.get(name) or imported_source(name)
    return f"delete it and re-run `{src.build_command}`" if src else "delete it and download or build it again"


def open_parquet(path):
    """Open a shard for reading, turning a missing, corrupt or wrong-schema file into a UserError."""
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises OSError/ArrowInvalid/... depending on how the file is broken
        raise UserError(f"cannot read parquet file {path} ({type(e).__name__}: {e}); {_rebuild_hint(path)}") from e
    if "text" not in pf.schema_arrow.names:
        raise UserError(f"parquet file {path} has no 'text' column (columns: {pf.schema_arrow.names}); "
                        f"{_rebuild_hint(path)}")
    return pf


def read_row_group_texts(path, row_group, parquet_file=None):
    """The `text` column of one row group, as a list of str."""
    pf = parquet_file or open_parquet(path)
    try:
        return pf.read_row_group(row_group, columns=["text"]).column("text").to_pylist()
    except Exception as e:  # a truncated or damaged data page can pass the footer check and fail only here
        raise UserError(f"cannot read row group {row_group} of {path} ({type(e).__name__}: {e}); "
                        f"{_rebuild_hint(path)}") from e


def parquets_iter_batched(split="train", start=0, step=1, source=None):
    """The texts of one row group at a time, for every global row group index g (counted across the split's files in
    order) with g % step == start: ranks shard the data with start=rank, step=world_size."""
    if step < 1 or not 0 <= start < step:
        raise ValueError(f"need step >= 1 and 0 <= start < step (got start={start}, step={step})")
    g = 0
    for path in list_parquet_files(split, source):
        with open_parquet(path) as pf:
            for rg in range(pf.num_row_groups):
                if g % step == start:
                    yield read_row_group_texts(path, rg, pf)
                g += 1


# -----------------------------------------------------------------------------
# Downloading

def _check_parquet(tmp_path):
    try:
        open_parquet(tmp_path).close()
    except UserError as e:
        raise AttemptFailed(f"not a usable parquet shard: {e}") from e


def download_shard(source, index, data_dir=None, max_attempts=5, backoff=2.0, on_bytes=None, stop=None):
    """Fetch one hub shard into data_dir (default: the source's data dir) with download_file's retries and checks
    (a readable parquet shard among them), and return its path. A shard already on disk and readable is left alone."""
    return _download_shard(source, index, data_dir, max_attempts, backoff, on_bytes, stop)[0]


def _download_shard(source, index, data_dir, max_attempts, backoff, on_bytes, stop):
    """download_shard, also saying whether it fetched anything: (path, fetched)."""
    src = get_source(source)
    if src.num_shards is not None and not 0 <= index < src.num_shards:
        raise UserError(f"shard index {index} out of range for {src.name} (0..{src.num_shards - 1})")
    url = shard_url(src.name, index)
    data_dir = data_dir or get_data_dir(src.name)
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, shard_filename(index))
    # One process per shard at a time (two `nanochat.dataset` runs, or torchrun ranks): the second
    # waits, then finds the shard complete. Temp files left by a killed run are cleared under the lock.
    os.makedirs(os.path.join(data_dir, ".locks"), exist_ok=True)
    with FileLock(os.path.join(data_dir, ".locks", shard_filename(index) + ".lock")):
        for name in os.listdir(data_dir):
            if name.startswith(os.path.basename(path) + ".tmp"):
                os.remove(os.path.join(data_dir, name))
        try:
            open_parquet(path).close()  # a missing or truncated shard (no footer) fails: fetch it
            return path, False
        except UserError:
            pass
        download_file(url, path, max_attempts=max_attempts, backoff=backoff, validate=_check_parquet,
                      on_bytes=on_bytes, stop=stop)
    return path, True


@dataclass
class DownloadSummary:
    downloaded: int = 0
    skipped: int = 0
    failed: dict = field(default_factory=dict)  # shard index -> error message
    bytes: int = 0  # size of the shards downloaded in this run
    seconds: float = 0.0


def download_shards(source, indices, workers=8, data_dir=None, max_attempts=5, backoff=2.0, progress=True):
    """Download several shards in a thread pool; a failure is recorded and the others carry on."""
    src = get_source(source)
    data_dir = data_dir or get_data_dir(src.name)
    indices = sorted(set(indices))
    summary = DownloadSummary()
    t0 = time.time()
    stop = threading.Event()
    lock = threading.Lock()
    bar = tqdm(total=None, unit="B", unit_scale=True, desc=f"shards 0/{len(indices)}",
               disable=not progress, dynamic_ncols=True)

    def on_bytes(n):
        with lock:
            bar.update(n)

    def work(index):
        path, fetched = _download_shard(src.name, index, data_dir, max_attempts, backoff, on_bytes, stop)
        return fetched, os.path.getsize(path)

    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        futures = {pool.submit(work, i): i for i in indices}
        for done, future in enumerate(as_completed(futures), start=1):
            index = futures[future]
            try:
                fetched, nbytes = future.result()
                if fetched:
                    summary.downloaded += 1
                    summary.bytes += nbytes
                else:
                    summary.skipped += 1
            except UserError as e:
                summary.failed[index] = str(e)
            except Exception as e:  # noqa: BLE001 -- a bug or a full disk: report it with the shard, keep going
                summary.failed[index] = f"{shard_filename(index)}: {type(e).__name__}: {e}"
            with lock:
                bar.set_description_str(f"shards {done}/{len(indices)}")
    except KeyboardInterrupt:
        # tell workers to drop their temp files and quit, rather than waiting for whole shards to finish
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)
        bar.close()
    summary.seconds = time.time() - t0
    return summary


if __name__ == "__main__":
    # `python -m nanochat.dataset` (karpathy/nanochat's command) has its command line in scripts/dataset.py, which also
    # reaches the text import add-on; it runs as a program of its own (the library imports no script).
    import sys

    os.execv(sys.executable, [sys.executable, "-m", "scripts.dataset", *sys.argv[1:]])
