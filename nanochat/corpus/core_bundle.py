"""
A CORE eval bundle about the built-in world in the files of DCLM's published bundle (core.yaml, eval_meta_data.csv,
eval_data/**.jsonl), so nanochat.core_eval scores what the built-in corpus teaches, offline. Fact tasks ask about the
held-out subjects in the corpus's own wordings, 0-shot on purpose: a few-shot example drawn about the same subject
would give the answer away. Arithmetic and spelling use the corpus's own formats.
"""

import csv
import json
import os
import random
import shutil

import yaml

from nanochat.corpus.drills import OP_SYMBOLS, SPELLING_WORDS, spell_out
from nanochat.corpus.world import OCCUPATIONS, RELATIONS, with_article

EVAL_BUNDLE_CHOICES = 4  # options per multiple-choice / schema example
EVAL_BUNDLE_SHOTS = 3  # few-shot examples for the arithmetic and spelling tasks
EVAL_LM_EXAMPLES = 240  # examples of each generated arithmetic / letter-count task


def object_last_templates(relation):
    """(text before the object, whether the object takes "a"/"an") of each template that ends on its object."""
    return [(template[:-len(slot)], article) for template in RELATIONS[relation].templates
            for slot, article in ((" {o}.", False), (" {a_o}.", True)) if template.endswith(slot)]


def _fact_choice_examples(rng, subjects, relation, true_value, pool, per_subject):
    """A trained statement about each subject, cut before its object; the true object is one of 4 choices."""
    cuts = object_last_templates(relation)
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
    cuts = object_last_templates("capital")
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
        context = f"{a} {rng.choice(OP_SYMBOLS[op])} {b} ="
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
    return [{"context": f"{w} is spelled", "continuation": spell_out(w)} for w in words]


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
            examples.append({"context": f"How many {letter}'s are in {word}? {spell_out(word)}. The word {word} has",
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


def write_eval_bundle(out_dir, world, seed, version=""):
    """Write the CORE bundle about `world` to out_dir and return its tasks; built in a temp dir then renamed into
    place, so a reader never sees half a bundle."""
    tasks = build_eval_tasks(world, seed)
    out_dir = os.path.abspath(out_dir)
    tmp_dir = f"{out_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a killed run with our pid
    try:
        core = {"icl_tasks": []}
        meta = [["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline",
                 "Centered Metric?", "Description"]]
        for t in tasks:
            uri = f"{t['category']}/{t['label']}.jsonl"
            os.makedirs(os.path.join(tmp_dir, "eval_data", t["category"]), exist_ok=True)
            with open(os.path.join(tmp_dir, "eval_data", uri), "w", encoding="utf-8") as f:
                f.writelines(json.dumps(example, ensure_ascii=False) + "\n" for example in t["examples"])
            core["icl_tasks"].append({"label": t["label"], "dataset_uri": uri, "num_fewshot": [t["num_fewshot"]],
                                      "icl_task_type": t["icl_task_type"],
                                      "continuation_delimiter": t["continuation_delimiter"]})
            meta.append([t["label"], t["category"].replace("_", " "), t["icl_task_type"].replace("_", " "),
                         t["num_fewshot"], len(t["examples"]), f"{t['random_baseline']:g}", "", t["description"]])
        header = (f"# CORE tasks about the built-in world of nanochat.corpus, seed {seed} (version {version}).\n"
                  "# Written by `python -m nanochat.corpus`; scored by `python -m scripts.base_eval "
                  "--eval-bundle=builtin`.\n")
        with open(os.path.join(tmp_dir, "core.yaml"), "w", encoding="utf-8") as f:
            f.write(header + yaml.safe_dump(core, sort_keys=False, default_flow_style=None, allow_unicode=True))
        with open(os.path.join(tmp_dir, "eval_meta_data.csv"), "w", encoding="utf-8", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows(meta)
        if os.path.exists(out_dir):  # a directory cannot be renamed onto a non-empty one: move the old aside first
            old_dir = f"{out_dir}.old{os.getpid()}"
            os.rename(out_dir, old_dir)
            os.rename(tmp_dir, out_dir)
            if os.path.islink(old_dir):  # a link to a bundle elsewhere: replace the link, leave its target alone
                os.unlink(old_dir)
            else:
                shutil.rmtree(old_dir)
        else:
            os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return tasks
