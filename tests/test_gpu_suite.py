"""
gpu_check --suite (bench/gpu_suite.py) scaled down on a CPU, as CI runs it: every section gives its rows: ours
against the reference (here: no checkout, and the row says how to get one), fp8 (ours emulated against bf16; torchao
skipped with its reason), a base_train whose val bpb falls, eager and captured decoding (the captured step run
eagerly, the same tokens), chat_web one at a time and batched, every stage for a few steps and chat_web answering on
their model; the rows go to a dated file under --results-dir and a JSON line. Bad --only / --suite-minutes are refused before any work.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from bench import gpu_suite

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def suite(base, args, timeout=900):
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base), NANOCHAT_DATA_SOURCE="builtin", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--suite", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_sections_and_deadlines_are_refused_before_any_work(tmp_path):
    p = suite(tmp_path, ["--only", "train,graphs"])
    assert p.returncode != 0 and "--only takes train,decode,fp8,run,serve,stages (got graphs)" in p.stderr
    p = suite(tmp_path, ["--suite-minutes", "0"])
    assert p.returncode != 0 and "--suite-minutes must be > 0" in p.stderr
    (tmp_path / "a_file").write_text("")
    p = suite(tmp_path, ["--results-dir", str(tmp_path / "a_file" / "results")])
    assert p.returncode != 0 and "cannot write the suite's results" in p.stderr
    os.remove(tmp_path / "a_file")
    assert os.listdir(tmp_path) == []


@pytest.mark.quick
def test_reference_checkout_is_found_or_explained(tmp_path):
    missing, how = gpu_suite.reference_checkout(str(tmp_path / "none"))
    assert missing is None and f"git clone {gpu_suite.REFERENCE_URL}" in how and gpu_suite.REFERENCE_COMMIT[:12] in how
    (tmp_path / "ref" / "nanochat").mkdir(parents=True)
    (tmp_path / "ref" / "nanochat" / "gpt.py").write_text("")
    (tmp_path / "ref" / "COMMIT").write_text(gpu_suite.REFERENCE_COMMIT + "\n")
    assert gpu_suite.reference_checkout(str(tmp_path / "ref")) == (str(tmp_path / "ref"), gpu_suite.REFERENCE_COMMIT)


@pytest.mark.quick
def test_the_offline_wheels_carry_every_package_the_server_and_its_client_import():
    """The GPU machine has torch but none of chat_web's stack: every distribution that importing the server, the
    tokenizer and bench serve's client loads must be among dev/offline_wheels.py's wheels (a hand-kept list missed
    fastapi 0.165's opentelemetry-api and the openai client, and a lease lost its chat_web rows)."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "dev"))
    try:
        import offline_wheels
    finally:
        sys.path.pop(0)
    carried = {line.split("==")[0].lower() for line in offline_wheels.requirements()}
    # the closure as the installed packages' own metadata states it (not uv.lock, which requirements() reads)
    from importlib import metadata
    from packaging.requirements import Requirement

    normalize = lambda name: re.sub(r"[-_.]+", "-", name).lower()
    needed, todo = set(), ["fastapi", "uvicorn", "openai", "rustbpe"]
    while todo:
        name = normalize(todo.pop())
        if name not in needed:
            needed.add(name)
            for line in metadata.requires(name) or []:
                requirement = Requirement(line)
                if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                    todo.append(requirement.name)
    assert "opentelemetry-api" in needed  # what fastapi 0.165 imports at start-up, as on the H100
    assert needed - carried == set()


@pytest.mark.slow  # ~3 minutes: compiled training runs, a 30-step base_train, four chat_web servers, every stage
def test_the_suite_scaled_down_gives_every_sections_rows(tmp_path):
    p = suite(tmp_path / "base", ["--suite-minutes", "14",
                                  "--reference", str(tmp_path / "no_reference"), "--results-dir", str(tmp_path / "results")])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])["gpu_suite"]
    rows = dict(result["rows"])
    ours = [r for name, r in rows.items() if re.match(r"d2 (bfloat16|float32) training", name) and "ours" in name]
    assert len(ours) == 1 and re.fullmatch(r"[\d,]+ tok/s, MFU [\d.]+ % \(data \d+ / forward \d+ / backward \d+ / "
                                           r"optimizer \d+ ms\)", ours[0]), ours
    reference = [r for name, r in rows.items() if "reference" in name]
    assert reference and reference[0].startswith("skipped: no reference checkout") and "git clone" in reference[0]
    fp8 = {name.split("(")[1].split(")")[0]: r for name, r in rows.items() if "fp8 training" in name}
    assert re.search(r"x bf16's [\d,]+, loss after 3 steps [\d.]+ vs [\d.]+ \([+-][\d.]+%\), [1-9]\d* linears in fp8",
                     fp8["ours"])
    assert fp8["torchao"].startswith("skipped: torchao's float8 training needs a CUDA GPU")
    run = [r for name, r in rows.items() if "base_train, 30 steps" in name]
    assert len(run) == 1 and "(falls)" in run[0], run
    decode = {name: r for name, r in rows.items() if "BatchEngine" in name}
    assert len(decode) == 4 and all("ms a step" in r for r in decode.values())
    captured = [r for name, r in decode.items() if name.endswith("captured")]
    assert all(re.search(r"the eager tokens in (\d+)/\1 rows \(ran eagerly: CUDA graphs need a GPU", r) for r in captured)
    # the control for a captured step's disagreement: eager decoding against itself at fewer rows (one CPU: the same)
    assert decode[next(name for name in decode if name.endswith("4 rows, eager"))].endswith(
        "the tokens eager decoding wrote with fewer rows in 1/1 rows of 1")
    serve = {name: r for name, r in rows.items() if name.startswith("chat_web (")}
    assert len(serve) == 6 and all(r.endswith("0 errors") or "0 errors;" in r for r in serve.values()), serve
    assert any("x one at a time" in r for r in serve.values())
    stages = [r for name, r in rows.items() if name.startswith("every stage")]
    assert len(stages) == 1 and all(f"{stage} " in stages[0] for stage in ("corpus", "tok_train", "base_train", "base_loss",
                                                                         "base_eval", "mid_train", "chat_sft", "chat_rl",
                                                                         "chat_eval")), stages
    assert rows["chat_web on the stages' RL model, one request"].startswith("200, a reply of")
    written = list((tmp_path / "results").iterdir())  # one dated file of this run's rows, BENCHMARKS.md untouched
    assert len(written) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\d_\d{6}_.+\.md", written[0].name), written
    table = [line for line in written[0].read_text().splitlines() if line.startswith("| 20")]
    assert len(table) == len(rows) and all("no CUDA" in line for line in table)
    assert not [r for r in rows.values() if r.startswith("failed")]
    assert {r for r in rows.values() if r.startswith("skipped")} == {reference[0], fp8["torchao"]}
