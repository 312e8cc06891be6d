"""
Tests for tasks/: every hub loader against a local server that speaks the hub's parquet API
(real schemas, nested columns included), the verdicts of each task's evaluate on right and wrong
answers, mixtures and slicing, bad input, the built-in tasks' splits and wordings, rendering, and the
`python -m tasks` listing.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from nanochat.common import UserError
from nanochat.data import hub
from nanochat.corpus.world import RELATIONS
from nanochat.calculator import use_calculator
from tasks import (TASKS, Arithmetic, CustomJSON, Identity, SimpleSpelling, SpellingBee, Task, TaskMixture,
                            TaskSequence, WorldQA, get_task, humaneval, validate_conversation)
from tasks.builtin import ANSWER_TEMPLATES, DEV_QUESTIONS, EVAL_IDENTITY_QUESTIONS, EVAL_QUESTIONS, EVAL_RELATIONS, SFT_ASKS, SFT_FRAMES, \
    SFT_IDENTITY_QUESTIONS, SFT_QUESTIONS
from tasks.gsm8k import answer_parts
from nanochat.tokenizer import RustBPETokenizer

from conftest import ParquetHub  # noqa: E402

@pytest.fixture
def base_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    return tmp_path / "base"


@pytest.fixture
def parquet_hub(base_dir, monkeypatch):
    server = ParquetHub()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    yield server
    server.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_base_dir):
    return RustBPETokenizer.from_directory(os.path.join(tiny_base_dir, "tokenizer"))


def check_render(tokenizer, conversation):
    """Render; mask must be 1 exactly on assistant tokens (text, tool calls, <|assistant_end|>), not on tool output."""
    ids, mask = tokenizer.render_conversation(conversation, max_tokens=None)
    special = {name: tokenizer.encode_special(name) for name in tokenizer.get_special_tokens()}
    in_assistant = in_output = False
    for token, m in zip(ids, mask):
        if token == special["<|assistant_start|>"]:
            assert m == 0
            in_assistant = True
            continue
        if token == special["<|output_start|>"]:
            in_output = True
        assert m == int(in_assistant and not in_output), tokenizer.visualize_render(ids, mask)
        if token == special["<|output_end|>"]:
            in_output = False
        if token == special["<|assistant_end|>"]:
            in_assistant = False
    assert sum(mask) > 0
    return ids


# -----------------------------------------------------------------------------
# Hub tasks

ARC_ROWS = [
    {"id": "q1", "question": "Which gas do plants take in?",
     "choices": {"text": ["oxygen", "carbon dioxide", "helium", "neon"], "label": ["A", "B", "C", "D"]}, "answerKey": "B"},
    {"id": "q2", "question": "What melts ice?", "choices": {"text": ["heat", "cold", "dark"], "label": ["A", "B", "C"]},
     "answerKey": "A"},
]
ARC_ROWS_2 = [
    {"id": "q3", "question": "How many legs has a spider?",
     "choices": {"text": ["six", "eight", "ten", "four", "two"], "label": ["1", "2", "3", "4", "5"]}, "answerKey": "2"},
]


@pytest.mark.quick
def test_arc_downloads_once_renders_and_evaluates(parquet_hub, base_dir, tokenizer):
    parquet_hub.add("allenai/ai2_arc", "ARC-Easy", "test", ARC_ROWS, ARC_ROWS_2)
    task = get_task("arc-easy", split="test")
    directory = base_dir / "task_data" / "allenai" / "ai2_arc" / "ARC-Easy" / "test"
    assert sorted(os.listdir(directory)) == [".lock", "files.json", "part-0000.parquet", "part-0001.parquet"]
    assert task.name == "ARC-Easy" and task.eval_type == "categorical" and len(task) == 3

    first = task[0]
    user = first["messages"][0]["content"]
    assert "Which gas do plants take in?" in user and "\nB. carbon dioxide\n" in user and "letter" in user
    assert first["messages"][1] == {"role": "assistant", "content": "B"} and first["letters"] == ["A", "B", "C", "D"]
    assert task[1]["letters"] == ["A", "B", "C"]
    assert task[2]["letters"] == ["1", "2", "3", "4", "5"] and "\n2. eight\n" in task[2]["messages"][0]["content"]
    assert task.evaluate(first, "B") and task.evaluate(first, " B\n") and not task.evaluate(first, "A")
    assert task.evaluate(task[2], "2") and not task.evaluate(task[2], "B")
    assert task.baseline == pytest.approx((1 / 4 + 1 / 3 + 1 / 5) / 3)
    check_render(tokenizer, first)

    requests = len(parquet_hub.requests)
    again = get_task("ARC-Easy", split="test")
    assert len(parquet_hub.requests) == requests  # the manifest says it is all here: no network at all
    assert [again[i] for i in range(3)] == [task[i] for i in range(3)]


@pytest.mark.quick
def test_mmlu_and_its_auxiliary_train_split(parquet_hub, tokenizer):
    rows = [{"question": "What is 2 + 2?", "subject": "elementary_mathematics", "choices": ["3", "4", "5", "22"],
             "answer": 1},
            {"question": "Capital of France?", "subject": "geography", "choices": ["Rome", "Lyon", "Paris", "Nice"],
             "answer": 2}]
    parquet_hub.add("cais/mmlu", "all", "validation", rows)
    parquet_hub.add("cais/mmlu", "auxiliary_train", "train", [{"train": r} for r in rows])
    task = get_task("MMLU", split="validation")
    aux = get_task("mmlu-aux")  # a single split: no need to name it
    assert len(task) == len(aux) == 2 and task.baseline == 0.25
    for t in (task, aux):
        example = t[0]
        assert "elementary mathematics" in example["messages"][0]["content"]
        assert "\nB. 4\n" in example["messages"][0]["content"]
        assert example["letters"] == ["A", "B", "C", "D"] and example["messages"][1]["content"] == "B"
        assert t.evaluate(example, "B") and not t.evaluate(example, "C")
        assert t.evaluate(t[1], "C")
        check_render(tokenizer, example)


GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.quick
def test_gsm8k_tool_calls_evaluate_and_reward(parquet_hub, tokenizer):
    parquet_hub.add("openai/gsm8k", "main", "test", [
        {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                     "How many clips did Natalia sell altogether in April and May?", "answer": GSM8K_ANSWER},
        {"question": "A farm has 1200 hens and buys 34 more. How many hens?",
         "answer": "1200 + 34 = <<1200+34=1234>>1234 hens.\n#### 1,234"}])
    task = get_task("GSM8K", split="test")
    example = task[0]
    parts = example["messages"][1]["content"]
    assert parts == [
        {"type": "text", "text": "Natalia sold 48/2 = "},
        {"type": "python", "text": "48/2"}, {"type": "python_output", "text": "24"},
        {"type": "text", "text": "24 clips in May.\nNatalia sold 48+24 = "},
        {"type": "python", "text": "48+24"}, {"type": "python_output", "text": "72"},
        {"type": "text", "text": "72 clips altogether in April and May.\n#### 72"},
    ]
    # the text parts alone read as the answer without its annotations; the calculator agrees with each output
    assert "".join(p["text"] for p in parts if p["type"] == "text") == re.sub(r"<<[^>]*>>", "", GSM8K_ANSWER)
    assert all(use_calculator(a["text"]) == b["text"] for a, b in zip(parts, parts[1:]) if a["type"] == "python")
    assert task.evaluate(example, "48 + 24 = 72 clips.\n#### 72") and task.reward(example, "#### 72") == 1.0
    assert not task.evaluate(example, "#### 73") and task.reward(example, "so 72 clips\n#### 70") == 0.0
    assert not task.evaluate(example, "The answer is 72.")  # no final '####' answer
    assert task.evaluate(task[1], "#### 1234") and task.evaluate(task[1], "#### 1,234")
    assert answer_parts("no annotations\n#### 5") == [{"type": "text", "text": "no annotations\n#### 5"}]
    check_render(tokenizer, example)


HUMANEVAL_ROW = {
    "task_id": "HumanEval/0",
    "prompt": "from typing import List\n\n\ndef total(numbers: List[int]) -> int:\n    \"\"\"Sum of the numbers.\"\"\"\n",
    "canonical_solution": "    return sum(numbers)\n",
    "test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n",
    "entry_point": "total",
}


@pytest.mark.quick
def test_humaneval_runs_completions_in_the_sandbox(parquet_hub, tokenizer, monkeypatch):
    monkeypatch.setattr(humaneval, "TIMEOUT_SECONDS", 1.0)
    parquet_hub.add("openai/openai_humaneval", "openai_humaneval", "test", [HUMANEVAL_ROW])
    task = get_task("HumanEval")
    example = task[0]
    reference = example["messages"][1]["content"]
    assert reference.startswith("```python\nfrom typing import List") and "return sum(numbers)" in reference
    assert task.evaluate(example, reference)
    # no imports (the prompt's are added), prose around the block
    right = "Here it is:\n```python\ndef total(numbers: List[int]) -> int:\n    return sum(numbers)\n```\nDone."
    wrong = "```python\ndef total(numbers: List[int]) -> int:\n    return len(numbers)\n```"
    assert task.evaluate(example, right) and not task.evaluate(example, wrong)
    assert not task.evaluate(example, "def total(numbers):\n    while True:\n        pass\n")  # times out
    check_render(tokenizer, example)


@pytest.mark.quick
def test_smoltalk_skips_invalid_conversations(parquet_hub, tokenizer, capsys):
    def msg(role, content):
        return {"content": content, "role": role}

    rows = [{"messages": [msg("user", "Hi"), msg("assistant", "Hello! How can I help?")]},
            {"messages": [msg("user", "one"), msg("user", "two"), msg("assistant", "three")]},  # roles out of order
            {"messages": [msg("system", "Be brief."), msg("user", "Name a colour."), msg("assistant", "Blue.")]},
            {"messages": [msg("user", "Hello?"), msg("assistant", "")]}]  # empty answer
    parquet_hub.add("HuggingFaceTB/smol-smoltalk", "default", "test", rows)
    task = get_task("SmolTalk", split="test")
    assert len(task) == 2 and task.skipped == 2 and "skipped 2 of 4" in capsys.readouterr().out
    assert task[0] == rows[0] and task[1] == rows[2]
    with pytest.raises(NotImplementedError):
        task.evaluate(task[0], "anything")
    ids = check_render(tokenizer, task[1])
    assert "Be brief." in tokenizer.decode(ids)


@pytest.mark.quick
def test_hub_errors_name_the_task_the_url_and_the_fix(parquet_hub, monkeypatch):
    with pytest.raises(UserError) as e:  # the server does not know this split: 404 on the listing
        get_task("GSM8K", split="train")
    message = str(e.value)
    assert "GSM8K" in message and f"{parquet_hub.endpoint}/api/datasets/openai/gsm8k/parquet/main/train" in message
    assert "404" in message and "HF_ENDPOINT" in message and "built-in" in message

    parquet_hub.add("openai/gsm8k", "main", "train", [{"question": "q", "answer": "#### 1"}])
    parquet_hub.splits[("openai/gsm8k", "main", "train")] = []  # lists no file
    with pytest.raises(UserError, match="non-empty JSON list"):
        get_task("GSM8K", split="train")

    # a listing whose file is missing: the file's URL is named
    parquet_hub.add("openai/gsm8k", "main", "test", [{"question": "q", "answer": "#### 1"}])
    real_urls = hub._list_parquet_urls
    monkeypatch.setattr(hub, "_list_parquet_urls", lambda *args: [u.replace("/0.parquet", "/7.parquet")
                                                                   for u in real_urls(*args)])
    with pytest.raises(UserError) as e:
        get_task("GSM8K", split="test")
    assert "GSM8K" in str(e.value) and "/files/openai/gsm8k/main/test/7.parquet" in str(e.value)
    assert "HF_ENDPOINT" in str(e.value)
    monkeypatch.setattr(hub, "_list_parquet_urls", real_urls)

    # nobody listening at all
    monkeypatch.setattr(hub, "LIST_BACKOFF_SECONDS", 0.0)
    port = parquet_hub.server.server_address[1]
    parquet_hub.close()
    with pytest.raises(UserError) as e:
        get_task("ARC-Challenge", split="test")
    assert "ARC-Challenge" in str(e.value) and f"127.0.0.1:{port}/api/datasets/allenai/ai2_arc" in str(e.value)
    assert "HF_ENDPOINT" in str(e.value)


# -----------------------------------------------------------------------------
# Mixtures, sequences, slicing


class Numbers(Task):
    def __init__(self, name, n, **slice_args):
        super().__init__(**slice_args)
        self.name, self.n = name, n

    def num_rows(self):
        return self.n

    def get_row(self, index):
        return {"messages": [{"role": "user", "content": f"{self.name}{index}"}, {"role": "assistant", "content": "ok"}]}


def labels(task):
    return [task[i]["messages"][0]["content"] for i in range(len(task))]


@pytest.mark.quick
def test_slicing():
    assert labels(Numbers("a", 10, start=2, stop=8, step=3)) == ["a2", "a5"]
    assert len(Numbers("a", 10, start=4)) == 6 and len(Numbers("a", 10, stop=50)) == 10
    task = Numbers("a", 3)
    assert [c["messages"][0]["content"] for c in task] == ["a0", "a1", "a2"]  # iteration stops at the end
    with pytest.raises(IndexError):
        task[3]


@pytest.mark.quick
def test_mixture_is_a_deterministic_shuffle_and_oversamples():
    a, b = Numbers("a", 30), Numbers("b", 10)
    mix = TaskMixture([a, b], seed=1)
    assert labels(mix) == labels(TaskMixture([a, b], seed=1))
    assert labels(mix) != labels(TaskMixture([a, b], seed=2))
    assert sorted(labels(mix)) == sorted(labels(a) + labels(b))  # every example exactly once
    assert labels(mix) != labels(a) + labels(b)  # and shuffled
    twice = labels(TaskMixture([a, b, b], seed=1))
    assert len(twice) == 50 and sum(x.startswith("b") for x in twice) == 20
    assert sorted(set(twice)) == sorted(labels(a) + labels(b))
    assert len(TaskMixture([a, b], seed=1, stop=5)) == 5


@pytest.mark.quick
def test_sequence_keeps_order():
    seq = TaskSequence([Numbers("a", 2), Numbers("b", 3, start=1), Numbers("c", 0), Numbers("d", 1)])
    assert labels(seq) == ["a0", "a1", "b1", "b2", "d0"]
    assert labels(TaskSequence([Numbers("a", 2), Numbers("b", 3)], step=2)) == ["a0", "b0", "b2"]


# -----------------------------------------------------------------------------
# Bad input


@pytest.mark.quick
def test_validator_names_the_problem():
    def conv(*roles):
        return {"messages": [{"role": r, "content": "x"} for r in roles]}

    validate_conversation(conv("user", "assistant"))
    validate_conversation(conv("system", "user", "assistant", "user", "assistant"))
    cases = [
        (conv("user", "assistant", "user", "user", "assistant"), "message 3 has role 'user' after 'user': roles must alternate"),
        (conv("assistant", "user"), "message 0 has role 'assistant' first"),
        (conv("user", "system", "assistant"), "message 1 has role 'system': only the first"),
        (conv("user", "assistant", "user"), "must end with the assistant"),
        (conv("user", "bot"), "unknown role 'bot'"),
        ({"messages": []}, "at least one message"),
        ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]}, "message 0 .* empty"),
        ({"messages": [{"role": "user", "content": [{"type": "python", "text": "1+1"}]},
                       {"role": "assistant", "content": "2"}]}, "part 0 has type 'python'"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text"}]}]},
         "no 'text' string"),
    ]
    for conversation, reason in cases:
        with pytest.raises(ValueError, match=reason):
            validate_conversation(conversation)


@pytest.mark.quick
def test_customjson_loads_and_reports_bad_lines(tmp_path, tokenizer):
    good = tmp_path / "good.jsonl"
    lines = [json.dumps([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]), "",
             json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                      {"role": "assistant", "content": [{"type": "python", "text": "2+2"},
                                                                        {"type": "python_output", "text": "4"},
                                                                        {"type": "text", "text": "4"}]}]})]
    good.write_text("\n".join(lines) + "\n")
    task = get_task("customjson", path=str(good))
    assert len(task) == 2 and task[0]["messages"][1]["content"] == "Hello"
    check_render(tokenizer, task[1])

    not_json = tmp_path / "not_json.jsonl"
    not_json.write_text(lines[0] + "\n" + lines[0] + "\n{'role': 'user'}\n")
    with pytest.raises(UserError, match=r"not_json\.jsonl, line 3: not valid JSON"):
        CustomJSON(str(not_json))
    out_of_order = tmp_path / "order.jsonl"
    out_of_order.write_text(lines[0] + "\n" + json.dumps([{"role": "assistant", "content": "Hi"}]) + "\n")
    with pytest.raises(UserError, match=r"order\.jsonl, line 2: not a valid conversation: message 0 has role"):
        CustomJSON(str(out_of_order))
    with pytest.raises(UserError, match="missing.jsonl"):
        CustomJSON(str(tmp_path / "missing.jsonl"))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(UserError, match=r"blank\.jsonl holds no conversations"):
        CustomJSON(str(blank))
    with pytest.raises(UserError, match="path="):
        get_task("CustomJSON")


@pytest.mark.quick
def test_unknown_task_and_split():
    with pytest.raises(UserError) as e:
        get_task("ARC-Medium", split="test")
    assert all(name in str(e.value) for name in TASKS)
    with pytest.raises(UserError, match="sft, dev, eval"):
        get_task("WorldQA", split="train")
    with pytest.raises(UserError, match="splits train, validation, test"):
        get_task("ARC-Easy")  # several splits: one must be named


# -----------------------------------------------------------------------------
# Built-in tasks

SEED = 7  # the tiny corpus's seed


def template_regex(template):
    return re.compile("^" + re.escape(template).replace(re.escape("{s}"), ".+") + "$")


@pytest.mark.quick
def test_worldqa_splits_keep_subjects_and_wordings_apart():
    sft, evaluation = WorldQA("sft", seed=SEED), WorldQA("eval", seed=SEED)
    world = sft.world
    sft_users = [m["content"] for c in sft.conversations for m in c["messages"] if m["role"] == "user"]
    sft_subjects = {c["subject"] for c in sft.conversations}
    assert sft_subjects and not sft_subjects & world.eval_subjects
    assert not any(s in q for s in world.eval_subjects for q in sft_users)  # not even in a two-question one
    assert {c["subject"] for c in evaluation.conversations} <= world.eval_subjects
    assert len(evaluation) == len([f for f in world.eval_facts() if f.relation in
                                   ("capital", "language", "population", "neighbour", "birthplace")])
    assert any(len(c["messages"]) == 4 for c in sft.conversations)  # a few ask two questions

    pretraining = {q for r in RELATIONS.values() for q in r.questions}
    for relation in RELATIONS:
        sft_forms, eval_forms = set(SFT_QUESTIONS[relation]), set(EVAL_QUESTIONS[relation])
        assert len(sft_forms) >= 5 and 2 <= len(eval_forms) <= 3
        assert not (sft_forms & eval_forms) and not (eval_forms & pretraining) and not (sft_forms & pretraining)
        assert ANSWER_TEMPLATES[relation] in RELATIONS[relation].templates  # answers in a wording pretraining told
    eval_patterns = [template_regex(t) for forms in EVAL_QUESTIONS.values() for t in forms]
    assert not any(p.match(q) for p in eval_patterns for q in sft_users)
    eval_users = [c["messages"][0]["content"] for c in evaluation.conversations]
    assert all(any(p.match(q) for p in eval_patterns) for q in eval_users)
    assert WorldQA("eval", seed=SEED).conversations == evaluation.conversations  # deterministic

    # the dev split: the same held-out facts in a third set of wordings, none of SFT's, eval's or pretraining's
    dev = WorldQA("dev", seed=SEED)
    assert sorted((c["subject"], c["relation"]) for c in dev.conversations) == \
        sorted((c["subject"], c["relation"]) for c in evaluation.conversations)
    assert set(DEV_QUESTIONS) == set(EVAL_RELATIONS)
    for relation, dev_forms in DEV_QUESTIONS.items():
        assert not set(dev_forms) & (set(SFT_QUESTIONS[relation]) | set(EVAL_QUESTIONS[relation]) | pretraining)
    dev_patterns = [template_regex(t) for forms in DEV_QUESTIONS.values() for t in forms]
    dev_users = [c["messages"][0]["content"] for c in dev.conversations]
    assert all(any(p.match(q) for p in dev_patterns) and not any(p.match(q) for p in eval_patterns) for q in dev_users)
    assert not any(p.match(q) for p in dev_patterns for q in sft_users)


@pytest.mark.quick
def test_worldqa_sft_frames_come_with_every_relation():
    # a frame that only one relation's questions used would let the model answer by the frame, not the question
    frames = [template_regex(f.replace("{ask}", "{s}").replace("{direct}", "{s}")) for f in SFT_FRAMES if f[0] != "{"]
    for relation, wordings in SFT_QUESTIONS.items():
        assert len(SFT_ASKS[relation]) >= 6
        for frame in frames:
            assert sum(bool(frame.match(w)) for w in wordings) == len(SFT_ASKS[relation]), (relation, frame.pattern)
        for ask, direct in SFT_ASKS[relation]:
            assert "{s}" in ask and "{s}" in direct and direct in wordings


@pytest.mark.quick
def test_worldqa_evaluate_and_chance():
    task = WorldQA("eval", seed=SEED)
    world = task.world
    by_relation = {}
    for c in task.conversations:
        by_relation.setdefault(c["relation"], c)
    for relation, conversation in by_relation.items():
        assert task.evaluate(conversation, conversation["messages"][-1]["content"]), relation
    country = by_relation["neighbour"]["subject"]
    left, right = world.neighbours(country)
    stranger = next(c.name for c in world.countries if c.name not in (country, left, right))
    assert task.evaluate(by_relation["neighbour"], f"{country} borders {left}.")
    assert task.evaluate(by_relation["neighbour"], f"{right} is next to it.")
    assert not task.evaluate(by_relation["neighbour"], f"{country} borders {stranger}.")
    assert not task.evaluate(by_relation["neighbour"], f"{country}.")
    assert not task.evaluate(by_relation["neighbour"], f"{left} or {stranger}.")  # hedging fails

    capital = world.by_name[by_relation["capital"]["subject"]].capital
    other = next(c.capital for c in world.countries if c.capital != capital)
    assert task.evaluate(by_relation["capital"], f"It is {capital.upper()}.")
    assert not task.evaluate(by_relation["capital"], f"It is {other}.")
    assert not task.evaluate(by_relation["capital"], f"It is {capital}x.")  # whole words only

    population = world.by_name[by_relation["population"]["subject"]].population
    assert task.evaluate(by_relation["population"], f"About {population} million people.")
    assert not task.evaluate(by_relation["population"], f"About {population + 100} million people.")
    assert not task.evaluate(by_relation["population"], f"About 1{population} million people.")
    assert not task.evaluate(by_relation["population"], "I don't know.")
    assert 0 < task.baseline < 0.01


@pytest.mark.quick
def test_identity():
    sft, evaluation = Identity("sft", seed=SEED), Identity("eval", seed=SEED)
    assert not set(EVAL_IDENTITY_QUESTIONS) & {q for q, _ in SFT_IDENTITY_QUESTIONS}
    sft_users = {m["content"] for c in sft.conversations for m in c["messages"] if m["role"] == "user"}
    assert not any(q in u for q in EVAL_IDENTITY_QUESTIONS for u in sft_users)
    assert any(len(c["messages"]) == 4 for c in sft.conversations)
    for c in list(sft.conversations) + list(evaluation.conversations):
        assert "nanochat" in " ".join(m["content"] for m in c["messages"] if m["role"] == "assistant")
    example = evaluation[0]
    assert evaluation.evaluate(example, example["messages"][-1]["content"])
    assert evaluation.evaluate(example, "I'm NanoChat.") and not evaluation.evaluate(example, "I am ChatGPT.")


@pytest.mark.quick
def test_arithmetic_is_right_and_splits_never_share_a_question():
    train, test = Arithmetic("train", seed=SEED, num_examples=1500), Arithmetic("test", seed=SEED, num_examples=300)
    seen = {}
    for split, task in (("train", train), ("test", test)):
        for example in task:
            parts = example["messages"][1]["content"]
            expression, output = parts[1]["text"], parts[2]["text"]
            a, op, b = expression.split()
            assert eval(expression) == example["answer"] == int(output) == int(use_calculator(expression))
            assert task.evaluate(example, parts[3]["text"]) and not task.evaluate(example, f"{example['answer'] + 1}")
            seen.setdefault((a, op, b), set()).add(split)
    assert all(len(splits) == 1 for splits in seen.values())
    assert any("test" in s for s in seen.values()) and any("train" in s for s in seen.values())
    word_problems = [e for e in test if not e["messages"][0]["content"].startswith(("What", "Calculate", "Work", "Can"))]
    assert word_problems  # some are word problems
    assert Arithmetic("test", seed=SEED, num_examples=20)[7] == test[7]  # any example on its own, deterministic


@pytest.mark.quick
def test_spelling_tasks():
    bee_train, bee_test = SpellingBee("train", seed=SEED, num_examples=500), SpellingBee("test", seed=SEED)
    assert not set(bee_train.words) & set(bee_test.words)
    for task in (bee_train, bee_test):
        for example in task:
            parts = example["messages"][1]["content"]
            word, letter = re.fullmatch(r"'(\w+)'\.count\('(\w)'\)", parts[1]["text"]).groups()
            assert example["answer"] == word.count(letter) == int(parts[2]["text"]) == int(use_calculator(parts[1]["text"]))
            assert word in example["messages"][0]["content"] and task.evaluate(example, parts[3]["text"])
            assert not task.evaluate(example, f"It has {word.count(letter) + 1}.")
    spell_train, spell_test = SimpleSpelling("train", seed=SEED), SimpleSpelling("test", seed=SEED)
    train_words = {e["answer"] for e in spell_train}
    test_words = {e["answer"] for e in spell_test}
    assert not train_words & test_words and any(w[0].isupper() for w in test_words)  # world names too
    example = next(e for e in spell_test if e["answer"].islower())
    word = example["answer"].replace("-", "")
    assert spell_test.evaluate(example, example["messages"][1]["content"])
    assert spell_test.evaluate(example, f"Sure: {example['answer'].upper()}")
    assert not spell_test.evaluate(example, f"{example['answer']}-s") and not spell_test.evaluate(example, word)


@pytest.mark.quick
def test_builtin_conversations_are_valid_short_and_render(tokenizer):
    lengths = []
    for name in ("WorldQA", "Identity", "Arithmetic", "SpellingBee", "SimpleSpelling"):
        cls, _, splits = TASKS[name]
        for split in splits:
            task = cls(split=split, seed=SEED)
            for conversation in task:
                validate_conversation(conversation)
                lengths.append(len(check_render(tokenizer, conversation)))
    assert max(lengths) < 200, max(lengths)


def test_main_lists_every_task_offline(parquet_hub, base_dir):
    parquet_hub.add("openai/openai_humaneval", "openai_humaneval", "test", [HUMANEVAL_ROW])
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base_dir))
    run = subprocess.run([sys.executable, "-m", "tasks", "--download", "humaneval"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens: the listing must not need the network
    run = subprocess.run([sys.executable, "-m", "tasks"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = {line.split()[0]: line for line in run.stdout.splitlines() if line.strip()}
    assert all(name in rows for name in TASKS)
    assert "test 1" in rows["HumanEval"] and "--download GSM8K" in rows["GSM8K"]
    assert "sft" in rows["WorldQA"] and "eval" in rows["WorldQA"]
    assert "== WorldQA ==" in run.stdout and "== HumanEval ==" in run.stdout
