"""
Chat tasks: what mid-training and SFT train on, what RL rewards and what chat_eval measures.

    get_task("ARC-Easy", split="test")          any task by name (case-insensitive)
    TaskMixture([...], seed=42), TaskSequence([...]), Repeated(task, 2.5)
    python -m tasks                    every task, its splits, eval type and an example

Hub tasks (ARC, MMLU, GSM8K, HumanEval, SmolTalk) download their parquet files into
<base_dir>/task_data/ on first use; the built-in tasks (WorldQA, Identity, Arithmetic, SpellingBee,
SimpleSpelling) are generated offline; CustomJSON reads your own JSONL file (and judges a reply by whether it
contains the file's answer).
"""

from nanochat.common import UserError
from tasks.arc import ARC
from tasks.base import CategoricalTask, Repeated, Task, TaskMixture, TaskSequence, validate_conversation
from tasks.builtin import Arithmetic, Identity, WorldFacts, WorldQA
from tasks.customjson import CustomJSON
from tasks.gsm8k import GSM8K
from tasks.humaneval import HumanEval
from tasks.mmlu import MMLU
from tasks.smoltalk import SmolTalk
from tasks.spelling import SimpleSpelling, SpellingBee

# name -> (class, fixed constructor arguments, splits); hub tasks first, then the built-in ones
TASKS = {
    "ARC-Easy": (ARC, {"subset": "ARC-Easy"}, ("train", "validation", "test")),
    "ARC-Challenge": (ARC, {"subset": "ARC-Challenge"}, ("train", "validation", "test")),
    "MMLU": (MMLU, {"subset": "all"}, ("test", "validation", "dev")),
    "MMLU-aux": (MMLU, {"subset": "auxiliary_train"}, ("train",)),
    "GSM8K": (GSM8K, {}, ("train", "test")),
    "HumanEval": (HumanEval, {}, ("test",)),
    "SmolTalk": (SmolTalk, {}, ("train", "test")),
    "WorldQA": (WorldQA, {}, ("sft", "dev", "eval")),
    "WorldFacts": (WorldFacts, {}, ("eval",)),
    "Identity": (Identity, {}, ("sft", "eval")),
    "Arithmetic": (Arithmetic, {}, ("train", "test")),
    "SpellingBee": (SpellingBee, {}, ("train", "test")),
    "SimpleSpelling": (SimpleSpelling, {}, ("train", "test")),
    "CustomJSON": (CustomJSON, {}, ()),  # no splits: one file, passed as path=
}
HUB_TASKS = ("ARC-Easy", "ARC-Challenge", "MMLU", "MMLU-aux", "GSM8K", "HumanEval", "SmolTalk")
BUILTIN_TASKS = ("WorldQA", "WorldFacts", "Identity", "Arithmetic", "SpellingBee", "SimpleSpelling")


def canonical_name(name):
    """The registry's spelling of a task name (any case), or UserError listing the valid names."""
    for known in TASKS:
        if known.lower() == str(name).lower():
            return known
    raise UserError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")


def get_task(name, split=None, **kwargs):
    """A task by name. `split` may be left out only for tasks with one split; CustomJSON needs path=."""
    name = canonical_name(name)
    cls, fixed, splits = TASKS[name]
    if cls is CustomJSON:
        if "path" not in kwargs:
            raise UserError("task CustomJSON needs path= (a JSONL file of conversations)")
        return CustomJSON(**kwargs)
    if split is None and len(splits) == 1:
        split = splits[0]
    if split not in splits:
        raise UserError(f"task {name} has splits {', '.join(splits)}; got split={split!r}")
    return cls(split=split, **fixed, **kwargs)


__all__ = ["Task", "CategoricalTask", "TaskMixture", "TaskSequence", "Repeated", "validate_conversation", "ARC", "MMLU",
           "GSM8K", "HumanEval", "SmolTalk", "CustomJSON", "SpellingBee", "SimpleSpelling", "WorldQA", "WorldFacts", "Identity",
           "Arithmetic", "TASKS", "HUB_TASKS", "BUILTIN_TASKS", "get_task"]
