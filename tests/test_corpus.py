"""Tests for the built-in synthetic corpus: determinism, shard layout, fact coverage, and correct arithmetic/spelling."""

import operator
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import core_eval
from nanochat.common import UserError
from nanochat.corpus import build as corpus
from nanochat.corpus import core_bundle, documents, drills, world as world_mod
from nanochat.corpus.__main__ import main as corpus_command

SIZE_MB = 0.3


def read_texts(path):
    return pq.read_table(path).column("text").to_pylist()


def shard_paths(out_dir):
    return sorted(os.path.join(out_dir, n) for n in os.listdir(out_dir) if n.endswith(".parquet"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One small corpus for seed 42, shared by the read-only tests."""
    out = str(tmp_path_factory.mktemp("corpus42"))
    summary = corpus.write_corpus(out, seed=42, size_mb=SIZE_MB, shard_mb=0.1, verbose=False)
    paths = shard_paths(out)
    val = read_texts(paths[0])
    train = [t for p in paths[1:] for t in read_texts(p)]
    return {"out": out, "summary": summary, "paths": paths, "val": val, "train": train,
            "train_text": "\n".join(train), "world": world_mod.build_world(42)}


def sentences(text):
    """Split documents into sentences, dropping the list and answer markers the styles put in front."""
    for line in text.splitlines():
        line = re.sub(r"^(A: |- )", "", line.strip())
        yield from re.split(r"(?<=[.!?])\s+", line)


# -----------------------------------------------------------------------------
# World


@pytest.mark.quick
def test_world_shape_and_split():
    world = world_mod.build_world(42)
    assert len(world.countries) == 300 and len(world.people) == 200
    assert len(world.facts) == 300 * 5 + 200 * 2
    assert len(set(world.facts)) == len(world.facts)
    names = [n.lower() for n in world.continents + world.languages + [c.name for c in world.countries]
             + [c.capital for c in world.countries] + [p.first for p in world.people]
             + [p.name.split()[1] for p in world.people]]
    assert len(set(names)) == len(names)
    # no name hides inside another, so answers can be checked by substring
    for i, a in enumerate(names):
        assert not any(a in b for j, b in enumerate(names) if j != i), a
    # every country borders two others on its own continent
    for c in world.countries[:50]:
        nbrs = world.neighbours(c.name)
        assert len(nbrs) == 2 and all(world.by_name[n].continent == c.continent for n in nbrs)
    # held-out subjects: ~20% of each kind, and the facts split cleanly
    assert len([c for c in world.countries if c.name in world.eval_subjects]) == 60
    assert len([p for p in world.people if p.name in world.eval_subjects]) == 40
    sft, held = world.sft_facts(), world.eval_facts()
    assert len(sft) + len(held) == len(world.facts)
    assert not {f.subject for f in sft} & {f.subject for f in held}
    assert set(world.sft_subjects) == {f.subject for f in sft}


@pytest.mark.quick
def test_relations_templates():
    assert len(world_mod.RELATIONS) == 7
    for rel in world_mod.RELATIONS.values():
        assert len(set(rel.templates)) >= 15, rel.name
        for t in rel.templates:
            assert "{s}" in t and ("{o}" in t or "{a_o}" in t), t
            # one sentence each, so the text can be split back into statements
            assert t.endswith(".") and ". " not in t, t
        assert rel.questions and all(q.endswith(("?", ".")) for q in rel.questions)


@pytest.mark.quick
def test_world_depends_on_seed():
    a, b = world_mod.build_world(1), world_mod.build_world(2)
    assert [c.name for c in a.countries] != [c.name for c in b.countries]
    assert [c.name for c in a.countries] == [c.name for c in world_mod.build_world(1).countries]


# -----------------------------------------------------------------------------
# Files


@pytest.mark.quick
def test_layout(built):
    names = [os.path.basename(p) for p in built["paths"]]
    assert names[0] == "shard_00000.parquet"
    assert names[1:] == [f"shard_{i:05d}.parquet" for i in range(1, len(names))]
    assert len(names) >= 3  # val + several train shards at shard_mb=0.1
    train_groups = 0
    for path in built["paths"]:
        pf = pq.ParquetFile(path)
        assert pf.schema_arrow.names == ["text"] and pf.schema_arrow.field("text").type == pa.string()
        if not path.endswith("shard_00000.parquet"):
            train_groups += pf.num_row_groups
        assert pf.num_row_groups >= 1
    assert train_groups >= 16
    assert all(isinstance(t, str) and t.strip() for t in built["train"] + built["val"])
    text_mb = sum(len(t.encode()) for t in built["train"] + built["val"]) / 1e6
    assert SIZE_MB * 0.9 < text_mb < SIZE_MB * 1.5
    info = corpus.read_corpus_info(built["out"])
    assert info["seed"] == 42 and info["train_docs"] == len(built["train"]) and info["val_docs"] == len(built["val"])
    assert not [n for n in os.listdir(built["out"]) if ".tmp" in n]
    # an explicit --out gets its own eval bundle beside the shards, never the default corpus's one
    bundle = os.path.join(built["out"], core_eval.BUILTIN_BUNDLE_NAME)
    assert os.path.isfile(os.path.join(bundle, "core.yaml")) and info["eval_bundle_dir"] == bundle


@pytest.mark.quick
def test_readable_through_dataset_api(tmp_path, monkeypatch):
    from nanochat import dataset

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "builtin")
    corpus_command(["--seed", "5", "--size-mb", "0.2"])  # default --out is the builtin source's data dir
    val = dataset.list_parquet_files("val")
    train = dataset.list_parquet_files("train")
    assert [os.path.basename(p) for p in val] == ["shard_00000.parquet"]
    assert train and all(os.path.dirname(p) == str(tmp_path / "base_data" / "builtin") for p in train)
    batches = list(dataset.parquets_iter_batched("train", start=1, step=2))
    assert batches and all(isinstance(b, list) and isinstance(b[0], str) for b in batches)
    # the default build writes the CORE bundle about its world where --eval-bundle=builtin looks
    assert core_eval.builtin_eval_bundle_dir() == str(tmp_path / "eval_bundle_builtin")
    assert (tmp_path / "eval_bundle_builtin" / "core.yaml").is_file()
    assert "seed 5" in (tmp_path / "eval_bundle_builtin" / "core.yaml").read_text()


@pytest.mark.quick
def test_deterministic_and_seeded(tmp_path):
    a, b, c = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")
    corpus.write_corpus(a, seed=7, size_mb=0.2, verbose=False)
    corpus.write_corpus(b, seed=7, size_mb=0.2, verbose=False)
    corpus.write_corpus(c, seed=8, size_mb=0.2, verbose=False)
    pa_, pb = shard_paths(a), shard_paths(b)
    assert [os.path.basename(p) for p in pa_] == [os.path.basename(p) for p in pb]
    for x, y in zip(pa_, pb):
        with open(x, "rb") as fx, open(y, "rb") as fy:
            assert fx.read() == fy.read(), x
    texts_a = [t for p in pa_ for t in read_texts(p)]
    texts_c = [t for p in shard_paths(c) for t in read_texts(p)]
    assert len(set(texts_a) & set(texts_c)) < 0.01 * len(texts_a)


@pytest.mark.quick
def test_rebuild_removes_stale_shards(tmp_path):
    out = str(tmp_path)
    corpus.write_corpus(out, seed=1, size_mb=0.3, shard_mb=0.05, verbose=False)
    many = shard_paths(out)
    corpus.write_corpus(out, seed=1, size_mb=0.3, shard_mb=10, verbose=False)
    assert len(many) > 3 and len(shard_paths(out)) == 2


@pytest.mark.quick
def test_bad_flags(tmp_path, capsys):
    with pytest.raises(UserError, match="--size-mb"):
        corpus_command(["--size-mb", "0", "--out", str(tmp_path)])
    with pytest.raises(UserError, match="--shard-mb"):
        corpus_command(["--shard-mb", "-1", "--out", str(tmp_path)])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="--out"):
        corpus.write_corpus(str(blocker / "sub"), size_mb=0.1, verbose=False)
    assert not list(tmp_path.glob("*.parquet"))


@pytest.mark.quick
def test_cli_prints_config_and_summary(tmp_path, capsys):
    corpus_command(["--seed", "3", "--size-mb", "0.1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "seed=3" in out and "wrote shard_00000.parquet" in out
    assert re.search(r"done: [\d,]+ docs, [\d.]+ MB of text .* \d+ shards, [\d.]+s", out)


# -----------------------------------------------------------------------------
# Content


@pytest.mark.quick
def test_every_fact_is_told_in_train(built):
    told = set(sentences(built["train_text"]))
    missing = []
    for fact in built["world"].facts:
        wordings = {world_mod.render_statement(fact, t) for t in world_mod.RELATIONS[fact.relation].templates}
        if not wordings & told:
            missing.append(fact)
    assert not missing, missing[:5]
    assert built["summary"]["mentions_min"] >= 1


@pytest.mark.quick
def test_facts_told_about_50_times_at_default_size():
    import random
    from collections import Counter

    world = world_mod.build_world(42)
    mentions = Counter()
    train_world_bytes = corpus.MIXTURE["world"] * 0.95 * 6e6  # the default build's train share of world text
    documents.generate_world_documents(world, random.Random(0), train_world_bytes, mentions=mentions)
    counts = [mentions[f] for f in world.facts]
    mean = sum(counts) / len(counts)
    # SPEC §5: ~50 mentions per fact, and no fact neglected
    assert 40 <= mean <= 70 and min(counts) >= 25, (mean, min(counts))


SYMBOLS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "×": operator.mul,
           "/": operator.truediv, "÷": operator.truediv}
ARITHMETIC_PATTERNS = [
    (r"(?<![\w.])(-?\d+) ([-+*×/÷]) (-?\d+) = (-?\d+)(?!\d)", lambda a, op, b: SYMBOLS[op](a, b)),
    (r"The sum of (\d+) and (\d+) is (-?\d+)\.", lambda a, b: a + b),
    (r"(\d+) plus (\d+) equals (-?\d+)\.", lambda a, b: a + b),
    (r"Adding (\d+) and (\d+) gives (-?\d+)\.", lambda a, b: a + b),
    (r"The difference between (\d+) and (\d+) is (-?\d+)\.", lambda a, b: a - b),
    (r"(\d+) minus (\d+) equals (-?\d+)\.", lambda a, b: a - b),
    (r"Taking (\d+) away from (\d+) leaves (-?\d+)\.", lambda b, a: a - b),
    (r"The product of (\d+) and (\d+) is (-?\d+)\.", lambda a, b: a * b),
    (r"(\d+) times (\d+) equals (-?\d+)\.", lambda a, b: a * b),
    (r"Multiplying (\d+) by (\d+) gives (-?\d+)\.", lambda a, b: a * b),
    (r"(\d+) divided by (\d+) is (-?\d+)\.", lambda a, b: a / b),
    (r"Dividing (\d+) by (\d+) gives (-?\d+)\.", lambda a, b: a / b),
    (r"(\d+) split into (\d+) equal parts gives (-?\d+) each\.", lambda a, b: a / b),
    (r"(\d) \+ (\d) = \d+, plus the carried 1 makes (\d+)", lambda a, b: a + b + 1),
]


@pytest.mark.quick
def test_arithmetic_is_correct(built):
    text = built["train_text"]
    checked = 0
    for pattern, expected in ARITHMETIC_PATTERNS:
        found = 0
        for m in re.finditer(pattern, text):
            *args, result = m.groups()
            args = [a if a in "+-*×/÷" else int(a) for a in args]
            assert expected(*args) == int(result), m.group(0)
            found += 1
        assert found > 0, f"no arithmetic of the form {pattern!r} in the corpus"
        checked += found
    assert checked > 500
    # worked sums end in the right total
    for m in re.finditer(r"Let's add (\d+) and (\d+) column by column\.(.*?)So \1 \+ \2 = (\d+)\.", text, re.DOTALL):
        assert int(m.group(1)) + int(m.group(2)) == int(m.group(4))


@pytest.mark.quick
def test_spelling_is_correct(built):
    text = built["train_text"]
    checks = {
        r"(\w+) is spelled ([A-Za-z](?:-[A-Za-z])+)\.": lambda w, s: s.replace("-", "") == w,
        r"Spelling (\w+) letter by letter: ([a-z](?:, [a-z])*)\.": lambda w, s: s.replace(", ", "") == w,
        r"How many \w's are in (\w+)\? ([a-z](?:-[a-z])*)\.": lambda w, s: s.replace("-", "") == w,
        r"The word (\w+) has (\d+) letters\.": lambda w, n: len(w) == int(n),
        r"The word (\w+) has (\d+) letter (\w)\.": lambda w, n, c: w.count(c) == int(n),
        r"The letter (\w) appears (\d+) times? in (\w+)\.": lambda c, n, w: w.count(c) == int(n),
        r"(\w+) backwards is (\w+)\.": lambda w, r: w[::-1] == r,
        r"The first letter of (\w+) is (\w)\.": lambda w, c: w[0] == c,
        r"The last letter of (\w+) is (\w)\.": lambda w, c: w[-1] == c,
    }
    for pattern, ok in checks.items():
        matches = list(re.finditer(pattern, text))
        assert matches, f"no spelling of the form {pattern!r} in the corpus"
        for m in matches:
            assert ok(*m.groups()), m.group(0)
    # step-by-step counts number each occurrence in order and spell the whole word
    walks = list(re.finditer(r"Let's count the letter (\w) in (\w+)\. Going letter by letter: (.*?)\. "
                             r"The word \2 has (\d+) letter \1\.", text))
    assert walks
    for m in walks:
        letter, word, steps, n = m.groups()
        steps = steps.split(", ")
        assert "".join(s[0] for s in steps) == word
        numbers = [int(s[3:-1]) for s in steps if s[0] == letter]
        assert numbers == list(range(1, word.count(letter) + 1)) and int(n) == word.count(letter)
    # some letter counts are zero, so "none" is a thing the model sees
    assert re.search(r"has 0 letter \w\.|appears 0 times", text)


@pytest.mark.quick
def test_val_is_held_out_documents_about_the_same_world(built):
    train, val, world = set(built["train"]), built["val"], built["world"]
    assert len(val) >= 20
    assert not train & set(val)
    countries = [c.name for c in world.countries]
    about_world = [d for d in val if any(n in d for n in countries[:60])]
    assert len(about_world) > 0.2 * len(val)
    # val retells the same facts in trained wordings: many of its sentences occur in train too
    told = set(sentences(built["train_text"]))
    val_sentences = [s for d in val for s in sentences(d)]
    assert sum(s in told for s in val_sentences) > 0.3 * len(val_sentences)


# -----------------------------------------------------------------------------
# The CORE eval bundle about the world (its parsing and scoring are tested in test_core_eval.py)


def bundle_files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.quick
def test_eval_bundle_is_deterministic_per_seed_and_replaced_whole(tmp_path):
    world7 = world_mod.build_world(7)
    core_bundle.write_eval_bundle(tmp_path / "a", world7, 7)
    core_bundle.write_eval_bundle(tmp_path / "b", world7, 7)
    core_bundle.write_eval_bundle(tmp_path / "c", world_mod.build_world(8), 8)
    a, b, c = (bundle_files(tmp_path / n) for n in "abc")
    assert a == b and "core.yaml" in a and len(a) == 2 + len(core_bundle.build_eval_tasks(world7, 7))
    assert a.keys() == c.keys() and a != c
    assert all(a[k] != c[k] for k in a if k.endswith(".jsonl"))
    # rewriting over an existing bundle swaps it whole: new contents, no temp or old folder left behind
    (tmp_path / "a" / "stray.txt").write_text("from an older build")
    core_bundle.write_eval_bundle(tmp_path / "a", world_mod.build_world(8), 8)
    assert bundle_files(tmp_path / "a") == c
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]
    # a base dir whose bundle is a link to another one's: the link is replaced, the bundle it pointed at kept
    os.symlink(tmp_path / "b", tmp_path / "linked")
    core_bundle.write_eval_bundle(tmp_path / "linked", world_mod.build_world(8), 8)
    assert not os.path.islink(tmp_path / "linked") and bundle_files(tmp_path / "linked") == c
    assert bundle_files(tmp_path / "b") == a


def true_statements(world, relation, facts=None):
    """Every trained wording of every fact of a relation: sentence -> fact."""
    facts = world.facts if facts is None else facts
    return {world_mod.render_statement(f, t): f for f in facts if f.relation == relation
            for t in world_mod.RELATIONS[relation].templates}


@pytest.mark.quick
def test_eval_bundle_asks_true_facts_about_held_out_subjects_in_trained_wordings():
    world = world_mod.build_world(42)
    tasks = {t["label"]: t for t in core_bundle.build_eval_tasks(world, 42)}
    held_out_countries = {c.name for c in world.countries if c.name in world.eval_subjects}
    for label, relation in (("world_capital", "capital"), ("world_continent", "continent"),
                            ("world_language", "language"), ("world_occupation", "occupation")):
        task = tasks[label]
        assert task["icl_task_type"] == "multiple_choice" and task["random_baseline"] == 25
        held_out = true_statements(world, relation, world.eval_facts())
        anywhere = true_statements(world, relation)
        asked = set()
        for ex in task["examples"]:
            sentences = [f"{ex['query']}{task['continuation_delimiter']}{c}" for c in ex["choices"]]
            gold = sentences[ex["gold"]]
            assert gold in held_out, gold  # a true fact about a held-out subject, word for word as trained
            asked.add(held_out[gold].subject)
            assert not [s for i, s in enumerate(sentences) if i != ex["gold"] and s in anywhere], sentences
        expected = held_out_countries if relation != "occupation" else \
            {p.name for p in world.people if p.name in world.eval_subjects}
        assert asked == expected and len(task["examples"]) >= 200

    schema = tasks["world_capital_schema"]
    capitals = true_statements(world, "capital")
    for ex in schema["examples"]:
        sentences = [f"{option} {ex['continuation']}" for option in ex["context_options"]]
        assert sentences[ex["gold"]] in capitals and capitals[sentences[ex["gold"]]].subject in held_out_countries
        assert sum(s in capitals for s in sentences) == 1


@pytest.mark.quick
def test_eval_bundle_arithmetic_and_spelling_are_right_and_in_corpus_format(built):
    tasks = {t["label"]: t for t in core_bundle.build_eval_tasks(built["world"], 42)}
    text = built["train_text"]

    arithmetic = tasks["arithmetic"]["examples"]
    assert len({ex["context"] for ex in arithmetic}) == len(arithmetic) >= 200
    for ex in arithmetic:
        a, op, b = re.fullmatch(r"(\d+) ([-+*×/÷]) (\d+) =", ex["context"]).groups()
        assert SYMBOLS[op](int(a), int(b)) == int(ex["continuation"]), ex
    assert {ex["context"].split()[1] for ex in arithmetic} == set(SYMBOLS)
    assert re.search(r"(?m)^\d+ [-+*×/÷] \d+ = \d+$", text)  # the practice-sums lines they imitate

    spelling = tasks["spelling"]["examples"]
    words = [ex["context"].removesuffix(" is spelled") for ex in spelling]
    assert set(drills.SPELLING_WORDS) <= set(words) and len(set(words)) == len(words)
    for ex, word in zip(spelling, words):
        sentence = f"{ex['context']} {ex['continuation']}."
        assert re.fullmatch(r"(\w+) is spelled ([A-Za-z](?:-[A-Za-z])+)\.", sentence)
        assert ex["continuation"].replace("-", "") == word
    assert re.search(r"(?m)^\w+ is spelled [a-z](-[a-z])+\.$", text)

    counts = tasks["letter_count"]["examples"]
    assert len({ex["context"] for ex in counts}) == len(counts) >= 200
    for ex in counts:
        sentence = f"{ex['context']} {ex['continuation']}."
        letter, word, spelled, n = re.fullmatch(
            r"How many (\w)'s are in (\w+)\? ([a-z](?:-[a-z])*)\. The word \2 has (\d+) letter \1\.", sentence).groups()
        assert spelled.replace("-", "") == word and int(n) == word.count(letter)
    assert any(ex["continuation"].startswith("0 ") for ex in counts)
    assert re.search(r"How many \w's are in \w+\? [a-z](-[a-z])*\. The word \w+ has \d+ letter \w\.", text)
