"""
The torch APIs the project's code uses now and did not at the given commits: what a GPU lease's older torch (the image's
2.11 while uv.lock installs a newer one here) has not run yet, to check against that release before a lease.

    python dev/torch_api_diff.py 2fc4048 8e18ead e7bb7ed     # the commits the leases of 2026-11-27/28 ran

Reads bench/, nanochat/, scripts/ and tasks/ at HEAD and at each commit (git show, no checkout): every attribute chain
from torch or an alias of one of its modules (`import torch.nn.functional as F`, `from torch.x import y`), and each
keyword a call of such a chain passes. Methods called on tensors or modules are not followed (their receiver is no
torch name), so a new keyword on one of them goes unseen.
"""

import ast
import subprocess
import sys

FOLDERS = ("bench", "nanochat", "scripts", "tasks")


def uses(source):
    """{"torch.chain" or "torch.chain(keyword=)"} of one file's source."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    alias, found = {"torch": "torch"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                if name.name.split(".")[0] == "torch":
                    if name.asname:  # `import torch.x as y`; a plain `import torch.x` binds the name torch
                        alias[name.asname] = name.name
                    found.add(name.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for name in node.names:
                alias[name.asname or name.name] = f"{node.module}.{name.name}"
                found.add(f"{node.module}.{name.name}")

    def chain(node):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return ".".join([alias[node.id], *reversed(parts)]) if isinstance(node, ast.Name) and node.id in alias else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and chain(node):
            found.add(chain(node))
        elif isinstance(node, ast.Call) and chain(node.func):
            found.update(f"{chain(node.func)}({keyword.arg}=)" for keyword in node.keywords if keyword.arg)
    return found


def at(commit):
    """{use: [files]} over the project's code at `commit`."""
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit], capture_output=True, text=True,
                            check=True).stdout.split()
    found = {}
    for path in listed:
        if path.endswith(".py") and path.split("/")[0] in FOLDERS:
            source = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True).stdout
            for use in uses(source):
                found.setdefault(use, []).append(path)
    return found


def main(commits):
    before = set().union(*(at(commit) for commit in commits))
    for use, paths in sorted(at("HEAD").items()):
        if use not in before:
            print(f"{use}  ({', '.join(sorted(paths)[:3])})")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python dev/torch_api_diff.py COMMIT [COMMIT ...]  (commits whose code ran on the older torch)")
    main(sys.argv[1:])
