"""
CustomJSON: conversations of your own from a JSONL file, one per line, each either a list of messages or
{"messages": [...]}. Any bad line stops the load with the file, the line number and the reason.

Evaluated (chat_eval -a file:PATH), a conversation's last assistant message is the expected answer and the reply is
right when it contains that answer, both normalised (answer_matches): write the expected answer as the least a right
reply must say.

OwnData is what the chat stages make of such files: --data FILE[:WEIGHT] (weighted, a few held out for val_loss
unless --val-data gives the validation conversations), --val-data and --identity-file.
"""

import copy
import hashlib
import json
import math
import os
import re

from nanochat.common import UserError, json_loads
from nanochat.stage import HELD_OUT_EVERY, HELD_OUT_MIN
from tasks.base import Repeated, Task, TaskMixture, validate_conversation


def read_conversations(path):
    """([conversation], [line number]) of a JSONL file; UserError naming the file, the line and the fault."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror})") from None
    conversations, lines = [], []
    for number, raw in enumerate(data.splitlines(), start=1):  # bytes: no split at \u2028, which JSON text may hold
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # an editor's byte-order mark is not an error
        except UnicodeDecodeError as e:
            raise UserError(f"{path}, line {number}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                            f"{e.start + 1})") from None
        if not line.strip():
            continue
        try:
            item = json_loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}, line {number}: not valid JSON ({e.msg} at column {e.colno})") from None
        conversation = {"messages": item} if isinstance(item, list) else item
        try:
            validate_conversation(conversation)
        except ValueError as e:
            raise UserError(f"{path}, line {number}: not a valid conversation: {e}") from None
        conversations.append({"messages": conversation["messages"]})
        lines.append(number)
    if not conversations:  # training on it would quietly train on nothing of it
        raise UserError(f"{path} holds no conversations: write one per line, a JSON list of messages or "
                        "{\"messages\": [...]}")
    return conversations, lines


def normalise(text):
    """Casefolded words of text, one space apart: punctuation, symbols and every kind of whitespace become one space."""
    return " ".join(re.sub(r"[\W_]+", " ", text.casefold()).split())


def answer_text(conversation):
    """The expected answer: the last assistant message's text (its text parts, where it calls a tool)."""
    content = conversation["messages"][-1]["content"]
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def answer_matches(reply, expected):
    """Whether reply contains expected as whole words, after normalise: 'Teal!' answers 'teal', 'steal' does not."""
    expected = normalise(expected)
    return bool(expected) and f" {expected} " in f" {normalise(reply)} "


def _digest(conversation):
    return hashlib.sha256(json.dumps(conversation["messages"], sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class CustomJSON(Task):
    name = "CustomJSON"

    def __init__(self, path, **slice_args):
        super().__init__(**slice_args)
        self.path, self.name = path, os.path.basename(path)
        self.conversations, self.lines = read_conversations(path)

    def num_rows(self):
        return len(self.conversations)

    def get_row(self, index):
        return self.conversations[index]

    def evaluate(self, conversation, completion):
        return answer_matches(completion, answer_text(conversation))

    def part(self, indices, name):
        """A CustomJSON of some of this file's conversations (in file order), for the held-out split."""
        view = copy.copy(self)
        view.name = name
        view.conversations = [self.conversations[i] for i in indices]
        view.lines = [self.lines[i] for i in indices]
        return view

    def split_off_validation(self):
        """
        (train, held out or None): a file of HELD_OUT_MIN or more conversations holds out ceil(n / HELD_OUT_EVERY) of
        them, those whose content hashes lowest. By content, not position: the same conversations whatever the lines'
        order, a conversation written twice on one side only (never trained on and measured), and one added later
        takes a place only if it hashes lower.
        """
        n = len(self.conversations)
        if n < HELD_OUT_MIN:
            return self, None
        wanted = math.ceil(n / HELD_OUT_EVERY)
        copies = {}
        for i, conversation in enumerate(self.conversations):
            copies.setdefault(_digest(conversation), []).append(i)
        held = []
        for digest in sorted(copies):
            if len(held) >= wanted:
                break
            if len(held) + len(copies[digest]) < n:  # something is left to train on
                held += copies[digest]
        kept = sorted(set(range(n)) - set(held))
        return self.part(kept, self.name), self.part(sorted(held), f"{self.name} (held out)")

    def check_rows(self, tokenizer, row_tokens, why):
        """Refuse a conversation longer than a row: it would be cut, the end of its answer never learned."""
        for conversation, line in zip(self.conversations, self.lines):
            n = len(tokenizer.render_conversation(conversation, max_tokens=None)[0])
            if n > row_tokens:
                raise UserError(f"{self.path}, line {line}: the conversation is {n} tokens, more than a row holds "
                                f"({row_tokens} {why}); shorten it or split it in two")

    def check_answerable(self, tokenizer, context, max_new_tokens):
        """Refuse an evaluation line that no reply could pass: an answer with no words, or no room to write it."""
        for conversation, line in zip(self.conversations, self.lines):
            expected = answer_text(conversation)
            if not normalise(expected):
                raise UserError(f"{self.path}, line {line}: the expected answer {expected!r} has no letters or digits "
                                "to look for in a reply")
            prompt, answer = len(tokenizer.render_for_completion(conversation)), len(tokenizer.encode(expected))
            if prompt + answer > context:
                raise UserError(f"{self.path}, line {line}: the question and its expected answer are {prompt + answer} "
                                f"tokens, more than the model's context ({context})")
            if answer > max_new_tokens:
                raise UserError(f"{self.path}, line {line}: the expected answer is {answer} tokens, more than a reply "
                                f"may write (--max-new-tokens={max_new_tokens})")


class OwnData:
    """
    The user's files of a chat stage. data: [(path, weight)] of --data, each trained on `weight` times per epoch
    (Repeated), its held-out conversations (CustomJSON.split_off_validation) measured by val_loss unless val_data (the
    paths of --val-data) gives the validation conversations instead; identity_file: --identity-file, which fills the
    mixture's identity slot. Every file is read, and every bad line refused, here.
    """

    def __init__(self, data=(), val_data=(), identity_file=None):
        self.files, self.train, self.val, self.notes = [], [], [], []
        for path, weight in data:
            task = self._read(path)
            kept, held = (task, None) if val_data else task.split_off_validation()
            times = Repeated(kept, weight, seed=0)
            if times.num_examples() == 0:
                raise UserError(f"--data {path}:{weight:g} keeps none of its {kept.num_examples()} training "
                                f"conversations; the least weight that keeps one is {0.5 / kept.num_examples():.3g}")
            self.train.append(times)
            self.val += [held] if held else []
            self.notes.append(f"{task.name}: {kept.num_examples()} conversations x{weight:g} = {times.num_examples()} per "
                              f"epoch" + (f", {held.num_examples()} held out for val_loss" if held else ""))
        given = [self._read(path) for path in val_data]
        self.val += given
        self.notes += [f"val_loss on {', '.join(t.name for t in given)} (--val-data)"] if given else []
        self.identity_file = self._read(identity_file) if identity_file else None

    def _read(self, path):
        task = CustomJSON(path)
        self.files.append(task)
        return task

    def identity(self, default):
        """The tasks of the mixture's identity slot: the --identity-file's, else `default`."""
        return [self.identity_file] if self.identity_file else default

    def mixtures(self, train, val, train_seed, val_seed):
        """(train mixture, validation mixture, self): a stage's own tasks with the user's added (none added: the
        stage's mixtures as they were). Nothing to validate on (--mixture=none, no file large enough to hold any out)
        is refused."""
        if not val + self.val:
            raise UserError(f"--mixture=none leaves val_loss nothing to measure: a --data file holds out 1 in "
                            f"{HELD_OUT_EVERY} of its conversations only from {HELD_OUT_MIN} conversations up; give "
                            "--val-data FILE")
        return TaskMixture(train + self.train, seed=train_seed), TaskMixture(val + self.val, seed=val_seed), self

    def check_rows(self, tokenizer, row_tokens, why):
        for task in self.files:
            task.check_rows(tokenizer, row_tokens, why)

    def describe(self):
        """One line for the stage's announcement: what each --data file gives per epoch, and what validation reads."""
        return "; ".join(self.notes)
