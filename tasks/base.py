"""
What every chat task shares: the `Task` base with slicing, `TaskMixture` and `TaskSequence` to combine
tasks, the conversation validator, the multiple-choice prompt format, and a few answer-checking helpers.

A task is a list of conversations ({"messages": [...]} plus fields its `evaluate` reads). Subclasses
supply `num_rows()` and `get_row(i)`; the base maps example i of the slice start:stop:step onto a row.
"""

import bisect
import random
import re
from array import array

# -----------------------------------------------------------------------------
# Conversations

ROLES = ("system", "user", "assistant")
ASSISTANT_PART_TYPES = ("text", "python", "python_output")


def _check_content(i, role, content):
    if isinstance(content, str):
        if not content.strip():
            raise ValueError(f"message {i} ({role}) has empty content")
        return
    if not isinstance(content, list) or not content:
        raise ValueError(f"message {i} ({role}) content must be a non-empty string or a non-empty list of parts")
    allowed = ASSISTANT_PART_TYPES if role == "assistant" else ("text",)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise ValueError(f"message {i} ({role}) part {j} has type {kind!r}: "
                             f"{role} parts may be {', '.join(allowed)}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"message {i} ({role}) part {j} has no 'text' string")
    if not any(part["text"].strip() for part in content):
        raise ValueError(f"message {i} ({role}) has empty content")


def validate_conversation(conversation):
    """
    Raise ValueError naming the first problem: roles must alternate user/assistant starting with user
    (one optional leading system message), every content is a non-empty string or list of parts
    (text for user/system; text, python, python_output for the assistant), and the assistant speaks last.
    """
    messages = conversation.get("messages") if isinstance(conversation, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError("a conversation is {'messages': [...]} with at least one message")
    previous = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is not a dict with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i} has unknown role {role!r}: roles are user, assistant and system")
        if role == "system" and i > 0:
            raise ValueError(f"message {i} has role 'system': only the first message may be a system message")
        expected = "assistant" if previous == "user" else "user"
        if role != "system" and role != expected:
            after = f"after {previous!r}" if previous else "first"
            raise ValueError(f"message {i} has role {role!r} {after}: roles must alternate user/assistant, "
                             "starting with user")
        _check_content(i, role, message.get("content"))
        previous = role
    if previous != "assistant":
        raise ValueError(f"the last message has role {previous!r}: a conversation must end with the assistant's answer")
    return conversation


def conversation_text(conversation):
    """A readable one-string view of a conversation (tool calls in brackets), for listings and debugging."""
    lines = []
    for message in conversation["messages"]:
        content = message["content"]
        if isinstance(content, list):
            shown = {"text": "{}", "python": "[python: {}]", "python_output": "[output: {}]"}
            content = "".join(shown[part["type"]].format(part["text"]) for part in content)
        lines.append(f"{message['role']}: {content}")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Multiple choice (ARC, MMLU): one prompt format, answered by a single letter


def multiple_choice_conversation(question, choices, letters, answer_letter, topic=None):
    intro = f"Multiple choice question about {topic}:" if topic else "Multiple choice question:"
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(letters, choices))
    prompt = f"{intro} {question}\n\n{options}\n\nAnswer with the letter of the correct choice."
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer_letter}],
            "letters": list(letters)}


# -----------------------------------------------------------------------------
# Checking answers

NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_number(text):
    """'1,234' -> 1234.0; None for anything that is not a number."""
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def last_number(text):
    """The last number written in text (commas ignored), or None."""
    found = NUMBER_RE.findall(text)
    return parse_number(found[-1]) if found else None


def mentions(text, phrase):
    """Whether phrase occurs in text as whole words, ignoring case."""
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text, re.IGNORECASE) is not None


# -----------------------------------------------------------------------------
# Tasks


class Task:
    """A sliceable list of conversations. Subclasses implement num_rows, get_row and (to be evaluated) evaluate."""

    name = "task"
    eval_type = "generative"  # "categorical": answered by one of example["letters"]; "generative": sampled text

    def __init__(self, start=0, stop=None, step=1):
        if step < 1 or start < 0 or (stop is not None and stop < start):
            raise ValueError(f"bad slice start={start} stop={stop} step={step}")
        self.start, self.stop, self.step = start, stop, step

    def num_rows(self):
        raise NotImplementedError

    def get_row(self, index):
        raise NotImplementedError

    def _rows(self):
        return range(self.num_rows())[self.start:self.stop:self.step]

    def num_examples(self):
        return len(self._rows())

    def get_example(self, i):
        return self.get_row(self._rows()[i])

    def __len__(self):
        return self.num_examples()

    def __getitem__(self, i):
        return self.get_example(i)  # an IndexError past the end ends iteration

    def evaluate(self, conversation, completion):
        """Whether `completion` (the assistant's reply, as text) answers `conversation` correctly."""
        raise NotImplementedError(f"{self.name} has no evaluation")

    def reward(self, conversation, completion):
        return float(self.evaluate(conversation, completion))

    @property
    def baseline(self):
        """Accuracy of random guessing: 1/choices for categorical tasks (averaged), 0 for generative ones."""
        if self.eval_type != "categorical":
            return 0.0
        if not hasattr(self, "_baseline"):
            self._baseline = sum(1 / len(self.get_example(i)["letters"]) for i in range(len(self))) / max(1, len(self))
        return self._baseline


class CategoricalTask(Task):
    """Answered by one letter: right when the reply is the letter of the reference answer."""

    eval_type = "categorical"

    def evaluate(self, conversation, completion):
        return completion.strip() == conversation["messages"][-1]["content"]


class TaskMixture(Task):
    """Every example of every task, in one deterministic shuffled order; list a task twice to oversample it."""

    def __init__(self, tasks, seed=42, **slice_args):
        super().__init__(**slice_args)
        self.tasks = list(tasks)
        self.name = "+".join(t.name for t in self.tasks)
        pairs = [(t, j) for t, task in enumerate(self.tasks) for j in range(task.num_examples())]
        random.Random(seed).shuffle(pairs)
        # two flat arrays instead of a list of tuples: a mixture can hold half a million examples
        self._task_index = array("I", (t for t, _ in pairs))
        self._example_index = array("I", (j for _, j in pairs))

    def num_rows(self):
        return len(self._task_index)

    def get_row(self, index):
        return _tagged(self, self._task_index[index], self.tasks[self._task_index[index]].get_example(self._example_index[index]))

    def evaluate(self, conversation, completion):
        return _owner(self, conversation).evaluate(conversation, completion)

    def reward(self, conversation, completion):
        return _owner(self, conversation).reward(conversation, completion)


class Repeated(Task):
    """
    A task's examples `times` times over (times > 0, a float): every example int(times) times, then a seeded choice of
    round(fraction x examples) of them once more. A mixture walks the same order every epoch, so a fraction's choice
    is the same every epoch: 0.5 trains on one half of the task, never the other (2.5: all twice, one half a third
    time). Rows are computed from the index, not copied: a mixture holding this keeps one index per row all the same.
    """

    def __init__(self, task, times, seed=0, **slice_args):
        super().__init__(**slice_args)
        if not times > 0:
            raise ValueError(f"times={times} must be > 0")
        self.task, self.times = task, times
        self.name = f"{task.name} x{times:g}"
        n = task.num_examples()
        self.whole = int(times)
        extra = int((times - self.whole) * n + 0.5)
        self.chosen = sorted(random.Random(seed).sample(range(n), extra))

    def num_rows(self):
        return self.whole * self.task.num_examples() + len(self.chosen)

    def get_row(self, index):
        n = self.task.num_examples()
        return self.task.get_example(index % n if index < self.whole * n else self.chosen[index - self.whole * n])

    def evaluate(self, conversation, completion):
        return self.task.evaluate(conversation, completion)

    def reward(self, conversation, completion):
        return self.task.reward(conversation, completion)


class TaskSequence(Task):
    """The tasks' examples one task after the other, in the order given."""

    def __init__(self, tasks, **slice_args):
        super().__init__(**slice_args)
        self.tasks = list(tasks)
        self.name = ",".join(t.name for t in self.tasks)
        self._ends = []
        total = 0
        for task in self.tasks:
            total += task.num_examples()
            self._ends.append(total)

    def num_rows(self):
        return self._ends[-1] if self._ends else 0

    def get_row(self, index):
        t = bisect.bisect_right(self._ends, index)
        return _tagged(self, t, self.tasks[t].get_example(index - (self._ends[t - 1] if t else 0)))

    def evaluate(self, conversation, completion):
        return _owner(self, conversation).evaluate(conversation, completion)

    def reward(self, conversation, completion):
        return _owner(self, conversation).reward(conversation, completion)


def _tagged(combined, task_index, conversation):
    """The conversation, marked with which of the combined task's tasks it came from, so verdicts go to that task."""
    return {**conversation, "_from": {**conversation.get("_from", {}), id(combined): task_index}}


def _owner(combined, conversation):
    return combined.tasks[conversation["_from"][id(combined)]]
