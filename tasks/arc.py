"""
ARC (allenai/ai2_arc): grade-school science questions with 3-5 choices, configs ARC-Easy and
ARC-Challenge. Categorical: the assistant answers with the label of the right choice.
"""

from nanochat.data.hub import load_table, table_row
from tasks.base import CategoricalTask, multiple_choice_conversation

REPO = "allenai/ai2_arc"
SUBSETS = ("ARC-Easy", "ARC-Challenge")
SPLITS = ("train", "validation", "test")


class ARC(CategoricalTask):
    def __init__(self, subset, split, **slice_args):
        super().__init__(**slice_args)
        if subset not in SUBSETS or split not in SPLITS:
            raise ValueError(f"ARC has subsets {SUBSETS} and splits {SPLITS}, not {subset!r}/{split!r}")
        self.name = subset
        self.table = load_table(subset, REPO, subset, split)

    def num_rows(self):
        return self.table.num_rows

    def get_row(self, index):
        return conversation_from_row(table_row(self.table, index))


def conversation_from_row(row):
    # Some rows label their choices 1-4 instead of A-D: the labels are used as they are.
    labels, texts = row["choices"]["label"], row["choices"]["text"]
    conversation = multiple_choice_conversation(row["question"], texts, labels, row["answerKey"])
    conversation["id"] = row["id"]
    return conversation
