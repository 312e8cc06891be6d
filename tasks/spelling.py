"""
Spelling tasks built from the corpus's word list (nanochat.corpus.drills), no download needed:
SpellingBee ("How many r's are in strawberry?", counted with the calculator) and SimpleSpelling
("Spell the word garden" -> "g-a-r-d-e-n", the corpus's spelling format). Words are split between
train and test by a seeded shuffle, so the splits never share a word.

SpellingBee counts letters in the word list only; SimpleSpelling also spells the built-in world's
country names and first names, as the corpus does (40 % of its examples; the held-out subjects'
names are the test split's, so SFT never mentions a held-out subject).
"""

import random
import re

from nanochat.corpus.drills import SPELLING_WORDS, spell_out
from tasks.base import Task, last_number, validate_conversation
from tasks.builtin import get_world, world_seed

SPLITS = ("train", "test")
TEST_FRACTION = 0.2
LETTERS = "abcdefghijklmnopqrstuvwxyz"
COUNT_QUESTIONS = ("How many {x}'s are in {w}?", "How many times does the letter {x} appear in {w}?",
                   "Count the letter {x} in {w}.", "How many {x}'s does the word {w} have?",
                   "In the word {w}, how many times does {x} occur?")
COUNT_ANSWERS = ("The word {w} has {k} letter {x}.", "The letter {x} appears {k} {times} in {w}.")
SPELL_QUESTIONS = ("Spell the word {w}.", "How do you spell {w}?", "Can you spell {w} for me?",
                   "Spell {w} letter by letter.", "What is the spelling of {w}?")
# The corpus's own sentence with a lead-in: a tiny model copies the word from the question far more
# reliably when it is not the answer's first word. One form, so no answer habit spreads to other tasks.
SPELL_ANSWER = "The word {w} is spelled {spelled}."
DEFAULT_EXAMPLES = {"train": 2000, "test": 200}


def split_words(words, seed, split):
    """The words of one split: a seeded shuffle of the distinct words, the last TEST_FRACTION for test."""
    words = sorted(set(words))
    random.Random(f"spelling-words-{seed}").shuffle(words)
    cut = len(words) - round(TEST_FRACTION * len(words))
    return words[:cut] if split == "train" else words[cut:]


class SpellingTask(Task):
    splits = SPLITS

    def __init__(self, split, seed=None, num_examples=None, **slice_args):
        super().__init__(**slice_args)
        if split not in SPLITS:
            raise ValueError(f"{self.name} has splits {', '.join(SPLITS)}, not {split!r}")
        self.split = split
        self.seed = world_seed() if seed is None else seed
        self.size = DEFAULT_EXAMPLES[split] if num_examples is None else num_examples

    def num_rows(self):
        return self.size

    def rng_for(self, index):
        return random.Random(f"{self.name}-{self.split}-{self.seed}-{index}")  # any example on its own


class SpellingBee(SpellingTask):
    """Count a letter in a word: spell it, count with the calculator, state the count."""

    name = "SpellingBee"

    def __init__(self, split, seed=None, num_examples=None, **slice_args):
        super().__init__(split, seed, num_examples, **slice_args)
        self.words = split_words(SPELLING_WORDS, self.seed, split)

    def get_row(self, index):
        rng = self.rng_for(index)
        word = rng.choice(self.words)
        # A random letter of a word is nearly always there once, and "1" would be right 3 times in 4:
        # pick a kind first (a repeated letter, a single one, an absent one), then a letter of that kind.
        repeated = sorted({x for x in word if word.count(x) > 1})
        single = sorted({x for x in word if word.count(x) == 1})
        absent = [x for x in LETTERS if x not in word]
        letter = rng.choice(rng.choice([kind for kind in (repeated, single, absent) if kind]))
        count = word.count(letter)
        answer = rng.choice(COUNT_ANSWERS).format(w=word, k=count, x=letter, times="time" if count == 1 else "times")
        parts = [{"type": "text", "text": f"The word {word} is spelled {spell_out(word)}. "},
                 {"type": "python", "text": f"'{word}'.count('{letter}')"},
                 {"type": "python_output", "text": str(count)},
                 {"type": "text", "text": answer}]
        question = rng.choice(COUNT_QUESTIONS).format(x=letter, w=word)
        return validate_conversation({"messages": [{"role": "user", "content": question},
                                                   {"role": "assistant", "content": parts}], "answer": count})

    def evaluate(self, conversation, completion):
        return last_number(completion) == conversation["answer"]


class SimpleSpelling(SpellingTask):
    """Spell a word (or a name of the built-in world) letter by letter."""

    name = "SimpleSpelling"

    def __init__(self, split, seed=None, num_examples=None, **slice_args):
        super().__init__(split, seed, num_examples, **slice_args)
        world = get_world(self.seed)
        names = [(c.name, c.name) for c in world.countries] + [(p.first, p.name) for p in world.people]
        test_split = split == "test"
        self.words = split_words(SPELLING_WORDS, self.seed, split)
        self.names = [word for word, subject in names if (subject in world.eval_subjects) == test_split]

    def get_row(self, index):
        rng = self.rng_for(index)
        word = rng.choice(self.words if rng.random() < 0.6 else self.names)
        spelled = spell_out(word)
        question = rng.choice(SPELL_QUESTIONS).format(w=word)
        answer = SPELL_ANSWER.format(w=word, spelled=spelled)
        return validate_conversation({"messages": [{"role": "user", "content": question},
                                                   {"role": "assistant", "content": answer}], "answer": spelled})

    def evaluate(self, conversation, completion):
        # the exact spelling, not a prefix of a longer one ("g-a-r-d-e-n-s" is wrong)
        spelled = re.escape(conversation["answer"])
        return re.search(rf"(?<![\w-]){spelled}(?![\w-])", completion, re.IGNORECASE) is not None
