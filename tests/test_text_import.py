"""`python -m nanochat.dataset import`: a user's own text (files, folders, globs, a hub dataset) as a data source."""

import gzip
import json
import os
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset
from nanochat.common import UserError
from nanochat.data import text_import
from nanochat.dataset import list_parquet_files, parquets_iter_batched
from scripts import bench
from scripts.dataset import main as dataset_command

from conftest import REPO_ROOT, ParquetHub  # noqa: E402
from test_run_hardening import read_only_command  # noqa: E402

GERMAN = "Grüße aus Köln: Die Straßenbahn fährt über die Brücke, während es draußen schneit."
JAPANESE = "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。"
EMOJI = "Launch day 🚀🎉 — the team shipped it, and the coffee ☕ ran out by noon."


def english(i, sentences=3):
    return " ".join(f"Story {i} sentence {k}: the river carried boat number {i * 7 + k} past the mill." for k in
                    range(sentences))


def write_inputs(root):
    """A folder of every input kind, and the documents it holds (stripped), in no particular order."""
    os.makedirs(root / "books" / "more")
    docs = []
    for i in range(12):  # .txt, one document per file, in nested folders
        text = english(i, sentences=2 + i % 4)
        (root / "books" / ("more" if i % 2 else "") / f"story{i:02d}.txt").write_text(text + "\n", encoding="utf-8")
        docs.append(text)
    (root / "books" / "de.md").write_text(GERMAN, encoding="utf-8")
    (root / "books" / "ja.txt").write_text(JAPANESE, encoding="utf-8")
    (root / "books" / "emoji.txt.gz").write_bytes(gzip.compress(EMOJI.encode()))
    (root / "books" / "notes.csv").write_text("ignored,because,not,a,text,kind\n")
    docs += [GERMAN, JAPANESE, EMOJI]
    with open(root / "dump.jsonl", "w", encoding="utf-8") as f:  # a nested field, and a blank line
        for i in range(8):
            f.write(json.dumps({"id": i, "meta": {"body": f"JSON record {i}: " + english(100 + i)}}) + "\n")
            docs.append(f"JSON record {i}: " + english(100 + i))
        f.write("\n")
    table = pa.table({"content": [f"Parquet row {i}. " + english(200 + i) for i in range(6)]})
    pq.write_table(table, root / "rows.parquet")
    docs += table.column("content").to_pylist()
    with pa.output_stream(str(root / "more.jsonl.zst"), compression="zstd") as f:
        f.write(json.dumps({"meta": {"body": "Zstd record: " + english(300)}}).encode() + b"\n")
    docs.append("Zstd record: " + english(300))
    return docs


def rows(source, split):
    return [t for batch in parquets_iter_batched(split, source=source) for t in batch]


def import_args(root, *extra):
    return ["import", "mine", str(root / "books"), str(root / "dump.jsonl"), str(root / "rows.parquet"),
            str(root / "*.zst"), "--field", "meta.body", "--column", "content", *extra]


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.delenv("NANOCHAT_DATA_SOURCE", raising=False)
    return tmp_path / "base"


@pytest.mark.quick
def test_every_input_kind_becomes_one_source_with_a_stable_hashed_val_split(base, tmp_path, capsys):
    docs = write_inputs(tmp_path)
    dataset_command(import_args(tmp_path, "--val-docs", "4"))
    out = capsys.readouterr().out
    assert "import mine: 1 train shard(s) + val shard shard_00000.parquet" in out and "documents" in out
    val, train = rows("mine", "val"), rows("mine", "train")
    assert len(val) == 4 and len(train) == len(docs) - 4 and sorted(val + train) == sorted(docs)
    assert {GERMAN, JAPANESE, EMOJI} <= set(val + train)  # UTF-8 of every script survives
    assert list_parquet_files("val", source="mine")[0].endswith("base_data/mine/shard_00000.parquet")
    manifest = json.loads((base / "base_data" / "mine" / "import.json").read_text())
    assert [s["documents"] for s in manifest["inputs"]] == [15, 8, 6, 1]
    assert sum(s["val_documents"] for s in manifest["inputs"]) == 4
    # Training rows come in hash order, not input order: a folder sorted by topic is not fed topic by topic.
    assert train != [d for d in docs if d in set(train)]

    # The same documents, inputs in another order, into another base dir: the same val split and the same rows.
    os.environ["NANOCHAT_BASE_DIR"] = str(tmp_path / "other")
    args = import_args(tmp_path, "--val-docs", "4")
    dataset_command(args[:2] + list(reversed(args[2:6])) + args[6:])
    assert rows("mine", "val") == val and rows("mine", "train") == train

    # --val-frac: membership by hash range, so more documents never move one across the split.
    os.environ["NANOCHAT_BASE_DIR"] = str(tmp_path / "frac")
    dataset_command(import_args(tmp_path, "--val-frac", "0.3"))
    frac_val = set(rows("mine", "val"))
    (tmp_path / "books" / "extra.txt").write_text(english(999))
    dataset_command(import_args(tmp_path, "--val-frac", "0.3"))
    assert frac_val <= set(rows("mine", "val")) and english(999) in set(rows("mine", "val") + rows("mine", "train"))


@pytest.mark.quick
def test_duplicates_empty_and_invalid_utf8_are_counted_and_blank_lines_split(base, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("First paragraph.\n\nSecond paragraph,\nstill second.\n  \n\nThird.\n\n")
    (folder / "b.txt").write_text("Second paragraph,\nstill second.")  # a duplicate of a's second block
    (folder / "c.txt").write_bytes(b"caf\xe9 au lait, na\xefve")  # latin-1, not UTF-8
    (folder / "d.txt").write_text("   \n")
    dataset_command(["import", "blocks", str(folder), "--split-on", "blank-lines", "--val-docs", "1"])
    stats = json.loads((base / "base_data" / "blocks" / "import.json").read_text())["inputs"][0]
    assert (stats["documents"], stats["duplicates"], stats["empty"], stats["invalid_utf8"]) == (4, 1, 2, 2)
    texts = set(rows("blocks", "val") + rows("blocks", "train"))
    assert texts == {"First paragraph.", "Second paragraph,\nstill second.", "Third.", "caf\ufffd au lait, na\ufffdve"}
    out = capsys.readouterr().out
    assert "duplicates" in out and "bad UTF-8" in out


@pytest.mark.quick
def test_cut_document_keeps_every_character_and_no_piece_is_longer():
    paragraphs = [english(i, sentences=1 + i % 5) for i in range(20)]
    documents = ["\n\n".join(paragraphs), "\n".join(paragraphs), " ".join(paragraphs), JAPANESE * 20,
                 "x" * 1000, "short"]
    for doc in documents:
        for limit in (50, 120, 333):
            pieces = text_import.cut_document(doc, limit)
            assert "".join(pieces) == doc and all(0 < len(p) <= limit for p in pieces)
    pieces = text_import.cut_document("\n\n".join(paragraphs), 400)
    assert all(p.endswith("\n\n") for p in pieces[:-1])  # cut at blank lines when there are any in reach
    pieces = text_import.cut_document(" ".join(paragraphs), 400)
    assert all(p.endswith(". ") for p in pieces[:-1])  # else at sentence ends


@pytest.mark.quick
def test_max_doc_chars_pieces_and_idempotent_reimport(base, tmp_path, capsys):
    folder = tmp_path / "long"
    folder.mkdir()
    docs = ["\n\n".join(english(10 * i + k, 4) for k in range(6)) for i in range(5)]
    for i, doc in enumerate(docs):
        (folder / f"{i}.md").write_text(doc)
    args = ["import", "long", str(folder), "--max-doc-chars", "300", "--val-docs", "1", "--max-seq-len", "32"]
    dataset_command(args)
    out = capsys.readouterr().out
    assert "at --max-seq-len=32 the loader would crop" in out
    pieces = rows("long", "val") + rows("long", "train")
    assert max(map(len, pieces)) <= 300
    # exactly the documents' pieces (which join back into them: test_cut_document_...), none cropped or lost
    assert sorted(pieces) == sorted(p for doc in docs for p in text_import.cut_document(doc, 300))
    manifest = json.loads((base / "base_data" / "long" / "import.json").read_text())
    assert manifest["inputs"][0]["cut"] == 5

    shard = base / "base_data" / "long" / "shard_00001.parquet"
    mtime = shard.stat().st_mtime_ns
    dataset_command(args)
    assert "nothing to do" in capsys.readouterr().out and shard.stat().st_mtime_ns == mtime
    (folder / "0.md").write_text("A changed document.")
    dataset_command(args)
    assert "nothing to do" not in capsys.readouterr().out
    assert "A changed document." in rows("long", "val") + rows("long", "train")
    assert not [n for n in os.listdir(base / "base_data") if n.startswith(".long.") and not n.endswith(".lock")]


@pytest.mark.quick
def test_hub_dataset_import_through_the_parquet_api(base, monkeypatch, capsys):
    hub = ParquetHub()
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        hub.add("someone/essays", "default", "train", [{"essay": english(i)} for i in range(10)],
                [{"essay": english(i)} for i in range(10, 16)])
        args = ["import", "essays", "--hf-repo", "someone/essays", "--column", "essay", "--val-docs", "2"]
        dataset_command(args)
        assert len(rows("essays", "val")) == 2 and len(rows("essays", "train")) == 14
        fetched = len(hub.requests)
        dataset_command(args)
        assert "nothing to do" in capsys.readouterr().out and len(hub.requests) == fetched  # files kept locally
        with pytest.raises(UserError, match="import --hf-repo someone/missing: cannot list the parquet files"):
            dataset_command(["import", "missing", "--hf-repo", "someone/missing"])
        assert not (base / "base_data" / "missing").exists()
    finally:
        hub.close()


@pytest.mark.slow  # 10 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_an_imported_source_trains_tokenizes_and_evaluates(base, tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "all.txt").write_text("\n\n".join(english(i, 3) + " " + GERMAN for i in range(400)))
    dataset_command(["import", "river", str(corpus), "--split-on", "blank-lines", "--val-docs", "40"])
    env = dict(os.environ, NANOCHAT_DATA_SOURCE="river", OMP_NUM_THREADS="1")

    def run(*cmd):
        p = subprocess.run([sys.executable, "-m", *cmd], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        return p.stdout

    run("scripts.tok_train", "--max-chars=200000", "--vocab-size=300")
    out = run("scripts.base_train", "--depth=2", "--aspect-ratio=32", "--head-dim=32", "--max-seq-len=64",
              "--device-batch-size=2", "--total-batch-size=256", "--num-iterations=20", "--eval-every=20",
              "--eval-tokens=1024", "--core-metric-every=-1", "--sample-every=-1", "--data-source=river")
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")
              and "loss " in line]
    assert losses and losses[-1] < losses[0]
    out = run("scripts.base_loss", "--device-batch-size=2", "--split-tokens=1024", "--data-source=river")
    assert "val" in out and "bpb" in out
    listing = run("nanochat.dataset", "list")
    assert "river" in listing and "imported" in listing and "shard_00000.parquet" in listing
    # bench quality on it, with a tokenizer of its own size: the source is linked into bench's workspace
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "river")
    capsys.readouterr()
    bench.main(["quality", "--data-source=river", "--depth=1", "--seq-len=32", "--total-batch-size=128",
                "--device-batch-size=2", "--steps=2", "--eval-at", "2", "--eval-tokens=256", "--seeds", "1",
                "--vocab-size=290"])
    assert "quality: val bpb on river" in capsys.readouterr().out
    assert os.path.islink(next((tmp_path / "tmp" / "nanochat_bench_quality").iterdir()) / "base_data" / "river")


BAD = [
    (["import", "x", "{root}/nothing_here"], "input {root}/nothing_here does not exist"),
    (["import", "x", "{root}/empty_dir"], "input folder {root}/empty_dir holds no"),
    (["import", "x", "{root}/bad.jsonl"], "{root}/bad.jsonl line 2: not JSON"),
    (["import", "x", "{root}/nofield.jsonl", "--field", "meta.body"], "{root}/nofield.jsonl line 1: no field 'meta.body'"),
    (["import", "x", "{root}/t.parquet", "--column", "body"], "{root}/t.parquet has no column 'body'"),
    (["import", "x", "{root}/binary.txt"], "{root}/binary.txt looks binary"),
    (["import", "x", "{root}/good", "--val-frac", "0.0001"], "val shard would be empty"),
    (["import", "x", "{root}/good", "--val-docs", "3"], "would take every one of the 3 documents"),
    (["import", "climbmix", "{root}/good"], "'climbmix' is a built-in source"),
    (["import", "../up", "{root}/good"], "'../up' is not a plain source name"),
]


def make_bad_inputs(root):
    (root / "empty_dir").mkdir()
    (root / "empty_dir" / "x.csv").write_text("a,b")
    (root / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (root / "nofield.jsonl").write_text('{"meta": {"title": "no body"}}\n')
    pq.write_table(pa.table({"text": ["a"]}), root / "t.parquet")
    (root / "binary.txt").write_bytes(b"\x7fELF\x00\x00\x01binary")
    (root / "good").mkdir()
    for i in range(3):
        (root / "good" / f"{i}.txt").write_text(english(i))


@pytest.mark.quick
@pytest.mark.parametrize("argv,message", BAD, ids=["missing", "no-files", "not-json", "no-field", "no-column", "binary",
                                                  "val-empty", "val-all", "hub-name", "not-plain"])
def test_bad_input_names_the_file_and_writes_nothing(base, tmp_path, argv, message):
    make_bad_inputs(tmp_path)
    argv = [a.format(root=tmp_path) for a in argv]
    with pytest.raises(UserError) as e:
        dataset_command(argv)
    assert message.format(root=tmp_path) in str(e.value)
    data = base / "base_data"
    assert not data.exists() or [n for n in os.listdir(data) if not n.endswith(".lock")] == []


def test_bad_input_exits_1_and_an_unknown_source_says_how_to_import(base, tmp_path):
    make_bad_inputs(tmp_path)
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "nanochat.dataset", "import", "x", str(tmp_path / "bad.jsonl")], env=env,
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "line 2: not JSON" in p.stderr and "Traceback" not in p.stderr
    with pytest.raises(UserError, match=r"'nope' is not a data source.*python -m nanochat.dataset import nope"):
        dataset.get_source("nope")
    # A read-only base dir: refused before any input is read.
    base.mkdir(exist_ok=True)
    before = sorted(os.walk(base))
    p = subprocess.run(read_only_command(str(base), [sys.executable, "-m", "nanochat.dataset", "import", "x",
                                                     str(tmp_path / "good")]),
                       env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "cannot write" in p.stderr and "Read-only file system" in p.stderr, p.stderr
    assert sorted(os.walk(base)) == before
