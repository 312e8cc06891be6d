"""
What a GPU lease carries, checked on the CPU before the lease (`python -m scripts.gpu_check --prepare-lease`): the
working tree (git's tracked files and the untracked ones it does not ignore) travels whole, and the ignored paths the
suite needs are named in the run's `carry`: 8 paths and 64 MiB in all, the tree included (the device tool's limits). The
dry run prints the size of each, refuses in one line past either limit or when a path the suite needs is missing or
wrong, and otherwise prints the carry list and the command to paste. With --reference-git it first writes the
reference as a `git archive` of REFERENCE_COMMIT with its COMMIT file (~1.1 MiB; a clone would carry its history too).
"""

import io
import os
import re
import shutil
import subprocess
import tarfile

MAX_BYTES, MAX_PATHS = 64 * 2**20, 8  # what one run of the device tool carries, the tree included
WHEELS, REFERENCE, CACHES = ".whl", ".reference", ".compile_cache"  # the ignored paths the suite reads, by name
INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
           f"{WHEELS}/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1")


def mib(size):
    return f"{size / 2**20:.1f} MiB"


def size_of(path):
    """(bytes, files) of a file or a folder's files, a link counted as the link (it travels as one)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_size, 1
    total = files = 0
    for folder, _, names in os.walk(path):
        for name in names:
            total += os.lstat(os.path.join(folder, name)).st_size
            files += 1
    return total, files


def tree_size(root):
    """(bytes, files) of what travels unnamed: git's tracked files and the untracked ones it does not ignore."""
    p = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                       capture_output=True, check=True)
    names = {name for name in p.stdout.decode().split("\0") if name}
    present = [os.path.join(root, name) for name in names if os.path.lexists(os.path.join(root, name))]
    return sum(os.lstat(path).st_size for path in present), len(present)


def reference_from_git(git_dir, target, commit):
    """`target` made anew from `git archive` of `commit` in the repository `git_dir` (a clone or a bare mirror of the
    reference), with a COMMIT file holding its full hash. Returns the hash."""
    full = subprocess.run(["git", "-C", git_dir, "rev-parse", "--verify", f"{commit}^{{commit}}"], capture_output=True,
                          text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", git_dir, "archive", "--format=tar", full], capture_output=True,
                             check=True).stdout
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")  # git's own archive, still kept to plain files inside target
    with open(os.path.join(target, "COMMIT"), "w") as f:
        f.write(full + "\n")
    return full


def wheel_problems(folder):
    """What is wrong with the wheels in `folder` against its requirements.txt (dev/offline_wheels.sh writes both): a
    requirement with no wheel, or a package with wheels of two versions (that stops the whole install)."""
    requirements = os.path.join(folder, "requirements.txt")
    if not os.path.isfile(requirements):
        return [f"{folder} has no requirements.txt: bash dev/offline_wheels.sh {WHEELS}"]
    normalize = lambda name: re.sub(r"[-_.]+", "_", name).lower()  # noqa: E731  (a wheel's file name spells it so)
    have = {}
    for name in os.listdir(folder):
        if name.endswith(".whl"):
            package, version = name.split("-")[:2]
            have.setdefault(normalize(package), set()).add(version)
    problems = [f"{package}: wheels of {len(versions)} versions ({', '.join(sorted(versions))})"
                for package, versions in have.items() if len(versions) > 1]
    with open(requirements) as f:
        for line in f.read().split():
            package, version = line.split("==")
            if version not in have.get(normalize(package), ()):
                problems.append(f"no wheel of {line} in {folder}: bash dev/offline_wheels.sh {WHEELS}")
    return problems


def check(root, carry, reference_commit):
    """The dry run: (lines to print, problems). carry: the ignored paths the run names, relative to `root`."""
    lines, problems = [], []
    tree, files = tree_size(root)
    sizes = [("the tree (tracked and unignored files)", tree, files, "")]
    for path in carry:
        full = os.path.join(root, path)
        if not os.path.lexists(full):
            if path == CACHES:
                lines.append(f"  {path}: none here (every compile starts cold); not carried")
            else:
                problems.append(f"{path} is missing")
            continue
        size, count = size_of(full)
        note = ""
        if path == WHEELS:
            problems += wheel_problems(full)
            note = f"{sum(name.endswith('.whl') for name in os.listdir(full))} wheels"
        elif path == REFERENCE:
            commit_file = os.path.join(full, "COMMIT")
            commit = open(commit_file).read().strip() if os.path.isfile(commit_file) else ""
            if commit != reference_commit or not os.path.isfile(os.path.join(full, "nanochat", "gpt.py")):
                problems.append(f"{path} is not the reference at {reference_commit[:7]} with its COMMIT: give "
                                f"--reference-git GIT_DIR (a clone or mirror of karpathy/nanochat)")
            if os.path.exists(os.path.join(full, ".git")):
                problems.append(f"{path} holds a .git (a clone's history): give --reference-git to write a git archive")
            note = f"karpathy/nanochat {commit[:7]}" if commit else ""
        elif path == CACHES:
            others = [name for name in os.listdir(full) if name != "compile_cache.tar.gz"]
            note = "compile_cache.tar.gz" + (f" and {len(others)} other files (they travel too)" if others else "")
        sizes.append((path, size, count, note))
    named = [path for path in carry if os.path.lexists(os.path.join(root, path))]
    total = sum(size for _, size, _, _ in sizes)
    width = max(len(name) for name, _, _, _ in sizes)
    lines = [f"  {name:<{width}}  {mib(size):>9}  {count:>5} files" + (f"  {note}" if note else "")
             for name, size, count, note in sizes] + lines
    lines.append(f"  {'total':<{width}}  {mib(total):>9}  of {mib(MAX_BYTES)}, {len(named)} carried paths of {MAX_PATHS}")
    if total > MAX_BYTES:
        largest = ", ".join(f"{name.split(' (')[0]} {mib(size)}" for name, size, _, _ in
                            sorted(sizes, key=lambda s: -s[1])[:3])
        problems.insert(0, f"{total:,} bytes would travel, more than {MAX_BYTES:,} ({mib(MAX_BYTES)}; the largest: "
                           f"{largest})")
    if len(carry) > MAX_PATHS:  # the tool refuses the run's carry list itself, whether or not each path is here
        problems.insert(0, f"{len(carry)} carried paths, more than {MAX_PATHS}")
    return lines, named, problems


def command(only, minutes, commit):
    """The lease's command, to paste: the wheels installed, then the suite, its compile caches in CACHES (a carried
    archive there is unpacked first; a later command on the warm machine finds them) and its files in $OUT."""
    return (f"{INSTALL} && python3 -m scripts.gpu_check --suite --only {only} --suite-minutes {minutes:g} "
            f"--compile-cache-dir {CACHES} --out-dir \"$OUT\" --commit {commit}")


def main(args, root, reference_commit, log=print):
    """gpu_check --prepare-lease: the reference written from --reference-git if given, the dry run, and the carry list
    and command when it passes. Returns whether it passed."""
    if args.reference_git:
        full = reference_from_git(args.reference_git, os.path.join(root, REFERENCE), reference_commit)
        log(f"{REFERENCE}: git archive of {full[:7]} from {args.reference_git}, with its COMMIT")
    carry = [path for path in args.carry.split(",") if path]
    lines, named, problems = check(root, carry, reference_commit)
    log(f"lease: what travels ({mib(MAX_BYTES)} and {MAX_PATHS} carried paths at most, the tree included)")
    for line in lines:
        log(line)
    if problems:
        log(f"lease: refused: {'; '.join(problems)}")
        return False
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True).stdout.strip()
    only = args.only or "train,fp8"
    log(f"lease: ready: carry {named!r}, timeout_s {round(60 * args.suite_minutes) + 30}, command:")
    log(command(only, args.suite_minutes, commit))
    if dirty:
        log(f"lease: note: the tree has changes not committed; the rows will name {commit}, which is not what runs")
    return True
