"""
Built-in chat tasks about the offline world of nanochat.corpus, generated from a seed with no network:
WorldQA (questions about the world's facts), Identity (who the assistant is) and Arithmetic (sums with
the calculator tool). With SpellingBee and SimpleSpelling they are all the CPU preset's chat data.

The split that matters is WorldQA's: "sft" asks about `world.sft_facts()` in SFT wordings, "eval" asks
about the held-out subjects in EVAL wordings that neither SFT nor pretraining ever used. The answers
are statements in a wording pretraining told, so a model that answers a held-out question has to map a
new question onto what it read. Every conversation is a few dozen tokens: the CPU model's context is 256.
"""

import functools
import operator
import random
import re
import zlib

from nanochat.corpus.drills import _equation
from nanochat.corpus.world import build_world, render_question, render_statement
from tasks.base import Task, last_number, mentions, validate_conversation

DEFAULT_WORLD_SEED = 42


def world_seed():
    """The seed the built-in corpus was built with (its corpus.json), else the corpus's default seed."""
    from nanochat.corpus.build import read_corpus_info  # lazy: it pulls in the dataset and eval modules

    info = read_corpus_info()
    return int(info["seed"]) if info else DEFAULT_WORLD_SEED


@functools.lru_cache(maxsize=4)
def get_world(seed):
    return build_world(seed)


def _check_split(task, split, splits):
    if split not in splits:
        raise ValueError(f"{task} has splits {', '.join(splits)}, not {split!r}")


# -----------------------------------------------------------------------------
# WorldQA

# Question wordings: SFT ones teach the question -> statement mapping; EVAL ones are held out of SFT.
# Both are disjoint from each other and from the Q&A wordings of pretraining (RELATIONS[r].questions).
# An SFT question is a frame ("Could you tell me ...?") around an ask ("the capital of {s}"): every frame goes
# with every ask, so a frame says nothing about the relation. Read by hand, the d4's held-out answers are
# right or wrong by wording, not by fact: at seeds 43 and 44 three of 15 held-out wordings were 0 % right
# ("Could you tell me the birthplace of X?" got X's work) and most others 85-100 %; the model routes a question
# to a relation by a few of its words and had learnt only the words SFT needed, e.g. "city" with a person
# for the birthplace ("birthplace" never came without "city"). Crossing the frames alone changed nothing
# (70 % -> 71 / 70 %); what helped is more asks, 6-10 per relation in the words pretraining's statements use
# for it, one with "birthplace" and no "city" (seeds 42 / 43 / 44: 90.5 / 70 / 70 % -> 88 / 78.5 / 89 %).
SFT_FRAMES = ("Tell me {ask}.", "Do you know {ask}?", "Can you tell me {ask}?", "Could you tell me {ask}?",
              "Quick question: {direct}", "I'm curious, {direct}", "{direct}")
# Per relation, an ask two ways: embedded in a frame ("the capital of {s}") and as a question of its own.
SFT_ASKS = {
    "capital": (("the capital of {s}", "What's the capital of {s}?"),
                ("the capital city of {s}", "What is the capital city of {s}?"),
                ("which city serves as the capital of {s}", "Which city serves as the capital of {s}?"),
                ("what city is the capital of {s}", "What city is the capital of {s}?"),
                ("which city {s} is governed from", "Which city is {s} governed from?"),
                ("where the government of {s} sits", "Where does the government of {s} sit?"),
                ("the seat of government of {s}", "Where is the seat of government of {s}?"),
                ("the city where the parliament of {s} sits", "In which city does the parliament of {s} sit?"),
                ("{s}'s capital", "{s}'s capital is which city?")),
    "continent": (("the continent of {s}", "What's the continent of {s}?"),
                  ("which continent {s} is in", "Which continent is {s} in?"),
                  ("what continent {s} is part of", "What continent is {s} part of?"),
                  ("which continent {s} belongs to", "Which continent does {s} belong to?"),
                  ("which continent is home to {s}", "Which continent is home to {s}?"),
                  ("in which continent {s} lies", "In which continent does {s} lie?")),
    "language": (("the main language of {s}", "What's the main language of {s}?"),
                 ("the official language of {s}", "What is the official language of {s}?"),
                 ("what people in {s} speak", "What do people in {s} speak?"),
                 ("what language is used in {s}", "What language is used in {s}?"),
                 ("which language the locals use in {s}", "Which language do the locals use in {s}?"),
                 ("the everyday language of {s}", "What is the everyday language of {s}?"),
                 ("what language schools in {s} teach in", "What language do schools in {s} teach in?"),
                 ("the language spoken in {s}", "Which language is spoken across {s}?"),
                 ("which language {s} uses", "Which language does {s} use?"),
                 ("what language you hear in {s}", "What language would I hear in {s}?")),
    "population": (("the population of {s}", "What is the size of the population of {s}?"),
                   ("roughly how many people live in {s}", "Roughly how many people live in {s}?"),
                   ("the approximate population of {s}", "What is the approximate population of {s}?"),
                   ("how many inhabitants {s} has", "How many inhabitants does {s} have?"),
                   ("how many residents {s} has", "How many residents does {s} have?"),
                   ("the number of people living in {s}", "What is the number of people living in {s}?"),
                   ("how big the population of {s} is", "How big is the population of {s}?"),
                   ("how many citizens {s} has", "About how many citizens does {s} have?"),
                   ("how many people live in {s}", "How many people does {s} have?"),
                   ("how many people {s} is home to", "How many people is {s} home to?")),
    "neighbour": (("a country that borders {s}", "What is a country that borders {s}?"),
                  ("a neighbour of {s}", "What is one neighbour of {s}?"),
                  ("which country is next to {s}", "Which country is next to {s}?"),
                  ("a country that shares a border with {s}", "Which country shares a border with {s}?"),
                  ("what country neighbours {s}", "What country neighbours {s}?"),
                  ("a country on the border of {s}", "What's a country on the border of {s}?"),
                  ("which country is adjacent to {s}", "What country is adjacent to {s}?"),
                  ("a country across the border from {s}", "Which country lies across the border from {s}?"),
                  ("which country {s} borders", "Which country does {s} border?")),
    "birthplace": (("the hometown of {s}", "What is {s}'s hometown?"),
                   ("which city {s} was born in", "Which city was {s} born in?"),
                   ("which city is the birthplace of {s}", "Which city is the birthplace of {s}?"),
                   ("where {s} comes from", "Where does {s} come from?"),
                   ("which town {s} is from", "Which town is {s} from?"),
                   ("the home city of {s}", "What is the home city of {s}?"),
                   ("the city of birth of {s}", "What's the city of birth of {s}?"),
                   ("where {s} was born", "In what city was {s} born?"),
                   ("the city {s} is a native of", "Which city is {s} a native of?"),
                   ("what {s}'s birthplace is", "What is {s}'s birthplace?")),
    "occupation": (("what {s} does for work", "What does {s} do for work?"),
                   ("the job of {s}", "What job does {s} have?"),
                   ("the occupation of {s}", "What is the occupation of {s}?"),
                   ("what kind of work {s} does", "What kind of work does {s} do?"),
                   ("how {s} earns a living", "How does {s} earn a living?"),
                   ("which line of work {s} is in", "Which line of work is {s} in?"),
                   ("what trade {s} follows", "What trade does {s} follow?"),
                   ("what {s} trained as", "What did {s} train as?")),
}


def _framed(frame, ask, direct):
    return frame.format(ask=ask, direct=direct if frame.startswith("{") else direct[0].lower() + direct[1:])


SFT_QUESTIONS = {relation: tuple(_framed(frame, ask, direct) for ask, direct in asks for frame in SFT_FRAMES)
                 for relation, asks in SFT_ASKS.items()}

EVAL_QUESTIONS = {
    "capital": ("Can you tell me which city is {s}'s capital?", "What's the name of the capital of {s}?",
                "Quick question: what is {s}'s capital called?"),
    "continent": ("{s} is on which continent?", "Can you tell me on what continent {s} is located?"),
    "language": ("If I travel to {s}, what language will people speak?", "Could you tell me what the people of {s} speak?",
                 "In {s}, what language is spoken?"),
    "population": ("Could you tell me how many people {s} has?", "What's the population of {s}, roughly?",
                   "How populous is {s}?"),
    "neighbour": ("Can you name a country bordering {s}?", "Which country can you reach by crossing the border of {s}?",
                  "Could you tell me a country next door to {s}?"),
    "birthplace": ("Could you tell me the birthplace of {s}?", "{s} was born in which city?",
                   "Name the city where {s} was born, please."),
    "occupation": ("Could you tell me {s}'s profession?", "What does {s} work as?"),
}
# Dev wordings: a third held-out set, for tuning how SFT generalises across wordings without reading the eval
# split's answers (`WorldQA("dev")`: the held-out subjects asked these ways). Written before any run looked at them.
DEV_QUESTIONS = {
    "capital": ("Name the capital of {s}.", "Do you happen to know what {s}'s capital is?", "What city is {s} run from?"),
    "language": ("Which tongue do the people of {s} use?", "Tell me what language they speak in {s}.",
                 "What language would I need to learn to live in {s}?"),
    "population": ("How many people are there in {s}?", "Give me the population of {s}.",
                   "How large is the population of {s}, approximately?"),
    "neighbour": ("What country is on the other side of {s}'s border?", "Tell me one country that {s} touches.",
                  "Which country lies beside {s}?"),
    "birthplace": ("Where is {s} originally from?", "Tell me the town where {s} was born.", "What city did {s} grow up in?"),
}
# Each answer is a statement pretraining told, so answering = recalling it. Each opens with a few words
# before the subject: a tiny model copies the subject from the question far more reliably after such a
# lead-in than when the subject is the answer's first word (measured on the CPU preset's d4 model after
# a short SFT: held-out neighbour and birthplace questions went from 7-10 % right to 65-75 %).
ANSWER_TEMPLATES = {
    "capital": "The capital of {s} is {o}.",
    "continent": "The country of {s} sits in {o}.",
    "language": "The main language of {s} is {o}.",
    "population": "The population of {s} is roughly {o}.",
    "neighbour": "One of the neighbours of {s} is {o}.",
    "birthplace": "The birthplace of {s} is {o}.",
    "occupation": "The work of {s} is that of {a_o}.",
}
# Continents (8) and occupations (25) would be guessed right 4-13 % of the time: they are trained in
# SFT but not asked in the eval split, whose chance level stays under 1 %.
EVAL_RELATIONS = ("capital", "language", "population", "neighbour", "birthplace")
SFT_REPEATS = 5  # conversations per SFT fact, each in a different wording
SFT_PAIR_FRACTION = 0.1  # extra two-question conversations, as a fraction of the SFT facts


class WorldQA(Task):
    """One question about one fact of the built-in world per conversation (a few SFT ones ask two)."""

    name = "WorldQA"
    splits = ("sft", "dev", "eval")

    def __init__(self, split, seed=None, **slice_args):
        super().__init__(**slice_args)
        _check_split(self.name, split, self.splits)
        self.split = split
        self.seed = world_seed() if seed is None else seed
        self.world = world = get_world(self.seed)
        capitals = {c.capital for c in world.countries}
        self.candidates = {  # every object an answer could name, per relation: naming a wrong one fails
            "capital": capitals, "birthplace": capitals, "continent": set(world.continents),
            "language": set(world.languages),
            "occupation": {f.object for f in world.facts if f.relation == "occupation"},
            "neighbour": {c.name for c in world.countries},
        }
        self.num_populations = len({c.population for c in world.countries})
        rng = random.Random(f"worldqa-{split}-{self.seed}")
        if split == "sft":
            self.conversations = self._sft(rng)
        else:
            self.conversations = self._eval(rng, DEV_QUESTIONS if split == "dev" else EVAL_QUESTIONS)

    def _sft(self, rng):
        facts = self.world.sft_facts()
        conversations = []
        for fact in facts:
            for question in rng.sample(SFT_QUESTIONS[fact.relation], SFT_REPEATS):
                conversations.append(self._conversation([(fact, question)]))
        for _ in range(round(SFT_PAIR_FRACTION * len(facts))):
            first = rng.choice(facts)
            # half the pairs stay on one subject, as a curious user would
            pool = self.world.facts_by_subject[first.subject] if rng.random() < 0.5 else facts
            second = rng.choice([f for f in pool if f != first])
            asked = [(f, rng.choice(SFT_QUESTIONS[f.relation])) for f in (first, second)]
            conversations.append(self._conversation(asked))
        rng.shuffle(conversations)
        return conversations

    def _eval(self, rng, wordings):
        facts = [f for f in self.world.eval_facts() if f.relation in EVAL_RELATIONS]
        turn = {r: 0 for r in EVAL_RELATIONS}
        conversations = []
        for fact in facts:  # the wordings of a relation in turn, so each is used about equally
            questions = wordings[fact.relation]
            conversations.append(self._conversation([(fact, questions[turn[fact.relation] % len(questions)])]))
            turn[fact.relation] += 1
        rng.shuffle(conversations)  # any first N (chat_eval's --max-problems) then covers every relation
        return conversations

    def _conversation(self, asked):
        messages = []
        for fact, question in asked:
            messages += [{"role": "user", "content": render_question(fact, question)},
                         {"role": "assistant", "content": render_statement(fact, ANSWER_TEMPLATES[fact.relation])}]
        last = asked[-1][0]
        return validate_conversation({"messages": messages, "subject": last.subject, "relation": last.relation})

    def num_rows(self):
        return len(self.conversations)

    def get_row(self, index):
        return self.conversations[index]

    def accepted_answers(self, subject, relation):
        if relation == "neighbour":
            return set(self.world.neighbours(subject))
        return {f.object for f in self.world.facts_by_subject[subject] if f.relation == relation}

    def evaluate(self, conversation, completion):
        """Right when the reply names a true object of the asked fact and no wrong one (hedging fails)."""
        subject, relation = conversation["subject"], conversation["relation"]
        accepted = self.accepted_answers(subject, relation)
        if relation == "population":
            named = {f"{n} million" for n in re.findall(r"(\d+)\s+million", completion, re.IGNORECASE)}
        else:
            named = {o for o in self.candidates[relation] - {subject} if mentions(completion, o)}
        return bool(named) and named <= accepted

    def chance(self, conversation):
        """The chance of naming a right object by picking one of the relation's objects at random."""
        relation = conversation["relation"]
        if relation == "population":
            return 1 / self.num_populations
        options = self.candidates[relation] - {conversation["subject"]}
        return len(self.accepted_answers(conversation["subject"], relation)) / len(options)

    @property
    def baseline(self):
        return sum(self.chance(self.get_example(i)) for i in range(len(self))) / max(1, len(self))


class WorldFacts(WorldQA):
    """
    For base models: a statement pretraining told, cut before its object ("The capital of Zorland is"); the
    model's greedy continuation must name the object. No chat format: `text_prompt` is the whole prompt, and
    chat_eval feeds it after <|bos|> as plain text. Asks about the held-out subjects, each fact in two of its
    relation's object-final wordings.
    """

    name = "WorldFacts"
    splits = ("eval",)
    eval_type = "completion"

    def _eval(self, rng, wordings):
        from nanochat.corpus.core_bundle import object_last_templates

        examples = []
        for fact in self.world.eval_facts():
            if fact.relation not in EVAL_RELATIONS:
                continue
            for prefix, _ in rng.sample(object_last_templates(fact.relation), 2):
                text = prefix.format(s=fact.subject)
                examples.append({"messages": [{"role": "user", "content": text},
                                              {"role": "assistant", "content": fact.object}],
                                 "text_prompt": text, "subject": fact.subject, "relation": fact.relation})
        rng.shuffle(examples)
        return examples

    def evaluate(self, conversation, completion):
        return super().evaluate(conversation, completion.split("\n")[0].split(".")[0])  # the first clause only


# -----------------------------------------------------------------------------
# Identity

IDENTITY_INTRO = (
    "I'm nanochat, a small language model trained from scratch with the nanochat pipeline.",
    "I am nanochat, a tiny language model trained from scratch with the nanochat pipeline.",
    "My name is nanochat. I'm a small language model, trained from scratch with the nanochat pipeline.",
)
IDENTITY_SKILLS = (
    "I know about a small invented world of countries and people, I can do arithmetic with a calculator, "
    "and I can spell words.",
    "I can answer questions about a small invented world, work out sums with a calculator and spell words.",
)
IDENTITY_ORIGIN = (
    "The nanochat pipeline trained me from scratch: first on text, then on conversations like this one.",
    "I was trained from scratch by the nanochat pipeline, on a small corpus and then on conversations.",
)
IDENTITY_NOT_HUMAN = (
    "No, I'm not a person.",
    "I'm not a human, I'm a program.",
)
# (question, what the answer adds after the introduction); "" = the introduction alone
SFT_IDENTITY_QUESTIONS = (
    ("Who are you?", ""), ("What are you?", ""), ("What is your name?", ""), ("What's your name?", ""),
    ("Tell me about yourself.", "skills"), ("Introduce yourself.", "skills"), ("Who made you?", "origin"),
    ("How were you trained?", "origin"), ("Where do you come from?", "origin"), ("What model are you?", ""),
    ("Are you a person?", "not_human"), ("Are you human?", "not_human"), ("Are you ChatGPT?", "not_chatgpt"),
    ("What can you do?", "skills"), ("What do you know about?", "skills"), ("Who am I talking to?", ""),
    ("What should I call you?", ""), ("What kind of assistant are you?", "skills"), ("Hello, who is this?", ""),
    ("Are you a robot?", "not_human"), ("Can you tell me who you are?", ""), ("Could you introduce yourself?", "skills"),
)
EVAL_IDENTITY_QUESTIONS = (
    "Could you describe what you are?", "Which assistant is this?", "Whom am I chatting with right now?",
    "Please state your name.", "What are you called?", "Can you say who you are?",
)
GREETINGS = ("Hi!", "Hello!", "Hey there.", "Good morning!")
GREETING_REPLIES = ("Hello! I'm nanochat. What would you like to know?", "Hi! I'm nanochat, happy to help.")
THANKS = ("Thanks!", "Thank you.", "Great, thanks.")
THANKS_REPLIES = ("You're welcome!", "Glad to help. Ask me anything else.")
IDENTITY_SFT_EXAMPLES = 240


def identity_answer(rng, extra):
    if extra == "not_human":
        return rng.choice(IDENTITY_NOT_HUMAN) + " " + rng.choice(IDENTITY_INTRO)
    if extra == "not_chatgpt":
        return "No. " + rng.choice(IDENTITY_INTRO)
    more = {"skills": IDENTITY_SKILLS, "origin": IDENTITY_ORIGIN}.get(extra)
    return rng.choice(IDENTITY_INTRO) + (" " + rng.choice(more) if more else "")


class Identity(Task):
    """'Who are you?' in many wordings: the assistant says it is nanochat and what it can do."""

    name = "Identity"
    splits = ("sft", "eval")

    def __init__(self, split, seed=None, **slice_args):
        super().__init__(**slice_args)
        _check_split(self.name, split, self.splits)
        self.seed = world_seed() if seed is None else seed
        rng = random.Random(f"identity-{split}-{self.seed}")
        if split == "eval":  # each held-out wording alone and after a greeting
            self.conversations = [self._conversation(rng, prefix + question, "")
                                  for question in EVAL_IDENTITY_QUESTIONS for prefix in ("", "Hello! ")]
            return
        self.conversations = []
        for i in range(IDENTITY_SFT_EXAMPLES):
            question, extra = SFT_IDENTITY_QUESTIONS[i % len(SFT_IDENTITY_QUESTIONS)]
            conversation = self._conversation(rng, question, extra)
            style = rng.random()
            if style < 0.15:  # a greeting first
                conversation["messages"][:0] = [{"role": "user", "content": rng.choice(GREETINGS)},
                                                {"role": "assistant", "content": rng.choice(GREETING_REPLIES)}]
            elif style < 0.3:  # thanks at the end
                conversation["messages"] += [{"role": "user", "content": rng.choice(THANKS)},
                                             {"role": "assistant", "content": rng.choice(THANKS_REPLIES)}]
            self.conversations.append(conversation)

    def _conversation(self, rng, question, extra):
        return validate_conversation({"messages": [{"role": "user", "content": question},
                                                   {"role": "assistant", "content": identity_answer(rng, extra)}]})

    def num_rows(self):
        return len(self.conversations)

    def get_row(self, index):
        return self.conversations[index]

    def evaluate(self, conversation, completion):
        return mentions(completion, "nanochat")


# -----------------------------------------------------------------------------
# Arithmetic

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}  # "/" is always exact
OPERATION_WORDS = {"+": ("+", "plus"), "-": ("-", "minus"), "*": ("×", "*", "times"), "/": ("÷", "/", "divided by")}
PLAIN_QUESTIONS = ("What is {a} {w} {b}?", "Calculate {a} {w} {b}.", "What does {a} {w} {b} equal?",
                   "Work out {a} {w} {b}.", "Can you compute {a} {w} {b}?")
LEAD_INS = ("Let me use the calculator. ", "I'll calculate it. ", "Using the calculator: ")
ITEMS = ("apples", "coins", "books", "stamps", "marbles", "pencils", "shells", "cards")
ARITHMETIC_EXAMPLES = {"train": 4000, "test": 400}
TEST_SHARE = 10  # one equation in TEST_SHARE belongs to the test split


def _word_problem(rng, name, op):
    """(question, lead-in, a, b, how the answer sentence ends) in the style of the corpus's word problems."""
    item = rng.choice(ITEMS)
    if op == "+":
        a, b = rng.randint(2, 500), rng.randint(2, 500)
        return (f"{name} had {a} {item} and got {b} more. How many {item} does {name} have now?",
                "We add them. ", a, b, f"so {name} now has {{c}} {item}.")
    if op == "-":
        a = rng.randint(10, 900)
        b = rng.randint(1, a)
        return (f"{name} had {a} {item} and gave away {b}. How many {item} are left?",
                "We subtract. ", a, b, f"so {{c}} {item} are left.")
    if op == "*":
        a, b = rng.randint(2, 30), rng.randint(2, 40)
        return (f"{name} packed {a} boxes with {b} {item} in each. How many {item} are there in all?",
                "We multiply. ", a, b, f"so there are {{c}} {item} in all.")
    b, c = rng.randint(2, 12), rng.randint(2, 40)
    return (f"{name} shared {b * c} {item} equally among {b} friends. How many {item} did each friend get?",
            "We divide. ", b * c, b, f"so each friend got {{c}} {item}.")


class Arithmetic(Task):
    """Sums, differences, products and exact quotients, plain or as word problems, solved with the calculator."""

    name = "Arithmetic"
    splits = ("train", "test")

    def __init__(self, split, seed=None, num_examples=None, **slice_args):
        super().__init__(**slice_args)
        _check_split(self.name, split, self.splits)
        self.split = split
        self.seed = world_seed() if seed is None else seed
        self.names = [p.first for p in get_world(self.seed).people]
        self.size = ARITHMETIC_EXAMPLES[split] if num_examples is None else num_examples

    def in_split(self, a, op, b):
        """Which split an equation belongs to: a fixed hash, so train and test never share a question."""
        bucket = zlib.crc32(f"{self.seed}:{a}{op}{b}".encode()) % TEST_SHARE
        return (bucket == 0) == (self.split == "test")

    def num_rows(self):
        return self.size

    def get_row(self, index):
        rng = random.Random(f"arithmetic-{self.split}-{self.seed}-{index}")  # any example on its own, in any order
        while True:
            op = rng.choice("+-*/")
            if rng.random() < 0.3:
                question, lead_in, a, b, ending = _word_problem(rng, rng.choice(self.names), op)
            else:
                a, b, _ = _equation(rng, op)
                word = rng.choice(OPERATION_WORDS[op])
                question = rng.choice(PLAIN_QUESTIONS).format(a=a, w=word, b=b)
                lead_in, ending = rng.choice(LEAD_INS), None
            if self.in_split(a, op, b):
                break
        c = OPERATIONS[op](a, b)
        expression = f"{a} {op} {b}"
        equation = f"{a} {OPERATION_WORDS[op][0]} {b} = {c}"
        answer = f"{equation}, {ending.format(c=c)}" if ending else f"{equation}."
        parts = [{"type": "text", "text": lead_in}, {"type": "python", "text": expression},
                 {"type": "python_output", "text": str(c)}, {"type": "text", "text": answer}]
        return validate_conversation({"messages": [{"role": "user", "content": question},
                                                   {"role": "assistant", "content": parts}], "answer": c})

    def evaluate(self, conversation, completion):
        return last_number(completion) == conversation["answer"]
