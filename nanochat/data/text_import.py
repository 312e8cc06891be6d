"""
Your own text as a data source: `python -m nanochat.dataset import NAME INPUT...` turns files, folders and globs of
.txt/.md, .jsonl/.json and .parquet (each optionally .gz or .zst), or a Hugging Face dataset split, into
base_data/NAME/shard_XXXXX.parquet with one `text` column, which every stage trains on by name (--data-source NAME).
What an import does to the text and why (val split and row order by hash, cuts, dedupe, bounded memory, which files a
folder yields, atomic and idempotent rebuilds) is told in docs/data.md.
"""

import codecs
import contextlib
import fnmatch
import glob
import gzip
import hashlib
import heapq
import itertools
import json
import os
import re
import shutil
import stat
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from filelock import FileLock

from nanochat.common import (JSON_TOO_DEEP, UserError, atomic_write_text, ensure_writable, get_base_dir, json_loads,
                             print0, read_json_object, sha256_of)
from nanochat.dataset import IMPORT_MANIFEST, is_plain_name

FORMAT_VERSION = 1  # bump when the same inputs and options would give other shards
VAL_INDEX = 0
TEXT_EXTS, JSON_EXTS, PARQUET_EXTS = (".txt", ".md"), (".jsonl", ".json"), (".parquet",)
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
DEFAULT_VAL_FRAC = 0.01
SHARD_CHARS = 250_000_000  # about the hub shards' size (~250 M characters each)
MAX_ROWS_PER_GROUP = 1024  # the hub shards' row groups; smaller for a small source, so 8 ranks x 8 groups exist
NUM_BUCKETS = 64
CHARS_PER_TOKEN = 4.0  # the estimate when no tokenizer has been trained yet (English BPE: ~4 characters a token)
RECORD = struct.Struct("<QQIII")  # piece hash, document hash, input index, piece index, text bytes
READ_BYTES = 1 << 18  # files are read, decompressed and decoded this much at a time
MAX_DOC_CHARS = 1 << 26  # one document held whole (a .txt file with --split-on file, a JSONL line): ~64 M characters
# What a parse builds, beyond its text: a record's JSON values (a JSONL line, an item of a .json list), each an object
# of 24-64 bytes for 2-3 characters ("[],"), so 2^26 characters of them would be ~2 GiB; this many are ~70 MB.
MAX_RECORD_VALUES = 1 << 20
# A parquet row group's text column, decompressed, as its footer says: a batch of it is built before any cell can be
# measured, so it may hold one longest document in 4-byte UTF-8 and no more (8 cells of 100 M took 1.6 GiB).
MAX_ROW_GROUP_BYTES = 4 * MAX_DOC_CHARS
PARQUET_SLICE_CHARS = 1 << 22  # a parquet batch's cells become Python strings about this many characters at a time
BLANK_LINE = re.compile(r"[ \t]*")
KINDS = "/".join(TEXT_EXTS + JSON_EXTS + PARQUET_EXTS) + " (optionally .gz or .zst)"  # for error messages
SKIPPED = {  # what a folder or glob holds that is not read, as the summary words it
    "links": "links to a folder or out of the input (read them with --follow-links)",
    "broken": "broken links",
    "special": "special files (FIFOs, devices, sockets)",
}


def _count_invalid(error):
    """U+FFFD for what cannot be decoded (invalid UTF-8) or encoded (a lone surrogate, which JSON's \\ud800 escapes
    carry), counting each replacement."""
    if isinstance(error, UnicodeEncodeError):
        count = error.end - error.start
        _count_invalid.replaced += count
        return "\ufffd".encode("utf-8") * count, error.end  # utf-8's encoder takes back bytes, or ASCII-only text
    _count_invalid.replaced += 1
    return "\ufffd", error.end


_count_invalid.replaced = 0
codecs.register_error("nanochat_count_replace", _count_invalid)


def _counting_invalid(stats, convert, *args):
    """convert(*args) (a decode or an encode with errors="nanochat_count_replace"), adding its replacements to
    stats.invalid_utf8."""
    _count_invalid.replaced = 0
    result = convert(*args)
    stats.invalid_utf8 += _count_invalid.replaced
    return result


# -----------------------------------------------------------------------------
# Options and inputs


@dataclass
class ImportOptions:
    split_on: str = "file"  # "file": one document per .txt/.md file; "blank-lines": documents between blank lines
    field: str = "text"  # JSON(L): the (dotted) field holding the text
    column: str = "text"  # parquet: the column holding the text
    val_docs: int | None = None
    val_frac: float | None = None
    max_doc_chars: int | None = None
    max_seq_len: int = 2048  # only for the summary's estimate of what the loader would crop


@dataclass
class Input:
    """One INPUT argument (or the hub dataset): its label in the summary, its files, and how it was given."""
    label: str
    files: list  # paths, sorted
    fingerprint: dict = field(default_factory=dict)  # what makes a re-import a no-op when unchanged
    skipped: dict = field(default_factory=dict)  # kind (a key of SKIPPED) -> paths in its folder left unread
    when_unreadable: str = ""  # what to do when one of its files cannot be read (a hub download: delete it)


def split_extension(path):
    """('.jsonl', 'gzip') for data.jsonl.gz; (ext, None) uncompressed; ext '' when not a supported kind."""
    lower = path.lower()
    compression = None
    for suffix, codec in COMPRESSIONS.items():
        if lower.endswith(suffix):
            lower, compression = lower[: -len(suffix)], codec
    ext = os.path.splitext(lower)[1]
    return (ext if ext in TEXT_EXTS + JSON_EXTS + PARQUET_EXTS else ""), compression


def _has_magic(part):
    return any(c in part for c in "*?[")


class _Finder:
    """The files under one input folder (or a glob's fixed leading folders), and what is left unread and why: links
    out of the folder or to a folder unless follow_links (each real folder then visited once), and special files."""

    def __init__(self, root, follow_links):
        self.root_real = os.path.realpath(root or ".")
        self.follow_links = follow_links
        self.skipped = {}
        self.visited = set()  # (device, inode) of folders already listed

    def skip(self, kind, path):
        """Record path as left unread; None, what kind() answers for it."""
        self.skipped.setdefault(kind, []).append(path)

    def kind(self, path):
        """'dir' (to descend into), 'file' (to read) or None: a skipped entry, or a file of no kind we read."""
        try:
            st = os.lstat(path)
        except OSError:  # gone since it was listed, or a glob's literal part that names nothing
            return None
        is_link = stat.S_ISLNK(st.st_mode)
        try:
            st = os.stat(path) if is_link else st  # where a link leads
        except OSError:  # a dangling link, or a loop of links
            return self.skip("broken", path)
        if stat.S_ISDIR(st.st_mode):
            return self.skip("links", path) if is_link and not self.follow_links else "dir"
        if not split_extension(path)[0]:
            return None
        if not stat.S_ISREG(st.st_mode):
            return self.skip("special", path)
        if self.follow_links or os.path.commonpath([self.root_real, os.path.realpath(path)]) == self.root_real:
            return "file"
        return self.skip("links", path)

    def list_dir(self, directory):
        try:
            return sorted(os.listdir(directory or "."))
        except OSError as e:
            raise UserError(f"cannot list the folder {directory or '.'} ({e.strerror or e})") from None

    def folder(self, top):
        """The files under top in os.walk's order (a folder's own files, sorted, before its subfolders'); hidden
        names skipped. A stack, not recursion: a folder tree may be deeper than Python's recursion limit."""
        files, stack = [], [top]
        while stack:
            directory = stack.pop()
            st = os.stat(directory)
            if (st.st_dev, st.st_ino) in self.visited:
                continue
            self.visited.add((st.st_dev, st.st_ino))
            subfolders = []
            for name in self.list_dir(directory):
                if name.startswith("."):
                    continue
                path = os.path.join(directory, name)
                kind = self.kind(path)
                if kind == "file":
                    files.append(path)
                elif kind == "dir":
                    subfolders.append(path)
            stack.extend(reversed(subfolders))
        return files

    def glob(self, root, parts):
        """The paths under root matching the pattern's parts, as glob.glob(recursive=True) matches them ('**' for
        any depth of folders, '*' not matching a hidden name), without following a link to a folder (with
        follow_links: each real folder once per pattern part)."""
        found, stack, seen = set(), [(root, 0)], set()
        while stack:
            path, i = stack.pop()
            if i == len(parts):
                found.add(path)
                continue
            part = parts[i]
            if not _has_magic(part):
                stack.append((os.path.join(path, part), i + 1))
                continue
            if not os.path.isdir(path or "."):
                continue
            st = os.stat(path or ".")
            if (st.st_dev, st.st_ino, i) in seen:  # '**' through a followed link back to a folder already expanded
                continue
            seen.add((st.st_dev, st.st_ino, i))
            for name in self.list_dir(path):
                if name.startswith(".") and not part.startswith("."):
                    continue
                child = os.path.join(path, name)
                if part == "**":
                    if i + 1 == len(parts):
                        found.add(child)
                    if os.path.isdir(child) and (self.follow_links or not os.path.islink(child)):
                        stack.append((child, i))
                elif fnmatch.fnmatchcase(name, part):
                    stack.append((child, i + 1))
            if part == "**":
                stack.append((path, i + 1))  # '**' matching no folder at all
        return sorted(found)


def expand_input(arg, follow_links=False):
    """(files, skipped) for one INPUT argument: a file (read wherever it leads, if a regular file), a folder
    (searched recursively) or a glob."""
    if _has_magic(arg) or os.path.isdir(arg):
        if _has_magic(arg):
            parts = arg.split(os.sep)
            fixed = next(i for i, part in enumerate(parts) if _has_magic(part))
            root = os.sep.join(parts[:fixed]) or ("" if fixed == 0 else os.sep)
            finder = _Finder(root, follow_links)
            files = [p for p in finder.glob(root, parts[fixed:]) if finder.kind(p) == "file"]
            what = f"input {arg} matches"
        else:
            finder = _Finder(arg, follow_links)
            files, what = finder.folder(arg), f"input folder {arg} holds"
        if not files:
            counts = ", ".join(f"{len(paths)} {SKIPPED[kind]}" for kind, paths in finder.skipped.items())
            raise UserError(f"{what} no {KINDS} files" + (f" (skipped: {counts})" if counts else ""))
        return files, finder.skipped
    if not os.path.exists(arg):
        broken = " (a broken link)" if os.path.islink(arg) else ""
        raise UserError(f"input {arg} does not exist{broken}; pass files, folders or globs of {KINDS}")
    if not split_extension(arg)[0]:
        raise UserError(f"input {arg} is not a {KINDS} file; rename it, or convert it to one of those")
    if not stat.S_ISREG(os.stat(arg).st_mode):
        raise UserError(f"input {arg} is not a regular file (a FIFO, a device or a socket), and reading one may never "
                        "end; copy its text into a file")
    return [arg], {}


def file_fingerprint(path):
    try:
        return {"path": os.path.abspath(path), "size": os.path.getsize(path), "sha256": sha256_of(path)}
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e})") from None


def local_inputs(args, follow_links=False):
    inputs = []
    for arg in args:
        files, skipped = expand_input(arg, follow_links)
        inputs.append(Input(arg, files, {"arg": arg, "files": [file_fingerprint(p) for p in files]}, skipped))
    return inputs


# -----------------------------------------------------------------------------
# Reading documents, and cutting long ones


def byte_chunks(path):
    """The file's bytes, decompressed, READ_BYTES at a time: never the whole file in memory."""
    compression = split_extension(path)[1]
    opener = {"gzip": lambda: gzip.open(path, "rb"), "zstd": lambda: pa.input_stream(path, compression="zstd"),
              None: lambda: open(path, "rb")}[compression]
    try:
        with opener() as f:
            while data := f.read(READ_BYTES):
                yield data
    except (OSError, EOFError, zlib.error, pa.ArrowException) as e:
        raise UserError(f"cannot read {path} ({type(e).__name__}: {e}); is it really {compression or 'uncompressed'}?"
                        ) from None


def text_chunks(path, stats):
    """The file's text a chunk at a time: decoded as UTF-8 (invalid bytes replaced and counted), a binary file (a
    NUL byte anywhere, not only near the start) refused."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="nanochat_count_replace")
    for data in itertools.chain(byte_chunks(path), [None]):  # None: the end, where a cut-off sequence is invalid
        if data and b"\0" in data:
            raise UserError(f"{path} looks binary (it holds NUL bytes), not text; pass text, JSON(L) or parquet files")
        text = _counting_invalid(stats, decoder.decode, data or b"", data is None)
        if text:
            yield text


def whole_text(path, stats, limit):
    r"""The file's text in one string ("\r\n" read as "\n"), refused when longer than `limit` characters."""
    pieces, chars, held = [], 0, ""
    for chunk in text_chunks(path, stats):
        chunk = held + chunk
        held = "\r" if chunk.endswith("\r") else ""  # its "\n" may start the next chunk
        chunk = chunk[:len(chunk) - len(held)].replace("\r\n", "\n")
        chars += len(chunk)
        if chars > limit:
            raise UserError(_too_long(path, limit))
        pieces.append(chunk)
    return "".join(pieces) + held


def text_lines(path, stats):
    r"""The file's lines without their "\n" ("\r\n" read as "\n"), as text.split("\n") gives them, one at a time."""
    partial, partial_chars = [], 0  # the line the last chunk ended in
    for chunk in text_chunks(path, stats):
        lines = chunk.split("\n")
        for line in lines[:-1]:
            if partial:
                line = "".join(partial) + line
                partial, partial_chars = [], 0
            yield line[:-1] if line.endswith("\r") else line
        partial.append(lines[-1])
        partial_chars += len(lines[-1])
        if partial_chars > MAX_DOC_CHARS:
            raise UserError(_too_long(path, MAX_DOC_CHARS, "a line"))
    yield "".join(partial)


def blank_line_blocks(path, stats):
    r"""The documents of a text file cut at blank lines, exactly as re.split(r"\n[ \t]*\n", text) cuts the whole
    text, read a line at a time: a blank line followed by another line ends a document."""
    lines = text_lines(path, stats)
    block = [next(lines)]  # a file has at least one line, if an empty one
    chars, blank = len(block[0]), None
    for line in lines:
        if blank is not None:
            yield "\n".join(block)
            block, chars, blank = [line], len(line), None
        elif BLANK_LINE.fullmatch(line):
            blank = line
        else:
            block.append(line)
            chars += len(line) + 1
            if chars > MAX_DOC_CHARS:
                raise UserError(_too_long(path, MAX_DOC_CHARS))
    if blank is not None:
        block.append(blank)
    yield "\n".join(block)


def _too_long(path, limit, what="a document"):
    return (f"{path}: {what} of more than {limit:,} characters, more than an import holds in memory at once; split "
            "the file (--split-on blank-lines cuts a text file at its blank lines; a .json list can become .jsonl)")


_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{},:]')  # a string (maybe cut short), a bracket, a separator
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def check_json_values(text, where, start=0):
    """Refuse the record at text[start:] when parsing it would make more than MAX_RECORD_VALUES values, counted before
    it is parsed: each value but the first follows a ',' or ':', or opens with '[' or '{'. A value takes a character at
    least, so a shorter text needs no count, and one count over all the text (its strings, and any records after this
    one, included) clears most others; the rest are counted token by token, strings skipped, to the record's end."""
    start = _JSON_SPACE.match(text, start).end()
    if len(text) - start <= MAX_RECORD_VALUES or text[start:start + 1] not in ("[", "{") or \
            1 + sum(text.count(c, start) for c in ",:[{") <= MAX_RECORD_VALUES:
        return
    depth, values = 0, 1
    for token in _JSON_TOKEN.finditer(text, start):
        kind = token.group()[0]
        depth += (kind in "[{") - (kind in "]}")
        values += kind in ",:[{"
        if values > MAX_RECORD_VALUES:
            raise UserError(f"{where}: a record of more than {MAX_RECORD_VALUES:,} JSON values (arrays, numbers, keys...), "
                            "more than an import builds at once; keep the text in a field and little else")
        if depth == 0:
            return


def parse_json(text, where, hint):
    check_json_values(text, where)
    try:
        return json_loads(text)
    except ValueError as e:
        reason = JSON_TOO_DEEP if getattr(e, "msg", None) == JSON_TOO_DEEP else f"not JSON ({e})"
        raise UserError(f"{where}: {reason}; {hint}") from None


def json_list_items(path, stats):
    """The items of a .json file's top-level list, each decoded as the text reaches it: json.loads of the whole file
    built every record at once (4.8 M tiny ones, 2 GiB). Held: one item's text, at most MAX_DOC_CHARS."""
    hint = "a .json input is a list of records (or use .jsonl)"
    chunks, decoder = text_chunks(path, stats), json.JSONDecoder()
    text, at, ended = "", 0, False

    def read_on(need):
        """Read until `need` characters lie unparsed past `at`, or the file ends; what was parsed is dropped."""
        nonlocal text, at, ended
        pieces, held = [text[at:]], len(text) - at
        while held < need and not ended:
            chunk = next(chunks, None)
            ended = chunk is None
            pieces.append(chunk or "")
            held += len(chunk or "")
        text, at = "".join(pieces), 0

    def next_char():
        """The next character past white space (`at` moved to it), or '' at the end of the file."""
        nonlocal at
        while True:
            at = _JSON_SPACE.match(text, at).end()
            if at < len(text) or ended:
                return text[at:at + 1]
            read_on(1)

    first = next_char()
    if first != "[":
        kind = {"{": "an object", '"': "a string", "": "nothing"}.get(first, "something else")
        raise UserError(f"{path}: a .json input must be a JSON list of records or strings, not {kind}; {hint}")
    at += 1
    separator = "]" if next_char() == "]" else ","  # an empty list, or the first item
    at += separator == "]"
    index = 0
    while separator == ",":
        next_char()
        while True:  # one item, decoded once its whole text is held
            check_json_values(text, f"{path} item {index}", at)
            try:
                item, end = decoder.raw_decode(text, at)
                if ended or end + 3 <= len(text):  # else a number may go on in the next chunk ("1." then "5e+3")
                    break
            except RecursionError:
                raise UserError(f"{path}: {JSON_TOO_DEEP} (item {index}); {hint}") from None
            except ValueError as e:
                # cut short by the end of what is held: a string left open, or a value wanted at the very end
                cut = e.msg.startswith("Unterminated string") or e.pos >= len(text) - 8
                if ended or not cut:
                    raise UserError(f"{path} item {index}: not JSON ({e}); {hint}") from None
            if len(text) - at > MAX_DOC_CHARS:
                raise UserError(_too_long(path, MAX_DOC_CHARS, "a record"))
            read_on(2 * (len(text) - at))  # twice what is held, so an item's text is parsed O(1) times over
        at = end
        yield item
        index += 1
        separator = next_char()
        if separator not in (",", "]"):
            raise UserError(f"{path}: not JSON after item {index - 1} (a ',' or ']' was expected); {hint}")
        at += 1
    if next_char():
        raise UserError(f"{path}: not JSON: more follows the list's closing ']'; {hint}")


def _field_text(record, dotted, where):
    """The text at a record's dotted field ('a.b.0': record['a']['b'][0]), or the record itself: a JSON string."""
    if isinstance(record, str) and dotted == "text":
        return record  # a JSON list of plain strings
    value = record
    for part in dotted.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            keys = f" (its keys: {', '.join(map(str, record))})" if isinstance(record, dict) else ""
            raise UserError(f"{where}: no field {dotted!r}{keys}; pass --field with the (dotted) path to the text")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"{where}: field {dotted!r} holds a {type(value).__name__}, not text; "
                        f"pass --field with the path to a string")
    return value


def documents_in_file(path, options, stats):
    """Yield the documents of one file."""
    ext = split_extension(path)[0]
    if ext in PARQUET_EXTS:
        yield from _parquet_documents(path, options)
    elif ext in TEXT_EXTS:
        if options.split_on == "blank-lines":
            yield from blank_line_blocks(path, stats)
        else:
            yield whole_text(path, stats, MAX_DOC_CHARS)
    elif ext == ".jsonl":
        for lineno, line in enumerate(text_lines(path, stats), start=1):
            if not line.strip():
                continue
            record = parse_json(line, f"{path} line {lineno}", "each line of a .jsonl file is one JSON object")
            yield _field_text(record, options.field, f"{path} line {lineno}")
    else:
        for i, record in enumerate(json_list_items(path, stats)):
            yield _field_text(record, options.field, f"{path} item {i}")


def _parquet_documents(path, options):
    # Parquet is read from its footer back, so a compressed one is first decompressed into a temp file (not memory).
    with (tempfile.TemporaryFile() if split_extension(path)[1] else contextlib.nullcontext()) as spool:
        if spool is not None:
            for data in byte_chunks(path):
                spool.write(data)
            spool.seek(0)
        try:
            pf = pq.ParquetFile(spool or path)
        except Exception as e:  # pyarrow raises several kinds for a file that is not parquet
            raise UserError(f"cannot read {path} as parquet ({type(e).__name__}: {e})") from None
        schema = pf.schema_arrow
        if options.column not in schema.names:
            raise UserError(f"{path} has no column {options.column!r} (its columns: {', '.join(schema.names)}); "
                            f"pass --column")
        kind = schema.field(options.column).type
        if not pa.types.is_string(kind) and not pa.types.is_large_string(kind):
            raise UserError(f"{path}: column {options.column!r} holds {kind}, not text; pass --column with a string "
                            f"column")
        chunks = parquet_text_chunks(pf, options.column, path)
        # A dictionary-encoded chunk is read as a dictionary: decoded, 8 rows of one 100 M value would be 800 M.
        pf_dictionary = pq.ParquetFile(spool or path, read_dictionary=[options.column]) if any(
            chunk.has_dictionary_page for chunk in chunks) else None
        for group, chunk in enumerate(chunks):
            reader = pf_dictionary if chunk.has_dictionary_page else pf
            batches = reader.iter_batches(batch_size=4096, row_groups=[group], columns=[options.column])
            while True:
                try:
                    batch = next(batches, None)
                except (pa.ArrowException, OSError) as e:  # a damaged data page passes the footer check, fails here
                    raise UserError(f"cannot read {path} as parquet ({type(e).__name__}: {e})") from None
                if batch is None:
                    break
                yield from parquet_cells(batch.column(0), path)


def parquet_text_chunks(pf, column, path):
    """The text column's chunk in each row group, every one's decompressed size (the footer's) checked before any is
    read: a batch is built whole before its cells can be measured."""
    meta = pf.metadata
    leaf = next(j for j in range(meta.num_columns) if meta.schema.column(j).path == column)
    chunks = [meta.row_group(group).column(leaf) for group in range(meta.num_row_groups)]
    for group, chunk in enumerate(chunks):
        if chunk.total_uncompressed_size > MAX_ROW_GROUP_BYTES:
            raise UserError(f"{path}: row group {group} holds {chunk.total_uncompressed_size:,} bytes of column "
                            f"{column!r} decompressed, more than the {MAX_ROW_GROUP_BYTES:,} an import reads at once; "
                            "write the file with smaller row groups (pyarrow: pq.write_table(..., row_group_size=N))")
    return chunks


def parquet_cells(column, path):
    """A batch's cells as Python strings ("" for a null): each measured in Arrow first, one over MAX_DOC_CHARS refused
    before any is built, then built a slice of about PARQUET_SLICE_CHARS at a time (a dictionary's value once a row)."""
    dictionary = column.dictionary if pa.types.is_dictionary(column.type) else None
    if dictionary is not None:
        column = column.indices  # its slices are decoded one at a time below
        lengths = pc.take(pc.utf8_length(dictionary), column)
    else:
        lengths = pc.utf8_length(column)
    ends = np.cumsum(lengths.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    if len(ends) and np.diff(ends, prepend=0).max() > MAX_DOC_CHARS:
        raise UserError(_too_long(path, MAX_DOC_CHARS))
    start = 0
    while start < len(ends):
        before = int(ends[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, before + PARQUET_SLICE_CHARS, side="right")))
        piece = column.slice(start, stop - start)
        for text in (piece if dictionary is None else pc.take(dictionary, piece)).to_pylist():
            yield text or ""
        start = stop


_CUTS = [re.compile(r"\n[ \t]*\n"), re.compile(r"\n"), re.compile(r"[.!?][\"')\]]*[ \t]+"), re.compile(r"[ \t]+")]


def cut_document(text, max_chars):
    """Consecutive pieces of at most max_chars characters that join back into text. Each cut goes after the last
    separator of the strongest kind (blank line, line end, sentence end, space) in the second half of the window, so
    pieces stay long; a "word" longer than the window is cut where the window ends."""
    pieces, start = [], 0
    while len(text) - start > max_chars:
        window = text[start:start + max_chars]
        ends = ([m.end() for m in pattern.finditer(window) if m.end() >= max_chars // 2] for pattern in _CUTS)
        cut = next((found[-1] for found in ends if found), max_chars)
        pieces.append(text[start:start + cut])
        start += cut
    return pieces + [text[start:]] if start < len(text) else pieces


# -----------------------------------------------------------------------------
# Building the source


@dataclass
class InputStats:
    label: str
    files: int = 0
    documents: int = 0  # kept: non-empty, not duplicates
    chars: int = 0
    duplicates: int = 0
    empty: int = 0
    invalid_utf8: int = 0  # byte sequences replaced by U+FFFD
    cut: int = 0  # documents cut into more than one piece
    pieces: int = 0
    val_documents: int = 0
    tokens: float = 0.0  # estimated, filled in at the end
    skipped: dict = field(default_factory=dict)  # kind (a key of SKIPPED) -> {"count": n, "examples": first paths}


def _scatter(inputs, options, document_source, bucket_dir):
    """Pass 1: every kept document's pieces into hash buckets on disk. Returns (stats per input, document hashes)."""
    buckets = [open(os.path.join(bucket_dir, f"{i:03d}.bin"), "wb") for i in range(NUM_BUCKETS)]
    seen, doc_hashes, all_stats = set(), [], []
    try:
        for index, item in enumerate(inputs):
            skipped = {kind: {"count": len(paths), "examples": paths[:3]} for kind, paths in item.skipped.items()}
            stats = InputStats(item.label, files=len(item.files), skipped=skipped)
            all_stats.append(stats)
            for text in document_source(item, stats):
                text = text.strip()
                if not text:
                    stats.empty += 1
                    continue
                # lone surrogates, which JSON can carry, are invalid UTF-8 too
                encoded = _counting_invalid(stats, text.encode, "utf-8", "nanochat_count_replace")
                if _count_invalid.replaced:
                    text = encoded.decode("utf-8")
                digest = hashlib.sha256(encoded).digest()
                if digest[:16] in seen:
                    stats.duplicates += 1
                    continue
                seen.add(digest[:16])
                doc_hash = int.from_bytes(digest[:8], "big")
                doc_hashes.append(doc_hash)
                stats.documents += 1
                stats.chars += len(text)
                pieces = cut_document(text, options.max_doc_chars) if options.max_doc_chars else [text]
                stats.cut += len(pieces) > 1
                stats.pieces += len(pieces)
                for k, piece in enumerate(pieces):
                    data = piece.encode("utf-8")
                    piece_hash = int.from_bytes(hashlib.sha256(data + digest).digest()[:8], "big")
                    buckets[piece_hash * NUM_BUCKETS >> 64].write(
                        RECORD.pack(piece_hash, doc_hash, index, k, len(data)) + data)
    finally:
        for f in buckets:
            f.close()
    return all_stats, doc_hashes


def val_threshold(doc_hashes, options):
    """Documents whose hash is below the returned value are val documents (docs/data.md: the val split)."""
    n = len(doc_hashes)
    if n == 0:
        raise UserError("the inputs hold no documents (every one was empty or a duplicate)")
    if options.val_docs is not None:
        if options.val_docs < 1:
            raise UserError(f"--val-docs must be at least 1 (got {options.val_docs}); the val shard would be empty")
        if options.val_docs >= n:
            raise UserError(f"--val-docs {options.val_docs} would take every one of the {n} documents; "
                            f"pass a smaller --val-docs so some are left to train on")
        return heapq.nsmallest(options.val_docs, doc_hashes)[-1] + 1
    frac = DEFAULT_VAL_FRAC if options.val_frac is None else options.val_frac
    threshold = int(frac * 2**64)
    val = sum(h < threshold for h in doc_hashes)
    if val == 0 and options.val_frac is None and n > 1:
        return min(doc_hashes) + 1  # a small source: the default fraction holds no document, so take one
    if val == 0:
        raise UserError(f"--val-frac {frac:g} selects none of the {n} documents, so the val shard would be empty; "
                        f"pass a larger --val-frac or --val-docs N")
    if val == n:
        raise UserError(f"--val-frac {frac:g} selects every one of the {n} documents; pass a smaller --val-frac or "
                        f"--val-docs N")
    return threshold


class ShardWriter:
    """Rows into shard_XXXXX.parquet files of about shard_chars characters each, row groups of rows_per_group."""

    def __init__(self, out_dir, first_index, rows_per_group, shard_chars):
        self.out_dir, self.index, self.rows_per_group, self.shard_chars = out_dir, first_index, rows_per_group, shard_chars
        self.writer, self.rows, self.chars, self.paths = None, [], 0, []

    def add(self, text):
        self.rows.append(text)
        self.chars += len(text)
        if len(self.rows) == self.rows_per_group:
            self._flush()

    def _flush(self, last=False):
        """Write the rows held as a row group; close the shard when it is full enough, or the last."""
        if self.rows:
            if self.writer is None:
                path = os.path.join(self.out_dir, f"shard_{self.index:05d}.parquet")
                self.writer = pq.ParquetWriter(path, pa.schema([("text", pa.string())]), compression="zstd")
                self.paths.append(path)
            self.writer.write_table(pa.table({"text": pa.array(self.rows, type=pa.string())}),
                                    row_group_size=self.rows_per_group)
            self.rows = []
        if self.writer is not None and (last or self.chars >= self.shard_chars):
            self.writer.close()
            self.writer, self.index, self.chars = None, self.index + 1, 0

    def close(self):
        self._flush(last=True)
        return self.paths


def _gather(bucket_dir, threshold, all_stats, out_dir, rows_per_group, shard_chars):
    """Pass 2: bucket by bucket, pieces sorted by hash, to the val shard or the train shards. Returns (val paths,
    train paths, the first 2000 pieces: a sample for the token estimate)."""
    sample = []
    val = ShardWriter(out_dir, VAL_INDEX, rows_per_group, float("inf"))
    train = ShardWriter(out_dir, VAL_INDEX + 1, rows_per_group, shard_chars)
    for i in range(NUM_BUCKETS):
        path = os.path.join(bucket_dir, f"{i:03d}.bin")
        with open(path, "rb") as f:
            data = f.read()
        os.remove(path)
        records, offset = [], 0
        while offset < len(data):
            piece_hash, doc_hash, index, k, size = RECORD.unpack_from(data, offset)
            offset += RECORD.size
            records.append((piece_hash, doc_hash, index, k, data[offset:offset + size].decode("utf-8")))
            offset += size
        records.sort()
        for piece_hash, doc_hash, index, k, text in records:
            if doc_hash < threshold:
                val.add(text)
                all_stats[index].val_documents += k == 0
            else:
                train.add(text)
            if len(sample) < 2000:
                sample.append(text)
    return val.close(), train.close(), sample


def estimate_tokens(texts, base_dir):
    """(tokens per text, how): with the base dir's tokenizer when one is trained, else characters / CHARS_PER_TOKEN."""
    tokenizer_dir = os.path.join(base_dir, "tokenizer")
    if os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        try:
            from nanochat.tokenizer import RustBPETokenizer

            tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
            return [len(ids) for ids in tokenizer.encode(list(texts))], "the base dir's tokenizer"
        except Exception:  # noqa: BLE001 -- an estimate is still an estimate; fall back to characters
            pass
    return [len(t) / CHARS_PER_TOKEN for t in texts], f"~{CHARS_PER_TOKEN:g} characters a token"


def crop_fraction(token_counts, max_seq_len):
    """Of the tokens in these pieces (each with its BOS), the fraction the loader crops at rows of max_seq_len + 1."""
    total = sum(n + 1 for n in token_counts)
    cropped = sum(max(0, n - max_seq_len) for n in token_counts)
    return cropped / total if total else 0.0


def build_source(name, inputs, options, document_source=None, data_root=None, command=None, reserved=(),
                 shard_chars=SHARD_CHARS):
    """
    Build (or confirm unchanged) the source `name` under data_root (default <base_dir>/base_data) from `inputs`,
    reading their documents with document_source(input, stats) (default: the files' documents). `reserved` names the
    sources that may not be overwritten (the dataset registry's). Returns the manifest dict; manifest["unchanged"] is
    True when nothing was rebuilt.
    """
    if not is_plain_name(name):
        raise UserError(f"{name!r} is not a plain source name: use letters, digits, '-', '_' and '.', starting with a "
                        f"letter or digit (at most 64 characters)")
    if name in reserved:
        raise UserError(f"{name!r} is a built-in source ({', '.join(reserved)}); pick another name for your data")
    if options.max_doc_chars is not None and options.max_doc_chars < 1:
        raise UserError(f"--max-doc-chars must be at least 1 (got {options.max_doc_chars})")
    if options.val_frac is not None and not 0 < options.val_frac < 1:
        raise UserError(f"--val-frac must be between 0 and 1 (got {options.val_frac:g})")
    if options.val_frac is not None and options.val_docs is not None:
        raise UserError("pass --val-docs or --val-frac, not both")
    if options.split_on not in ("file", "blank-lines"):
        raise UserError(f"--split-on must be 'file' or 'blank-lines' (got {options.split_on!r})")
    base_dir = get_base_dir()
    data_root = data_root or os.path.join(base_dir, "base_data")
    ensure_writable(data_root, f"the {name} source")
    os.makedirs(data_root, exist_ok=True)
    final_dir = os.path.join(data_root, name)
    fingerprint = {"version": FORMAT_VERSION, "inputs": [i.fingerprint for i in inputs], "options": vars(options),
                   "shard_chars": shard_chars}
    with FileLock(os.path.join(data_root, f".{name}.lock")):
        _recover(data_root, name)
        old = read_json_object(os.path.join(final_dir, IMPORT_MANIFEST))
        if old and old.get("fingerprint") == fingerprint and all(
                os.path.isfile(os.path.join(final_dir, s)) for s in old.get("shards", [])):
            print0(f"import {name}: unchanged since {old['created']} ({len(old['shards'])} shards in {final_dir}); "
                   f"nothing to do")
            return dict(old, unchanged=True)
        tmp_dir = os.path.join(data_root, f".{name}.tmp-{os.getpid()}")
        try:
            os.makedirs(os.path.join(tmp_dir, ".buckets"))
            manifest = _build(name, inputs, options, document_source or _file_documents(options), tmp_dir, base_dir,
                              shard_chars)
            manifest.update(name=name, fingerprint=fingerprint, command=command or f"python -m nanochat.dataset "
                            f"import {name} ...", created=time.strftime("%Y-%m-%d %H:%M:%S"))
            atomic_write_text(os.path.join(tmp_dir, IMPORT_MANIFEST), json.dumps(manifest, indent=2))
            _swap_into_place(tmp_dir, final_dir, data_root, name)
        except OSError as e:  # reading errors are UserErrors by now: this is writing (a full disk, a quota)
            shutil.rmtree(tmp_dir, ignore_errors=True)
            _recover(data_root, name)  # puts back the previous source if the swap was cut short
            raise UserError(f"cannot write the {name} source in {data_root} ({e.strerror or e}); nothing was changed "
                            f"(the previous source, if any, is as it was): free some space (an import needs about "
                            f"twice its text's size) and run it again") from None
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return dict(manifest, unchanged=False)


def _file_documents(options):
    def documents(item, stats):
        for path in item.files:
            try:
                yield from documents_in_file(path, options, stats)
            except UserError as e:
                if not item.when_unreadable:
                    raise
                raise UserError(f"{e}; {item.when_unreadable}") from None
    return documents


def _build(name, inputs, options, document_source, out_dir, base_dir, shard_chars):
    bucket_dir = os.path.join(out_dir, ".buckets")
    t0 = time.time()
    all_stats, doc_hashes = _scatter(inputs, options, document_source, bucket_dir)
    threshold = val_threshold(doc_hashes, options)
    total_pieces = sum(s.pieces for s in all_stats)
    rows_per_group = max(1, min(MAX_ROWS_PER_GROUP, total_pieces // 64))
    val_paths, train_paths, sample = _gather(bucket_dir, threshold, all_stats, out_dir, rows_per_group, shard_chars)
    os.rmdir(bucket_dir)
    counts, how = estimate_tokens(sample, base_dir)
    tokens_per_char = sum(counts) / max(1, sum(len(t) for t in sample))
    for stats in all_stats:
        stats.tokens = stats.chars * tokens_per_char
    return {"shards": [os.path.basename(p) for p in val_paths + train_paths], "val_shard": os.path.basename(val_paths[0]),
            "rows_per_group": rows_per_group, "inputs": [vars(s) for s in all_stats], "tokens_estimated_with": how,
            "crop": {"max_seq_len": options.max_seq_len, "sampled_pieces": len(sample),
                     "fraction": crop_fraction(counts, options.max_seq_len)},
            "seconds": round(time.time() - t0, 2)}


def _swap_into_place(tmp_dir, final_dir, data_root, name):
    """Replace final_dir by tmp_dir; a kill between the two renames leaves .NAME.old, which _recover puts back."""
    old_dir = os.path.join(data_root, f".{name}.old")
    if os.path.exists(final_dir):
        os.rename(final_dir, old_dir)
    os.rename(tmp_dir, final_dir)
    shutil.rmtree(old_dir, ignore_errors=True)


def _recover(data_root, name):
    """Clear what a killed import left: its temp dirs, and an old copy that never got replaced."""
    for path in glob.glob(os.path.join(data_root, f".{glob.escape(name)}.tmp-*")):
        shutil.rmtree(path, ignore_errors=True)
    old_dir = os.path.join(data_root, f".{name}.old")
    if os.path.exists(old_dir):
        if os.path.exists(os.path.join(data_root, name)):
            shutil.rmtree(old_dir, ignore_errors=True)
        else:
            os.rename(old_dir, os.path.join(data_root, name))


# -----------------------------------------------------------------------------
# Reporting


def print_summary(manifest, data_dir):
    """A table with one row per input and a total, what was skipped, the loader's crop, and where the shards are."""
    table = [["input", "files", "documents", "characters", "tokens (est.)", "val docs", "duplicates", "empty",
              "bad UTF-8", "cut docs", "pieces"]]
    keys = ["files", "documents", "chars", "tokens", "val_documents", "duplicates", "empty", "invalid_utf8", "cut",
            "pieces"]
    table += [[s["label"]] + [f"{s[k]:,.0f}" for k in keys] for s in manifest["inputs"]]
    if len(manifest["inputs"]) > 1:
        table.append(["total"] + [f"{sum(s[k] for s in manifest['inputs']):,.0f}" for k in keys])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print0("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for stats in manifest["inputs"]:
        for kind, skipped in stats.get("skipped", {}).items():
            more = ", ..." if skipped["count"] > len(skipped["examples"]) else ""
            print0(f"{stats['label']}: skipped {skipped['count']:,} {SKIPPED[kind]}: "
                   f"{', '.join(skipped['examples'])}{more}")
    crop = manifest["crop"]
    print0(f"tokens estimated with {manifest['tokens_estimated_with']}; at --max-seq-len={crop['max_seq_len']} the "
           f"loader would crop {100 * crop['fraction']:.1f} % of the tokens (measured on {crop['sampled_pieces']:,} "
           f"pieces)" + (": pass --max-doc-chars to cut long documents into pieces that fit a row"
                         if crop["fraction"] > 0.05 else ""))
    print0(f"import {manifest['name']}: {len(manifest['shards']) - 1} train shard(s) + val shard "
           f"{manifest['val_shard']} (row groups of {manifest['rows_per_group']:,}) in {data_dir} "
           f"({manifest['seconds']:.1f} s); train on it with --data-source={manifest['name']} "
           f"or NANOCHAT_DATA_SOURCE={manifest['name']}")


def check_hub_dataset(repo, config, split):
    """--hf-repo, --config and --split become folders under task_data/: each must be a plain name, as NAME is ('../..'
    would write anywhere). Refused before anything is written or fetched."""
    from nanochat.data.hub import dataset_id_problem

    problem = dataset_id_problem(repo, config, split)
    if problem:
        which, why = problem
        flag = {"repo": "--hf-repo", "config": "--config", "split": "--split"}[which]
        raise UserError(f"{flag} {why}")


def hub_input(repo, config, split):
    """A Hugging Face dataset split as an input: its parquet files, fetched once through the hub's parquet API."""
    from nanochat.data.hub import fetch_parquet_files, split_dir

    check_hub_dataset(repo, config, split)
    paths = fetch_parquet_files(repo, repo, config, split, label=f"import --hf-repo {repo}",
                                how_to_fix="check the network, or set HF_ENDPOINT to a reachable mirror of "
                                           "huggingface.co; or download the files and import them from disk")
    # A file that was checked when downloaded and cannot be read now was damaged on disk: the cache must go.
    return Input(f"{repo} ({config}/{split})", paths,
                 {"hf_repo": repo, "config": config, "split": split, "files": [file_fingerprint(p) for p in paths]},
                 when_unreadable=f"delete {split_dir(repo, config, split)} to download the split again")
