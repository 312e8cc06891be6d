"""
MMLU (cais/mmlu): four-choice questions on 57 subjects. Config "all" (splits test, validation, dev)
for evaluation; config "auxiliary_train" (split train, each row nested in a struct column "train")
for mid-training. Categorical: the assistant answers with a letter A-D.
"""

from nanochat.data.hub import load_table, table_row
from tasks.base import CategoricalTask, multiple_choice_conversation

REPO = "cais/mmlu"
SPLITS = {"all": ("test", "validation", "dev"), "auxiliary_train": ("train",)}
LETTERS = ("A", "B", "C", "D")


class MMLU(CategoricalTask):
    def __init__(self, subset, split, **slice_args):
        super().__init__(**slice_args)
        if split not in SPLITS.get(subset, ()):
            raise ValueError(f"MMLU has subsets and splits {SPLITS}, not {subset!r}/{split!r}")
        self.subset = subset
        self.name = "MMLU" if subset == "all" else "MMLU-aux"
        self.table = load_table(self.name, REPO, subset, split)

    def num_rows(self):
        return self.table.num_rows

    def get_row(self, index):
        return conversation_from_row(table_row(self.table, index))

    @property
    def baseline(self):
        return 1 / len(LETTERS)


def conversation_from_row(row):
    row = row.get("train", row)  # auxiliary_train nests each question in a struct column "train"
    letters = LETTERS[:len(row["choices"])]
    topic = row["subject"].replace("_", " ") if row.get("subject") else None
    conversation = multiple_choice_conversation(row["question"], row["choices"], letters, letters[row["answer"]], topic)
    conversation["subject"] = row.get("subject", "")
    return conversation
