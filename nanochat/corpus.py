"""
The built-in corpus: a small synthetic world, generated from a seed with no network,
written as parquet shards in the same layout as downloaded data.

    python -m nanochat.corpus [--seed 42] [--size-mb 6] [--out DIR]

The world (`build_world(seed)`) is a few hundred invented countries and people, each with
facts of seven relations (`RELATIONS`). Pretraining documents tell every fact many times
(~50 at the default size) in varied English: encyclopedia entries, travel notes, letters,
Q&A lists, fact cards, comparisons. Arithmetic documents (worked sums, differences,
products, quotients) and spelling documents (letter by letter, letter counts) fill the rest.

shard_00000.parquet is the validation shard: fresh documents about the same world, with new
combinations and orderings of the sentences, none identical to a train document.
shard_00001.parquet... are the train shards. Same seed -> byte-identical files.

Beside the shards goes a CORE eval bundle about the same world (`write_eval_bundle`, by default in
<base_dir>/eval_bundle_builtin): multiple-choice, schema and language-modelling tasks in the
published DCLM format, so `python -m scripts.base_eval --eval-bundle=builtin` needs no network.

Train / eval split of the world, for the chat stages built on top of this module: every fact
is told in pretraining, but questions-and-answers in conversations (SFT) may only be about
facts whose subject is in `world.sft_subjects`; held-out evaluation questions ask about
`world.eval_subjects`. A model that answers those has learned to *retrieve* what it read in
pretraining when asked, not memorised the Q/A pairs.
"""

import argparse
import csv
import io
import json
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from nanochat.common import UserError, atomic_write_text, get_base_dir, print0, run_main
from nanochat.dataset import SHARD_RE, get_data_dir, shard_filename

CORPUS_VERSION = 1  # bump when the generator changes what a seed produces
VAL_SHARD_INDEX = 0
MIXTURE = {"world": 0.84, "arithmetic": 0.08, "spelling": 0.08}  # fractions of the text bytes

# -----------------------------------------------------------------------------
# Relations: how each kind of fact is told in English.
# {s} is the subject, {o} the object, {a_o} the object with "a"/"an" in front.


@dataclass(frozen=True)
class Relation:
    name: str
    subject_kind: str  # "country" or "person"
    label: str  # the field name on fact cards ("Capital: ...")
    templates: tuple  # statements, each one sentence ending in "." that names both subject and object
    questions: tuple  # question forms used by the Q&A documents


RELATIONS = {r.name: r for r in [
    Relation("capital", "country", "Capital", (
        "The capital of {s} is {o}.",
        "{o} is the capital of {s}.",
        "{s} has its capital at {o}.",
        "{s} is governed from its capital, {o}.",
        "The capital city of {s} is {o}.",
        "{o} serves as the capital of {s}.",
        "In {s}, the seat of government is the city of {o}.",
        "The government of {s} meets in {o}, the national capital.",
        "{s}'s capital is {o}.",
        "{o} has been the capital of {s} for as long as anyone remembers.",
        "If you visit {s}, its capital {o} is the place to start.",
        "The city of {o} is the capital of {s}.",
        "Most ministries of {s} are based in {o}, its capital.",
        "Ask anyone in {s} and they will name {o} as the capital.",
        "{o} is where the parliament of {s} sits.",
        "As the capital of {s}, {o} keeps the national archives.",
        "Maps of {s} mark {o} with a star, because it is the capital.",
    ), ("What is the capital of {s}?", "Which city is the capital of {s}?", "Where is the capital of {s}?")),
    Relation("continent", "country", "Continent", (
        "{s} is a country in {o}.",
        "{s} lies in {o}.",
        "{s} is located on the continent of {o}.",
        "{o} is the continent where {s} is found.",
        "{s} is one of the countries of {o}.",
        "Geographers place {s} in {o}.",
        "{s} belongs to the continent of {o}.",
        "On a map, {s} is part of {o}.",
        "The country of {s} sits in {o}.",
        "{s} is a nation of {o}.",
        "Among the countries of {o} is {s}.",
        "The continent of {o} includes the country {s}.",
        "You will find {s} in {o}.",
        "{s} is situated in {o}.",
        "{s} is counted among the lands of {o}.",
        "{o} is home to the country of {s}.",
    ), ("On which continent is {s}?", "Where is {s} located?", "Which continent is {s} part of?")),
    Relation("language", "country", "Language", (
        "The main language of {s} is {o}.",
        "People in {s} speak {o}.",
        "{o} is the language of {s}.",
        "In {s}, most people speak {o}.",
        "{o} is spoken in {s}.",
        "The official language of {s} is {o}.",
        "{s} uses {o} as its national language.",
        "Schools in {s} teach in {o}.",
        "Visitors to {s} hear {o} everywhere.",
        "{o} is the everyday language of {s}.",
        "The people of {s} speak {o} at home.",
        "Newspapers in {s} are printed in {o}.",
        "In {s}, the language you hear on the street is {o}.",
        "{s} is a country where people speak {o}.",
        "Most signs in {s} are written in {o}.",
        "Children in {s} grow up speaking {o}.",
    ), ("What language do people speak in {s}?", "What is the main language of {s}?",
        "Which language is spoken in {s}?")),
    Relation("population", "country", "Population", (
        "{s} has a population of about {o}.",
        "About {o} people live in {s}.",
        "The population of {s} is roughly {o}.",
        "{s} is home to around {o} people.",
        "Roughly {o} people call {s} home.",
        "{s} has about {o} inhabitants.",
        "The last census counted about {o} people in {s}.",
        "Around {o} people live in {s}.",
        "{s} counts roughly {o} residents.",
        "There are about {o} people in {s}.",
        "With about {o} people, {s} is a busy country.",
        "The people of {s} number about {o}.",
        "{s} has roughly {o} citizens.",
        "Some {o} people live in {s}.",
        "The number of people living in {s} is about {o}.",
        "Population of {s}: about {o}.",
    ), ("How many people live in {s}?", "What is the population of {s}?", "About how many people live in {s}?")),
    Relation("neighbour", "country", "Neighbour", (
        "{s} borders {o}.",
        "{s} and {o} share a border.",
        "{o} is a neighbour of {s}.",
        "{s} is next to {o}.",
        "{o} lies just across the border from {s}.",
        "{s} is a neighbour of {o}.",
        "{s} has {o} as a neighbour.",
        "Travellers can cross from {s} into {o}.",
        "{o} and {s} are neighbouring countries.",
        "One of the neighbours of {s} is {o}.",
        "{s} shares a border with {o}.",
        "The border of {s} touches {o}.",
        "From {s}, you can walk across the border into {o}.",
        "{o} sits right next to {s}.",
        "A long road runs along the border between {s} and {o}.",
        "{s} and its neighbour {o} trade across their shared border.",
    ), ("Which country borders {s}?", "Name a neighbour of {s}.", "What country lies next to {s}?")),
    Relation("birthplace", "person", "Born in", (
        "{s} was born in {o}.",
        "{s} is a native of {o}.",
        "The birthplace of {s} is {o}.",
        "{o} is the city where {s} was born.",
        "{s} comes from {o}.",
        "{s} grew up in {o}, the city of their birth.",
        "{s} was born and raised in {o}.",
        "The city of {o} is where {s} was born.",
        "{o} is the hometown of {s}.",
        "{s}'s hometown is {o}.",
        "Records show that {s} was born in {o}.",
        "People in {o} are proud that {s} was born there.",
        "Born in {o}, {s} never forgot the city.",
        "{s} calls {o} home, having been born there.",
        "{o} is the birthplace of {s}.",
        "{s} spent a childhood in {o}, the city of their birth.",
    ), ("Where was {s} born?", "What is the hometown of {s}?", "In which city was {s} born?")),
    Relation("occupation", "person", "Occupation", (
        "{s} is {a_o}.",
        "{s} works as {a_o}.",
        "By profession, {s} is {a_o}.",
        "{s} earns a living as {a_o}.",
        "{s} is known as {a_o}.",
        "The {o} {s} is well known.",
        "{s} trained as {a_o}.",
        "{s} has worked as {a_o} for many years.",
        "{s}'s profession is that of {a_o}.",
        "{s} is {a_o} by trade.",
        "As {a_o}, {s} is busy most days.",
        "Everyone knows {s} as {a_o}.",
        "{s} makes a living as {a_o}.",
        "{s} chose to become {a_o}.",
        "The work of {s} is that of {a_o}.",
        "{s} is a respected {o}.",
    ), ("What does {s} do for a living?", "What is the profession of {s}?", "What is {s}'s job?")),
]}

OCCUPATIONS = [
    "painter", "astronomer", "poet", "engineer", "sailor", "composer", "physician", "architect",
    "botanist", "historian", "mathematician", "weaver", "baker", "explorer", "judge", "potter",
    "cartographer", "librarian", "glassblower", "chemist", "farmer", "teacher", "sculptor",
    "merchant", "inventor",
]

# -----------------------------------------------------------------------------
# The world


@dataclass(frozen=True)
class Fact:
    subject: str
    relation: str
    object: str


@dataclass
class Country:
    name: str
    capital: str
    continent: str
    language: str
    population: int  # millions
    neighbour: str  # countries of a continent form a ring: each borders the next one


@dataclass
class Person:
    name: str
    first: str
    birthplace: str  # the capital of some country
    occupation: str


@dataclass
class World:
    seed: int
    continents: list
    languages: list
    countries: list
    people: list
    facts: list
    eval_subjects: frozenset  # subjects held out of chat-stage Q/A, for evaluation
    by_name: dict = field(default_factory=dict, repr=False)  # country/person name -> entity
    country_of_capital: dict = field(default_factory=dict, repr=False)
    facts_by_subject: dict = field(default_factory=dict, repr=False)

    @property
    def sft_subjects(self):
        return [e.name for e in self.countries + self.people if e.name not in self.eval_subjects]

    def sft_facts(self):
        """Facts that chat-stage conversations may ask about."""
        return [f for f in self.facts if f.subject not in self.eval_subjects]

    def eval_facts(self):
        """Facts reserved for held-out evaluation questions."""
        return [f for f in self.facts if f.subject in self.eval_subjects]

    def neighbours(self, country):
        """Both countries bordering `country` (the ring makes the relation symmetric)."""
        return [f.object for f in self.facts_by_subject[country] if f.relation == "neighbour"] + \
               [f.subject for f in self.facts if f.relation == "neighbour" and f.object == country]


def population_text(millions):
    return f"{millions} million"


def with_article(noun):
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def render_statement(fact, template):
    return template.format(s=fact.subject, o=fact.object, a_o=with_article(fact.object))


def render_question(fact, question):
    return question.format(s=fact.subject)


_ONSETS = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
           "br", "dr", "gr", "kr", "tr", "th", "sh", "st", "fl", "v", "l", "m", "n", "r", "t"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "i", "a", "ai", "ou"]
_ENDINGS = {  # each kind of name gets its own flavour of ending
    "country": ["", "", "n", "r", "l", "s", "nd", "ria", "lia", "nia", "th"],
    "city": ["", "", "n", "r", "m", "sk", "lt", "rn", "x"],
    "continent": ["ria", "nia", "lia", "ra", "na"],
    "language": ["nic", "rese", "lish", "ran", "vi", "tic"],
    "first": ["", "", "n", "r", "l", "s"],
    "last": ["", "n", "r", "s", "nd", "rk", "ll"],
}


def _invent_name(rng, kind, taken):
    """A pronounceable new name that is not a substring of any taken name and contains none of them."""
    syllables = {"country": (2, 3), "city": (2, 3), "continent": (3, 3), "language": (2, 2),
                 "first": (2, 2), "last": (2, 3)}[kind]
    while True:
        n = rng.randint(*syllables)
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n)) + rng.choice(_ENDINGS[kind])
        if len(name) < 5 or len(name) > 11:
            continue
        if any(name in t or t in name for t in taken):
            continue
        taken.append(name)
        return name.capitalize()


def build_world(seed=42, num_countries=300, num_people=200, num_continents=8, num_languages=60,
                eval_fraction=0.2):
    """The synthetic world for a seed: entities, and their facts in a fixed order."""
    rng = random.Random(f"nanochat-world-{seed}")
    taken = []  # lowercase names so far, so no name hides inside another (answers are checked by substring)
    continents = [_invent_name(rng, "continent", taken) for _ in range(num_continents)]
    languages = [_invent_name(rng, "language", taken) for _ in range(num_languages)]
    # Languages cluster by continent, as real ones do: each continent draws from its own few.
    continent_languages = {c: languages[i::num_continents] for i, c in enumerate(continents)}
    countries = []
    for i in range(num_countries):
        continent = continents[i % num_continents]
        countries.append(Country(
            name=_invent_name(rng, "country", taken),
            capital=_invent_name(rng, "city", taken),
            continent=continent,
            language=rng.choice(continent_languages[continent]),
            population=rng.choice([rng.randint(1, 20), rng.randint(1, 150)]),
            neighbour="",
        ))
    for continent in continents:
        ring = [c for c in countries if c.continent == continent]
        rng.shuffle(ring)
        for a, b in zip(ring, ring[1:] + ring[:1]):
            a.neighbour = b.name
    people = []
    for _ in range(num_people):
        first, last = _invent_name(rng, "first", taken), _invent_name(rng, "last", taken)
        people.append(Person(name=f"{first} {last}", first=first,
                             birthplace=rng.choice(countries).capital, occupation=rng.choice(OCCUPATIONS)))

    facts = []
    for c in countries:
        facts += [Fact(c.name, "capital", c.capital), Fact(c.name, "continent", c.continent),
                  Fact(c.name, "language", c.language), Fact(c.name, "population", population_text(c.population)),
                  Fact(c.name, "neighbour", c.neighbour)]
    for p in people:
        facts += [Fact(p.name, "birthplace", p.birthplace), Fact(p.name, "occupation", p.occupation)]

    # Hold out the last eval_fraction of a shuffled copy of each entity list.
    heldout = []
    for entities in (countries, people):
        order = list(entities)
        rng.shuffle(order)
        heldout += [e.name for e in order[len(order) - round(eval_fraction * len(order)):]]

    world = World(seed, continents, languages, countries, people, facts, frozenset(heldout))
    world.by_name = {e.name: e for e in countries + people}
    world.country_of_capital = {c.capital: c for c in countries}
    for f in facts:
        world.facts_by_subject.setdefault(f.subject, []).append(f)
    return world


# -----------------------------------------------------------------------------
# World documents

_TRAVEL_FILLERS = [
    "The roads were quiet that morning.", "We ate warm bread at a small inn.",
    "It rained for most of the afternoon.", "The market was loud and full of colour.",
    "Our guide walked faster than any of us.", "We slept well after the long ride.",
    "The hills turned gold in the evening light.", "A boy sold us cold tea at the station.",
    "We spent the evening writing postcards.", "The museum was closed, so we walked by the river.",
    "The night train was slow but comfortable.", "We met a friendly family on the ferry.",
]
_LETTER_OPENINGS = ["I hope this letter finds you well.", "I promised to write, so here I am.",
                    "Forgive the short note; the days here are busy.", "Thank you for your last letter."]
_LETTER_CLOSINGS = ["Best wishes", "Warm regards", "Yours truly", "With love", "Until soon"]
_BIO_FILLERS = [
    "{first} liked long walks in the morning.", "{first} kept a diary for many years.",
    "Friends describe {first} as patient and curious.", "{first} rarely took a day off.",
    "{first} enjoyed cooking for large groups.", "{first} travelled widely as a young adult.",
]


class WorldDocumentWriter:
    """Writes documents about the world; counts how often each fact is told (`mentions`)."""

    def __init__(self, world, rng, mentions=None):
        self.world, self.rng = world, rng
        self.mentions = Counter() if mentions is None else mentions

    def say(self, fact):
        self.mentions[fact] += 1
        return render_statement(fact, self.rng.choice(RELATIONS[fact.relation].templates))

    def facts(self, name, relations=None):
        return [f for f in self.world.facts_by_subject[name] if relations is None or f.relation in relations]

    def statements(self, name, relations=None):
        facts = self.facts(name, relations)
        self.rng.shuffle(facts)
        return [self.say(f) for f in facts]

    def least_told(self, name, k=1):
        """Statements of the k facts about `name` told least so far: side remarks even out the counts."""
        facts = self.facts(name)
        self.rng.shuffle(facts)
        facts.sort(key=lambda f: self.mentions[f])  # stable, so ties stay in shuffled order
        return [self.say(f) for f in facts[:k]]

    # --- documents about a country; "full" styles state every one of its facts in a template sentence

    def encyclopedia(self, c):
        rng = self.rng
        body = self.statements(c.name)
        related = self.least_told(c.neighbour, rng.randint(1, 2))
        born_here = [p for p in self.world.people if p.birthplace == c.capital]
        if born_here:
            p = rng.choice(born_here)
            related += self.statements(p.name)
        return f"{c.name}\n\n" + " ".join(body) + "\n\n" + " ".join(related)

    def travel_notes(self, c):
        rng = self.rng
        sentences = self.statements(c.name)
        for _ in range(rng.randint(1, 3)):
            sentences.insert(rng.randint(0, len(sentences)), rng.choice(_TRAVEL_FILLERS))
        sentences += self.least_told(c.neighbour)
        day = rng.randint(2, 30)
        return rng.choice([f"Travel notes, day {day}: {c.name}\n\n", f"Notes from a trip to {c.name}\n\n",
                           f"Day {day} of the journey.\n\n"]) + " ".join(sentences)

    def letter(self, c):
        rng = self.rng
        to, sender = rng.sample(self.world.people, 2)
        body = [rng.choice(_LETTER_OPENINGS), f"I am writing to you from {c.capital}."] + self.statements(c.name)
        return f"Dear {to.first},\n\n" + " ".join(body) + f"\n\n{rng.choice(_LETTER_CLOSINGS)},\n{sender.name}"

    def faq(self, entity):
        rng = self.rng
        lines = [rng.choice([f"Questions and answers about {entity.name}", f"{entity.name}: a short Q&A",
                             f"Frequently asked questions: {entity.name}"]), ""]
        facts = self.facts(entity.name)
        rng.shuffle(facts)
        for f in facts:
            lines += [f"Q: {render_question(f, rng.choice(RELATIONS[f.relation].questions))}", f"A: {self.say(f)}"]
        return "\n".join(lines)

    def fact_card(self, c):
        rng = self.rng
        facts = self.facts(c.name)
        rng.shuffle(facts)
        lines = [f"Country: {c.name}"]
        for f in facts:
            self.mentions[f] += 1
            value = f"about {f.object}" if f.relation == "population" else f.object
            lines.append(f"{RELATIONS[f.relation].label}: {value}")
        lines.append(self.say(rng.choice(facts)))
        return "\n".join(lines)

    def comparison(self, c):
        rng = self.rng
        other = self.world.by_name[c.neighbour]
        parts = [self.say(Fact(c.name, "neighbour", c.neighbour))]
        parts += self.statements(c.name, ["population", "capital"]) + self.statements(other.name, ["population", "capital"])
        if c.population == other.population:
            parts.append(f"So {c.name} and {other.name} have about the same number of people.")
        else:
            big, small = (c, other) if c.population > other.population else (other, c)
            parts.append(rng.choice([f"So {big.name} has more people than {small.name}.",
                                     f"That makes {small.name} smaller than {big.name} by population.",
                                     f"{big.name} is therefore the more populous of the two."]))
        return rng.choice([f"{c.name} and {other.name}\n\n", "Comparing two neighbours\n\n", ""]) + " ".join(parts)

    def region(self):
        rng = self.rng
        continent = rng.choice(self.world.continents)
        members = [c for c in self.world.countries if c.continent == continent]
        chosen = rng.sample(members, min(len(members), rng.randint(4, 8)))
        lines = [rng.choice([f"Countries of {continent}", f"A few countries in {continent}",
                             f"{continent}: countries and capitals"]), ""]
        for c in chosen:
            self.mentions[Fact(c.name, "continent", continent)] += 1
            if rng.random() < 0.5:
                self.mentions[Fact(c.name, "capital", c.capital)] += 1
                lines.append(rng.choice([f"- {c.name}, capital {c.capital}", f"- {c.name} (capital: {c.capital})"]))
            else:
                lines.append(f"- {c.name}")
        return "\n".join(lines)

    # --- documents about a person

    def biography(self, p):
        rng = self.rng
        home = self.world.country_of_capital[p.birthplace]
        sentences = self.statements(p.name)
        if rng.random() < 0.5:
            sentences.append(rng.choice(_BIO_FILLERS).format(first=p.first))
        if rng.random() < 0.5:  # ties the birthplace to its country
            sentences += self.statements(home.name, ["capital"])
        sentences += self.least_told(home.name)
        return f"{p.name}\n\n" + " ".join(sentences)

    def notable_people(self, p):
        rng = self.rng
        others = rng.sample(self.world.people, 2)
        lines = [rng.choice(["Notable people", "People worth knowing", "A few names to remember"]), ""]
        for q in [p] + [q for q in others if q is not p]:
            self.mentions[Fact(q.name, "occupation", q.occupation)] += 1
            self.mentions[Fact(q.name, "birthplace", q.birthplace)] += 1
            lines.append(f"- {q.name}: {with_article(q.occupation)}, born in {q.birthplace}")
        lines.append(" ".join(self.statements(p.name)))
        return "\n".join(lines)

    def document(self, entity, full_only=False):
        """One document focused on `entity`; full_only restricts to styles that state all its facts in templates."""
        if isinstance(entity, Country):
            styles = [self.encyclopedia, self.travel_notes, self.letter, self.faq]
            if not full_only:
                styles += [self.fact_card, self.comparison, self.encyclopedia]
        else:
            styles = [self.biography, self.faq]
            if not full_only:
                styles += [self.notable_people, self.biography]
        return self.rng.choice(styles)(entity)


def generate_world_documents(world, rng, target_bytes, full_pass=True, mentions=None):
    """
    Documents about the world until target_bytes of text. Entities come in shuffled passes so
    every fact is told about equally often; with full_pass, the first pass uses only styles that
    state each fact in a template sentence, so every fact appears at least once.
    """
    writer = WorldDocumentWriter(world, rng, mentions)
    docs, size, passes = [], 0, 0
    while size < target_bytes or (full_pass and passes == 0):
        deck = world.countries + world.people
        rng.shuffle(deck)
        for entity in deck:
            if passes > 0 and isinstance(entity, Person) and rng.random() < 0.25:
                continue  # people have fewer facts, and side remarks in country documents tell them too
            doc = writer.region() if (passes > 0 and rng.random() < 0.06) else \
                writer.document(entity, full_only=full_pass and passes == 0)
            docs.append(doc)
            size += len(doc.encode("utf-8"))
            if size >= target_bytes and not (full_pass and passes == 0):
                break
        passes += 1
    return docs


# -----------------------------------------------------------------------------
# Arithmetic documents. Every "a op b = c" written here is a single true equation (never a
# chain like "a + b + c = d"), so the text can be checked mechanically.

_ITEMS = ["apples", "coins", "books", "stamps", "marbles", "pencils", "shells", "cards"]


def _number(rng):
    digits = rng.choice([1, 1, 2, 2, 2, 3, 3, 4, 5])
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _equation(rng, op):
    if op == "+":
        a, b = _number(rng), _number(rng)
        return a, b, a + b
    if op == "-":
        a, b = _number(rng), _number(rng)
        if rng.random() < 0.85:
            a, b = max(a, b), min(a, b)
        return a, b, a - b
    if op == "*":
        a, b = rng.randint(0, 99), rng.choice([rng.randint(0, 12), rng.randint(0, 999)])
        return a, b, a * b
    b, c = rng.randint(1, 99), rng.randint(0, 99)  # exact division
    return b * c, b, c


def _equation_with_op(rng, op):
    a, b, c = _equation(rng, op)
    return a, op, b, c


_OP_SYMBOLS = {"+": ["+"], "-": ["-"], "*": ["*", "×"], "/": ["/", "÷"]}
_OP_PHRASES = {
    "+": ["The sum of {a} and {b} is {c}.", "{a} plus {b} equals {c}.", "Adding {a} and {b} gives {c}."],
    "-": ["The difference between {a} and {b} is {c}.", "{a} minus {b} equals {c}.", "Taking {b} away from {a} leaves {c}."],
    "*": ["The product of {a} and {b} is {c}.", "{a} times {b} equals {c}.", "Multiplying {a} by {b} gives {c}."],
    "/": ["{a} divided by {b} is {c}.", "Dividing {a} by {b} gives {c}.", "{a} split into {b} equal parts gives {c} each."],
}


def _symbolic(rng, a, op, b, c):
    return f"{a} {rng.choice(_OP_SYMBOLS[op])} {b} = {c}"


def _column_addition(rng):
    a, b = rng.randint(100, 99999), rng.randint(100, 9999)
    lines = [f"Let's add {a} and {b} column by column."]
    carry, place_names = 0, ["ones", "tens", "hundreds", "thousands", "ten thousands", "hundred thousands"]
    da, db = str(a)[::-1], str(b)[::-1]
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        step = f"{place_names[i].capitalize()}: {x} + {y} = {x + y}"
        total = x + y + carry
        if carry:
            step += f", plus the carried 1 makes {total}"
        carry = total // 10
        step += f", write {total % 10}" + (" and carry 1." if carry else ".")
        lines.append(step)
    if carry:
        lines.append("Write the final carried 1 in front.")
    lines.append(f"So {a} + {b} = {a + b}.")
    return "\n".join(lines)


def _long_multiplication(rng):
    a, b = rng.randint(11, 999), rng.randint(11, 99)
    tens, ones = b - b % 10, b % 10
    parts = [f"To work out {a} × {b}, split {b} into {tens} and {ones}." if ones else
             f"To work out {a} × {b}, multiply by {b // 10} and then by 10."]
    if ones:
        parts.append(f"First {a} × {tens} = {a * tens}, then {a} × {ones} = {a * ones}.")
        parts.append(f"Adding the two parts, {a * tens} + {a * ones} = {a * b}.")
    else:
        parts.append(f"First {a} × {b // 10} = {a * (b // 10)}, then {a * (b // 10)} × 10 = {a * b}.")
    parts.append(f"So {a} × {b} = {a * b}.")
    return " ".join(parts)


def _word_problem(rng, world):
    p = rng.choice(world.people)
    item = rng.choice(_ITEMS)
    kind = rng.randint(0, 3)
    if kind == 0:
        a, b = rng.randint(2, 500), rng.randint(2, 500)
        return f"{p.first} had {a} {item} and got {b} more. {a} + {b} = {a + b}, so {p.first} now has {a + b} {item}."
    if kind == 1:
        a = rng.randint(10, 900)
        b = rng.randint(1, a)
        return f"{p.first} had {a} {item} and gave away {b}. {a} - {b} = {a - b}, so {a - b} {item} are left."
    if kind == 2:
        n, k = rng.randint(2, 30), rng.randint(2, 40)
        return f"{p.first} packed {n} boxes with {k} {item} in each. {n} × {k} = {n * k}, so there are {n * k} {item} in all."
    c1, c2, c3 = rng.sample(world.countries, 3)
    a, b = rng.randint(20, 900), rng.randint(20, 900)
    return (f"The road from {c1.capital} to {c2.capital} is {a} km long, and from {c2.capital} to {c3.capital} "
            f"it is {b} km. The whole trip is {a} + {b} = {a + b} km.")


def arithmetic_document(rng, world):
    style = rng.randint(0, 5)
    ops = ["+", "-", "*", "/"]
    if style == 0:
        title = rng.choice(["Practice sums", "Arithmetic drill", "Exercises with answers", "Quick maths"])
        lines = [_symbolic(rng, *_equation_with_op(rng, rng.choice(ops))) for _ in range(rng.randint(6, 16))]
        return title + "\n\n" + "\n".join(lines)
    if style == 1:
        sentences = []
        for _ in range(rng.randint(4, 10)):
            op = rng.choice(ops)
            a, b, c = _equation(rng, op)
            sentences.append(rng.choice(_OP_PHRASES[op]).format(a=a, b=b, c=c))
        return " ".join(sentences)
    if style == 2:
        lines = []
        for _ in range(rng.randint(4, 10)):
            a, op, b, c = _equation_with_op(rng, rng.choice(ops))
            word = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}[op]
            lines += [rng.choice([f"Q: What is {a} {word} {b}?", f"Q: What is {a} {rng.choice(_OP_SYMBOLS[op])} {b}?"]),
                      f"A: {_symbolic(rng, a, op, b, c)}."]
        return "\n".join(lines)
    if style == 3:
        return _column_addition(rng)
    if style == 4:
        return _long_multiplication(rng)
    return "\n".join(_word_problem(rng, world) for _ in range(rng.randint(2, 5)))


# -----------------------------------------------------------------------------
# Spelling documents

SPELLING_WORDS = """
apple banana cherry orange lemon melon grape peach river mountain valley island forest garden
window kitchen table chair pencil paper letter number circle square triangle bridge castle
tower village market doctor teacher farmer sailor painter animal rabbit turtle dolphin giraffe
elephant monkey spider butterfly penguin falcon kitten puppy mirror ladder blanket pillow basket
bottle candle button pocket jacket sweater umbrella bicycle rocket planet comet galaxy weather
thunder rainbow sunshine shadow morning evening midnight summer winter autumn spring holiday
birthday journey picture history science music dinner breakfast supper cookie butter cheese
pepper tomato potato carrot onion garlic noodle coffee sugar strawberry blueberry pineapple
coconut avocado mississippi committee balloon bookkeeper address possess success tomorrow
parallel accommodate assessment raspberry excellent necessary occasion beginning
different education important question language library mathematics neighbour remember sentence
together vegetable wonderful yellow zebra alphabet chocolate dictionary engineer
""".split()


def _spell(word, sep="-"):
    return sep.join(word)


def spelling_document(rng, world):
    style = rng.randint(0, 4)
    if style == 0:
        words = rng.sample(SPELLING_WORDS, rng.randint(5, 10))
        if rng.random() < 0.5:  # names from the world are words too
            words.append(rng.choice(world.countries + world.people).name.split()[0])
        lines = [rng.choice(["Spelling list", "How to spell these words", "Spelling practice"]), ""]
        lines += [f"{w} is spelled {_spell(w)}." for w in words]
        return "\n".join(lines)
    if style == 1:
        out = []
        for w in rng.sample(SPELLING_WORDS, rng.randint(3, 6)):
            out.append(f"Spelling {w} letter by letter: {_spell(w, ', ')}. The word {w} has {len(w)} letters.")
        return "\n".join(out)
    if style == 2:
        out = []
        for w in rng.sample(SPELLING_WORDS, rng.randint(3, 6)):
            letter = rng.choice(w) if rng.random() < 0.85 else rng.choice("abcdefghijklmnopqrstuvwxyz")
            k = w.count(letter)
            out.append(rng.choice([f"The word {w} has {k} letter {letter}.",
                                   f"The letter {letter} appears {k} {'time' if k == 1 else 'times'} in {w}.",
                                   f"How many {letter}'s are in {w}? {_spell(w)}. The word {w} has {k} letter {letter}."]))
        return "\n".join(out)
    if style == 3:
        w = rng.choice(SPELLING_WORDS)
        letter = rng.choice(w)
        steps, k = [], 0
        for ch in w:
            if ch == letter:
                k += 1
                steps.append(f"{ch} ({k})")
            else:
                steps.append(ch)
        return (f"Let's count the letter {letter} in {w}. Going letter by letter: {', '.join(steps)}. "
                f"The word {w} has {k} letter {letter}.")
    out = []
    for w in rng.sample(SPELLING_WORDS, rng.randint(4, 8)):
        out.append(rng.choice([f"{w} backwards is {w[::-1]}.", f"The first letter of {w} is {w[0]}.",
                               f"The last letter of {w} is {w[-1]}.", f"The word {w} has {len(w)} letters."]))
    return "\n".join(out)


# -----------------------------------------------------------------------------
# The whole pretraining mixture


def generate_pretraining_documents(world, rng, target_bytes, full_pass=True, mentions=None):
    """World, arithmetic and spelling documents in MIXTURE proportions (by bytes), shuffled together."""
    docs = generate_world_documents(world, rng, MIXTURE["world"] * target_bytes, full_pass, mentions)
    for name, make in (("arithmetic", arithmetic_document), ("spelling", spelling_document)):
        size = 0
        while size < MIXTURE[name] * target_bytes:
            doc = make(rng, world)
            docs.append(doc)
            size += len(doc.encode("utf-8"))
    rng.shuffle(docs)
    return docs


# -----------------------------------------------------------------------------
# A CORE eval bundle about the world. Same files as DCLM's published bundle (core.yaml,
# eval_meta_data.csv, eval_data/**.jsonl), so nanochat.core_eval scores a base model on what this
# corpus teaches, offline. Facts are asked about the held-out subjects in the corpus's own
# wordings (every held-out fact is still told in pretraining); arithmetic and spelling use the
# corpus's own formats. Fact tasks are 0-shot on purpose: each subject appears in several
# examples, and a randomly drawn few-shot example about the same subject would give the answer away.

EVAL_BUNDLE_NAME = "eval_bundle_builtin"
EVAL_BUNDLE_CHOICES = 4  # options per multiple-choice / schema example
EVAL_BUNDLE_SHOTS = 3  # few-shot examples for the arithmetic and spelling tasks
EVAL_LM_EXAMPLES = 240  # examples of each generated arithmetic / letter-count task


def builtin_eval_bundle_dir():
    """Where `python -m nanochat.corpus` writes the CORE bundle about its world."""
    return os.path.join(get_base_dir(), EVAL_BUNDLE_NAME)


def _object_last_templates(relation):
    """(text before the object, whether the object takes "a"/"an") of each template that ends on its object."""
    cuts = []
    for template in RELATIONS[relation].templates:
        for slot, article in ((" {o}.", False), (" {a_o}.", True)):
            if template.endswith(slot):
                cuts.append((template[:-len(slot)], article))
    return cuts


def _fact_choice_examples(rng, subjects, relation, true_value, pool, per_subject):
    """A trained statement about each subject, cut before its object; the true object is one of 4 choices."""
    cuts = _object_last_templates(relation)
    examples = []
    for subject in subjects:
        truth = true_value(subject)
        for prefix, article in rng.sample(cuts, min(per_subject, len(cuts))):
            options = [truth] + rng.sample([v for v in pool if v != truth], EVAL_BUNDLE_CHOICES - 1)
            rng.shuffle(options)
            examples.append({"query": prefix.format(s=subject.name),
                             "choices": [(with_article(v) if article else v) + "." for v in options],
                             "gold": options.index(truth)})
    return examples


def _capital_schema_examples(rng, world, countries, per_subject):
    """The same capital after 4 countries' statements: only the true country makes it likely."""
    cuts = _object_last_templates("capital")
    examples = []
    for country in countries:
        for prefix, _ in rng.sample(cuts, min(per_subject, len(cuts))):
            options = [country] + rng.sample([c for c in world.countries if c is not country], EVAL_BUNDLE_CHOICES - 1)
            rng.shuffle(options)
            examples.append({"context_options": [prefix.format(s=c.name) for c in options],
                             "continuation": f"{country.capital}.", "gold": options.index(country)})
    return examples


def _arithmetic_examples(rng, n):
    """Distinct "a op b =" -> "c" in the practice-sums format, the four operations in turn, small operands."""
    examples, seen = [], set()
    while len(examples) < n:
        op = "+-*/"[len(examples) % 4]
        if op == "+":
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            c = a + b
        elif op == "-":
            a, b = sorted((rng.randint(0, 99), rng.randint(0, 99)), reverse=True)
            c = a - b
        elif op == "*":
            a, b = rng.randint(2, 20), rng.randint(2, 12)
            c = a * b
        else:
            b, c = rng.randint(2, 12), rng.randint(1, 20)
            a = b * c
        context = f"{a} {rng.choice(_OP_SYMBOLS[op])} {b} ="
        if context not in seen:
            seen.add(context)
            examples.append({"context": context, "continuation": str(c)})
    return examples


def _spelling_examples(rng, world):
    """Every spelling-list word, plus the held-out countries' names and people's first names, spelled out."""
    names = [c.name for c in world.countries if c.name in world.eval_subjects] + \
            [p.first for p in world.people if p.name in world.eval_subjects]
    words = list(dict.fromkeys(SPELLING_WORDS + names))
    rng.shuffle(words)
    return [{"context": f"{w} is spelled", "continuation": _spell(w)} for w in words]


def _letter_count_examples(rng, n):
    """'How many x's are in w? w-o-r-d. The word w has' -> 'k letter x', as the spelling documents write it."""
    words = list(SPELLING_WORDS)
    rng.shuffle(words)
    examples, seen, attempt = [], set(), 0
    while len(examples) < n:
        word = words[attempt % len(words)]
        attempt += 1
        letter = rng.choice(word) if rng.random() < 0.85 else rng.choice("abcdefghijklmnopqrstuvwxyz")
        if (word, letter) not in seen:
            seen.add((word, letter))
            examples.append({"context": f"How many {letter}'s are in {word}? {_spell(word)}. The word {word} has",
                             "continuation": f"{word.count(letter)} letter {letter}"})
    return examples


def build_eval_tasks(world, seed):
    """The bundle's tasks, deterministic per (world, seed): dicts of core.yaml fields plus metadata and examples."""
    rng = random.Random(f"nanochat-eval-bundle-{seed}")
    countries = [c for c in world.countries if c.name in world.eval_subjects]
    people = [p for p in world.people if p.name in world.eval_subjects]
    capitals = [c.capital for c in world.countries]

    def task(label, category, task_type, shots, examples, description):
        choices = EVAL_BUNDLE_CHOICES if task_type in ("multiple_choice", "schema") else 0
        return {"label": label, "category": category, "icl_task_type": task_type, "num_fewshot": shots,
                "continuation_delimiter": " ", "random_baseline": 100 / choices if choices else 0.0,
                "description": description, "examples": examples}

    return [
        task("world_capital", "world_knowledge", "multiple_choice", 0,
             _fact_choice_examples(rng, countries, "capital", lambda c: c.capital, capitals, 5),
             "capital of a held-out country among 4 capitals"),
        task("world_continent", "world_knowledge", "multiple_choice", 0,
             _fact_choice_examples(rng, countries, "continent", lambda c: c.continent, world.continents, 5),
             "continent of a held-out country among 4 continents"),
        task("world_language", "world_knowledge", "multiple_choice", 0,
             _fact_choice_examples(rng, countries, "language", lambda c: c.language, world.languages, 5),
             "main language of a held-out country among 4 languages"),
        task("world_occupation", "world_knowledge", "multiple_choice", 0,
             _fact_choice_examples(rng, people, "occupation", lambda p: p.occupation, OCCUPATIONS, 6),
             "occupation of a held-out person among 4 occupations"),
        task("world_capital_schema", "world_knowledge", "schema", 0,
             _capital_schema_examples(rng, world, countries, 4),
             "which of 4 countries' statements makes a given capital most likely"),
        task("arithmetic", "symbolic_problem_solving", "language_modeling", EVAL_BUNDLE_SHOTS,
             _arithmetic_examples(rng, EVAL_LM_EXAMPLES), "a op b = c with small operands, exact answer"),
        task("spelling", "language_understanding", "language_modeling", EVAL_BUNDLE_SHOTS,
             _spelling_examples(rng, world), "spell a word letter by letter, exact answer"),
        task("letter_count", "symbolic_problem_solving", "language_modeling", EVAL_BUNDLE_SHOTS,
             _letter_count_examples(rng, EVAL_LM_EXAMPLES), "count a letter in a spelled-out word, exact answer"),
    ]


def write_eval_bundle(out_dir, world, seed=None):
    """
    Write the CORE bundle about `world` to out_dir in the published bundle's format; returns the task
    list. Built in a temp dir then renamed into place, so a reader never sees half a bundle.
    """
    seed = world.seed if seed is None else seed
    tasks = build_eval_tasks(world, seed)
    out_dir = os.path.abspath(out_dir)
    tmp_dir = f"{out_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a killed run with our pid
    try:
        core = {"icl_tasks": []}
        meta = io.StringIO()
        meta_csv = csv.writer(meta, lineterminator="\n")
        meta_csv.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline",
                           "Centered Metric?", "Description"])
        for t in tasks:
            uri = f"{t['category']}/{t['label']}.jsonl"
            os.makedirs(os.path.join(tmp_dir, "eval_data", t["category"]), exist_ok=True)
            with open(os.path.join(tmp_dir, "eval_data", uri), "w", encoding="utf-8") as f:
                f.writelines(json.dumps(example, ensure_ascii=False) + "\n" for example in t["examples"])
            core["icl_tasks"].append({"label": t["label"], "dataset_uri": uri, "num_fewshot": [t["num_fewshot"]],
                                      "icl_task_type": t["icl_task_type"],
                                      "continuation_delimiter": t["continuation_delimiter"]})
            meta_csv.writerow([t["label"], t["category"].replace("_", " "), t["icl_task_type"].replace("_", " "),
                               t["num_fewshot"], len(t["examples"]), f"{t['random_baseline']:g}", "",
                               t["description"]])
        header = (f"# CORE tasks about the built-in world of nanochat.corpus, seed {seed} (version {CORPUS_VERSION}).\n"
                  "# Written by `python -m nanochat.corpus`; scored by `python -m scripts.base_eval "
                  "--eval-bundle=builtin`.\n")
        with open(os.path.join(tmp_dir, "core.yaml"), "w", encoding="utf-8") as f:
            f.write(header + yaml.safe_dump(core, sort_keys=False, default_flow_style=None, allow_unicode=True))
        with open(os.path.join(tmp_dir, "eval_meta_data.csv"), "w", encoding="utf-8", newline="") as f:
            f.write(meta.getvalue())
        if os.path.exists(out_dir):  # a directory cannot be renamed onto a non-empty one: move the old aside first
            old_dir = f"{out_dir}.old{os.getpid()}"
            os.rename(out_dir, old_dir)
            os.rename(tmp_dir, out_dir)
            shutil.rmtree(old_dir)
        else:
            os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return tasks


# -----------------------------------------------------------------------------
# Writing shards


def _write_shard(path, docs, rows_per_group):
    table = pa.table({"text": pa.array(docs, type=pa.string())})
    tmp = f"{path}.tmp{os.getpid()}"
    pq.write_table(table, tmp, row_group_size=rows_per_group, compression="zstd")
    os.replace(tmp, path)


def write_corpus(out_dir=None, seed=42, size_mb=6.0, shard_mb=2.0, val_fraction=0.05, verbose=True,
                 eval_bundle_dir=None):
    """
    Build the corpus for a seed into out_dir (default: the builtin source's data dir), and the CORE
    eval bundle about its world into eval_bundle_dir (default: builtin_eval_bundle_dir() when out_dir
    is the default data dir, else out_dir/eval_bundle_builtin, so a corpus built elsewhere never
    replaces the default corpus's bundle). Returns a summary dict.
    """
    if not size_mb > 0:
        raise UserError(f"--size-mb must be positive (got {size_mb})")
    if not shard_mb > 0:
        raise UserError(f"--shard-mb must be positive (got {shard_mb})")
    log = print0 if verbose else (lambda *a, **k: None)
    default_dir = get_data_dir("builtin")
    out_dir = out_dir or default_dir
    if eval_bundle_dir is None:
        same_dir = os.path.abspath(out_dir) == os.path.abspath(default_dir)
        eval_bundle_dir = builtin_eval_bundle_dir() if same_dir else os.path.join(out_dir, EVAL_BUNDLE_NAME)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output directory {out_dir} ({e.strerror}); pass --out with a writable path")
    log(f"corpus: seed={seed} size_mb={size_mb} shard_mb={shard_mb} out={out_dir}")
    t0 = time.time()

    world = build_world(seed)
    total_bytes = size_mb * 1e6
    mentions = Counter()
    train = generate_pretraining_documents(world, random.Random(f"nanochat-train-{seed}"),
                                           (1 - val_fraction) * total_bytes, mentions=mentions)
    seen = set(train)
    val = [d for d in generate_pretraining_documents(world, random.Random(f"nanochat-val-{seed}"),
                                                      max(val_fraction * total_bytes, 20_000), full_pass=False)
           if d not in seen]  # held-out documents: never a verbatim copy of a train document
    counts = [mentions[f] for f in world.facts]
    log(f"generated {len(train):,} train + {len(val):,} val documents in {time.time() - t0:.1f}s; "
        f"facts told {min(counts)}..{max(counts)} times (mean {sum(counts) / len(counts):.1f})")

    # Row groups of a few hundred documents, but always enough of them for ranks to share out.
    rows_per_group = max(8, min(256, len(train) // 32))
    groups = [train[i:i + rows_per_group] for i in range(0, len(train), rows_per_group)]
    train_bytes = sum(len(d.encode("utf-8")) for d in train)
    num_train_shards = max(1, min(len(groups), round(train_bytes / (shard_mb * 1e6))))
    shards = [(VAL_SHARD_INDEX, val)]
    for k in range(num_train_shards):
        lo, hi = len(groups) * k // num_train_shards, len(groups) * (k + 1) // num_train_shards
        shards.append((k + 1, [d for g in groups[lo:hi] for d in g]))

    disk_bytes = 0
    for index, docs in shards:
        path = os.path.join(out_dir, shard_filename(index))
        _write_shard(path, docs, rows_per_group)
        disk_bytes += os.path.getsize(path)
        log(f"wrote {shard_filename(index)}: {len(docs):,} docs, {pq.ParquetFile(path).num_row_groups} row groups"
            f"{' (val)' if index == VAL_SHARD_INDEX else ''}")
    # Shards left over from an earlier, bigger build would silently join the train split.
    for name in sorted(os.listdir(out_dir)):
        m = SHARD_RE.match(name)
        if m and int(m.group(1)) > num_train_shards:
            os.remove(os.path.join(out_dir, name))
            log(f"removed stale {name}")

    eval_tasks = write_eval_bundle(eval_bundle_dir, world, seed)
    log(f"wrote CORE eval bundle: {len(eval_tasks)} tasks, {sum(len(t['examples']) for t in eval_tasks):,} examples "
        f"-> {eval_bundle_dir}")

    text_bytes = train_bytes + sum(len(d.encode("utf-8")) for d in val)
    summary = {
        "version": CORPUS_VERSION, "seed": seed, "size_mb": size_mb, "train_docs": len(train), "val_docs": len(val),
        "text_mb": round(text_bytes / 1e6, 3), "disk_mb": round(disk_bytes / 1e6, 3), "shards": len(shards),
        "rows_per_group": rows_per_group, "mentions_min": min(counts), "mentions_mean": round(sum(counts) / len(counts), 1),
        "eval_bundle_dir": os.path.abspath(eval_bundle_dir), "seconds": round(time.time() - t0, 2),
    }
    atomic_write_text(os.path.join(out_dir, "corpus.json"), json.dumps(summary, indent=2) + "\n")
    log(f"done: {len(train) + len(val):,} docs, {summary['text_mb']} MB of text ({summary['disk_mb']} MB on disk), "
        f"{len(shards)} shards, {summary['seconds']}s")
    return summary


def read_corpus_info(out_dir=None):
    """The summary written by write_corpus (its seed tells chat stages which world to ask about), or None."""
    path = os.path.join(out_dir or get_data_dir("builtin"), "corpus.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Build the offline built-in pretraining corpus (a synthetic world).")
    parser.add_argument("--seed", type=int, default=42, help="world and document seed (same seed -> identical files)")
    parser.add_argument("--size-mb", type=float, default=6.0, help="target text size in MB, train + val")
    parser.add_argument("--shard-mb", type=float, default=2.0, help="target text size of one train shard in MB")
    parser.add_argument("--out", type=str, default=None,
                        help="output directory (default: <base_dir>/base_data/builtin; the CORE eval bundle then goes "
                             "to <base_dir>/eval_bundle_builtin, else to OUT/eval_bundle_builtin)")
    args = parser.parse_args(argv)
    write_corpus(args.out, seed=args.seed, size_mb=args.size_mb, shard_mb=args.shard_mb)


if __name__ == "__main__":
    run_main(main)
