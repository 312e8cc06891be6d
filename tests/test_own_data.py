"""
Training on your own conversations, in-process: every kind of bad line and bad --data weight refused in one line that
names the file and the line; weights (Repeated); the held-out split; the stages' mixtures with your files; the rows
and answers that cannot fit; chat_eval's answer rule. The runs for real (chat_sft on the fixture's invented facts
alone, then chat_eval on its held-out questions; the refusals before the model loads) are in test_chat_stages.py.
"""

import json
import os
import random
import re
from collections import Counter

import pytest

from nanochat.common import UserError
from nanochat.stage import data_files
from nanochat.tokenizer import RustBPETokenizer
from tasks import Repeated, Task, TaskMixture, get_task
from tasks.customjson import CustomJSON, OwnData, answer_matches, normalise

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
FACTS, HELD_OUT = os.path.join(DATA, "own_facts.jsonl"), os.path.join(DATA, "own_facts_held_out.jsonl")


def chat(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def write_lines(path, lines):
    with open(path, "wb") as f:
        f.write(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return str(path)


def write_chats(path, pairs):
    return write_lines(path, [json.dumps(chat(q, a)) for q, a in pairs])


@pytest.fixture(scope="module")
def tokenizer(tiny_base_dir):
    return RustBPETokenizer.from_directory(os.path.join(tiny_base_dir, "tokenizer"))


@pytest.mark.quick
def test_every_kind_of_bad_line_is_refused_in_one_line_naming_the_file_and_the_line(tmp_path):
    good = json.dumps(chat("Hi", "Hello"))
    cases = [  # (the bad line, written as line 2 after a good one; what the message says is wrong)
        ("{'role': 'user'}", "line 2: not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
        ("[{\"role\": \"user\", \"content\": \"Hi\"}", "line 2: not valid JSON"),
        (json.dumps([{"role": "robot", "content": "Hi"}, {"role": "assistant", "content": "x"}]),
         "line 2: not a valid conversation: message 0 has unknown role 'robot'"),
        (json.dumps([{"role": "assistant", "content": "Hi"}]), "line 2: not a valid conversation: message 0 has role "
                                                               "'assistant' first: roles must alternate"),
        (json.dumps(chat("a", "b") + chat("c", "d")[1:]), "message 2 has role 'assistant' after 'assistant'"),
        (json.dumps([chat("a", "b")[0], {"role": "system", "content": "s"}, chat("a", "b")[1]]),
         "message 1 has role 'system': only the first message may be a system message"),
        (json.dumps(chat("a", "b")[:1]), "the last message has role 'user'"),
        (json.dumps(chat("", "b")), "message 0 (user) has empty content"),
        (json.dumps(chat("a", " \n\t")), "message 1 (assistant) has empty content"),
        (json.dumps(chat("a", 42)), "message 1 (assistant) content must be a non-empty string or a non-empty list"),
        (json.dumps(chat(["a"], "b")), "message 0 (user) part 0 has type None"),
        (json.dumps(chat("a", None)), "message 1 (assistant) content must be a non-empty string"),
        (json.dumps([chat("a", "b")[0], "b"]), "message 1 is not a dict with 'role' and 'content'"),
        ("42", "line 2: not a valid conversation: a conversation is {'messages': [...]}"),
        (json.dumps({"conversation": chat("a", "b")}), "a conversation is {'messages': [...]}"),
        (json.dumps([]), "a conversation is {'messages': [...]} with at least one message"),
        ("caf\xe9".encode("latin-1"), "line 2: not UTF-8 text (byte 0xe9 at column 4)"),
    ]
    for i, (line, words) in enumerate(cases):
        path = write_lines(tmp_path / f"bad{i}.jsonl", [good, line, good])
        with pytest.raises(UserError) as e:
            CustomJSON(path)
        message = str(e.value)
        assert message.startswith(f"{path}, line 2: ") and words in message and "\n" not in message, (line, message)
    for name, content, words in [("empty.jsonl", b"", "empty.jsonl holds no conversations"),
                                 ("blank.jsonl", b"\n \n\r\n", "blank.jsonl holds no conversations")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError, match=re.escape(words)):
            CustomJSON(str(tmp_path / name))
    with pytest.raises(UserError, match=re.escape(f"cannot read {tmp_path / 'missing.jsonl'} (No such file")):
        CustomJSON(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match=re.escape(f"cannot read {tmp_path} (Is a directory)")):
        CustomJSON(str(tmp_path))
    # what an editor may add is not an error: a byte-order mark, Windows line ends, blank lines; the line numbers stay
    # the file's (the bad line after them is line 5)
    path = write_lines(tmp_path / "editor.jsonl", [b"\xef\xbb\xbf" + good.encode(), good.encode() + b"\r", b"", good, "[}"])
    with pytest.raises(UserError, match=r"editor\.jsonl, line 5: not valid JSON"):
        CustomJSON(path)
    assert len(CustomJSON(write_lines(tmp_path / "ok.jsonl", [b"\xef\xbb\xbf" + good.encode(), b"\r", good]))) == 2


@pytest.mark.quick
def test_data_flags_weights_and_bad_weights(tmp_path, monkeypatch):
    import scripts.chat_sft as chat_sft
    import scripts.mid_train as mid_train

    colon = write_chats(tmp_path / "a:b.jsonl", [("q", "a")])  # a file whose name has a colon needs no weight
    assert data_files(["my.jsonl", "my.jsonl:2", "my.jsonl:0.5", "x:y.jsonl:1e2", colon]) == \
        [("my.jsonl", 1.0), ("my.jsonl", 2.0), ("my.jsonl", 0.5), ("x:y.jsonl", 100.0), (colon, 1.0)]
    assert data_files([colon + ":3"]) == [(colon, 3.0)]
    for spec, words in [("my.jsonl:abc", "--data my.jsonl:abc: no file is named that, and 'abc' after the last ':' is "
                                         "not a weight (a number > 0 and <= 1000"),
                        ("my.jsonl:-1", "--data my.jsonl:-1: the weight -1 is not valid: must be > 0 and <= 1000"),
                        ("my.jsonl:0", "the weight 0 is not valid"), ("my.jsonl:nan", "the weight nan is not valid"),
                        ("my.jsonl:inf", "the weight inf is not valid"), ("my.jsonl:1001", "the weight 1001 is not valid"),
                        ("my.jsonl:", "'' after the last ':' is not a weight"), (":2", "--data :2 names no file")]:
        for script in (chat_sft, mid_train):  # refused with the flags, before a file, a model or a checkpoint is read
            with pytest.raises(UserError, match=re.escape(words)):
                script.parse_args(["--data", spec])
    for script in (chat_sft, mid_train):
        with pytest.raises(UserError, match=re.escape("--mixture=none is not valid: none trains on your files alone: "
                                                      "give one or more --data FILE[:WEIGHT]")):
            script.parse_args(["--mixture=none", "--identity-file", colon])
        args = script.parse_args(["--mixture=none", "--data", "a.jsonl:2", "--data", "b.jsonl", "--val-data", "v.jsonl"])
        assert (args.data, args.val_data) == (["a.jsonl:2", "b.jsonl"], ["v.jsonl"])


class Numbers(Task):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def num_rows(self):
        return self.n

    def get_row(self, i):
        return {"messages": chat(f"q{i}", f"a{i}"), "i": i}


@pytest.mark.quick
def test_a_weight_is_how_many_times_each_conversation_enters_an_epoch():
    def counts(times, n=10):
        task = Repeated(Numbers(n), times)
        return Counter(task[i]["i"] for i in range(len(task)))

    assert counts(1) == {i: 1 for i in range(10)} and counts(3) == {i: 3 for i in range(10)}
    half = counts(0.5)
    assert sorted(half.values()) == [1] * 5  # half of them, once
    two_and_half = counts(2.5)
    assert sorted(two_and_half.values()) == [2] * 5 + [3] * 5
    assert {i for i, c in two_and_half.items() if c == 3} == set(half)  # the same fixed half
    assert counts(0.5) == half and counts(0.25) and sum(counts(0.25).values()) == 3  # round(2.5) up: 3 of 10
    assert sum(counts(0.04).values()) == 0  # what --data refuses (below)
    mixed = TaskMixture([Numbers(4), Repeated(Numbers(3), 2)], seed=1)
    assert len(mixed) == 10 and Counter(mixed[i]["i"] for i in range(10)) == {0: 3, 1: 3, 2: 3, 3: 1}


@pytest.mark.quick
def test_held_out_conversations_are_chosen_by_content(tmp_path):
    task = CustomJSON(FACTS)
    train, held = task.split_off_validation()
    assert (len(task), len(train), len(held)) == (36, 34, 2)  # ceil(36 / 20)
    assert sorted(held.lines + train.lines) == list(range(1, 37)) and not set(held.lines) & set(train.lines)
    held_set = {json.dumps(c) for c in held.conversations}
    # the same conversations whatever the order of the lines, and when the file grows by a conversation hashing higher
    lines = open(FACTS).read().splitlines()
    random.Random(0).shuffle(lines)
    shuffled_held = CustomJSON(write_lines(tmp_path / "shuffled.jsonl", lines)).split_off_validation()[1]
    assert {json.dumps(c) for c in shuffled_held.conversations} == held_set
    # 9 conversations hold none out; 10 hold out one; 21 hold out two
    assert CustomJSON(write_chats(tmp_path / "nine.jsonl", [(f"q{i}", "a") for i in range(9)])).split_off_validation()[1] is None
    for n, out in ((10, 1), (20, 1), (21, 2)):
        _, held = CustomJSON(write_chats(tmp_path / f"n{n}.jsonl", [(f"q{i}", "a") for i in range(n)])).split_off_validation()
        assert len(held) == out, n
    # a conversation written several times is held out or trained on, every copy alike
    pairs = [(f"q{i}", "a") for i in range(12)]
    copies = CustomJSON(write_chats(tmp_path / "copies.jsonl", pairs + pairs + pairs))
    train, held = copies.split_off_validation()
    held_text = Counter(json.dumps(c) for c in held.conversations)
    assert len(held) >= 2 and all(n == 3 for n in held_text.values())
    assert not set(held_text) & {json.dumps(c) for c in train.conversations}


@pytest.mark.quick
def test_own_data_weights_held_out_val_data_and_refusals(tmp_path):
    own = OwnData([(FACTS, 2.5)])
    assert [len(t) for t in own.train] == [85] and [len(t) for t in own.val] == [2]  # 34 x 2.5; 2 held out
    assert own.describe() == "own_facts.jsonl: 34 conversations x2.5 = 85 per epoch, 2 held out for val_loss"
    train, val, _ = own.mixtures([], [], train_seed=3, val_seed=4)
    trained = {json.dumps(train[i]["messages"]) for i in range(len(train))}
    assert len(trained) == 34 and not trained & {json.dumps(val[i]["messages"]) for i in range(len(val))}
    # --val-data: every --data conversation is trained on, the given file is validated on
    own = OwnData([(FACTS, 1)], [HELD_OUT])
    assert [len(t) for t in own.train] == [36] and [len(t) for t in own.val] == [12]
    assert own.describe() == ("own_facts.jsonl: 36 conversations x1 = 36 per epoch; val_loss on own_facts_held_out.jsonl "
                              "(--val-data)")
    small = write_chats(tmp_path / "small.jsonl", [(f"q{i}", "a") for i in range(4)])
    with pytest.raises(UserError, match=re.escape("--data " + small + ":0.1 keeps none of its 4 training conversations; "
                                                  "the least weight that keeps one is 0.125")):
        OwnData([(small, 0.1)])
    with pytest.raises(UserError, match=re.escape("--mixture=none leaves val_loss nothing to measure: a --data file "
                                                  "holds out 1 in 20 of its conversations only from 10 conversations "
                                                  "up; give --val-data FILE")):
        OwnData([(small, 1)]).mixtures([], [], 1, 2)
    assert len(OwnData([(small, 1)]).mixtures([], [Numbers(2)], 1, 2)[1]) == 2  # the stage's own validation suffices
    with pytest.raises(UserError, match=r"held_out\.jsonl, line 3: not valid JSON"):
        OwnData([(FACTS, 1)], [write_lines(tmp_path / "held_out.jsonl", [json.dumps(chat("q", "a"))] * 2 + ["{"])])


@pytest.mark.quick
def test_stage_mixtures_with_your_files(tmp_path):
    import scripts.chat_sft as chat_sft
    import scripts.mid_train as mid_train

    identity = write_chats(tmp_path / "me.jsonl", [("Who are you?", "Me.")])
    for script, identity_times, seeds in ((chat_sft, 1, (3, 4)), (mid_train, 2, (1, 2))):
        train, val, _ = script.mixtures("builtin")
        names = [t.name for t in train.tasks]
        assert "Identity" in names and "own_facts.jsonl" not in str(names)
        with_data, with_val, own = script.mixtures("builtin", data=[(FACTS, 2)])
        # the built-in tasks as they were, in the same order and shuffle seed, then the file twice over
        assert [t.name for t in with_data.tasks] == names + ["own_facts.jsonl x2"]
        assert len(with_data) == len(train) + 68 and len(with_val) == len(val) + 2
        assert TaskMixture(with_data.tasks[:-1], seed=seeds[0])[0]["messages"] == train[0]["messages"]
        alone, alone_val, _ = script.mixtures("none", data=[(FACTS, 2)], identity_file=identity)
        assert [t.name for t in alone.tasks] == ["me.jsonl"] * identity_times + ["own_facts.jsonl x2"]
        assert len(alone) == 68 + identity_times and [t.name for t in alone_val.tasks] == ["own_facts.jsonl (held out)"]


@pytest.mark.quick
def test_rows_and_answers_that_cannot_fit_are_refused_naming_the_line(tmp_path, tokenizer):
    path = write_chats(tmp_path / "long.jsonl", [("short", "yes"), ("a long question " * 20, "yes")])
    own = OwnData([(path, 1)])
    own.check_rows(tokenizer, 200, "with --max-seq-len=199")
    with pytest.raises(UserError, match=r"long\.jsonl, line 2: the conversation is \d+ tokens, more than a row holds "
                                        r"\(64 with --max-seq-len=63\); shorten it or split it in two"):
        own.check_rows(tokenizer, 64, "with --max-seq-len=63")
    for pair, args, words in [
            (("q", "?!"), (128, 16), "line 2: the expected answer '?!' has no letters or digits to look for in a reply"),
            (("word " * 100, "fine"), (64, 16), "line 2: the question and its expected answer are"),
            (("q", "a rather longer answer than allowed"), (128, 3), "line 2: the expected answer is")]:
        task = CustomJSON(write_chats(tmp_path / "eval.jsonl", [("q", "a"), pair]))
        with pytest.raises(UserError, match=re.escape(words)):
            task.check_answerable(tokenizer, *args)
    CustomJSON(HELD_OUT).check_answerable(tokenizer, 128, 24)


@pytest.mark.quick
def test_a_reply_is_right_when_it_contains_the_expected_answer_normalised():
    expected = "Zorblat's favourite colour is teal."
    for reply, right in [("Zorblat's favourite colour is teal.", True), ("zorblat s FAVOURITE  colour\nis teal", True),
                         ("I think Zorblat’s favourite colour is teal!", True), ("Zorblat's favourite colour is teals", False),
                         ("Zorblat's favourite colour is steal.", False), ("Zorblat's favourite colour is red.", False),
                         ("", False)]:
        assert answer_matches(reply, expected) is right, reply
    assert answer_matches("It is TEAL.", "teal") and not answer_matches("Steal it.", "teal")
    assert answer_matches("teal-ish", "teal")  # punctuation separates words, as a space does
    assert normalise("  Café_au-lait!\t") == "café au lait" and not answer_matches("anything", "...")
    task = get_task("CustomJSON", path=HELD_OUT)
    conversation = task[0]
    assert task.evaluate(conversation, "Oh: zorblat's favourite colour is teal.") and not task.evaluate(conversation, "teal")
