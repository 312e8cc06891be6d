"""The repository's shape: a small core (nanochat's top-level files) that imports only itself, add-ons in folders that
the core never imports, no import circle; one name for one thing across the library, tasks/ and scripts/; every
`python -m` command the README and docs/ name answers --help; no function past 100 lines."""

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
def test_functions_short():
    """No function anywhere runs past 100 lines (a stage script may be as long as its story, its functions not)."""
    broken = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "scripts", "*.py")) +
                       glob.glob(os.path.join(REPO_ROOT, "tasks", "*.py")) +
                       glob.glob(os.path.join(REPO_ROOT, "nanochat", "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                broken.append(f"{os.path.relpath(path, REPO_ROOT)}: {node.name}() {node.end_lineno - node.lineno + 1} lines")
    assert not broken, broken


PROJECT_FOLDERS = ("nanochat", "scripts", "tasks", "bench")


def project_modules(root=REPO_ROOT):
    """{module name: path} of every module of the project's folders (a package by its __init__'s name)."""
    modules = {}
    for folder in PROJECT_FOLDERS:
        for path in glob.glob(os.path.join(root, folder, "**", "*.py"), recursive=True):
            name = ".".join(os.path.relpath(path, root)[:-3].split(os.sep))
            modules[name.removesuffix(".__init__")] = path
    return modules


def import_graph(root=REPO_ROOT):
    """{module: {(imported module, line)}} over every import of the project's modules, those inside functions too,
    each resolved to the project module it names (`from nanochat import gpt` -> nanochat.gpt)."""
    modules = project_modules(root)

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in {resolve(name) for name in names} - {None, module}:
                if not (path.endswith("__init__.py") and target.startswith(module + ".")):
                    edges.add((target, node.lineno))
        graph[module] = edges
    return graph


def is_core(module):
    """The core: nanochat's top-level files; an add-on: a folder of nanochat/."""
    return module.startswith("nanochat.") and module.count(".") == 1 and \
        os.path.isfile(os.path.join(REPO_ROOT, "nanochat", module.split(".")[1] + ".py"))


def import_circles(graph):
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def layering_offenders(graph):
    """Every import against the layers, named: a core module importing anything of nanochat/ outside the core (an
    add-on), and anything in nanochat/ importing scripts/, tasks/ or bench/, which live beside the library."""
    offenders = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges):
            if is_core(module) and target.startswith("nanochat.") and not is_core(target):
                offenders.append(f"{module} (core) imports the add-on {target} (line {line})")
            if module.startswith("nanochat.") and target.split(".")[0] in ("scripts", "tasks", "bench"):
                offenders.append(f"{module} imports {target}, which lives beside the library (line {line})")
    return offenders


@pytest.mark.quick
def test_the_core_imports_only_itself_the_library_nothing_beside_it_and_no_import_runs_in_a_circle(tmp_path):
    graph = import_graph()
    assert {"nanochat.gpt", "nanochat.engine", "nanochat.loop", "scripts.base_train"} <= set(graph)
    assert is_core("nanochat.gpt") and not is_core("nanochat.serving.serve") and not is_core("scripts.base_train")
    circles = import_circles(graph)
    assert not circles, "import circles: " + "; ".join(" -> ".join(group) for group in circles)
    offenders = layering_offenders(graph)
    assert not offenders, "\n".join(offenders)
    # the walk sees what it must: an import inside a function, relative and package imports, in a copy of the tree
    for folder in ("nanochat/serving", "scripts"):
        os.makedirs(tmp_path / folder)
    (tmp_path / "nanochat" / "gpt.py").write_text("def f():\n    from .serving import serve\n")
    (tmp_path / "nanochat" / "engine.py").write_text("import nanochat.gpt\n")
    (tmp_path / "nanochat" / "serving" / "__init__.py").write_text("")
    (tmp_path / "nanochat" / "serving" / "serve.py").write_text("from nanochat import engine\nimport scripts.tool\n")
    (tmp_path / "scripts" / "tool.py").write_text("import os\n")
    planted = import_graph(tmp_path)
    assert ("nanochat.serving.serve", 2) in planted["nanochat.gpt"] and ("nanochat.gpt", 1) in planted["nanochat.engine"]
    assert import_circles(planted) == [["nanochat.engine", "nanochat.gpt", "nanochat.serving.serve"]]
    assert layering_offenders(planted) == [
        "nanochat.gpt (core) imports the add-on nanochat.serving (line 2)",
        "nanochat.gpt (core) imports the add-on nanochat.serving.serve (line 2)",
        "nanochat.serving.serve imports scripts.tool, which lives beside the library (line 2)"]


CORE_LINES, CORE_FILE_LINES = 7500, 800  # nanochat's top-level files together, and each


@pytest.mark.quick
def test_the_core_is_small_enough_to_read_in_a_sitting():
    """The core within CORE_LINES lines, no file over CORE_FILE_LINES; base_train within 400, so that its loop is the
    step a reader points at."""
    sizes = {}
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "nanochat", "*.py"))):
        with open(path, encoding="utf-8") as f:
            sizes[os.path.basename(path)] = len(f.read().splitlines())
    assert {"gpt.py", "engine.py", "optim.py", "loop.py", "tokenizer.py", "dataloader.py"} <= set(sizes)
    assert sum(sizes.values()) <= CORE_LINES, f"the core is {sum(sizes.values()):,} lines: {sizes}"
    assert all(lines <= CORE_FILE_LINES for lines in sizes.values()), \
        {name: lines for name, lines in sizes.items() if lines > CORE_FILE_LINES}
    with open(os.path.join(REPO_ROOT, "scripts", "base_train.py"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 400


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


@pytest.mark.quick
def test_the_backward_pass_is_written_once_in_the_core_and_the_scripts():
    """Every stage's step is loop.train_step: a second `.backward()` in the core or a script is a second step."""
    calls = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "nanochat", "*.py")) +
                       glob.glob(os.path.join(REPO_ROOT, "scripts", "*.py"))):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        calls += [f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward"]
    assert len(calls) == 1 and calls[0].startswith("nanochat/loop.py:"), calls
