"""
Tests for nanochat.dataset: the split layout and rank sharding of parquet shards, clear
errors for missing/corrupt data, and the downloader against a local HTTP server that
injects faults (5xx, dropped connections, wrong size or hash, redirects).
"""

import hashlib
import io
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset
from nanochat.common import UserError
from nanochat.download import sha256_from_etag
from scripts.dataset import main as dataset_command

REPO = dataset.SOURCES["fineweb-edu"].hf_repo
VAL = dataset.SOURCES["fineweb-edu"].val_index


def parquet_bytes(texts, row_group_size=4, column="text"):
    buf = io.BytesIO()
    pq.write_table(pa.table({column: texts}), buf, row_group_size=row_group_size)
    return buf.getvalue()


def shard_texts(index, n=10):
    return [f"shard {index} document {j} " + "lorem ipsum " * (j % 5) for j in range(n)]


@pytest.fixture
def base_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.delenv("NANOCHAT_DATA_SOURCE", raising=False)
    return tmp_path / "base"


def write_shard(source, index, data):
    path = os.path.join(dataset.get_data_dir(source), dataset.shard_filename(index))
    with open(path, "wb") as f:
        f.write(data)
    return path


# -----------------------------------------------------------------------------
# Reading


@pytest.mark.quick
def test_list_parquet_files_separates_fixed_val_shard(base_dir):
    for i in (VAL, 0, 2, 1):  # written out of order; the val shard is the highest index on disk
        write_shard("fineweb-edu", i, parquet_bytes(shard_texts(i)))
    # leftovers from a killed download must not be mistaken for shards
    open(os.path.join(dataset.get_data_dir("fineweb-edu"), "shard_00003.parquet.tmp"), "wb").close()
    train = dataset.list_parquet_files("train", "fineweb-edu")
    val = dataset.list_parquet_files("val", "fineweb-edu")
    assert [os.path.basename(p) for p in train] == ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]
    assert [os.path.basename(p) for p in val] == [f"shard_{VAL:05d}.parquet"]

    # builtin: the val shard is shard 0 even though it is the first file on disk
    for i in range(3):
        write_shard("builtin", i, parquet_bytes(shard_texts(i)))
    assert [os.path.basename(p) for p in dataset.list_parquet_files("val", "builtin")] == ["shard_00000.parquet"]
    assert len(dataset.list_parquet_files("train", "builtin")) == 2


@pytest.mark.quick
def test_default_source_and_unknown_source(base_dir, monkeypatch):
    assert dataset.get_default_source() == "builtin"
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "climbmix")
    assert dataset.get_default_source() == "climbmix"
    with pytest.raises(UserError, match="nope"):
        dataset.get_data_dir("nope")


@pytest.mark.quick
def test_parquets_iter_batched_shards_row_groups_across_ranks(base_dir):
    # val shard 0 plus train shards with 3, 2 and 4 row groups
    sizes = {0: 8, 1: 12, 2: 8, 3: 16}
    for i, n in sizes.items():
        write_shard("builtin", i, parquet_bytes(shard_texts(i, n), row_group_size=4))
    everything = [t for i in (1, 2, 3) for t in shard_texts(i, sizes[i])]

    single = list(dataset.parquets_iter_batched("train", source="builtin"))
    assert len(single) == 9 and all(len(batch) == 4 for batch in single)
    assert [t for batch in single for t in batch] == everything

    ranks = [list(dataset.parquets_iter_batched("train", start=r, step=2, source="builtin")) for r in range(2)]
    assert [len(r) for r in ranks] == [5, 4]
    assert ranks[0] == single[0::2] and ranks[1] == single[1::2]
    seen = [t for r in ranks for batch in r for t in batch]
    assert len(seen) == len(set(seen)) and sorted(seen) == sorted(everything)

    val = [t for batch in dataset.parquets_iter_batched("val", source="builtin") for t in batch]
    assert val == shard_texts(0, 8)


@pytest.mark.quick
def test_missing_data_dir_raises_user_error(base_dir):
    with pytest.raises(UserError) as e:
        dataset.list_parquet_files("train", "fineweb-edu")
    assert os.path.join(str(base_dir), "base_data", "fineweb-edu") in str(e.value)
    assert "python -m nanochat.dataset" in str(e.value)
    with pytest.raises(UserError, match="nanochat.corpus"):
        list(dataset.parquets_iter_batched("train", source="builtin"))


@pytest.mark.quick
def test_missing_val_shard_raises_user_error(base_dir):
    write_shard("fineweb-edu", 0, parquet_bytes(shard_texts(0)))
    with pytest.raises(UserError, match=f"shard_{VAL:05d}.parquet"):
        dataset.list_parquet_files("val", "fineweb-edu")


@pytest.mark.quick
def test_corrupt_or_wrong_schema_parquet_raises_user_error(base_dir):
    write_shard("builtin", 0, parquet_bytes(shard_texts(0)))
    bad = write_shard("builtin", 1, os.urandom(3000))
    with pytest.raises(UserError) as e:
        list(dataset.parquets_iter_batched("train", source="builtin"))
    assert bad in str(e.value) and "nanochat.corpus" in str(e.value)
    with pytest.raises(UserError, match=bad):
        dataset.open_parquet(bad)

    # intact footer, damaged first data page: only reading the row group finds it
    damaged = bytearray(parquet_bytes(shard_texts(1, 40)))
    damaged[4:68] = b"\xff" * 64
    write_shard("builtin", 1, bytes(damaged))
    assert dataset.open_parquet(bad).num_row_groups == 10
    with pytest.raises(UserError, match="row group 0") as e:
        list(dataset.parquets_iter_batched("train", source="builtin"))
    assert bad in str(e.value)

    wrong = write_shard("builtin", 1, parquet_bytes(["x", "y"], column="content"))
    with pytest.raises(UserError, match="no 'text' column") as e:
        dataset.open_parquet(wrong)
    assert wrong in str(e.value)


# -----------------------------------------------------------------------------
# Downloading from a local fake hub


class FakeHub:
    """Serves /datasets/<repo>/resolve/main/shard_XXXXX.parquet, with scripted faults per shard and request."""

    def __init__(self):
        self.files = {}  # shard name -> bytes
        self.faults = {}  # shard name -> list of faults, one consumed per request ("ok" once exhausted)
        self.requests = {}  # shard name -> request count
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def add(self, index, data, faults=()):
        name = dataset.shard_filename(index)
        self.files[name] = data
        self.faults[name] = list(faults)

    def handle(self, req):
        name = req.path.rsplit("/", 1)[-1]
        if req.path.startswith("/cdn/"):  # the target of a redirect: plain bytes, no hash
            return self.send(req, self.files[name], sha=None)
        if req.path != f"/datasets/{REPO}/resolve/main/{name}" or name not in self.files:
            req.send_error(404)
            return
        with self.lock:
            self.requests[name] = self.requests.get(name, 0) + 1
            fault = self.faults[name].pop(0) if self.faults[name] else "ok"
            if fault.endswith("*"):  # a fault that repeats on every request
                self.faults[name].insert(0, fault)
        data = self.files[name]
        sha = hashlib.sha256(data).hexdigest()
        if fault.startswith("500"):
            req.send_error(500)
        elif fault.startswith("drop"):
            # promise the whole file, deliver half, hang up
            self.send(req, data, sha, body=data[: len(data) // 2])
        elif fault.startswith("bad_sha"):
            self.send(req, data, "f" * 64)
        elif fault.startswith("bad_size"):
            self.send(req, data, sha, length=len(data) + 100)
        elif fault.startswith("redirect"):
            # like the hub: the hash and size of the LFS file ride on the redirect to the CDN
            req.send_response(302)
            req.send_header("Location", f"/cdn/{name}")
            bad_sha, bad_size = fault.startswith("redirect_bad_sha"), fault.startswith("redirect_bad_size")
            req.send_header("X-Linked-Etag", '"' + ("0" * 64 if bad_sha else sha) + '"')
            req.send_header("X-Linked-Size", str(len(data) + (1 if bad_size else 0)))
            req.send_header("Content-Length", "0")
            req.end_headers()
        elif fault.startswith("weak_etag"):
            self.send(req, data, sha, etag=f'W/"{sha}"')
        else:
            self.send(req, data, sha)

    def send(self, req, data, sha, body=None, length=None, etag=None):
        req.send_response(200)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Content-Length", str(len(data) if length is None else length))
        if etag or sha:
            req.send_header("ETag", etag or f'"{sha}"')
        req.end_headers()
        req.wfile.write(data if body is None else body)
        req.wfile.flush()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(base_dir, monkeypatch):
    hub = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    yield hub
    hub.close()


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def leftovers(data_dir):
    return sorted(n for n in os.listdir(data_dir) if not dataset.SHARD_RE.match(n) and n != ".locks")


@pytest.mark.quick
def test_shard_url_honours_hf_endpoint(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert dataset.shard_url("climbmix", 7) == (
        "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main/shard_00007.parquet")
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example/")
    assert dataset.shard_url("fineweb-edu", 0).startswith("http://mirror.example/datasets/karpathy/fineweb-edu")
    with pytest.raises(UserError, match="nanochat.corpus"):
        dataset.shard_url("builtin", 0)


@pytest.mark.quick
def test_sha256_from_etag():
    h = "ab" * 32
    assert sha256_from_etag(h) == h
    assert sha256_from_etag(f'"{h.upper()}"') == h
    assert sha256_from_etag(f'W/"{h}"') == h
    assert sha256_from_etag('"' + "a" * 40 + '"') is None  # a git sha1, not a content hash
    assert sha256_from_etag(None) is None


@pytest.mark.quick
def test_download_retries_after_server_error(hub):
    data = parquet_bytes(shard_texts(0))
    hub.add(0, data, faults=["500"])
    path = dataset.download_shard("fineweb-edu", 0, backoff=0.01)
    assert read_bytes(path) == data
    assert hub.requests["shard_00000.parquet"] == 2
    assert leftovers(os.path.dirname(path)) == []


@pytest.mark.quick
def test_download_retries_after_dropped_connection(hub):
    data = parquet_bytes(shard_texts(1, 200))
    hub.add(1, data, faults=["drop", "drop"])
    path = dataset.download_shard("fineweb-edu", 1, backoff=0.01)
    assert read_bytes(path) == data
    assert hub.requests["shard_00001.parquet"] == 3


@pytest.mark.quick
@pytest.mark.parametrize("fault", ["weak_etag", "redirect"])
def test_download_accepts_weak_etag_and_hub_style_redirect(hub, fault):
    data = parquet_bytes(shard_texts(2))
    hub.add(2, data, faults=[fault])
    assert read_bytes(dataset.download_shard("fineweb-edu", 2, backoff=0.01)) == data
    assert hub.requests["shard_00002.parquet"] == 1


@pytest.mark.quick
@pytest.mark.parametrize("fault, problem", [("bad_sha*", "sha256 mismatch"), ("bad_size*", "bytes"),
                                            ("redirect_bad_sha*", "sha256 mismatch"),
                                            ("redirect_bad_size*", "X-Linked-Size"), ("drop*", "connection broken")])
def test_download_gives_up_with_clear_error_and_no_file(hub, fault, problem):
    hub.add(3, parquet_bytes(shard_texts(3)), faults=[fault])
    data_dir = dataset.get_data_dir("fineweb-edu")
    with pytest.raises(dataset.DownloadError) as e:
        dataset.download_shard("fineweb-edu", 3, max_attempts=3, backoff=0.001)
    message = str(e.value)
    assert dataset.shard_url("fineweb-edu", 3) in message and problem in message and "3 attempts" in message
    assert hub.requests["shard_00003.parquet"] == 3
    assert leftovers(data_dir) == [] and not os.path.exists(os.path.join(data_dir, dataset.shard_filename(3)))


@pytest.mark.quick
def test_client_error_is_not_retried(hub):
    with pytest.raises(dataset.DownloadError, match="HTTP 404"):
        dataset.download_shard("fineweb-edu", 5, max_attempts=4, backoff=0.001)


@pytest.mark.quick
def test_present_shard_is_not_downloaded_again_and_stale_temp_is_replaced(hub):
    hub.add(0, parquet_bytes(shard_texts(0)))
    hub.add(1, parquet_bytes(shard_texts(1)))
    on_disk = parquet_bytes(["already here"])
    path0 = write_shard("fineweb-edu", 0, on_disk)
    data_dir = os.path.dirname(path0)
    # a killed run left temp files behind, and (as a buggy tool might) a truncated file under shard 1's name
    open(os.path.join(data_dir, "shard_00000.parquet.tmp"), "wb").close()
    with open(os.path.join(data_dir, "shard_00001.parquet.tmp"), "wb") as f:
        f.write(hub.files["shard_00001.parquet"][:50])
    with open(os.path.join(data_dir, "shard_00001.parquet"), "wb") as f:
        f.write(hub.files["shard_00001.parquet"][:50])

    summary = dataset.download_shards("fineweb-edu", [0, 1], workers=2, backoff=0.001, progress=False)
    assert (summary.downloaded, summary.skipped, summary.failed) == (1, 1, {})
    assert "shard_00000.parquet" not in hub.requests and hub.requests["shard_00001.parquet"] == 1
    assert read_bytes(path0) == on_disk
    assert read_bytes(os.path.join(data_dir, "shard_00001.parquet")) == hub.files["shard_00001.parquet"]
    assert leftovers(data_dir) == []
    assert dataset.download_shard("fineweb-edu", 0, backoff=0.001) == path0
    assert "shard_00000.parquet" not in hub.requests


@pytest.mark.quick
def test_download_shards_reports_failures_and_keeps_going(hub):
    for i in range(3):
        hub.add(i, parquet_bytes(shard_texts(i)), faults=["bad_sha*"] if i == 1 else ["500"])
    summary = dataset.download_shards("fineweb-edu", [0, 1, 2], workers=3, max_attempts=2, backoff=0.001,
                                      progress=False)
    assert summary.downloaded == 2 and summary.skipped == 0 and list(summary.failed) == [1]
    assert "shard_00001.parquet" in summary.failed[1] and "sha256" in summary.failed[1]
    assert summary.bytes == len(hub.files["shard_00000.parquet"]) + len(hub.files["shard_00002.parquet"])
    assert sorted(n for n in os.listdir(dataset.get_data_dir("fineweb-edu")) if n != ".locks") == ["shard_00000.parquet", "shard_00002.parquet"]


@pytest.mark.quick
def test_cli_downloads_train_and_val_shards(hub, capsys):
    for i in (0, 1, VAL):
        hub.add(i, parquet_bytes(shard_texts(i)))
    dataset_command(["-n", "2", "-w", "2", "--data-source", "fineweb-edu"])
    out = capsys.readouterr().out
    assert "3 downloaded, 0 already present, 0 failed" in out
    assert len(dataset.list_parquet_files("train", "fineweb-edu")) == 2
    assert dataset.list_parquet_files("val", "fineweb-edu")[0].endswith(f"shard_{VAL:05d}.parquet")
    dataset_command(["-n", "2", "--source", "fineweb-edu"])  # re-run: nothing to fetch; the flag's old spelling
    out, err = capsys.readouterr()
    assert "0 downloaded, 3 already present" in out
    assert err.splitlines()[0] == "note: --source is now --data-source (the old spelling goes in the next release)", err
    assert hub.requests == {"shard_00000.parquet": 1, "shard_00001.parquet": 1, f"shard_{VAL:05d}.parquet": 1}


@pytest.mark.quick
def test_cli_rejects_builtin_and_bad_flags(hub):
    with pytest.raises(UserError, match="no URL.*python -m nanochat.corpus"):
        dataset_command(["-n", "2", "--data-source", "builtin"])
    with pytest.raises(UserError, match="-n must be between 0 and 1822"):
        dataset_command(["-n", "5000", "--data-source", "fineweb-edu"])
