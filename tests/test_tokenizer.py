"""Tests for nanochat.tokenizer and the tok_train / tok_eval scripts, on small tokenizers trained here."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import torch

from nanochat.checkpoint_manager import check_compatible
from nanochat.common import UserError
from nanochat.tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN, RustBPETokenizer, get_token_bytes, get_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = (
    "the a river stone light keeper harbour ship storm night winter coast ledger window "
    "number value sum total seven eleven twelve hundred function return import class def "
    "café naïve über straße 東京 北京 水 火 山 こんにちは 안녕 привет мир"
).split()


def make_corpus(seed, num_docs, words_per_doc=120):
    """Documents of random words, numbers, punctuation and code-ish fragments."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_docs):
        pieces = []
        for _ in range(words_per_doc):
            r = rng.random()
            if r < 0.1:
                pieces.append(str(rng.randint(0, 99999)))
            elif r < 0.15:
                pieces.append(
                    rng.choice([",", ".", "!", "?", "(x)", "==", "\n", "\n\n", "    ", "+", "=", "'s", "'ll"])
                )
            else:
                word = rng.choice(WORDS)
                pieces.append(word.capitalize() if rng.random() < 0.1 else word)
        docs.append(" ".join(pieces))
    return docs


def random_text(rng, max_len=60):
    """Random Unicode: ASCII, whitespace runs, accents, combining marks, CJK, emoji (ZWJ too), and any code point."""
    pools = [
        lambda: rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"),
        lambda: rng.choice(" \t\n\r") * rng.randint(1, 6),
        lambda: rng.choice(["\u00a0", "\u3000", "\r\n", "\u2028", "\x0b", "\x0c"]),
        lambda: rng.choice("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
        lambda: rng.choice("éàüßçñøåÆœ") + rng.choice(["", "\u0301", "\u0308"]),
        lambda: chr(rng.randint(0x4E00, 0x9FFF)),
        lambda: (
            chr(rng.randint(0x1F300, 0x1FAFF))
            + rng.choice(["", "\u200d" + chr(rng.randint(0x1F600, 0x1F64F)), "\ufe0f"])
        ),
        lambda: chr(rng.choice([rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])),
        lambda: rng.choice(SPECIAL_TOKENS),
        lambda: str(rng.randint(0, 10**9)),
    ]
    return "".join(rng.choice(pools)() for _ in range(rng.randint(0, max_len)))


@pytest.fixture(scope="module")
def tok():
    return RustBPETokenizer.train_from_iterator(iter(make_corpus(0, 500)), 512)


def first_special_id(tokenizer):
    return min(tokenizer.encode_special(s) for s in SPECIAL_TOKENS)


# -----------------------------------------------------------------------------
# Vocabulary and basic API


@pytest.mark.quick
def test_vocab_layout(tok):
    assert len(SPECIAL_TOKENS) == 9 and SPECIAL_TOKENS[0] == "<|bos|>" and SPECIAL_TOKENS[-1] == "<|output_end|>"
    assert r"\p{N}{1,2}" in SPLIT_PATTERN and r"\p{N}{1,3}" not in SPLIT_PATTERN
    assert tok.get_vocab_size() == 512
    assert tok.get_special_tokens() == set(SPECIAL_TOKENS)
    # the specials are the last nine ids, in the spec's order
    assert [tok.encode_special(s) for s in SPECIAL_TOKENS] == list(range(512 - 9, 512))
    assert tok.get_bos_token_id() == tok.encode_special("<|bos|>")
    assert tok.id_to_token(tok.get_bos_token_id()) == "<|bos|>"
    assert tok.id_to_token(ord("a")) == "a"
    with pytest.raises(ValueError):
        tok.encode_special("hello")


@pytest.mark.quick
def test_digits_split_in_pairs(tok):
    # whatever merges were learned, no token may hold 3 digits
    for ids in tok.encode(["1234567", "98765 4321", "x2024y"]):
        for i in ids:
            piece = tok.id_to_token(i)
            assert sum(c.isdigit() for c in piece) <= 2, piece


@pytest.mark.quick
def test_round_trip_random_unicode(tok):
    rng = random.Random(1234)
    texts = [random_text(rng) for _ in range(1500)]
    texts += ["", " ", "\n\n\n", "   \t  \n  ", "👨‍👩‍👧‍👦", "日本語のテキスト", "a" * 1000, " " * 77]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text, repr(text)
    assert [tok.decode(ids) for ids in tok.encode(texts)] == texts


@pytest.mark.quick
def test_literal_special_strings_are_plain_text(tok):
    specials = set(range(first_special_id(tok), tok.get_vocab_size()))
    rng = random.Random(7)
    texts = ["<|bos|>", "hello <|bos|> world", "".join(SPECIAL_TOKENS), "<|assistant_end|><|bos|>\n<|python_start|>1+1"]
    texts += [random_text(rng) + rng.choice(SPECIAL_TOKENS) + random_text(rng) for _ in range(200)]
    for text in texts:
        ids = tok.encode(text)
        assert not specials & set(ids), repr(text)
        assert tok.get_bos_token_id() not in ids
        assert tok.decode(ids) == text
    for ids in tok.encode(texts):
        assert not specials & set(ids)


@pytest.mark.quick
def test_batch_encode_equals_single(tok):
    rng = random.Random(99)
    texts = [random_text(rng, 200) for _ in range(300)] + make_corpus(5, 20)
    singles = [tok.encode(t) for t in texts]
    assert tok.encode(texts) == singles
    assert tok.encode(texts, num_threads=1) == singles
    assert tok(texts) == singles and tok(texts[0]) == singles[0]
    bos, end = tok.get_bos_token_id(), tok.encode_special("<|assistant_end|>")
    assert tok.encode(texts, prepend="<|bos|>", append=end) == [[bos] + s + [end] for s in singles]
    assert tok.encode(texts[3], prepend=bos, append="<|assistant_end|>") == [bos] + singles[3] + [end]
    assert tok.encode([]) == []


@pytest.mark.quick
def test_decode_accepts_tensors(tok):
    ids = tok.encode("The river stone, 1234.")
    assert tok.decode(torch.tensor(ids)) == "The river stone, 1234."
    assert tok.decode(np.array(ids)) == "The river stone, 1234."


@pytest.mark.quick
def test_token_bytes_sum_to_utf8_length(tok, tmp_path, monkeypatch):
    lengths = tok.token_byte_lengths()
    assert lengths.shape == (tok.get_vocab_size(),)
    assert (lengths[first_special_id(tok) :] == 0).all()
    assert (lengths[:256] == 1).all() and (lengths[256 : first_special_id(tok)] >= 2).all()
    rng = random.Random(3)
    for text in [random_text(rng, 100) for _ in range(300)]:
        ids = tok.encode(text)
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    # the module function reads the saved tokenizer and gives the same numbers as a tensor
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    tok.save(str(tmp_path / "tokenizer"))
    token_bytes = get_token_bytes("cpu")
    assert token_bytes.dim() == 1 and not token_bytes.is_floating_point()
    assert token_bytes.tolist() == lengths.tolist()
    ids = tok.encode("naïve café 東京 🙂", prepend="<|bos|>")
    assert int(token_bytes[torch.tensor(ids)].sum()) == len("naïve café 東京 🙂".encode("utf-8"))


# -----------------------------------------------------------------------------
# Chat rendering


def expected_render(tok, messages):
    """Build the (ids, mask) a conversation should render to, segment by segment, from the format rules."""
    sp = tok.encode_special
    segments = [([tok.get_bos_token_id()], 0)]
    for m in messages:
        if m["role"] == "user":
            segments += [([sp("<|user_start|>")], 0), (tok.encode(m["content"]), 0), ([sp("<|user_end|>")], 0)]
            continue
        segments.append(([sp("<|assistant_start|>")], 0))
        parts = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        for part in parts:
            if part["type"] == "text":
                segments.append((tok.encode(part["text"]), 1))
            elif part["type"] == "python":
                segments.append(([sp("<|python_start|>")] + tok.encode(part["text"]) + [sp("<|python_end|>")], 1))
            else:
                segments.append(([sp("<|output_start|>")] + tok.encode(part["text"]) + [sp("<|output_end|>")], 0))
        segments.append(([sp("<|assistant_end|>")], 1))
    ids = [i for seg, _ in segments for i in seg]
    mask = [m for seg, m in segments for _ in seg]
    return ids, mask


def mask_from_structure(tok, ids):
    """Independent check: 1 exactly inside assistant turns (start excluded, end included), outside tool output."""
    sp = tok.encode_special
    mask, in_assistant, in_output = [], False, False
    for i in ids:
        if i == sp("<|assistant_start|>"):
            mask.append(0)
            in_assistant = True
        elif i == sp("<|assistant_end|>"):
            mask.append(1)
            in_assistant = False
        elif i == sp("<|output_start|>"):
            mask.append(0)
            in_output = True
        elif i == sp("<|output_end|>"):
            mask.append(0)
            in_output = False
        else:
            mask.append(int(in_assistant and not in_output))
    return mask


TOOL_CONVERSATION = {
    "messages": [
        {"role": "user", "content": "What is 12 * 34? <|bos|> (literal)"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me use the calculator. "},
                {"type": "python", "text": "12 * 34"},
                {"type": "python_output", "text": "408"},
                {"type": "text", "text": " So the answer is 408."},
            ],
        },
        {"role": "user", "content": "Thanks! And café 東京?"},
        {"role": "assistant", "content": "Both are places to drink coffee 🙂"},
    ]
}


@pytest.mark.quick
def test_render_masks_exactly_assistant_tokens(tok):
    ids, mask = tok.render_conversation(TOOL_CONVERSATION)
    want_ids, want_mask = expected_render(tok, TOOL_CONVERSATION["messages"])
    assert len(ids) == len(mask)
    assert ids == want_ids
    for position, (got, want) in enumerate(zip(mask, want_mask)):
        assert got == want, f"token {position} ({tok.id_to_token(ids[position])!r}) has mask {got}, expected {want}"
    assert mask == mask_from_structure(tok, ids)
    # the literal "<|bos|>" typed by the user stays plain text: BOS appears once, at the start
    assert ids.count(tok.get_bos_token_id()) == 1 and ids[0] == tok.get_bos_token_id()
    # the supervised tokens decode to exactly what the assistant wrote (tool call included, tool output not)
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert learned == (
        "Let me use the calculator. <|python_start|>12 * 34<|python_end|> So the answer is 408.<|assistant_end|>"
        "Both are places to drink coffee 🙂<|assistant_end|>"
    )
    assert len(tok.visualize_render(ids, mask).splitlines()) == len(ids)


@pytest.mark.quick
def test_render_merges_system_message(tok):
    with_system = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
        ]
    }
    merged = {
        "messages": [{"role": "user", "content": "You are terse.\n\nHi"}, {"role": "assistant", "content": "Hello."}]
    }
    assert tok.render_conversation(with_system) == tok.render_conversation(merged)
    assert tok.render_conversation(merged) == expected_render(tok, merged["messages"])
    assert with_system["messages"][0]["role"] == "system"  # the caller's conversation is not modified


@pytest.mark.quick
def test_render_truncates(tok):
    full_ids, full_mask = tok.render_conversation(TOOL_CONVERSATION)
    for max_tokens in [1, 5, 17, len(full_ids) - 1, len(full_ids), len(full_ids) + 10]:
        ids, mask = tok.render_conversation(TOOL_CONVERSATION, max_tokens=max_tokens)
        assert ids == full_ids[:max_tokens] and mask == full_mask[:max_tokens]
    default_ids = tok.render_conversation(TOOL_CONVERSATION)[0]
    assert default_ids == tok.render_conversation(TOOL_CONVERSATION, max_tokens=2048)[0]


@pytest.mark.quick
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "content": "I speak first"}],
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "assistant", "content": "c"},
        ],
        [{"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}],
        [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "image", "text": "x"}]}],
        [],
    ],
)
def test_render_rejects_malformed_conversations(tok, messages):
    with pytest.raises(ValueError):
        tok.render_conversation({"messages": messages})


@pytest.mark.quick
def test_render_for_completion(tok):
    ids = tok.render_for_completion(TOOL_CONVERSATION)
    without_last = {"messages": TOOL_CONVERSATION["messages"][:-1]}
    prefix = tok.render_conversation(without_last, max_tokens=10**6)[0]
    assert ids == prefix + [tok.encode_special("<|assistant_start|>")]
    # a conversation that already ends with the user turn is primed the same way
    assert tok.render_for_completion(without_last) == ids


# -----------------------------------------------------------------------------
# Saving and loading


@pytest.mark.quick
def test_save_reload_in_new_process(tok, tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    tok.save(str(tokenizer_dir))
    assert sorted(os.listdir(tokenizer_dir)) == ["token_bytes.npy", "tokenizer.json", "tokenizer.tiktoken"]
    meta = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    assert meta["vocab_size"] == 512 and [name for name, _ in meta["special_tokens"]] == SPECIAL_TOKENS
    assert np.load(tokenizer_dir / "token_bytes.npy", allow_pickle=False).tolist() == tok.token_byte_lengths().tolist()

    rng = random.Random(11)
    texts = [random_text(rng) for _ in range(200)] + make_corpus(9, 5)
    script = (
        "import json, sys\n"
        "from nanochat.tokenizer import RustBPETokenizer\n"
        "tok = RustBPETokenizer.from_directory(sys.argv[1])\n"
        "texts = json.load(sys.stdin)\n"
        "print(json.dumps({'ids': tok.encode(texts), 'vocab': tok.get_vocab_size(), 'bos': tok.get_bos_token_id(),"
        " 'fp': tok.fingerprint()}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tokenizer_dir)],
        input=json.dumps(texts),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ids"] == tok.encode(texts)
    assert out["vocab"] == tok.get_vocab_size() and out["bos"] == tok.get_bos_token_id()
    assert out["fp"] == tok.fingerprint()


@pytest.mark.quick
def test_mismatched_or_corrupt_files_are_rejected(tok, tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    tok.save(str(tokenizer_dir))
    ranks = tokenizer_dir / "tokenizer.tiktoken"
    lines = ranks.read_text().splitlines(keepends=True)
    ranks.write_text("".join(lines[:-1]))  # as if a newer, smaller save was interrupted half way
    with pytest.raises(UserError, match="tok_train"):
        RustBPETokenizer.from_directory(str(tokenizer_dir))
    ranks.write_text("not base64 at all!\n")
    with pytest.raises(UserError, match="tok_train"):
        RustBPETokenizer.from_directory(str(tokenizer_dir))
    (tokenizer_dir / "tokenizer.json").write_text("{broken")
    with pytest.raises(UserError, match="tok_train"):
        RustBPETokenizer.from_directory(str(tokenizer_dir))


@pytest.mark.quick
def test_missing_tokenizer_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(UserError, match=r"python -m scripts\.tok_train"):
        get_tokenizer()
    with pytest.raises(UserError, match="tok_train"):
        get_token_bytes()


@pytest.mark.quick
def test_vocab_size_too_small():
    with pytest.raises(UserError, match="265"):
        RustBPETokenizer.train_from_iterator(iter(["abc"]), 264)
    # the smallest legal vocabulary has no merges at all, and still round-trips
    tiny = RustBPETokenizer.train_from_iterator(iter(["abc abc"]), 265)
    assert tiny.get_vocab_size() == 265 and tiny.decode(tiny.encode("héllo 🙂")) == "héllo 🙂"


@pytest.mark.quick
def test_small_corpus_gives_smaller_contiguous_vocab(tmp_path):
    small = RustBPETokenizer.train_from_iterator(iter(["ab ab ab cd"]), 600)
    assert 265 < small.get_vocab_size() < 600
    n = small.get_vocab_size()
    assert [small.encode_special(s) for s in SPECIAL_TOKENS] == list(range(n - 9, n))
    small.save(str(tmp_path))
    assert RustBPETokenizer.from_directory(str(tmp_path)).encode("ab cd ab") == small.encode("ab cd ab")


@pytest.mark.quick
def test_from_pretrained_wraps_tiktoken_encoding(tok, monkeypatch):
    ranks = dict(tok.mergeable_ranks)
    eot = len(ranks)
    specials = {"<|endoftext|>": eot}
    fake = tiktoken.Encoding("fake", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: fake)
    wrapped = RustBPETokenizer.from_pretrained("gpt2")
    assert wrapped.get_bos_token_id() == eot and wrapped.get_special_tokens() == {"<|endoftext|>"}
    assert wrapped.get_vocab_size() == eot + 1
    assert wrapped.encode("<|endoftext|> river", prepend="<|endoftext|>") == [eot] + tok.encode("<|endoftext|> river")
    assert wrapped.token_byte_lengths()[:eot].tolist() == tok.token_byte_lengths()[:eot].tolist()
    assert wrapped.token_byte_lengths()[eot] == 0


@pytest.mark.quick
def test_from_pretrained_unavailable_offline(tmp_path, monkeypatch):
    # an empty tiktoken cache and a proxy that refuses connections: the load must fail with a clear message
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with pytest.raises(UserError, match="gpt2.*not available"):
        RustBPETokenizer.from_pretrained("gpt2")


# -----------------------------------------------------------------------------
# Scripts


def write_shards(data_dir, docs_per_shard):
    os.makedirs(data_dir, exist_ok=True)
    for i, docs in enumerate(docs_per_shard):
        table = pa.table({"text": pa.array(docs, type=pa.string())})
        pq.write_table(table, os.path.join(data_dir, f"shard_{i:05d}.parquet"), row_group_size=50)


@pytest.mark.quick
def test_tok_train_and_eval_scripts(tmp_path, monkeypatch, capsys):
    from scripts import tok_eval, tok_train

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "builtin")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "no-tiktoken-cache"))
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    data_dir = tmp_path / "base_data" / "builtin"
    docs = make_corpus(21, 600)
    docs[150] = "x" * 50_000  # one giant train document, cut by --doc-cap
    write_shards(str(data_dir), [docs[:100], docs[100:350], docs[350:]])  # shard 0 is builtin's val shard

    with pytest.raises(UserError, match="--vocab-size"):
        tok_train.main(["--vocab-size", "200"])
    assert not (tmp_path / "tokenizer").exists()

    tok_train.main(["--max-chars", "2e5", "--doc-cap", "2000", "--vocab-size", "400"])
    out = capsys.readouterr().out
    assert "vocab_size=400" in out and "sanity round trip ok" in out
    chars = int(out.split("trained on ")[1].split(" chars")[0].replace(",", ""))
    assert 200_000 <= chars < 200_000 + 2000  # stops right after crossing --max-chars, each doc capped
    tokenizer = get_tokenizer()
    assert tokenizer.get_vocab_size() == 400
    assert tokenizer.decode(tokenizer.encode(docs[400])) == docs[400]

    results = tok_eval.main([])
    out = capsys.readouterr().out
    assert "gpt2 is not available" in out and "cl100k_base is not available" in out
    with pytest.raises(UserError, match="--data-source nosuch"):  # a source asked for by name must be there
        tok_eval.main(["--data-source", "nosuch"])
    capsys.readouterr()
    kinds = {kind for kind, _ in results}
    assert {"prose", "code", "math", "multilingual", "val (builtin)"} <= kinds
    nbytes, ntokens = results[("val (builtin)", "ours")]
    assert nbytes == sum(len(d.encode("utf-8")) for d in docs[:100])  # the val shard is shard 0, two row groups
    assert 1.0 < nbytes / ntokens  # BPE merges must compress text drawn from the training distribution

    # With a "gpt2" that tiktoken can load (here: bytes only, no merges), it gets its own columns: 1 token per byte.
    real_get_encoding = tiktoken.get_encoding

    def fake_get_encoding(name):
        if name != "gpt2":
            return real_get_encoding(name)
        ranks = {bytes([b]): b for b in range(256)}
        return tiktoken.Encoding("fake-gpt2", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": 256})

    monkeypatch.setattr(tiktoken, "get_encoding", fake_get_encoding)
    results = tok_eval.main([])
    out = capsys.readouterr().out
    assert "gpt2 B/tok" in out and "gpt2 is not available" not in out and "cl100k_base is not available" in out
    for kind in kinds:
        nbytes, _ = results[(kind, "ours")]
        assert results[(kind, "gpt2")] == (nbytes, nbytes)

    # A new tokenizer over the old one keeps a copy of the old: checkpoints trained with it cannot run without it,
    # and their error says where it is. The same tokenizer again sets nothing aside.
    old = RustBPETokenizer.from_directory(str(tmp_path / "tokenizer"))
    tok_train.main(["--max-chars", "2e5", "--doc-cap", "2000", "--vocab-size", "300"])
    aside = tmp_path / "previous_tokenizers" / old.fingerprint()[:12]
    assert f"kept in {aside}" in capsys.readouterr().out
    kept = RustBPETokenizer.from_directory(str(aside))
    assert kept.fingerprint() == old.fingerprint() and kept.get_vocab_size() == 400
    assert get_tokenizer().get_vocab_size() == 300
    with pytest.raises(UserError, match=f"kept that one in {aside}: copy the current one"):
        check_compatible({"model_config": {}, "tokenizer_hash": old.fingerprint()}, {}, get_tokenizer().fingerprint(),
                         "base_checkpoints/d4")
    tok_train.main(["--max-chars", "2e5", "--doc-cap", "2000", "--vocab-size", "300"])
    assert "kept in" not in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "previous_tokenizers")) == [old.fingerprint()[:12]]


def test_tok_train_empty_corpus_subprocess(tmp_path):
    write_shards(str(tmp_path / "base_data" / "builtin"), [[], []])  # val shard + one train shard, no rows
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(tmp_path), "NANOCHAT_DATA_SOURCE": "builtin"}
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "300"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    err_lines = proc.stderr.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("error: ") and "no text" in err_lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "tokenizer").exists()  # nothing saved
