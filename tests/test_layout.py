"""The repository's shape: one name for one thing across the library, tasks/ and scripts/; every `python -m` command
the README and docs/ name answers --help; no function past 100 lines, and the library importing nothing that lives
beside it."""

import ast
import glob
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
    "residual_mix": "kernels/cpu.py's hand-written kernel carries the name of the gpt.py operation it computes",
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


@pytest.mark.slow  # 31 s: ~30 interpreters importing torch
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


@pytest.mark.quick
def test_functions_short_and_library_free_of_its_tools():
    """The house rules: no function anywhere runs past 100 lines (a stage script may be as long as its story), and the
    library never imports the measuring tools (bench/), the chat tasks (tasks/) or the scripts, which live beside it;
    only a documented command's forwarder (`python -m nanochat.dataset` runs scripts/dataset.py) imports its script."""
    root = REPO_ROOT
    broken = []
    for path in sorted(glob.glob(os.path.join(root, "scripts", "*.py")) + glob.glob(os.path.join(root, "tasks", "*.py")) +
                       glob.glob(os.path.join(root, "nanochat", "**", "*.py"), recursive=True)):
        with open(path) as f:
            source = f.read()
        name = os.path.relpath(path, root)
        tree = ast.parse(source)
        forwarders = [range(n.lineno, n.end_lineno + 1) for n in tree.body if isinstance(n, ast.If)
                      and ast.unparse(n.test) in ("__name__ == '__main__'", '__name__ == "__main__"')]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                broken.append(f"{name}: {node.name}() {node.end_lineno - node.lineno + 1} lines")
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if not (imported and name.startswith("nanochat")):
                continue
            in_forwarder = any(node.lineno in lines for lines in forwarders)
            beside = ("bench", "tasks") if in_forwarder else ("bench", "tasks", "scripts")
            if any(m.split(".")[0] in beside for m in imported):
                broken.append(f"{name}:{node.lineno} imports what lives beside the library ({', '.join(imported)})")
    assert not broken, broken


@pytest.mark.quick
def test_karpathy_nanochat_common_helpers_keep_their_names():
    """Scripts and notebooks written against karpathy/nanochat call these by name (autodetect_device_type in each of
    its stage scripts); a refactor that folds one away breaks them without any test of ours noticing."""
    import torch

    from nanochat import common

    for name in ("autodetect_device_type", "compute_init", "compute_cleanup", "get_base_dir", "get_dist_info", "print0"):
        assert callable(getattr(common, name, None)), name
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    expected = "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    assert common.autodetect_device_type() == common.resolve_device_type("") == expected
