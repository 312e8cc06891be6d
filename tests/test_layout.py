"""The repository's shape: one name for one thing across the library, tasks/ and scripts/; every `python -m` command
the README and docs/ name answers --help."""

import ast
import os
import re
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Names that are a convention, each defined in several modules on purpose; anything else defined twice is a collision.
SHARED_NAMES = {
    "main": "a script's or command's entry point",
    "parse_args": "a stage script's flags, one parser per script",
    "mixtures": "a chat stage script's (train, val) task mixtures: mid_train and chat_sft each have theirs",
    "conversation_from_row": "each hub task module's row -> conversation mapping (tasks/arc.py, gsm8k.py, ...)",
    "residual_mix": "model/cpu_ops.py's hand-written kernel carries the name of the gpt.py operation it computes",
    "rotary_norm": "model/cpu_ops.py's hand-written kernel carries the name of the gpt.py operation it computes",
}


def top_level_public_names(root):
    """{name: [path, ...]} of the public functions and classes defined at the top of each module under root."""
    names = defaultdict(list)
    for folder in ("nanochat", "tasks", "scripts"):
        for directory, subdirs, files in os.walk(os.path.join(root, folder)):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            for file in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(directory, file)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                for node in tree.body:
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                            and not node.name.startswith("_"):
                        names[node.name].append(os.path.relpath(path, root))
    return names


@pytest.mark.quick
def test_no_public_name_is_defined_twice_for_different_things():
    names = top_level_public_names(REPO_ROOT)
    duplicated = {name: paths for name, paths in names.items() if len(paths) > 1 and name not in SHARED_NAMES}
    assert not duplicated, "defined in more than one module (rename one, or add a convention to SHARED_NAMES): " + \
        "; ".join(f"{name} in {', '.join(paths)}" for name, paths in sorted(duplicated.items()))
    # a convention nobody follows any more is an entry to remove
    assert all(len(names.get(name, [])) > 1 for name in SHARED_NAMES), \
        [name for name in SHARED_NAMES if len(names.get(name, [])) < 2]


def documented_commands():
    """The modules that README.md and docs/*.md tell users to run with `python -m` (or torchrun's -m)."""
    pages = [os.path.join(REPO_ROOT, "README.md")] + sorted(
        os.path.join(REPO_ROOT, "docs", name) for name in os.listdir(os.path.join(REPO_ROOT, "docs"))
        if name.endswith(".md"))
    modules = set()
    for page in pages:
        with open(page, encoding="utf-8") as f:
            modules.update(re.findall(r"-m ((?:nanochat|scripts|bench|tasks)(?:\.\w+)*)\b", f.read()))
    return sorted(m for m in modules if not m.endswith((".NAME", ".STAGE")))  # placeholders in prose


def test_every_documented_command_answers_help():
    commands = documented_commands()
    assert {"nanochat.dataset", "nanochat.corpus", "nanochat.report", "scripts.base_train"} <= set(commands), commands
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def help_of(module):
        p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO_ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
        return module, p

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(help_of, commands))
    failed = [f"{module}: exit {p.returncode}: {(p.stderr or p.stdout).strip()[-300:]}" for module, p in results
              if p.returncode != 0 or "usage" not in p.stdout.lower()]
    assert not failed, "\n".join(failed)
