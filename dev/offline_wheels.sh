#!/usr/bin/env bash
# The wheels a GPU machine without network needs beside the torch it already has (dev/offline_wheels.py says which
# and why): our tokenizer, chat_web's server, bench serve's client and torchao, at uv.lock's versions, into one folder:
#
#   bash dev/offline_wheels.sh .whl        # then, on the GPU machine:
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.whl}
rm -f "$OUT"/*.whl  # two versions of one package stop the whole install there
uv run --frozen python dev/offline_wheels.py "$OUT"
# the system pip (a uv venv has none), for the GPU machine's CPython 3.12 on x86-64 Linux
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" -r "$OUT/requirements.txt"
echo "$(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1), in $OUT: $(tr '\n' ' ' < "$OUT/requirements.txt")"
