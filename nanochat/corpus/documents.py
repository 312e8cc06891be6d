"""
Pretraining documents about the built-in world: encyclopedia entries, travel notes, letters, Q&A
lists, fact cards, comparisons, region lists, biographies. Every fact is told many times, each time
in a template sentence drawn at random, and `WorldDocumentWriter.mentions` counts how often.
"""

from collections import Counter

from nanochat.corpus.world import RELATIONS, Country, Fact, Person, render_question, render_statement, with_article

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
        """The facts about `name` (of these relations only, if given), in random order."""
        facts = [f for f in self.world.facts_by_subject[name] if relations is None or f.relation in relations]
        self.rng.shuffle(facts)
        return facts

    def statements(self, name, relations=None):
        return [self.say(f) for f in self.facts(name, relations)]

    def least_told(self, name, k=1):
        """Statements of the k facts about `name` told least so far: side remarks even out the counts."""
        facts = self.facts(name)
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
        for f in self.facts(entity.name):
            lines += [f"Q: {render_question(f, rng.choice(RELATIONS[f.relation].questions))}", f"A: {self.say(f)}"]
        return "\n".join(lines)

    def fact_card(self, c):
        rng = self.rng
        facts = self.facts(c.name)
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
    """Documents about the world until target_bytes of text. Entities come in shuffled passes, so every fact is told
    about equally often; with full_pass, the first pass uses only styles that state each fact in a template."""
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
