"""
The built-in world: a few hundred invented countries and people with facts of seven relations (`RELATIONS`), and
the English templates that state and ask about each fact. `build_world(seed)` is deterministic and splits the
subjects: chat stages may ask only about `world.sft_subjects`, held-out evaluation about `world.eval_subjects`. Every
fact is told in pretraining, so a model that answers held-out questions *retrieves* what it read, not memorised Q/A.
"""

import random
from dataclasses import dataclass, field

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
                  Fact(c.name, "language", c.language), Fact(c.name, "population", f"{c.population} million"),
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
