"""
SmolTalk (HuggingFaceTB/smol-smoltalk, splits train and test): general chat conversations, the bulk
of what teaches the model to converse. Generative, but with no automatic check: evaluate raises.

Rows that are not valid conversations (roles out of order, empty turns, no final answer) are skipped
when the split loads; `skipped` counts them and the count is printed.
"""

from nanochat.common import print0
from nanochat.data.hub import load_table
from tasks.base import Task, validate_conversation

REPO = "HuggingFaceTB/smol-smoltalk"
SPLITS = ("train", "test")


def valid_row_indices(messages_column):
    valid, index = [], 0
    for chunk in messages_column.chunks:  # a chunk at a time: the train split has ~460k conversations
        for messages in chunk.to_pylist():
            try:
                validate_conversation({"messages": messages})
                valid.append(index)
            except ValueError:
                pass
            index += 1
    return valid


class SmolTalk(Task):
    name = "SmolTalk"

    def __init__(self, split, **slice_args):
        super().__init__(**slice_args)
        if split not in SPLITS:
            raise ValueError(f"SmolTalk has splits {SPLITS}, not {split!r}")
        self.messages = load_table(self.name, REPO, "default", split).column("messages")
        self.valid = valid_row_indices(self.messages)
        self.skipped = len(self.messages) - len(self.valid)
        if self.skipped:
            print0(f"SmolTalk {split}: skipped {self.skipped:,} of {len(self.messages):,} rows "
                   "that are not valid conversations")

    def num_rows(self):
        return len(self.valid)

    def get_row(self, index):
        return conversation_from_row({"messages": self.messages[self.valid[index]].as_py()})


def conversation_from_row(row):
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]]}
