"""
CustomJSON: conversations of your own from a JSONL file, one per line, each either a list of messages
or {"messages": [...]}. Any bad line stops the load with the file, the line number and the reason.
Generative, with no automatic check (evaluate raises).
"""

import json

from nanochat.common import UserError, json_loads
from tasks.base import Task, validate_conversation


class CustomJSON(Task):
    name = "CustomJSON"

    def __init__(self, path, **slice_args):
        super().__init__(**slice_args)
        self.path = path
        self.conversations = []
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except OSError as e:
            raise UserError(f"CustomJSON: cannot read {path} ({e.strerror})") from None
        for number, line in enumerate(lines, start=1):
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
            self.conversations.append({"messages": conversation["messages"]})
        if not self.conversations:  # training on it would quietly train on nothing of it
            raise UserError(f"{path} holds no conversations: write one per line, a JSON list of messages or "
                            "{\"messages\": [...]}")

    def num_rows(self):
        return len(self.conversations)

    def get_row(self, index):
        return self.conversations[index]
