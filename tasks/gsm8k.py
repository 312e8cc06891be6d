"""
GSM8K (openai/gsm8k, config main): grade-school word problems whose worked answers carry calculator
annotations "<<48/2=24>>" and end with "#### 72". Generative, with a reward for RL.

The annotations become tool calls. Given "sold 48/2 = <<48/2=24>>24 clips", the assistant's parts are
text "sold 48/2 = ", python "48/2", python_output "24", text "24 clips": the annotation's own text is
dropped and everything else is kept as written, so the text parts alone read exactly like the answer
without annotations, and the model learns to copy the tool's output into its prose.
"""

import re

from nanochat.data.hub import load_table, table_row
from tasks.base import Task, parse_number

REPO = "openai/gsm8k"
SPLITS = ("train", "test")
ANNOTATION_RE = re.compile(r"<<([^<>]*)>>")
FINAL_ANSWER_RE = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def answer_parts(answer):
    """A GSM8K answer -> assistant content parts (text / python / python_output)."""
    parts, position = [], 0
    for match in ANNOTATION_RE.finditer(answer):
        parts.append({"type": "text", "text": answer[position:match.start()]})
        expression, equals, result = match.group(1).rpartition("=")
        if equals:  # an annotation without "=" has no result to show: it is dropped
            parts += [{"type": "python", "text": expression}, {"type": "python_output", "text": result}]
        position = match.end()
    parts.append({"type": "text", "text": answer[position:]})
    return [p for p in parts if p["type"] != "text" or p["text"]]


def final_answer(text):
    """The number after '####' (commas dropped), or None."""
    match = FINAL_ANSWER_RE.search(text)
    return parse_number(match.group(1)) if match else None


class GSM8K(Task):
    name = "GSM8K"

    def __init__(self, split, subset="main", **slice_args):
        super().__init__(**slice_args)
        if split not in SPLITS:
            raise ValueError(f"GSM8K has splits {SPLITS}, not {split!r}")
        self.table = load_table(self.name, REPO, subset, split)

    def num_rows(self):
        return self.table.num_rows

    def get_row(self, index):
        return conversation_from_row(table_row(self.table, index))

    def evaluate(self, conversation, completion):
        predicted = final_answer(completion)
        return predicted is not None and predicted == parse_number(conversation["answer"])


def conversation_from_row(row):
    return {"messages": [{"role": "user", "content": row["question"]},
                         {"role": "assistant", "content": answer_parts(row["answer"])}],
            "answer": row["answer"].rsplit("####", 1)[-1].strip()}  # the reference final answer, e.g. "72"
