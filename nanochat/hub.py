"""
The Hugging Face hub's file API, without huggingface_hub: where the hub is ($HF_ENDPOINT for a mirror or a test
server), and a model repo's files fetched into a local cache.

    GET {endpoint}/api/models/{owner}/{name}/tree/{revision}?recursive=true   the repo's files, sizes, LFS sha256
    GET {endpoint}/{owner}/{name}/resolve/{revision}/{path}                   one file

Files come through nanochat.download (retries, a size cap at the listed size, the LFS sha256 verified) into
<base_dir>/hub_cache/models/{owner}/{name}/{revision}/, and a manifest is written last: a revision with a manifest is
complete, and a later call reads it without the network.
"""

import json
import os
import re
import tempfile
from urllib.parse import quote

from nanochat.common import UserError, atomic_write_text, get_base_dir, print0
from nanochat.download import DownloadError, download_file

REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
MANIFEST = "files.json"


def hub_endpoint():
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def parse_repo_id(source):
    """'owner/name' or 'owner/name@revision' -> (repo, revision), or None when `source` is not written like one."""
    repo, _, revision = source.partition("@")
    if not REPO_RE.match(repo) or ".." in repo or (source.count("@") and not revision):
        return None
    return repo, revision or "main"


def model_cache_dir(repo, revision):
    return os.path.join(get_base_dir(), "hub_cache", "models", repo, revision.replace("/", "--"))


def fetch_json(url, attempts=3, backoff=1.0):
    """(value, text) of a JSON answer of the hub's API, fetched like every file (download_file's retries). An answer
    that is not JSON raises DownloadError at once: asking again would get the same."""
    answer = {}

    def read(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            answer["text"] = f.read()
        try:
            answer["value"] = json.loads(answer["text"])
        except ValueError:
            raise DownloadError(f"expected JSON, got {answer['text'][:200]!r}") from None

    with tempfile.TemporaryDirectory() as tmp:
        download_file(url, os.path.join(tmp, "answer.json"), max_attempts=attempts, backoff=backoff, max_bytes=16 << 20,
                      validate=read)
    return answer["value"], answer["text"]


def list_model_files(repo, revision):
    """{path: {"size": int or None, "sha256": str or None}} of every file in the repo at `revision`."""
    url = f"{hub_endpoint()}/api/models/{repo}/tree/{quote(revision, safe='')}?recursive=true"
    try:
        entries, text = fetch_json(url)
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("path"), str) for e in entries):
            raise DownloadError(f"expected a JSON list of files, got {text[:200]!r}")
    except DownloadError as e:
        raise UserError(f"cannot list the files of hub repo {repo}@{revision} at {url}: {e}; check the repo name "
                        "and revision, the network, or set HF_ENDPOINT to a reachable mirror") from None
    listing = {}
    for entry in entries:
        if entry.get("type", "file") == "file":
            lfs = entry.get("lfs") if isinstance(entry.get("lfs"), dict) else {}
            size = entry.get("size") if isinstance(entry.get("size"), int) else None
            listing[entry["path"]] = {"size": size, "sha256": lfs.get("oid") if isinstance(lfs.get("oid"), str) else None}
    if not listing:
        raise UserError(f"hub repo {repo}@{revision} lists no files at {url}")
    return listing


def cached_model_files(repo, revision):
    """{path: local path} of a complete earlier download of this revision, else None. Never touches the network."""
    directory = model_cache_dir(repo, revision)
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            names = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    paths = {name: os.path.join(directory, name) for name in names}
    return paths if all(os.path.isfile(p) for p in paths.values()) else None


def fetch_model_files(repo, revision, choose):
    """
    Local paths of the files `choose(listing)` picks from the repo (a list of repo paths), downloaded into the cache
    unless a complete download of the same choice is there already. Returns {repo path: local path}.
    """
    cached = cached_model_files(repo, revision)
    if cached is not None:
        print0(f"hub: {repo}@{revision} from the cache in {model_cache_dir(repo, revision)}")
        return cached
    listing = list_model_files(repo, revision)
    names = choose(listing)
    directory = model_cache_dir(repo, revision)
    total = sum(listing[n]["size"] or 0 for n in names)
    print0(f"hub: downloading {len(names)} file(s) of {repo}@{revision} ({total / 2**20:,.1f} MiB) -> {directory}")
    paths = {}
    for name in names:
        path = os.path.join(directory, *name.split("/"))
        url = f"{hub_endpoint()}/{repo}/resolve/{quote(revision, safe='')}/{quote(name)}"
        size = listing[name]["size"]
        try:
            download_file(url, path, expected_sha256=listing[name]["sha256"],
                          max_bytes=size if size is not None else 256 << 30)
        except DownloadError as e:
            raise UserError(f"hub repo {repo}@{revision}: {e}; run the import again to resume") from None
        paths[name] = path
    atomic_write_text(os.path.join(directory, MANIFEST), json.dumps({"files": names}, indent=2))
    return paths
