"""
The wheels a GPU machine without network needs beside its image's torch: what chat_web, the tokenizer, `bench serve`'s
clients (openai's, and httpx for its scoring and hostile modes) and gpu_check --suite's torchao comparison import, and
every package those import in turn, at uv.lock's versions, for CPython 3.12 on x86-64 Linux: this writes their
requirements.txt, dev/offline_wheels.sh downloads them:

    bash dev/offline_wheels.sh .whl        # runs this; then, on the GPU machine:
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

The dependencies are followed through uv.lock rather than listed by hand: a hand list missed opentelemetry-api when
fastapi 0.165 began importing it, and the H100 lease of 2026-11-28 lost its chat_web rows to that (and to the missing
openai client). torchao is pinned to 0.17.0, the release built for torch 2.11 (the image's); it is not in uv.lock.
"""

import os
import sys
import tomllib

from packaging.markers import Marker

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tokenizer, the server, bench serve's clients (openai's streams the chat requests; bench/serve.py calls httpx itself,
# which the image has at a version nobody here chose, and openai 3 no longer brings: it moved to httpx2)
ROOTS = ("rustbpe", "fastapi", "uvicorn", "openai", "httpx")
NOT_IN_LOCK = ("torchao==0.17.0",)
# What the suite imports and the GPU image already holds (its package list as read on a machine running it, 2026-11-17;
# the leases of 2026-11-27/28 ran the suite on them): torch and the packages built for it, and the scientific stack,
# too large to carry (pyarrow's wheel alone is ~40 MB of the 64 MiB a lease carries).
IMAGE_HOLDS = ("torch", "numpy", "pyarrow", "matplotlib", "psutil", "pyyaml", "requests", "urllib3", "filelock", "tqdm",
               "safetensors", "tiktoken")
# What the suite's code imports only in modes no lease runs, each inside the function that needs it: not carried.
NOT_ON_A_LEASE = {"lm-eval": "bench serve --lm-eval (lm-evaluation-harness and its datasets stack, hundreds of MB)",
                  "wandb": "base_train's --run, logging to wandb (a lease has no network)"}
# the GPU machine's interpreter, for uv.lock's markers
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name": "posix",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "extra": ""}


def applies(marker):
    return marker is None or Marker(marker).evaluate(TARGET)


def requirements(lock_path=os.path.join(REPO_ROOT, "uv.lock")):
    """["name==version", ...]: ROOTS and everything they depend on for TARGET, as uv.lock resolves it."""
    with open(lock_path, "rb") as f:
        packages = tomllib.load(f)["package"]
    by_name = {}  # name -> the lock entry resolved for TARGET (a name can have one entry per Python range)
    for package in packages:
        if any(applies(m) for m in package.get("resolution-markers", [None])):
            by_name.setdefault(package["name"], {})[package["version"]] = package
    pinned, todo = {}, [(name, None) for name in ROOTS]
    while todo:
        name, version = todo.pop()
        if name in pinned:
            continue
        versions = by_name.get(name)
        if not versions:
            raise SystemExit(f"{name} is not in {lock_path} for CPython 3.12 on Linux: run `uv lock`")
        entry = versions[version] if version in versions else next(iter(versions.values()))
        pinned[name] = entry["version"]
        todo += [(d["name"], d.get("version")) for d in entry.get("dependencies", []) if applies(d.get("marker"))]
    return [f"{name}=={version}" for name, version in sorted(pinned.items())] + list(NOT_IN_LOCK)


def main(out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "requirements.txt"), "w") as f:
        f.write("\n".join(requirements()) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".whl")
