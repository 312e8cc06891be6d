"""
HumanEval (openai/openai_humaneval): 164 Python functions to complete from their signature and
docstring. Generative: the reply's code runs in nanochat.execution's sandbox, the task's unit tests in a
sandboxed process of their own that calls it (a verdict the reply's code cannot forge), and it passes
only if every test does.
"""

import re

from nanochat.data.hub import load_table, table_row
from nanochat.execution import execute_tests
from tasks.base import Task

REPO = "openai/openai_humaneval"
CODE_BLOCK_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)
TIMEOUT_SECONDS = 5.0


def extract_code(completion):
    """The first fenced code block of a reply (an unclosed one runs to the end), else the whole reply."""
    match = CODE_BLOCK_RE.search(completion)
    return match.group(1) if match else completion


def with_prompt_imports(code, prompt):
    """Prepend the prompt's import lines that the code lacks (models often drop them when rewriting)."""
    imports = [line for line in prompt.splitlines() if line.startswith(("import ", "from ")) and line not in code]
    return "\n".join(imports + [code]) if imports else code


class HumanEval(Task):
    name = "HumanEval"

    def __init__(self, split="test", **slice_args):
        super().__init__(**slice_args)
        if split != "test":
            raise ValueError(f"HumanEval has only a test split, not {split!r}")
        self.table = load_table(self.name, REPO, "openai_humaneval", split)

    def num_rows(self):
        return self.table.num_rows

    def get_row(self, index):
        return conversation_from_row(table_row(self.table, index))

    def evaluate(self, conversation, completion):
        code = with_prompt_imports(extract_code(completion), conversation["prompt"])
        # The prompt's own helpers (HumanEval/10's is_palindrome, /38's encode_cyclic) serve the tests, not the reply's.
        tests = f"{conversation['test']}\n\ncheck({conversation['entry_point']})\n"
        return execute_tests(code, tests, conversation["entry_point"], setup=conversation["prompt"],
                             timeout=TIMEOUT_SECONDS).success


def conversation_from_row(row):
    request = f"Complete this Python function:\n\n```python\n{row['prompt']}```"
    solution = f"```python\n{row['prompt']}{row['canonical_solution']}```"
    return {"messages": [{"role": "user", "content": request}, {"role": "assistant", "content": solution}],
            "task_id": row["task_id"], "prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]}
