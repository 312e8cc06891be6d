"""
The tokenizer: byte-level BPE trained with `rustbpe` (fast, parallel) and run with `tiktoken` (fast, batched on
threads), saved as plain files with no pickle. The chat format lives here too: render_conversation turns a
conversation into token ids plus a mask of the tokens the assistant is trained to produce.
"""

import base64
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import rustbpe
import tiktoken

from nanochat.common import UserError, atomic_write_text, get_base_dir, json_load_file, read_json_object

SPECIAL_TOKENS = [
    "<|bos|>",  # starts every document and every conversation
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",  # the assistant calls the calculator tool
    "<|python_end|>",
    "<|output_start|>",  # the tool's answer, written into the stream by the engine
    "<|output_end|>",
]

# GPT-4's split pattern, except numbers split into runs of at most 2 digits (GPT-4 uses 3):
# with a small vocabulary, fewer number tokens leaves more room for words.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

RANKS_FILE = "tokenizer.tiktoken"  # one "base64(token bytes) rank" line per mergeable token
META_FILE = "tokenizer.json"  # split pattern, special tokens and their ids, vocab size, a checksum over all of it
TOKEN_BYTES_FILE = "token_bytes.npy"  # UTF-8 byte length of every id (specials 0), for outside tools
FORMAT_NAME = "nanochat-bpe"
FORMAT_VERSION = 1

TRAIN_HINT = "run `python -m scripts.tok_train` first"


def _ranks_to_text(mergeable_ranks):
    """The tiktoken rank file format: one 'base64 rank' line per token, sorted by rank."""
    return "\n".join(f"{base64.b64encode(token).decode('ascii')} {rank}"
                     for token, rank in sorted(mergeable_ranks.items(), key=lambda kv: kv[1])) + "\n"


def _fingerprint(ranks_text, pattern, special_tokens):
    """sha256 over everything that decides which ids a text gets; stored in checkpoints to catch mismatches."""
    data = ranks_text + pattern + json.dumps(special_tokens, sort_keys=True)  # hashed as one run of UTF-8 bytes
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


class RustBPETokenizer:
    """A tiktoken Encoding plus the nanochat conventions (BOS, chat specials, conversation rendering)."""

    def __init__(self, enc, mergeable_ranks, pattern, special_ids, bos_token):
        self.enc = enc  # a tiktoken.Encoding: does the actual encoding and decoding
        self.mergeable_ranks = mergeable_ranks  # token bytes -> id, kept for saving and for token byte lengths
        self.pattern = pattern
        self.special_ids = special_ids  # special token string -> id
        self.bos_token = bos_token

    # -------------------------------------------------------------------------
    # Construction

    @classmethod
    def train_from_iterator(cls, text_iterator, vocab_size):
        """Train on an iterator of strings. vocab_size counts the nine special tokens."""
        min_vocab = 256 + len(SPECIAL_TOKENS)
        if vocab_size < min_vocab:
            raise UserError(f"vocab size must be at least {min_vocab} (256 bytes + {len(SPECIAL_TOKENS)} special "
                            f"tokens), got {vocab_size}")
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(text_iterator, int(vocab_size) - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
        # A small corpus can run out of pairs to merge before reaching vocab_size; the specials then
        # follow the last merge directly, so ids stay contiguous.
        mergeable_ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
        return cls._from_parts(mergeable_ranks, SPLIT_PATTERN, SPECIAL_TOKENS)

    @classmethod
    def _from_parts(cls, mergeable_ranks, pattern, special_token_names, name="nanochat"):
        first_special = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(first_special)):
            raise ValueError("mergeable ranks must be exactly the ids 0..N-1")
        special_ids = {tok: first_special + i for i, tok in enumerate(special_token_names)}
        enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=mergeable_ranks, special_tokens=special_ids)
        return cls(enc, mergeable_ranks, pattern, special_ids, bos_token=special_token_names[0])

    @classmethod
    def from_directory(cls, tokenizer_dir):
        """Load a tokenizer written by save(). Reads plain text/JSON only."""
        meta_path = os.path.join(tokenizer_dir, META_FILE)
        ranks_path = os.path.join(tokenizer_dir, RANKS_FILE)
        for path in (meta_path, ranks_path):
            if not os.path.isfile(path):
                raise UserError(f"no tokenizer at {tokenizer_dir} ({os.path.basename(path)} missing): {TRAIN_HINT}")
        try:
            meta = json_load_file(meta_path)
            with open(ranks_path, encoding="utf-8") as f:
                ranks_text = f.read()
            if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
                raise ValueError(f"unknown format {meta.get('format')!r} version {meta.get('version')!r}")
            pattern = str(meta["pattern"])
            specials = [(str(name), int(i)) for name, i in meta["special_tokens"]]  # [name, id] pairs, in id order
            pairs = [line.split() for line in ranks_text.splitlines() if line]
            mergeable_ranks = {base64.b64decode(token_b64, validate=True): int(rank) for token_b64, rank in pairs}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"tokenizer files in {tokenizer_dir} are unreadable ({e}); delete the directory and "
                            f"{TRAIN_HINT}") from None
        # Files are written one at a time: a crash between two writes must not load silently as a mix.
        if meta.get("sha256") != _fingerprint(ranks_text, pattern, dict(specials)):
            raise UserError(f"tokenizer files in {tokenizer_dir} do not match each other (interrupted save?); "
                            f"{TRAIN_HINT}")
        n, names, ids = len(mergeable_ranks), [name for name, _ in specials], [i for _, i in specials]
        if sorted(mergeable_ranks.values()) != list(range(n)) or ids != list(range(n, n + len(ids))):
            raise UserError(f"token ids in {tokenizer_dir} are not 0..N-1 followed by the specials; {TRAIN_HINT}")
        return cls._from_parts(mergeable_ranks, pattern, names, name=meta.get("name", "nanochat"))

    @classmethod
    def from_pretrained(cls, tiktoken_name):
        """Wrap one of tiktoken's pretrained encodings (gpt2, cl100k_base, ...) for comparison."""
        try:
            enc = tiktoken.get_encoding(tiktoken_name)
        except Exception as e:  # tiktoken raises network, hash or value errors depending on what went wrong
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise UserError(f"tiktoken encoding {tiktoken_name!r} is not available: it is not in tiktoken's cache and "
                            f"could not be downloaded ({reason}); run once with network access or point "
                            "TIKTOKEN_CACHE_DIR at a cache holding it") from None
        special_ids = {token: enc.encode_single_token(token) for token in enc.special_tokens_set}
        # tiktoken has no public getter for the ranks or the pattern; we need them only to save or fingerprint.
        # gpt2 and cl100k_base both use <|endoftext|> as their document separator.
        return cls(enc, dict(enc._mergeable_ranks), enc._pat_str, special_ids, bos_token="<|endoftext|>")

    # -------------------------------------------------------------------------
    # Vocabulary

    def get_vocab_size(self):
        return self.enc.n_vocab

    def get_special_tokens(self):
        return set(self.special_ids)

    def id_to_token(self, id):
        return self.enc.decode([id])

    def encode_special(self, text):
        if text not in self.special_ids:
            raise ValueError(f"{text!r} is not a special token of this tokenizer (it has {sorted(self.special_ids)})")
        return self.special_ids[text]

    def get_bos_token_id(self):
        return self.special_ids[self.bos_token]

    def token_byte_lengths(self):
        """UTF-8 byte length of every id (int32 array, specials 0): the denominator of bits per byte."""
        lengths = np.zeros(self.get_vocab_size(), dtype=np.int32)
        for token, rank in self.mergeable_ranks.items():
            lengths[rank] = len(token)
        return lengths

    def fingerprint(self):
        """A hash of the vocabulary, split pattern and specials: equal fingerprints mean equal tokenization."""
        specials = dict(sorted(self.special_ids.items(), key=lambda kv: kv[1]))
        return _fingerprint(_ranks_to_text(self.mergeable_ranks), self.pattern, specials)

    # -------------------------------------------------------------------------
    # Encoding and decoding

    def _as_id(self, token):
        return self.encode_special(token) if isinstance(token, str) else int(token)

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """A string -> list of ids, a list of strings -> list of lists (on threads). Text is always ordinary text (a
        literal "<|bos|>" becomes plain bytes); prepend/append: an id or a special token string added to each row."""
        head = [] if prepend is None else [self._as_id(prepend)]
        tail = [] if append is None else [self._as_id(append)]
        if isinstance(text, str):
            return head + self.enc.encode_ordinary(text) + tail
        if isinstance(text, (list, tuple)):
            rows = self._encode_batch(list(text), num_threads)
            if head or tail:
                rows = [head + row + tail for row in rows]
            return rows
        raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")

    def _encode_batch(self, texts, num_threads):
        """One contiguous slice of the documents per thread, each a plain loop of encode_ordinary (which releases the
        GIL): tiktoken's encode_ordinary_batch, a future per document, was slower than one thread (dev/LOG.md)."""
        workers = max(1, min(num_threads, len(texts)))
        if workers == 1:
            return [self.enc.encode_ordinary(t) for t in texts]
        bounds = [len(texts) * i // workers for i in range(workers + 1)]
        slices = [texts[bounds[i]:bounds[i + 1]] for i in range(workers)]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            parts = pool.map(lambda part: [self.enc.encode_ordinary(t) for t in part], slices)
            return [row for part in parts for row in part]

    def __call__(self, *args, **kwargs):
        return self.encode(*args, **kwargs)

    def decode(self, ids):
        if hasattr(ids, "tolist"):  # torch tensors and numpy arrays
            ids = ids.tolist()
        return self.enc.decode(list(ids))

    # -------------------------------------------------------------------------
    # Saving

    def save(self, tokenizer_dir):
        """Write the three plain files; each write is atomic, and the checksum in tokenizer.json ties them together."""
        os.makedirs(tokenizer_dir, exist_ok=True)
        ranks_text = _ranks_to_text(self.mergeable_ranks)
        specials = sorted(self.special_ids.items(), key=lambda kv: kv[1])
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "name": self.enc.name,
            "vocab_size": self.get_vocab_size(),
            "num_merges": len(self.mergeable_ranks) - 256,
            "pattern": self.pattern,
            "special_tokens": [list(kv) for kv in specials],
            "sha256": _fingerprint(ranks_text, self.pattern, dict(specials)),
        }
        npy_path = os.path.join(tokenizer_dir, TOKEN_BYTES_FILE)
        tmp_npy = f"{npy_path}.tmp{os.getpid()}.npy"
        np.save(tmp_npy, self.token_byte_lengths(), allow_pickle=False)
        os.replace(tmp_npy, npy_path)
        atomic_write_text(os.path.join(tokenizer_dir, RANKS_FILE), ranks_text)
        atomic_write_text(os.path.join(tokenizer_dir, META_FILE), json.dumps(meta, indent=2) + "\n")

    # -------------------------------------------------------------------------
    # Chat format

    def _text_of(self, content, role):
        """User and system content: a string, or a list of text parts joined together."""
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return "".join(p["text"] for p in content)
        raise ValueError(f"{role} message content must be a string or a list of text parts, got {content!r:.80}")

    def _normalized_messages(self, conversation):
        """Merge a leading system message into the first user turn and check that roles alternate."""
        messages = conversation.get("messages") if isinstance(conversation, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError("a conversation is {'messages': [...]} with at least one message")
        if not all(isinstance(m, dict) for m in messages):
            raise ValueError("each message must be a dict with 'role' and 'content'")
        messages = list(messages)
        if messages[0].get("role") == "system":
            if len(messages) < 2 or messages[1].get("role") != "user":
                raise ValueError("a system message must be followed by a user message")
            system_text = self._text_of(messages[0].get("content"), "system")
            user_text = self._text_of(messages[1].get("content"), "user")
            messages = [{"role": "user", "content": system_text + "\n\n" + user_text}] + messages[2:]
        for i, message in enumerate(messages):
            expected = "user" if i % 2 == 0 else "assistant"
            if message.get("role") != expected:
                raise ValueError(f"message {i} has role {message.get('role')!r}; roles must alternate user/assistant, "
                                 "starting with user")
        return messages

    def render_conversation(self, conversation, max_tokens=2048):
        """Conversation -> (ids, mask), mask 1 where the assistant is trained to produce the token (its text, its tool
        calls, <|assistant_end|>), else 0. Both lists are cut to max_tokens (None: no limit)."""
        ids, mask = [self.get_bos_token_id()], [0]

        def add(m, text="", start=None, end=None):
            """text, between the special tokens start and end where given, all with mask m."""
            new = self.encode(text)
            new = ([self.encode_special(start)] if start else []) + new + ([self.encode_special(end)] if end else [])
            ids.extend(new)
            mask.extend([m] * len(new))

        for message in self._normalized_messages(conversation):
            content = message.get("content")
            if message["role"] == "user":
                add(0, self._text_of(content, "user"), "<|user_start|>", "<|user_end|>")
                continue
            add(0, start="<|assistant_start|>")
            if isinstance(content, str):
                add(1, content)
            elif isinstance(content, list):
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "text":
                        add(1, part["text"])
                    elif kind == "python":  # the model learns to write the call
                        add(1, part["text"], "<|python_start|>", "<|python_end|>")
                    elif kind == "python_output":  # the tool writes this at inference: nothing to learn
                        add(0, part["text"], "<|output_start|>", "<|output_end|>")
                    else:
                        raise ValueError(f"assistant content part must have type text, python or python_output, "
                                         f"got {part!r:.80}")
            else:
                raise ValueError(f"assistant message content must be a string or a list of parts, got {content!r:.80}")
            add(1, end="<|assistant_end|>")
        return ids[:max_tokens], mask[:max_tokens]

    def render_for_completion(self, conversation):
        """Ids that prime the model to write the next assistant turn (a final assistant message is dropped)."""
        messages = list(conversation.get("messages", [])) if isinstance(conversation, dict) else []
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        ids, _ = self.render_conversation({**conversation, "messages": messages}, max_tokens=None)
        return ids + [self.encode_special("<|assistant_start|>")]

    def visualize_render(self, ids, mask):
        """One line per token: id, mask, and the token text, for eyeballing a render while debugging."""
        return "\n".join(f"{i:>7} {m} {self.id_to_token(i)!r}" for i, m in zip(ids, mask))


# render_conversation / render_for_completion as a Jinja template (for transformers' apply_chat_template: an
# export's tokenizer, vLLM's /tokenizer_info): a leading system message merged into the
# first user turn (system + "\n\n" + user); add_generation_prompt drops a final assistant message and primes
# <|assistant_start|>.
CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
{%- if content is string -%}{{- content -}}
{%- else -%}{%- for part in content -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}
{%- else -%}{{- raise_exception('user and system content must be a string or text parts') -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(first=0, last=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- if messages | length < 2 or messages[1]['role'] != 'user' -%}
{{- raise_exception('a system message must be followed by a user message') -}}
{%- endif -%}
{%- set ns.first = 1 -%}
{%- endif -%}
{%- set ns.last = messages | length -%}
{%- if add_generation_prompt and messages and messages[-1]['role'] == 'assistant' -%}
{%- set ns.last = ns.last - 1 -%}
{%- endif -%}
{{- '<|bos|>' -}}
{%- for message in messages[ns.first:ns.last] -%}
{%- if message['role'] != (loop.index0 % 2 == 0 and 'user' or 'assistant') -%}
{{- raise_exception('roles must alternate user/assistant, starting with user (after an optional system message)') -}}
{%- endif -%}
{%- if message['role'] == 'user' -%}
{{- '<|user_start|>' -}}
{%- if loop.first and ns.first == 1 -%}{{- text_of(messages[0]['content']) + '\n\n' -}}{%- endif -%}
{{- text_of(message['content']) + '<|user_end|>' -}}
{%- else -%}
{{- '<|assistant_start|>' -}}
{%- if message['content'] is string -%}{{- message['content'] -}}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}{{- part['text'] -}}
{%- elif part['type'] == 'python' -%}{{- '<|python_start|>' + part['text'] + '<|python_end|>' -}}
{%- elif part['type'] == 'python_output' -%}{{- '<|output_start|>' + part['text'] + '<|output_end|>' -}}
{%- else -%}{{- raise_exception('assistant content parts must have type text, python or python_output') -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{- '<|assistant_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}
"""


# -----------------------------------------------------------------------------
# The project's tokenizer under the base dir


def get_tokenizer_dir():
    return os.path.join(get_base_dir(), "tokenizer")


def get_tokenizer():
    """The tokenizer trained by scripts.tok_train, from <base_dir>/tokenizer/."""
    return RustBPETokenizer.from_directory(get_tokenizer_dir())


def previous_tokenizers_dir():
    """Where tok_train keeps the tokenizers it replaced, one directory each."""
    return os.path.join(get_base_dir(), "previous_tokenizers")


def set_aside_dir(fingerprint):
    """A replaced tokenizer's directory: named by its fingerprint's first 12 hex digits."""
    return os.path.join(previous_tokenizers_dir(), fingerprint[:12])


def set_aside_tokenizer(tokenizer_dir, new_fingerprint):
    """Before a new tokenizer is written over another, copy the old one to set_aside_dir (checkpoints trained with it
    need it) and return that directory; None when there is none, or it is the same. Copied whole, then renamed into
    place: a crash at any point leaves the old tokenizer complete in one of the two places."""
    meta_path = os.path.join(tokenizer_dir, META_FILE)
    if not os.path.isfile(meta_path):
        return None
    old = str((read_json_object(meta_path) or {}).get("sha256", ""))
    if old == new_fingerprint:
        return None
    if len(old) == 64 and all(c in "0123456789abcdef" for c in old):
        aside = set_aside_dir(old)
    else:  # unreadable: kept under a name of its own
        aside = os.path.join(previous_tokenizers_dir(), f"unreadable-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    if not os.path.isdir(aside):
        tmp = f"{aside}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for name in (META_FILE, RANKS_FILE, TOKEN_BYTES_FILE):
            if os.path.isfile(os.path.join(tokenizer_dir, name)):
                shutil.copy2(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
        os.replace(tmp, aside)
    return aside


def get_token_bytes(device="cpu"):
    """1-D int32 tensor: UTF-8 byte length of each token id (specials 0), for bits-per-byte."""
    import torch

    # Recomputed from the ranks rather than read from token_bytes.npy: it is cheap and can never go stale.
    lengths = get_tokenizer().token_byte_lengths()
    return torch.from_numpy(lengths).to(device)
