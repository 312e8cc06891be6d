"""
`python -m nanochat.dataset import` against hostile or broken input, done for real: a hub that answers a dataset
config, split or repo with '..' in it, links and special files in a folder (a link to /etc/passwd-like files, loops,
/dev/zero, a FIFO), JSON nested 200,000 deep, a lone surrogate, a compressed file far larger than it looks, a full
disk, a name ending in a newline, a NUL past the first 64 KiB, a damaged cached hub file. Each ends in a one-line
reason or a documented skip, and a refused import leaves the base dir as it was.
"""

import functools
import gzip
import json
import os
import subprocess
import sys
import tracemalloc

import pytest

from nanochat.common import UserError
from nanochat.data import text_import
from nanochat.dataset import parquets_iter_batched
from scripts.dataset import main as dataset_command

from conftest import REPO_ROOT, ParquetHub  # noqa: E402

pytestmark = pytest.mark.timeout(60)  # a regression here tends to hang (a FIFO, a loop of links), not to fail


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.delenv("NANOCHAT_DATA_SOURCE", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    return tmp_path / "base"


def rows(source, split):
    return [t for batch in parquets_iter_batched(split, source=source) for t in batch]


def tree(root):
    """Every path under root, with file sizes: what 'left as it was' compares."""
    return sorted((os.path.relpath(os.path.join(d, n), root), os.path.getsize(os.path.join(d, n)) if n in files else -1)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


def holds_nothing(base):
    """The base dir of a refused import: absent, or empty but for the folders and lock files a start makes."""
    return all(size == -1 or path.endswith(".lock") for path, size in tree(base)) if base.exists() else True


def story(i):
    return f"Story {i}: the river carried boat number {i} past the mill, and the miller counted it twice."


def write_stories(folder, count=4, start=0):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + count):
        (folder / f"story{i:02d}.txt").write_text(story(i))


# -----------------------------------------------------------------------------
# 3. A hub dataset's repo, config and split stay inside the base dir


class AnswersEveryListing(ParquetHub):
    """A hub (or a mirror in the middle) that answers any listing URL, '..' and all, with one split's files."""

    def handle(self, req):
        if req.path.startswith("/files/"):
            return super().handle(req)
        self.requests.append(req.path)
        files = self.splits[("someone/essays", "default", "train")]
        urls = [f"{self.endpoint}/files/someone/essays/default/train/{i}.parquet" for i in range(len(files))]
        self.send(req, json.dumps(urls).encode(), "application/json")


@pytest.mark.quick
@pytest.mark.parametrize("flags, message", [
    (["--hf-repo", "someone/essays", "--config", "../../../../outside"], "--config '../../../../outside' is not a plain"),
    (["--hf-repo", "someone/essays", "--split", "../../../../outside"], "--split '../../../../outside' is not a plain"),
    (["--hf-repo", "../.."], "--hf-repo '../..' is not owner/name"),
    (["--hf-repo", "someone/essays", "--config", "default\n"], "--config 'default\\n' is not a plain"),
], ids=["config", "split", "repo", "newline"])
def test_a_hub_dataset_cannot_write_outside_the_base_dir(base, tmp_path, monkeypatch, flags, message):
    hub = AnswersEveryListing()
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        hub.add("someone/essays", "default", "train", [{"text": story(i)} for i in range(8)])
        before = tree(tmp_path)
        with pytest.raises(UserError) as e:
            dataset_command(["import", "essays"] + flags)
        assert message in str(e.value)
        assert tree(tmp_path) == before and hub.requests == []  # refused before the network, nothing written
    finally:
        hub.close()


@pytest.mark.quick
def test_a_split_dir_outside_task_data_is_refused_for_every_caller(base, monkeypatch):
    from nanochat.data.hub import fetch_parquet_files

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a regression fails fast, offline

    with pytest.raises(UserError, match=r"its config '\.\./\.\.' is not a plain name"):
        fetch_parquet_files("SomeTask", "someone/essays", "../..", "train")
    assert not base.exists()


# -----------------------------------------------------------------------------
# 5. Text import: links, special files, deep JSON, surrogates, memory, a full disk


def folder_with_links(tmp_path):
    """A folder of stories beside a secret, with a link to the secret, a link to a story inside, a dangling link, a
    link to itself, a link to /dev/zero, a FIFO and a link to the folder itself (a loop)."""
    books = tmp_path / "books"
    write_stories(books)
    (books / "more").mkdir()
    (books / "more" / "real.txt").write_text("A story kept one folder down, and read through a link too.")
    (tmp_path / "secret.txt").write_text("SECRET: the password is swordfish.")
    os.symlink(tmp_path / "secret.txt", books / "passwd.txt")
    os.symlink(books / "more" / "real.txt", books / "alias.txt")
    os.symlink(tmp_path / "nowhere.txt", books / "dangling.txt")
    os.symlink(books / "loop.txt", books / "loop.txt")
    os.symlink("/dev/zero", books / "zero.txt")
    os.mkfifo(books / "fifo.txt")
    os.symlink(books, books / "again")
    return books


@pytest.mark.quick
def test_links_and_special_files_in_a_folder_are_skipped_and_counted(base, tmp_path, capsys):
    books = folder_with_links(tmp_path)
    dataset_command(["import", "books", str(books), "--val-docs", "1"])
    out = capsys.readouterr().out
    texts = rows("books", "train") + rows("books", "val")
    assert sorted(texts) == sorted([story(i) for i in range(4)] + [(books / "more" / "real.txt").read_text()])
    assert (f"skipped 2 links to a folder or out of the input (read them with --follow-links): {books / 'again'}, "
            f"{books / 'passwd.txt'}") in out
    assert f"skipped 2 broken links: {books / 'dangling.txt'}, {books / 'loop.txt'}" in out
    assert f"skipped 2 special files (FIFOs, devices, sockets): {books / 'fifo.txt'}, {books / 'zero.txt'}" in out
    manifest = json.load(open(base / "base_data" / "books" / "import.json"))
    assert manifest["inputs"][0]["duplicates"] == 1  # alias.txt: the inside link, read like its target
    # --follow-links reads the secret (the user asked for it), visits the looping folder once, and still never
    # opens a device or a FIFO
    dataset_command(["import", "books", str(books), "--val-docs", "1", "--follow-links"])
    out = capsys.readouterr().out
    assert "SECRET: the password is swordfish." in rows("books", "train") + rows("books", "val")
    assert "skipped 2 special files" in out and "links to a folder" not in out


@pytest.mark.quick
def test_a_recursive_glob_over_loops_of_links_ends(base, tmp_path):
    """Two links back to their folder: glob.glob('d/**/*.txt') follows them 2^40 ways; the import does not."""
    books = tmp_path / "books"
    write_stories(books)
    os.symlink(books, books / "a")
    os.symlink(books, books / "b")
    dataset_command(["import", "books", str(books / "**" / "*.txt"), "--val-docs", "1"])
    assert len(rows("books", "train") + rows("books", "val")) == 4
    dataset_command(["import", "books2", str(books / "**" / "*.txt"), "--val-docs", "1", "--follow-links"])
    assert len(rows("books2", "train") + rows("books2", "val")) == 4


@pytest.mark.quick
def test_a_fifo_or_a_device_named_as_an_input_is_refused(base, tmp_path):
    os.mkfifo(tmp_path / "fifo.txt")
    os.symlink("/dev/zero", tmp_path / "zero.txt")
    for name in ("fifo.txt", "zero.txt"):
        with pytest.raises(UserError, match=rf"input {tmp_path / name} is not a regular file"):
            dataset_command(["import", "x", str(tmp_path / name)])
    assert holds_nothing(base)


@pytest.mark.quick
@pytest.mark.parametrize("kind", [".jsonl", ".json"])
def test_json_nested_200000_deep_is_one_line(base, tmp_path, kind):
    deep = "[" * 200_000 + "]" * 200_000
    path = tmp_path / f"deep{kind}"
    path.write_text(json.dumps({"text": story(0)}) + "\n" + deep + "\n" if kind == ".jsonl" else deep)
    where = f"{path} line 2" if kind == ".jsonl" else f"{path}"
    with pytest.raises(UserError, match=rf"{where}: JSON nested too deep to read"):
        dataset_command(["import", "x", str(path)])
    assert holds_nothing(base)


@pytest.mark.quick
def test_a_lone_surrogate_in_json_is_replaced_and_counted(base, tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "half a pair \\ud800 here"}\n' + "".join(json.dumps({"text": story(i)}) + "\n"
                                                                      for i in range(3)))
    dataset_command(["import", "s", str(path), "--val-docs", "1"])
    assert "half a pair \ufffd here" in rows("s", "train") + rows("s", "val")
    assert json.load(open(base / "base_data" / "s" / "import.json"))["inputs"][0]["invalid_utf8"] == 1


def peak_python_memory(consume):
    tracemalloc.start()
    try:
        consume()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.quick
def test_a_compressed_file_is_read_in_chunks_not_whole(tmp_path, monkeypatch):
    """8 MB of text in a ~50 KB .gz: reading its documents (blank-line blocks, JSONL lines) holds a chunk or two of
    it, not the whole file; a single document beyond MAX_DOC_CHARS is refused, not held."""
    paragraph = " ".join(story(i) for i in range(8))  # ~750 characters
    (tmp_path / "big.txt.gz").write_bytes(gzip.compress(("\n\n".join([paragraph] * 11_000)).encode(), 1))
    (tmp_path / "big.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps({"text": paragraph}) + "\n" for _ in range(10_000)).encode(), 1))
    options = text_import.ImportOptions(split_on="blank-lines")
    for name in ("big.txt.gz", "big.jsonl.gz"):
        stats = text_import.InputStats(name)
        count = []
        peak = peak_python_memory(lambda: count.append(sum(1 for _ in text_import.documents_in_file(
            str(tmp_path / name), options, stats))))
        assert count[0] >= 10_000 and peak < 4_000_000, (name, peak)  # the text alone is 8 MB
    monkeypatch.setattr(text_import, "MAX_DOC_CHARS", 100_000, raising=False)
    with pytest.raises(UserError, match=r"big.txt.gz: a document of more than 100,000 characters"):
        list(text_import.documents_in_file(str(tmp_path / "big.txt.gz"), text_import.ImportOptions(),
                                           text_import.InputStats("big")))


@pytest.mark.quick
def test_reading_in_chunks_cuts_documents_exactly_as_reading_whole_did(tmp_path, monkeypatch):
    """Chunks of 3 bytes, so every "\r\n", multi-byte character and blank line falls across a boundary somewhere: the
    whole text, its lines and its blank-line blocks are what text.replace("\r\n", "\n"), .split("\n") and
    re.split(r"\n[ \t]*\n", ...) give for the text read whole."""
    import random
    import re

    monkeypatch.setattr(text_import, "READ_BYTES", 3, raising=False)
    rng = random.Random(0)
    path = tmp_path / "t.txt"
    for _ in range(300):
        pieces = ["a", "b", " ", "\t", "\n", "\n", "\r", "\r\n", "é", "🚀"]
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        path.write_bytes(text.encode())
        whole = text.replace("\r\n", "\n")
        stats = text_import.InputStats("t")
        assert text_import.whole_text(str(path), stats, 1000) == whole
        assert list(text_import.text_lines(str(path), stats)) == whole.split("\n")
        assert list(text_import.blank_line_blocks(str(path), stats)) == re.split(r"\n[ \t]*\n", whole), repr(text)
        assert stats.invalid_utf8 == 0


def test_a_full_disk_is_one_line_and_the_previous_source_is_kept(base, tmp_path):
    """A re-import whose shards cannot be written (files may not grow past 200 KB: the kernel's EFBIG, as a full disk's
    ENOSPC) says so in one line, and the source built before is intact, with no temp dir left."""
    books = tmp_path / "books"
    write_stories(books)
    dataset_command(["import", "books", str(books), "--val-docs", "1"])
    before = sorted(rows("books", "train") + rows("books", "val"))
    snapshot = tree(base)
    # incompressible text, so the train shard outgrows the limit
    noise = os.urandom(300_000).hex()
    (books / "big.txt").write_text(" ".join(noise[i:i + 9] for i in range(0, len(noise), 9)))

    def small_disk():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    p = subprocess.run([sys.executable, "-m", "nanochat.dataset", "import", "books", str(books), "--val-docs", "1"],
                       env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=120, preexec_fn=small_disk)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"cannot write the books source in {base / 'base_data'} (File too large); nothing was changed" in p.stderr
    assert sorted(rows("books", "train") + rows("books", "val")) == before
    assert [path for path in tree(base) if path not in snapshot] == []


# -----------------------------------------------------------------------------
# 9. Names ending in a newline, a NUL past 64 KiB, a damaged cached hub file


@pytest.mark.quick
def test_a_name_tag_or_repo_ending_in_a_newline_is_refused(base, tmp_path):
    from nanochat.checkpoint_manager import checkpoint_dir
    from nanochat.data.hub import parse_repo_id

    write_stories(tmp_path / "books")
    with pytest.raises(UserError, match=r"'books\\n' is not a plain source name"):
        dataset_command(["import", "books\n", str(tmp_path / "books")])
    assert not base.exists()
    with pytest.raises(UserError, match=r"model tag 'd4\\n' must be a plain name"):
        checkpoint_dir("base", "d4\n")
    assert parse_repo_id("someone/model\n") is None and parse_repo_id("someone/model@main\n") is None
    assert parse_repo_id("someone/model@refs/pr/1") == ("someone/model", "refs/pr/1")
    assert parse_repo_id("someone/model@../../x") is None


@pytest.mark.quick
def test_a_nul_byte_anywhere_makes_a_file_binary(base, tmp_path):
    path = tmp_path / "late.txt"
    path.write_bytes(story(0).encode() * 1000 + b"\0\x01\x02 binary from here on")  # the NUL past 64 KiB
    with pytest.raises(UserError, match=rf"{path} looks binary"):
        dataset_command(["import", "x", str(path)])
    assert holds_nothing(base)


@pytest.mark.quick
def test_a_damaged_cached_hub_file_says_what_to_delete(base, monkeypatch):
    hub = ParquetHub()
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        hub.add("someone/essays", "default", "train", [{"text": story(i)} for i in range(8)])
        args = ["import", "essays", "--hf-repo", "someone/essays", "--val-docs", "2"]
        dataset_command(args)
        cached = base / "task_data" / "someone" / "essays" / "default" / "train" / "part-0000.parquet"
        cached.write_bytes(cached.read_bytes()[:100])  # cut short on disk, after its download was checked
        with pytest.raises(UserError) as e:
            dataset_command(args)
        assert f"cannot read {cached} as parquet" in str(e.value)
        assert f"delete {cached.parent} to download the split again" in str(e.value)
        assert len(rows("essays", "train")) == 6  # the source built before is as it was
    finally:
        hub.close()


@pytest.mark.quick
def test_a_hub_file_that_is_not_parquet_is_never_cached(base, monkeypatch):
    """The server sends something else under a parquet URL: the download is retried and refused, not kept."""
    hub = ParquetHub()
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        hub.splits[("someone/essays", "default", "train")] = [b"<html>rate limited</html>"]
        from nanochat import download
        from nanochat.data import hub as hub_module

        monkeypatch.setattr(hub_module, "download_file", functools.partial(download.download_file, backoff=0.001))

        with pytest.raises(UserError, match=r"not a parquet file"):
            hub_module.fetch_parquet_files("T", "someone/essays", "default", "train", label="t")
        split = base / "task_data" / "someone" / "essays" / "default" / "train"
        assert sorted(os.listdir(split)) == [".lock"]
    finally:
        hub.close()


# -----------------------------------------------------------------------------
# Hardening VI, 4: memory grows with a file's size, not with what it decompresses to


@pytest.mark.quick
def test_a_parquet_of_huge_cells_is_refused_from_its_footer_before_any_is_built(base, tmp_path, monkeypatch):
    """The attack at 1/16 of its size, the limits too (a document 2^22 characters, a row group 2^24 bytes): a zstd
    parquet of a few KB whose 8 cells hold 6.25 M characters each. Arrow built the whole batch and Python every cell
    before the first was measured (1.6 GiB at full size); the row group's size in the footer is refused first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from conftest import rss_growth

    monkeypatch.setattr(text_import, "MAX_DOC_CHARS", 1 << 22, raising=False)
    monkeypatch.setattr(text_import, "MAX_ROW_GROUP_BYTES", 1 << 24, raising=False)
    path = tmp_path / "cells.parquet"
    pq.write_table(pa.table({"text": ["x" * 6_250_000] * 8}), path, compression="zstd", use_dictionary=False)
    assert path.stat().st_size < 100_000
    with rss_growth() as grew, pytest.raises(UserError, match=r"cells.parquet: row group 0 holds 50,000,\d{3} bytes of "
                                                              r"column 'text' decompressed, more than the 16,777,216"):
        dataset_command(["import", "x", str(path)])
    assert grew["bytes"] < 24 << 20, grew
    assert holds_nothing(base)


@pytest.mark.quick
def test_a_parquet_dictionary_value_is_not_decoded_once_per_row(tmp_path):
    """1,000 rows naming one 256 K-character dictionary value, in a file of a few KB: Arrow decoded the value once per
    row (256 MB, and as much again in Python strings) before any cell was measured. Read as a dictionary, each row's
    text is made as it is reached."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from conftest import rss_growth

    path = tmp_path / "dictionary.parquet"
    pq.write_table(pa.table({"text": [story(0) * 2800] * 1000}), path, compression="zstd")
    assert path.stat().st_size < 100_000 and pq.ParquetFile(path).metadata.row_group(0).column(0).has_dictionary_page
    count = 0
    with rss_growth() as grew:
        for text in text_import.documents_in_file(str(path), text_import.ImportOptions(), text_import.InputStats("d")):
            count += len(text) == len(story(0)) * 2800
    assert count == 1000 and grew["bytes"] < 48 << 20, grew


@pytest.mark.quick
def test_a_json_list_is_read_a_record_at_a_time(tmp_path):
    """The attack scaled down: a .json.gz of 20,000 records, each a text and 100 empty lists (6 MB of JSON in a few
    tens of KB). json.loads of the whole file built all 2 M lists (~130 MB here; 4.8 M tiny records took 2 GiB at a
    quarter of the size allowed); read a record at a time, one is held."""
    from conftest import rss_growth

    record = json.dumps({"text": story(1), "x": [[]] * 100}, separators=(",", ":"))
    path = tmp_path / "many.json.gz"
    path.write_bytes(gzip.compress(("[" + ",".join([record] * 20_000) + "]").encode(), 1))
    count = 0
    with rss_growth() as grew:
        for text in text_import.documents_in_file(str(path), text_import.ImportOptions(), text_import.InputStats("m")):
            count += text == story(1)
    assert count == 20_000 and grew["bytes"] < 24 << 20, grew


@pytest.mark.quick
@pytest.mark.parametrize("kind", [".jsonl", ".json"])
def test_a_record_of_more_json_values_than_the_bound_is_refused_before_parsing(base, tmp_path, monkeypatch, kind):
    """One record, 6 M characters of '[],': 2 M lists (~130 MB) once parsed, from a line a tenth of the 2^26 a document
    may have. The values are counted in the text, and refused, before anything is parsed; the bound is lowered to
    2^16 here, so that the .json file is refused as its first 256 KB are read rather than after 1 MB of them."""
    from conftest import rss_growth

    monkeypatch.setattr(text_import, "MAX_RECORD_VALUES", 1 << 16, raising=False)
    record = json.dumps({"text": story(2), "x": [[]] * 2_000_000}, separators=(",", ":"))
    path = tmp_path / f"wide{kind}"
    path.write_text(json.dumps({"text": story(3)}) + "\n" + record + "\n" if kind == ".jsonl" else f"[{record}]")
    where = f"{path} line 2" if kind == ".jsonl" else f"{path} item 0"
    with rss_growth() as grew, pytest.raises(UserError, match=rf"{where}: a record of more than 65,536 JSON values"):
        dataset_command(["import", "x", str(path)])
    assert grew["bytes"] < 48 << 20, grew
    assert holds_nothing(base)
