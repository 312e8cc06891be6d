"""
CORE eval: bundle download/extraction from a local HTTP server, and scoring checked against
hand-worked answers for a model whose every prediction we can do in our heads.

The fake model predicts, at every position, the token whose id is one more than the current
token's (a -> b, b -> c, ' ' -> '!'), with high confidence. The tokenizer is one token per
character (id = ASCII code) plus a BOS id. So an answer's mean loss only depends on the fraction
of its scored tokens that follow the previous token in ASCII order: the higher, the better.
"""

import functools
import http.server
import importlib.util
import json
import os
import random
import shutil
import sys
import threading
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import random_tiny_gpt
import torch
import yaml

from nanochat import core_eval
from nanochat.common import UserError
from nanochat.corpus import core_bundle, world as world_mod

REPO_ROOT = Path(__file__).resolve().parents[1]

# -----------------------------------------------------------------------------
# Fakes


class CharTokenizer:
    BOS = 128

    def get_bos_token_id(self):
        return self.BOS

    def encode(self, text, prepend=None, append=None, num_threads=8):
        if isinstance(text, list):
            return [self.encode(t, prepend=prepend, append=append) for t in text]
        return ([] if prepend is None else [prepend]) + self.ids(text) + ([] if append is None else [append])

    def ids(self, text):
        ids = [ord(c) for c in text]
        assert all(i < 128 for i in ids), "test data must be ASCII"
        return ids

    __call__ = encode


class SuccessorModel(torch.nn.Module):
    """logits favour id+1 after id; records every batch it is given. A module, as the GPT it stands in for is."""

    vocab_size = 129

    def __init__(self, sequence_len=4096):
        super().__init__()
        self.config = SimpleNamespace(sequence_len=sequence_len)
        self.calls = []

    def forward(self, idx):
        assert idx.shape[1] <= self.config.sequence_len, "fed a row longer than the context"
        self.calls.append(idx.clone())
        logits = torch.zeros(*idx.shape, self.vocab_size)
        logits.scatter_(2, ((idx + 1) % self.vocab_size).unsqueeze(-1), 12.0)
        return logits


# -----------------------------------------------------------------------------
# A small bundle in the published format, with hand-worked answers

# multiple_choice, 4 choices -> 25 % random baseline. The query and " " are common to all choices,
# so the first scored token is predicted from ' ' (which predicts '!'). Per example, the fraction
# of scored tokens the model predicts (higher wins):
MC_ROWS = [
    # bcd 2/3, bdf 0/3, xzz 0/3, bcx 1/3 -> choice 0 = gold: correct
    {"query": "Q1:", "choices": ["bcd", "bdf", "xzz", "bcx"], "gold": 0},
    # all choices start with "m", so scoring starts after it: no 2/2, nopqrsx 6/7, p 0/1 -> choice 0:
    # correct. (Also scoring the shared "m", which ' ' does not predict, would give mno 2/3 <
    # mnopqrsx 6/8 and pick choice 1.)
    {"query": "Q2:", "choices": ["mno", "mnopqrsx", "mp"], "gold": 0},
    # !"# 3/3 (' ' -> '!'), abc 2/3 -> choice 0, gold is 1: wrong
    {"query": "Q3:", "choices": ["!\"#", "abc"], "gold": 1},
    # x 0/1, bcdefghz 6/8 -> choice 1 = gold: correct (the mean matters: summed, the long choice's
    # two misses would lose to the short one's single miss)
    {"query": "Q4:", "choices": ["x", "bcdefghz"], "gold": 1},
]
MC_ACCURACY = 3 / 4

# schema, 2 options -> 50 %. Delimiter "" so the shared tail is scored from each option's last char.
SCHEMA_ROWS = [
    # tail "cde": from b 3/3, from y 2/3 -> option 0 = gold: correct
    {"context_options": ["ab", "xy"], "continuation": "cde", "gold": 0},
    # tail "pq": from n 1/2, from o 2/2 -> option 1, gold 0: wrong
    {"context_options": ["lmn", "lmo"], "continuation": "pq", "gold": 0},
    # tail "xyz": from s 2/3, from w 3/3 -> option 1 = gold: correct
    {"context_options": ["rs", "uvw"], "continuation": "xyz", "gold": 1},
    # options share their last char, so the tail is "ijk": from h 3/3, from b 2/3 -> option 0: correct
    {"context_options": ["ghi", "abi"], "continuation": "jk", "gold": 0},
]
SCHEMA_ACCURACY = 3 / 4

# language_modeling, 0 % baseline: correct iff every continuation char follows its predecessor.
LM_ROWS = [
    {"context": "abc", "continuation": "def"},  # correct
    {"context": "abc", "continuation": "dex"},  # wrong at x
    {"context": "  mno \n", "continuation": "pqr"},  # context is stripped -> "mnopqr": correct
    {"context": "wxy", "continuation": "z{|"},  # z { | are 0x7a..0x7c: correct
]
LM_ACCURACY = 3 / 4

EXPECTED_CENTERED = {
    "mc_task": (MC_ACCURACY - 0.25) / 0.75,
    "schema_task": (SCHEMA_ACCURACY - 0.5) / 0.5,
    "lm_task": LM_ACCURACY,
}
EXPECTED_CORE = (2 / 3 + 1 / 2 + 3 / 4) / 3  # = 23/36, worked out by hand from the lines above

CORE_YAML = {
    "icl_tasks": [
        {"label": "mc_task", "dataset_uri": "language_understanding/mc_task.jsonl", "num_fewshot": [2],
         "icl_task_type": "multiple_choice", "continuation_delimiter": " "},
        {"label": "schema_task", "dataset_uri": "language_understanding/schema_task.jsonl", "num_fewshot": [1],
         "icl_task_type": "schema", "continuation_delimiter": ""},
        {"label": "lm_task", "dataset_uri": "symbolic_problem_solving/lm_task.jsonl", "num_fewshot": [0],
         "icl_task_type": "language_modeling", "continuation_delimiter": ""},
    ]
}
META_CSV = (
    "Eval Task,Task Category,Task Type,#shots,#datapoints,Random baseline,Centered Metric?,Description\n"
    "mc_task,language understanding,multiple choice,2,4,25,,\"A made-up task, with a comma\"\n"
    "schema_task,language understanding,schema,1,4,50,,made up\n"
    "lm_task,symbolic problem solving,language modeling,0,4,0,,made up\n"
    "unused_task,world knowledge,multiple choice,0,0,25,,not listed in core.yaml\n"
)


def write_bundle(root):
    """An eval_bundle/ folder like the published one; returns its path."""
    bundle = Path(root) / "eval_bundle"
    (bundle / "eval_data" / "language_understanding").mkdir(parents=True)
    (bundle / "eval_data" / "symbolic_problem_solving").mkdir(parents=True)
    (bundle / "core.yaml").write_text(yaml.safe_dump(CORE_YAML))
    (bundle / "eval_meta_data.csv").write_text(META_CSV)
    for task, rows in (("mc_task", MC_ROWS), ("schema_task", SCHEMA_ROWS), ("lm_task", LM_ROWS)):
        uri = next(t["dataset_uri"] for t in CORE_YAML["icl_tasks"] if t["label"] == task)
        (bundle / "eval_data" / uri).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return bundle


def zip_folder(folder, zip_path):
    folder = Path(folder)
    with zipfile.ZipFile(zip_path, "w", compression=zipfile.ZIP_STORED) as zf:
        for path in sorted(folder.parent.rglob("*")):
            if path.is_relative_to(folder):
                zf.write(path, path.relative_to(folder.parent).as_posix())


@pytest.fixture
def server(tmp_path):
    """Serve tmp_path/www over HTTP on 127.0.0.1; yields (www_dir, base_url, request_log)."""
    www = tmp_path / "www"
    www.mkdir()
    requests_seen = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests_seen.append(self.path)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{httpd.server_address[1]}", requests_seen
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def base_dir(tmp_path, monkeypatch):
    base = tmp_path / "base"
    base.mkdir()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    return base


def leftovers(base):
    return sorted(p.name for p in base.iterdir() if p.name != "eval_bundle.lock")


# -----------------------------------------------------------------------------
# Download and extraction


@pytest.mark.quick
def test_ensure_eval_bundle_downloads_extracts_and_caches(tmp_path, base_dir, server, monkeypatch):
    www, url, requests_seen = server
    zip_folder(write_bundle(tmp_path / "src"), www / "eval_bundle.zip")
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", f"{url}/eval_bundle.zip")

    bundle_dir = core_eval.ensure_eval_bundle()
    assert bundle_dir == str(base_dir / "eval_bundle")
    assert yaml.safe_load((base_dir / "eval_bundle" / "core.yaml").read_text()) == CORE_YAML
    assert (base_dir / "eval_bundle" / "eval_data" / "symbolic_problem_solving" / "lm_task.jsonl").is_file()
    assert leftovers(base_dir) == ["eval_bundle"]  # no temp zip or temp folder left behind
    assert requests_seen == ["/eval_bundle.zip"]

    # cached: a second call does not download again
    assert core_eval.ensure_eval_bundle() == bundle_dir
    assert requests_seen == ["/eval_bundle.zip"]

    # and the downloaded bundle scores as worked out by hand
    out = core_eval.evaluate_core(SuccessorModel(), CharTokenizer(), "cpu", verbose=False)
    assert out["core_metric"] == pytest.approx(EXPECTED_CORE)


@pytest.mark.quick
def test_zip_of_bundle_contents_without_top_folder_is_accepted(tmp_path, base_dir, server, monkeypatch):
    www, url, _ = server
    bundle = write_bundle(tmp_path / "src")
    with zipfile.ZipFile(www / "flat.zip", "w") as zf:
        for path in sorted(bundle.rglob("*")):
            zf.write(path, path.relative_to(bundle).as_posix())
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", f"{url}/flat.zip")
    bundle_dir = core_eval.ensure_eval_bundle()
    assert os.path.isfile(os.path.join(bundle_dir, "eval_meta_data.csv"))
    assert leftovers(base_dir) == ["eval_bundle"]


def corrupt_member_zip(tmp_path, www):
    good = www / "good.zip"
    zip_folder(write_bundle(tmp_path / "src"), good)
    data = bytearray(good.read_bytes())
    # stored (uncompressed) members: flip a byte of core.yaml's contents so its CRC no longer matches
    at = data.index(b"icl_tasks")
    data[at] ^= 0xFF
    return bytes(data)


@pytest.mark.quick
@pytest.mark.parametrize("kind", ["garbage", "truncated", "bad_crc", "no_core_yaml", "missing"])
def test_bad_download_gives_clear_error_and_leaves_nothing(tmp_path, base_dir, server, monkeypatch, kind):
    www, url, _ = server
    if kind == "garbage":
        (www / "bundle.zip").write_bytes(b"<html>this is not a zip</html>" * 100)
    elif kind == "truncated":
        zip_folder(write_bundle(tmp_path / "src"), www / "full.zip")
        full = (www / "full.zip").read_bytes()
        (www / "bundle.zip").write_bytes(full[: len(full) // 2])
    elif kind == "bad_crc":
        (www / "bundle.zip").write_bytes(corrupt_member_zip(tmp_path, www))
    elif kind == "no_core_yaml":
        with zipfile.ZipFile(www / "bundle.zip", "w") as zf:
            zf.writestr("eval_bundle/readme.txt", "nothing here")
    bundle_url = f"{url}/bundle.zip"
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", bundle_url)

    with pytest.raises(UserError) as excinfo:
        core_eval.ensure_eval_bundle()
    message = str(excinfo.value)
    assert bundle_url in message
    assert "\n" not in message
    assert leftovers(base_dir) == []  # no eval_bundle/, no half-extracted temp folder, no temp zip


# -----------------------------------------------------------------------------
# Scoring


@pytest.mark.quick
def test_evaluate_core_matches_hand_worked_answers(tmp_path, capsys):
    bundle = write_bundle(tmp_path)
    out = core_eval.evaluate_core(SuccessorModel(), CharTokenizer(), "cpu", bundle_dir=str(bundle))
    assert out["results"] == {"mc_task": MC_ACCURACY, "schema_task": SCHEMA_ACCURACY, "lm_task": LM_ACCURACY}
    assert out["centered_results"] == pytest.approx(EXPECTED_CENTERED)
    assert out["core_metric"] == pytest.approx(EXPECTED_CORE)
    printed = capsys.readouterr().out
    assert "mc_task" in printed and "lm_task" in printed


@pytest.mark.quick
@pytest.mark.parametrize("task_type, rows, verdicts", [
    ("multiple_choice", MC_ROWS, [True, True, False, True]),
    ("schema", SCHEMA_ROWS, [True, False, True, True]),
    ("language_modeling", LM_ROWS, [True, False, True, True]),
])
def test_each_example_verdict(task_type, rows, verdicts):
    delimiter = " " if task_type == "multiple_choice" else ""
    meta = {"task_type": task_type, "num_fewshot": 2, "continuation_delimiter": delimiter}
    model = SuccessorModel()
    got = [core_eval.evaluate_example(model, CharTokenizer(), rows, i, "cpu", meta) for i in range(len(rows))]
    assert got == verdicts
    # one forward pass per example, all of its choices in one batch, every row starting with BOS
    assert len(model.calls) == len(rows)
    for call, row in zip(model.calls, rows):
        expected_batch = len(row.get("choices", row.get("context_options", [None])))
        assert call.shape[0] == expected_batch
        assert (call[:, 0] == CharTokenizer.BOS).all()


@pytest.mark.quick
def test_fewshot_examples_are_rendered_and_deterministic():
    data = [{"query": f"Q{i}:", "choices": ["x", "y"], "gold": i % 2} for i in range(6)]
    shots_a = core_eval.sample_fewshot(data, 3, 3)
    shots_b = core_eval.sample_fewshot(data, 3, 3)
    assert shots_a == shots_b and len(shots_a) == 3
    assert data[3] not in shots_a and len({s["query"] for s in shots_a}) == 3
    prompts = core_eval.render_prompts("multiple_choice", data[3], " ", shots_a)
    shot_text = "".join(f"{s['query']} {s['choices'][s['gold']]}\n\n" for s in shots_a)
    assert prompts == [shot_text + "Q3: x", shot_text + "Q3: y"]
    # asking for more shots than there are other examples uses all of them
    assert len(core_eval.sample_fewshot(data[:3], 0, 10)) == 2


@pytest.mark.quick
def test_language_modeling_context_is_a_token_prefix():
    # With a " " delimiter the context drops its trailing space (in BPE it merges into the
    # continuation); with one token per character the space is then the first scored token.
    tok = CharTokenizer()
    shots = [{"context": "hi ", "continuation": "there"}]
    prompts = core_eval.render_prompts("language_modeling", {"context": " ab ", "continuation": "cd"}, " ", shots)
    assert prompts == ["hi there\n\nab", "hi there\n\nab cd"]
    rows, spans = core_eval.tokenize_prompts(tok, "language_modeling", prompts)
    assert len(rows) == 1 and rows[0] == tok.encode("hi there\n\nab cd", prepend=tok.BOS)
    start, end = spans[0]
    assert rows[0][start:end] == tok.encode(" cd")


@pytest.mark.quick
def test_long_contexts_are_cropped_from_the_left():
    tok = CharTokenizer()
    meta = {"task_type": "language_modeling", "num_fewshot": 0, "continuation_delimiter": ""}
    data = [{"context": "abcdefghijklmnop", "continuation": "qrs"}]  # 1 + 19 tokens, window of 8
    model = SuccessorModel(sequence_len=8)
    assert core_eval.evaluate_example(model, tok, data, 0, "cpu", meta) is True
    (call,) = model.calls
    assert call.tolist() == [[tok.BOS] + tok.encode("mnopqrs")]  # BOS kept, oldest context dropped

    # multiple choice: each row cropped on its own, then padded; the continuation survives
    meta = {"task_type": "multiple_choice", "num_fewshot": 0, "continuation_delimiter": " "}
    data = [{"query": "long long long query", "choices": ["!\"#$", "!x"], "gold": 0}]
    model = SuccessorModel(sequence_len=6)
    assert core_eval.evaluate_example(model, tok, data, 0, "cpu", meta) is True
    (call,) = model.calls
    assert call.shape == (2, 6)
    assert call[0].tolist() == [tok.BOS] + tok.encode(" !\"#$")
    assert call[1].tolist() == [tok.BOS] + tok.encode("ry !x")

    rows, spans = core_eval.crop_to_window([[9, 1, 2, 3, 4, 5]], [(3, 6)], 4)
    assert rows == [[9, 3, 4, 5]] and spans == [(1, 4)]


@pytest.mark.quick
def test_bad_bundle_metadata_is_a_user_error(tmp_path, monkeypatch):
    bundle = write_bundle(tmp_path)
    (bundle / "eval_meta_data.csv").write_text(META_CSV.replace("lm_task,", "renamed_task,"))
    with pytest.raises(UserError, match="lm_task"):
        core_eval.evaluate_core(SuccessorModel(), CharTokenizer(), "cpu", bundle_dir=str(bundle), verbose=False)
    (bundle / "eval_meta_data.csv").write_text(META_CSV)
    (bundle / "eval_data" / "language_understanding" / "mc_task.jsonl").write_text('{"query": "x"\n')
    with pytest.raises(UserError, match="mc_task.jsonl:1"):
        core_eval.evaluate_core(SuccessorModel(), CharTokenizer(), "cpu", bundle_dir=str(bundle), verbose=False)
    # the last task's file broken: found before the first task is evaluated, not after it
    write_bundle(tmp_path / "again")
    bundle = tmp_path / "again" / "eval_bundle"
    lm_file = next(bundle.rglob("lm_task.jsonl"))
    lm_file.write_text(lm_file.read_text() + "not json\n")
    evaluated = []
    monkeypatch.setattr(core_eval, "evaluate_task", lambda *args, **kwargs: evaluated.append(args) or 0.0)
    with pytest.raises(UserError, match="lm_task.jsonl"):
        core_eval.evaluate_core(SuccessorModel(), CharTokenizer(), "cpu", bundle_dir=str(bundle), verbose=False)
    assert evaluated == []


@pytest.mark.quick
def test_max_per_task_evaluates_a_subset(tmp_path):
    bundle = write_bundle(tmp_path)
    model = SuccessorModel()
    out = core_eval.evaluate_core(model, CharTokenizer(), "cpu", max_per_task=2, bundle_dir=str(bundle), verbose=False)
    assert len(model.calls) == 2 * 3
    for accuracy in out["results"].values():
        assert accuracy in (0.0, 0.5, 1.0)


# -----------------------------------------------------------------------------
# Distributed: two gloo ranks split the examples and agree on the totals


class CountingModel:
    """Passes calls through to a real model and counts them: one call per example scored."""

    def __init__(self, model):
        self.model, self.config, self.calls = model, model.config, 0

    def __call__(self, idx):
        self.calls += 1
        return self.model(idx)


def _rank_worker(rank, world_size, port, hand_bundle, real_bundle, tokenizer_dir, weights_path, max_per_task,
                 results_path):
    """One rank of a real gloo group: the hand-worked bundle with the successor model, then the real tiny GPT and
    BPE tokenizer on the built-in bundle. Writes both results and how many examples this rank scored."""
    from nanochat.tokenizer import RustBPETokenizer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = SuccessorModel()
        hand = core_eval.evaluate_core(model, CharTokenizer(), "cpu", bundle_dir=hand_bundle, verbose=False)
        hand["examples_seen"] = len(model.calls)
        tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
        gpt = tiny_real_gpt(tokenizer.get_vocab_size())
        gpt.load_state_dict(torch.load(weights_path, weights_only=True))
        counting = CountingModel(gpt)
        real = core_eval.evaluate_core(counting, tokenizer, "cpu", max_per_task=max_per_task, bundle_dir=real_bundle,
                                       verbose=False)
        real["examples_seen"] = counting.calls
        with open(f"{results_path}.{rank}", "w") as f:
            json.dump({"hand": hand, "real": real}, f)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.quick
def test_ranks_take_every_world_size_th_example_and_sum_counts(tmp_path, monkeypatch):
    # In-process stand-in for torch.distributed: run "rank 0" then "rank 1" of 2 and check they
    # split the examples between them and hand all_reduce their (correct, total) counts.
    reduced = []

    def fake_dist(rank):
        return SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                               get_rank=lambda: rank, get_world_size=lambda: 2, ReduceOp=torch.distributed.ReduceOp,
                               all_reduce=lambda tensor, op: reduced.append(tensor.tolist()))

    meta = {"task_type": "language_modeling", "num_fewshot": 1, "continuation_delimiter": ""}
    seen = []
    for rank in (0, 1):
        monkeypatch.setattr(core_eval, "dist", fake_dist(rank))
        monkeypatch.setattr(core_eval, "dist_rank_world", lambda rank=rank: (rank, 2))
        model = SuccessorModel()
        core_eval.evaluate_task(model, CharTokenizer(), LM_ROWS, "cpu", meta)
        seen.append([tuple(call[0, -3:].tolist()) for call in model.calls])
    continuations = [tuple(CharTokenizer().encode(row["continuation"])) for row in LM_ROWS]
    assert seen == [continuations[0::2], continuations[1::2]]
    # rank 0 has examples 0 and 2 (both right), rank 1 has 1 (wrong) and 3 (right)
    assert reduced == [[2, 2], [1, 2]]


@pytest.mark.timeout(180)
def test_two_gloo_ranks_agree_with_one_process(tmp_path, tiny_base_dir, seed7_bundle, monkeypatch, single_torch_thread):
    """
    A real 2-rank gloo group (spawned processes, one thread each): each rank scores every other example and
    all_reduce sums the (correct, total) counts, so both ranks return the single-process accuracies: the
    hand-worked ones for the successor model, and those of one process for the real tiny GPT on the built-in bundle.
    """
    import socket

    import torch.multiprocessing as mp

    hand_bundle = write_bundle(tmp_path)
    real_bundle, tasks = seed7_bundle
    tokenizer_dir = os.path.join(tiny_base_dir, "tokenizer")
    tokenizer = bpe_tokenizer(tiny_base_dir)
    gpt = tiny_real_gpt(tokenizer.get_vocab_size())
    weights_path = tmp_path / "gpt.pt"
    torch.save(gpt.state_dict(), weights_path)
    K = 5  # odd, so the ranks get 3 and 2 examples of each task
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ranks = mp.spawn(_rank_worker, args=(2, port, str(hand_bundle), real_bundle, tokenizer_dir, str(weights_path), K,
                                         str(tmp_path / "out")), nprocs=2, join=False)
    try:
        # the single-process answer, computed while the two ranks start up
        counting = CountingModel(gpt)
        single = core_eval.evaluate_core(counting, tokenizer, "cpu", max_per_task=K, bundle_dir=real_bundle,
                                         verbose=False)
    finally:
        while not ranks.join():
            pass
    outs = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]

    hand_worked = {"mc_task": MC_ACCURACY, "schema_task": SCHEMA_ACCURACY, "lm_task": LM_ACCURACY}
    for out in outs:
        assert out["hand"]["results"] == hand_worked
        assert out["hand"]["core_metric"] == pytest.approx(EXPECTED_CORE)
        assert out["real"]["results"] == single["results"]
        assert out["real"]["centered_results"] == single["centered_results"]
        assert out["real"]["core_metric"] == single["core_metric"]
    assert outs[0]["hand"]["examples_seen"] == outs[1]["hand"]["examples_seen"] == 6  # 12 examples, half each
    assert counting.calls == K * len(tasks)
    assert [out["real"]["examples_seen"] for out in outs] == [3 * len(tasks), 2 * len(tasks)]
    # some examples right and some wrong, so a rank's count missing from the sum would change an accuracy
    assert 0 < sum(single["results"].values()) < len(tasks)


# -----------------------------------------------------------------------------
# scripts/base_eval.py end to end, with checkpoint loading and the report faked


@pytest.mark.quick
def test_base_eval_script_writes_csv_and_report(tmp_path, base_dir, monkeypatch, capsys):
    write_bundle(base_dir)  # already cached: no download
    loaded, logged = [], []

    def fake_load_model(source, device, phase="eval", model_tag=None, step=None):
        loaded.append((source, phase, model_tag, step))
        return SuccessorModel(), CharTokenizer(), {"step": 1234}

    fake_checkpoint_manager = types.ModuleType("nanochat.checkpoint_manager")
    fake_checkpoint_manager.load_model = fake_load_model
    fake_checkpoint_manager.find_latest_tag = lambda source: "d9"
    fake_report = types.ModuleType("nanochat.report")
    fake_report.get_report = lambda: SimpleNamespace(log=lambda section, data: logged.append((section, data)))
    monkeypatch.setitem(sys.modules, "nanochat.checkpoint_manager", fake_checkpoint_manager)
    monkeypatch.setitem(sys.modules, "nanochat.report", fake_report)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)

    spec = importlib.util.spec_from_file_location("base_eval_under_test", REPO_ROOT / "scripts" / "base_eval.py")
    base_eval = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base_eval)
    base_eval.main(["--model-tag", "d1", "--device-type", "cpu"])

    assert loaded == [("base", "eval", "d1", None)]
    csv_text = (base_dir / "base_eval" / "d1_1234.csv").read_text()
    assert csv_text.splitlines()[0] == "Task,Accuracy,Centered"
    assert "mc_task,0.750000,0.666667" in csv_text
    assert csv_text.splitlines()[-1] == f"CORE,,{EXPECTED_CORE:.6f}"
    (section, data), = logged
    assert section == "Base model evaluation"
    assert {"eval bundle": "dclm", "CORE metric": pytest.approx(EXPECTED_CORE)} in data
    assert "| schema_task | 0.7500 | 0.5000 |" in data[-1]
    assert f"CORE metric: {EXPECTED_CORE:.4f}" in capsys.readouterr().out

    # no --model-tag: the stage's latest tag names the results file
    base_eval.main(["--device-type", "cpu", "--max-per-task", "2"])
    assert loaded[-1] == ("base", "eval", "d9", None)
    assert (base_dir / "base_eval" / "d9_1234.csv").is_file()

    with pytest.raises(UserError, match="--max-per-task"):
        base_eval.main(["--max-per-task", "0", "--device-type", "cpu"])

    # --eval-bundle: the built-in bundle or a folder; the file name and the report say which
    with pytest.raises(UserError, match="python -m nanochat.corpus"):
        base_eval.main(["--model-tag", "d1", "--device-type", "cpu", "--eval-bundle", "builtin"])
    shutil.copytree(base_dir / "eval_bundle", base_dir / "eval_bundle_builtin")  # stands in for the corpus's bundle
    shutil.copytree(base_dir / "eval_bundle", tmp_path / "my bundle")
    for flag, suffix in (("builtin", "_builtin"), (str(tmp_path / "my bundle"), "_my_bundle")):
        base_eval.main(["--model-tag", "d1", "--device-type", "cpu", "--eval-bundle", flag])
        assert (base_dir / "base_eval" / f"d1_1234{suffix}.csv").read_text() == csv_text
        section, data = logged[-1]
        assert section == "Base model evaluation"
        assert {"eval bundle": flag, "CORE metric": pytest.approx(EXPECTED_CORE)} in data
    with pytest.raises(UserError, match="--eval-bundle"):
        base_eval.main(["--model-tag", "d1", "--device-type", "cpu", "--eval-bundle", str(tmp_path)])



# -----------------------------------------------------------------------------
# resolve_eval_bundle, and the built-in bundle that nanochat.corpus writes about its world


@pytest.mark.quick
def test_resolve_eval_bundle(tmp_path, base_dir, monkeypatch):
    monkeypatch.setattr(core_eval, "ensure_eval_bundle", lambda: "downloaded-bundle")
    assert core_eval.resolve_eval_bundle() == "downloaded-bundle"
    assert core_eval.resolve_eval_bundle("dclm") == "downloaded-bundle"

    with pytest.raises(UserError, match=r"no built-in CORE eval bundle at .*python -m nanochat\.corpus"):
        core_eval.resolve_eval_bundle("builtin")
    core_bundle.write_eval_bundle(core_eval.builtin_eval_bundle_dir(), world_mod.build_world(3), 3)
    assert core_eval.resolve_eval_bundle("builtin") == str(base_dir / "eval_bundle_builtin")

    folder = write_bundle(tmp_path)
    assert core_eval.resolve_eval_bundle(str(folder)) == str(folder)
    for bad in (str(tmp_path), str(tmp_path / "nowhere"), str(folder / "core.yaml"), ""):
        with pytest.raises(UserError, match="--eval-bundle") as excinfo:
            core_eval.resolve_eval_bundle(bad)
        assert "\n" not in str(excinfo.value)


@pytest.fixture(scope="module")
def builtin_bundle(tmp_path_factory):
    bundle = tmp_path_factory.mktemp("builtin") / "eval_bundle_builtin"
    core_bundle.write_eval_bundle(bundle, world_mod.build_world(42), 42)
    return str(bundle)


@pytest.mark.quick
def test_builtin_bundle_parses_with_core_eval_loaders(builtin_bundle):
    tasks = core_eval.load_core_tasks(builtin_bundle)
    assert len(tasks) >= 5 and len({t["label"] for t in tasks}) == len(tasks)
    assert {t["task_type"] for t in tasks} == set(core_eval.TASK_TYPES)
    for task in tasks:
        data = core_eval.load_task_data(task["data_path"])
        assert len(data) >= 200, task["label"]
        assert 0 <= task["num_fewshot"] <= 5 and task["continuation_delimiter"] == " "
        if task["task_type"] == "language_modeling":
            assert task["random_baseline"] == 0
            assert all(ex["context"].strip() and ex["continuation"].strip() for ex in data)
            continue
        options = "choices" if task["task_type"] == "multiple_choice" else "context_options"
        num_options = len(data[0][options])
        assert task["random_baseline"] == pytest.approx(1 / num_options)
        golds = []
        for ex in data:
            assert len(ex[options]) == num_options and len(set(ex[options])) == num_options
            assert all(o.strip() for o in ex[options])
            assert isinstance(ex["gold"], int) and 0 <= ex["gold"] < num_options
            golds.append(ex["gold"])
        # the right answer sits in every position about equally often, so position bias scores at chance
        assert all(0.15 < golds.count(i) / len(golds) < 0.35 for i in range(num_options)), task["label"]


class ByteTokenizer(CharTokenizer):
    """One token per UTF-8 byte (the bundle has × and ÷), BOS = 256."""

    BOS = 256

    def ids(self, text):
        return list(text.encode("utf-8"))


class OracleModel:
    """
    Knows every example's right answer: within the current example (the text since the last blank
    line), it puts its confidence on each byte that continues a right answer's text, else predicts nothing.
    """

    vocab_size = 257

    def __init__(self, bundle_dir):
        self.next_bytes = {}
        for task in core_eval.load_core_tasks(bundle_dir):
            for ex in core_eval.load_task_data(task["data_path"]):
                text = core_eval.render_prompts(task["task_type"], ex, task["continuation_delimiter"], [])[-1 if
                    task["task_type"] == "language_modeling" else ex["gold"]].encode("utf-8")
                for i in range(len(text)):
                    self.next_bytes.setdefault(text[:i], set()).add(text[i])

    def __call__(self, idx):
        hits = []  # (row, position, byte) to make likely
        for b, row in enumerate(idx.tolist()):
            start = 1  # the current example's text starts after BOS, or after the last blank line
            for t in range(len(row)):
                if t > 0 and row[t] == ByteTokenizer.BOS:
                    break  # padding
                if t >= 2 and row[t - 1] == row[t] == ord("\n"):
                    start = t + 1
                hits += [(b, t, byte) for byte in self.next_bytes.get(bytes(row[start:t + 1]), ())]
        logits = torch.zeros(*idx.shape, self.vocab_size)
        logits[tuple(torch.tensor(hits).T)] = 20.0
        return logits


class RandomModel:
    vocab_size = 257

    def __init__(self):
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, idx):
        return torch.randn(*idx.shape, self.vocab_size, generator=self.generator)


@pytest.mark.quick
def test_builtin_bundle_scores_oracle_perfect_and_random_at_chance(builtin_bundle):
    oracle = core_eval.evaluate_core(OracleModel(builtin_bundle), ByteTokenizer(), "cpu", max_per_task=25,
                                     bundle_dir=builtin_bundle, verbose=False)
    assert set(oracle["results"].values()) == {1.0} and oracle["core_metric"] == pytest.approx(1.0)

    chance = core_eval.evaluate_core(RandomModel(), ByteTokenizer(), "cpu", max_per_task=150,
                                     bundle_dir=builtin_bundle, verbose=False)
    for task in core_eval.load_core_tasks(builtin_bundle):
        centered = chance["centered_results"][task["label"]]
        if task["task_type"] == "language_modeling":
            assert chance["results"][task["label"]] < 0.02, task["label"]  # exact answers are not guessed
        else:
            assert abs(centered) < 0.2, (task["label"], centered)  # 4 standard errors at 150 examples
    assert abs(chance["core_metric"]) < 0.1


# -----------------------------------------------------------------------------
# The real thing: a tiny GPT and the real BPE tokenizer on the built-in bundle of the tiny corpus's world


def tiny_real_gpt(vocab_size):
    """sequence_len 96 fits the 0-shot choice prompts whole, while the longest 3-shot letter_count prompts (up to
    ~140 tokens) get cropped."""
    return random_tiny_gpt(vocab_size, 96)


@pytest.fixture(scope="module")
def seed7_bundle(tmp_path_factory):
    """The built-in bundle about the world of seed 7, the seed of the tiny corpus; returns (folder, its tasks)."""
    bundle = tmp_path_factory.mktemp("seed7") / "eval_bundle_builtin"
    tasks = core_bundle.write_eval_bundle(bundle, world_mod.build_world(7), 7)
    return str(bundle), tasks


def bpe_tokenizer(tiny_base_dir):
    from nanochat.tokenizer import RustBPETokenizer

    return RustBPETokenizer.from_directory(os.path.join(tiny_base_dir, "tokenizer"))


def mean_losses_by_hand(model, rows, start):
    """Each row on its own (no batching, no padding): the mean negative log-likelihood of tokens start.. of it."""
    losses = []
    for row in rows:
        assert len(row) <= model.config.sequence_len  # no cropping to mirror
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([row])).double()[0], dim=-1)
        losses.append(-sum(logprobs[t - 1, row[t]].item() for t in range(start, len(row))) / (len(row) - start))
    return losses


def choice_verdict_by_hand(model, tokenizer, task_type, item):
    """
    Right or wrong, from the definition: render every candidate in full (0-shot, " " delimiter), score the tokens
    where the candidates differ (after their shared token prefix for multiple choice; their shared token suffix for
    schema), pick the lowest mean loss. Returns (verdict, gap between the best two mean losses).
    """
    bos = tokenizer.get_bos_token_id()
    if task_type == "multiple_choice":
        rows = [tokenizer.encode(f"{item['query']} {choice}", prepend=bos) for choice in item["choices"]]
        shared = 0
        while all(len(r) > shared + 1 and r[shared] == rows[0][shared] for r in rows):
            shared += 1
        losses = mean_losses_by_hand(model, rows, shared)
    else:
        rows = [tokenizer.encode(f"{option} {item['continuation']}", prepend=bos) for option in item["context_options"]]
        tail = 0
        while all(len(r) > tail + 1 and r[-1 - tail] == rows[0][-1 - tail] for r in rows):
            tail += 1
        assert tail >= 1
        losses = [mean_losses_by_hand(model, [row], len(row) - tail)[0] for row in rows]
    best = min(range(len(losses)), key=lambda i: losses[i])
    ranked = sorted(losses)
    return best == item["gold"], ranked[1] - ranked[0]


def exact_match_by_hand(model, tokenizer, context, delimiter, continuation):
    """language_modeling, 0-shot: greedy argmax must produce every token that carries a byte of the continuation."""
    ctx = context.strip()
    row = tokenizer.encode(ctx + delimiter + continuation, prepend=tokenizer.get_bos_token_id())
    with torch.no_grad():
        predicted = model(torch.tensor([row]))[0].argmax(dim=-1).tolist()
    end, scored = 0, []
    for t in range(1, len(row)):
        end += len(tokenizer.enc.decode_single_token_bytes(row[t]))
        if end > len(ctx.encode("utf-8")):
            scored.append(t)
    assert scored
    return all(predicted[t - 1] == row[t] for t in scored)


@pytest.mark.quick
def test_core_of_real_gpt_with_bpe_tokenizer(tiny_base_dir, seed7_bundle, single_torch_thread):
    """evaluate_core with the real model and tokenizer: every task scored, accuracies are counts out of K, centring
    follows each task's baseline, and the choice tasks' accuracies equal an independent scoring of the same examples."""
    bundle, tasks = seed7_bundle
    tokenizer = bpe_tokenizer(tiny_base_dir)
    model = tiny_real_gpt(tokenizer.get_vocab_size())
    K = 12
    out = core_eval.evaluate_core(model, tokenizer, "cpu", max_per_task=K, bundle_dir=bundle, verbose=False)

    assert set(out) == {"results", "centered_results", "core_metric"}
    assert list(out["results"]) == list(out["centered_results"]) == [t["label"] for t in tasks]
    for task in tasks:
        accuracy, baseline = out["results"][task["label"]], task["random_baseline"] / 100
        assert 0 <= accuracy <= 1 and accuracy * K == pytest.approx(round(accuracy * K))
        assert out["centered_results"][task["label"]] == pytest.approx((accuracy - baseline) / (1 - baseline))
    assert out["core_metric"] == pytest.approx(sum(out["centered_results"].values()) / len(tasks))

    # The same K examples evaluate_core took (a fixed shuffle, then the first K), scored independently.
    scored_by_hand = 0
    for task in tasks:
        if task["icl_task_type"] == "language_modeling":
            continue
        assert task["num_fewshot"] == 0 and task["continuation_delimiter"] == " "  # what the scoring above assumes
        data = [dict(example) for example in task["examples"]]
        random.Random(core_eval.TASK_SHUFFLE_SEED).shuffle(data)
        meta = {"task_type": task["icl_task_type"], "num_fewshot": 0, "continuation_delimiter": " "}
        correct = 0
        for idx in range(K):
            verdict, gap = choice_verdict_by_hand(model, tokenizer, task["icl_task_type"], data[idx])
            assert gap > 1e-4, (task["label"], idx)  # a clear winner: batching/padding noise cannot flip it
            assert core_eval.evaluate_example(model, tokenizer, data, idx, "cpu", meta) == verdict, (task["label"], idx)
            correct += verdict
        assert out["results"][task["label"]] == correct / K, task["label"]
        scored_by_hand += correct
    assert 0 < scored_by_hand < 5 * K  # neither all wrong nor all right, so the comparison can tell them apart


@pytest.mark.quick
def test_exact_match_of_real_gpt_with_bpe_tokenizer(tiny_base_dir, seed7_bundle, single_torch_thread):
    """language_modeling verdicts of evaluate_example equal an independent greedy check, on real examples (which a
    random model gets wrong), on the model's own greedy continuations (right) and on those spoiled after one token."""
    bundle, tasks = seed7_bundle
    tokenizer = bpe_tokenizer(tiny_base_dir)
    model = tiny_real_gpt(tokenizer.get_vocab_size())
    bos = tokenizer.get_bos_token_id()
    cases = []  # (example, delimiter)
    for task in tasks:
        if task["icl_task_type"] != "language_modeling":
            continue
        for example in task["examples"][:3]:
            cases.append((example, " "))
            prompt = tokenizer.encode(example["context"].strip(), prepend=bos)
            greedy = []
            with torch.no_grad():
                for _ in range(2):
                    greedy.append(int(model(torch.tensor([prompt + greedy]))[0, -1].argmax()))
            cases.append(({"context": example["context"], "continuation": tokenizer.decode(greedy)}, ""))
            cases.append(({"context": example["context"], "continuation": tokenizer.decode(greedy[:1]) + " zebra"}, ""))
    verdicts = []
    for example, delimiter in cases:
        meta = {"task_type": "language_modeling", "num_fewshot": 0, "continuation_delimiter": delimiter}
        expected = exact_match_by_hand(model, tokenizer, example["context"], delimiter, example["continuation"])
        assert core_eval.evaluate_example(model, tokenizer, [example], 0, "cpu", meta) == expected, example
        verdicts.append(expected)
    assert True in verdicts and False in verdicts
