"""
The Hugging Face hub without its client libraries ($HF_ENDPOINT for a mirror or a test server): a dataset split's
parquet files into <base_dir>/task_data/{repo}/{config}/{split}/, and a model repo's files into
<base_dir>/hub_cache/models/{owner}/{name}/{revision}/, each through nanochat.download with a manifest
(files.json) written last, so a folder with one is complete and is read again without the network. Every name the
hub or the user gives becomes a path only when it is plain: nothing is ever written outside those folders.
"""

import json
import os
import re
import tempfile
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock

from nanochat.common import UserError, atomic_write_text, get_base_dir, json_loads, print0, read_json_object
from nanochat.dataset import hub_endpoint
from nanochat.download import HEX64, AttemptFailed, DownloadError, download_file

# Always used with fullmatch: re.match with '$' would accept a name ending in a newline.
PLAIN_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # one folder name: no '..' or '.', no separator
REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)*")  # a branch, tag or commit
MAX_NAME_BYTES = 200  # of one part of a listed path: the file system's 255, less the room a temp file's suffix takes
MAX_PATH_CHARS = 1000
MANIFEST = "files.json"  # written last into a download directory: its presence means complete


def parse_repo_id(source):
    """'owner/name' or 'owner/name@revision' -> (repo, revision), or None when `source` is not written like one."""
    repo, _, revision = source.partition("@")
    if not REPO_RE.fullmatch(repo) or ".." in repo or (source.count("@") and not revision):
        return None
    if revision and (not REVISION_RE.fullmatch(revision) or len(revision_folder(revision)) > MAX_NAME_BYTES):
        return None
    return repo, revision or "main"


def revision_folder(revision):
    """A revision as one folder name, one to one: '/' is written %2F, which no revision holds (x/y and x--y differ)."""
    return quote(revision, safe="")


def model_cache_dir(repo, revision):
    return os.path.join(get_base_dir(), "hub_cache", "models", repo, revision_folder(revision))


def repo_path_problem(name):
    """Why a listed file path cannot be written inside the download folder, or None when it is relative and plain:
    parts joined by '/', none empty, '.' or '..', no backslash or drive letter, no control character, each part a
    possible file name. The hub lists nothing else."""
    if not isinstance(name, str) or not name:
        return "an empty path"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, which JSON can carry and no file name can
        return "a path that is not valid Unicode"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a path with a control character (a NUL, a newline...)"
    parts = name.split("/")
    if "\\" in name or re.match(r"[A-Za-z]:", name) or any(part in ("", ".", "..") for part in parts):
        return "a path that leads outside its download folder (a '..', '.' or empty part, or an absolute path)"
    if len(name) > MAX_PATH_CHARS or any(len(part.encode("utf-8")) > MAX_NAME_BYTES for part in parts):
        return f"a path too long to write (a part over {MAX_NAME_BYTES} bytes, or over {MAX_PATH_CHARS} characters)"
    return None


def local_path_in(directory, name):
    """Where repo file `name` goes under `directory`, or None when it would land outside it (its path resolved, links
    in the folder followed)."""
    if repo_path_problem(name) is not None:
        return None
    path = os.path.join(directory, *name.split("/"))
    inside = os.path.realpath(directory)
    return path if os.path.commonpath([inside, os.path.realpath(path)]) == inside else None


def fetch_json(url, attempts=3, backoff=1.0):
    """The value of a JSON answer of the hub's API, fetched like every file (download_file's retries). An answer that
    is not JSON raises DownloadError at once: asking again would get the same. Errors say what the answer is, never
    echo it: it is a server's text, and a terminal is no place for it."""
    answer = {}

    def read(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        try:
            answer["value"] = json_loads(text)
        except ValueError as e:
            raise DownloadError(f"expected JSON, got {len(text):,} characters that are not ({e})") from None

    with tempfile.TemporaryDirectory() as tmp:
        download_file(url, os.path.join(tmp, "answer.json"), max_attempts=attempts, backoff=backoff, max_bytes=16 << 20,
                      validate=read)
    return answer["value"]


def json_kind(value):
    """What a JSON value is (an object, a list of 3 items, a string...), for an error that must not echo it."""
    if isinstance(value, list):
        return f"a list of {len(value):,} items"
    return {dict: "an object", str: "a string", bool: "true or false", type(None): "null"}.get(type(value), "a number")


def list_model_files(repo, revision):
    """{path: {"size": int or None, "sha256": str or None}} of every file in the repo at `revision`."""
    url = f"{hub_endpoint()}/api/models/{repo}/tree/{quote(revision, safe='')}?recursive=true"
    try:
        entries = fetch_json(url)
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("path"), str) for e in entries):
            raise DownloadError(f"expected a JSON list of files (objects with a path), got {json_kind(entries)}")
    except DownloadError as e:
        raise UserError(f"cannot list the files of hub repo {repo}@{revision} at {url}: {e}; check the repo name "
                        "and revision, the network, or set HF_ENDPOINT to a reachable mirror") from None
    listing = {}
    for entry in entries:
        problem = repo_path_problem(entry["path"])
        if problem:
            raise UserError(f"refusing hub repo {repo}@{revision}: its listing names {entry['path'][:100]!r}, {problem}")
        if entry.get("type", "file") == "file":
            lfs = entry.get("lfs") if isinstance(entry.get("lfs"), dict) else {}
            size = entry.get("size") if type(entry.get("size")) is int and entry["size"] >= 0 else None
            oid = lfs.get("oid") if isinstance(lfs.get("oid"), str) and HEX64.fullmatch(lfs["oid"]) else None
            listing[entry["path"]] = {"size": size, "sha256": oid}
    if not listing:
        raise UserError(f"hub repo {repo}@{revision} lists no files at {url}")
    return listing


def _manifest_names(directory, name_ok=lambda name: True):
    """The file names the manifest of a complete download in `directory` lists; None without one we wrote."""
    names = (read_json_object(os.path.join(directory, MANIFEST)) or {}).get("files")
    return names if isinstance(names, list) and all(isinstance(n, str) and name_ok(n) for n in names) else None


def fetch_model_files(repo, revision, choose):
    """{repo path: local path} of the files `choose(listing)` picks from the repo (a list of repo paths), downloaded
    into the cache unless a complete download is there already (then the network is never touched)."""
    directory = model_cache_dir(repo, revision)
    names = _manifest_names(directory)
    if names is not None:
        cached = {name: local_path_in(directory, name) for name in names}
        if all(p is not None and os.path.isfile(p) for p in cached.values()):
            print0(f"hub: {repo}@{revision} from the cache in {directory}")
            return cached
    listing = list_model_files(repo, revision)
    names = choose(listing)
    unlisted = [n for n in names if n not in listing]
    if unlisted:
        raise UserError(f"hub repo {repo}@{revision} does not list {', '.join(unlisted)}")
    targets = {name: local_path_in(directory, name) for name in names}  # all checked before anything is fetched
    outside = [n for n, path in targets.items() if path is None]
    if outside:
        raise UserError(f"refusing hub repo {repo}@{revision}: {', '.join(outside)} would be written outside its "
                        f"download folder {directory} (a link there leads elsewhere); delete that folder and try again")
    total = sum(listing[n]["size"] or 0 for n in names)
    print0(f"hub: downloading {len(names)} file(s) of {repo}@{revision} ({total / 2**20:,.1f} MiB) -> {directory}")
    for name, path in targets.items():
        url = f"{hub_endpoint()}/{repo}/resolve/{quote(revision, safe='')}/{quote(name)}"
        size = listing[name]["size"]
        try:
            # no listed size: download_file's cap for a size nobody announced (docs/data.md's 16 GiB)
            download_file(url, path, expected_sha256=listing[name]["sha256"], max_bytes=size)
        except DownloadError as e:
            raise UserError(f"hub repo {repo}@{revision}: {e}; run the import again to resume") from None
    atomic_write_text(os.path.join(directory, MANIFEST), json.dumps({"files": names}, indent=2))
    return targets


# -----------------------------------------------------------------------------
# Datasets: a split's parquet files

PART_FILE_RE = re.compile(r"part-\d{4,}\.parquet")  # the names fetch_parquet_files gives the split's files
LIST_ATTEMPTS = 3
LIST_BACKOFF_SECONDS = 1.0  # doubled after each failed attempt to list a split


def dataset_id_problem(repo, config, split):
    """(which, why) for the first of a dataset's repo, config and split that is not a plain name; None when all are.
    Each becomes a folder under task_data/, so a '..' there would write anywhere."""
    if not (isinstance(repo, str) and REPO_RE.fullmatch(repo) and ".." not in repo):
        return "repo", (f"{repo!r} is not owner/name (letters, digits, '-', '_' and '.', each part starting with a "
                        "letter or digit)")
    for which, value in (("config", config), ("split", split)):
        if not (isinstance(value, str) and PLAIN_PART_RE.fullmatch(value) and len(value) <= MAX_NAME_BYTES):
            return which, (f"{value!r} is not a plain name (letters, digits, '-', '_' and '.', starting with a letter "
                           "or digit)")
    return None


def split_dir(repo, config, split):
    problem = dataset_id_problem(repo, config, split)
    if problem:
        raise UserError(f"hub dataset {repo!r} ({config!r}/{split!r}): its {problem[0]} {problem[1]}")
    return os.path.join(get_base_dir(), "task_data", repo, config, split)


TASK_HOW_TO_FIX = ("check the network, or set HF_ENDPOINT to a reachable mirror of huggingface.co; offline, use the "
                   "built-in tasks (WorldQA, Identity, Arithmetic, SpellingBee, SimpleSpelling) as the CPU preset does")


def local_parquet_files(repo, config, split):
    """The split's parquet files if a complete download is on disk, else None. Never touches the network."""
    directory = split_dir(repo, config, split)
    names = _manifest_names(directory, PART_FILE_RE.fullmatch)
    if names is None:
        return None
    paths = [os.path.join(directory, name) for name in names]
    return paths if all(os.path.isfile(p) for p in paths) else None


def _list_parquet_urls(label, repo, config, split, how_to_fix):
    """The split's parquet URLs, from the hub's listing: fetched like every file (download_file's retries)."""
    url = f"{hub_endpoint()}/api/datasets/{repo}/parquet/{config}/{split}"
    try:
        urls = fetch_json(url, attempts=LIST_ATTEMPTS, backoff=LIST_BACKOFF_SECONDS)
        if not (isinstance(urls, list) and urls and all(isinstance(u, str) for u in urls)):
            raise DownloadError(f"expected a non-empty JSON list of parquet URLs, got {json_kind(urls)}")
    except DownloadError as e:
        raise UserError(f"{label}: cannot list the parquet files of {repo} ({config}/{split}) at {url}: {e}; "
                        f"{how_to_fix}") from None
    return urls


def fetch_parquet_files(task_name, repo, config, split, label=None, how_to_fix=None):
    """Local paths of the split's parquet files, downloading whatever is missing. `label` and `how_to_fix` word the
    errors for a caller other than a task (default: "task NAME", and the offline tasks to use instead)."""
    label = label or f"task {task_name}"
    how_to_fix = how_to_fix or TASK_HOW_TO_FIX
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
                download_file(url, path, validate=_check_parquet)
            except DownloadError as e:
                raise UserError(f"{label}: {e}; {how_to_fix}") from None
        atomic_write_text(os.path.join(directory, MANIFEST), json.dumps({"urls": urls, "files": names}, indent=2))
        return [os.path.join(directory, name) for name in names]


def _check_parquet(tmp_path):
    """A downloaded file must be parquet (its footer read back), or the attempt failed: never cache what cannot be read."""
    try:
        pq.ParquetFile(tmp_path).close()
    except Exception as e:  # pyarrow raises several kinds for a file that is not parquet
        raise AttemptFailed(f"not a parquet file ({type(e).__name__}: {e})") from None


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
    return None if paths is None else sum(pq.ParquetFile(p).metadata.num_rows for p in paths)


def table_row(table, index):
    """Row `index` of a table as a dict of plain Python values (nested structs become dicts and lists)."""
    return {name: table.column(name)[index].as_py() for name in table.column_names}
