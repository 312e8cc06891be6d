#!/usr/bin/env bash
# The wheels a GPU machine without network needs beside the torch it already has (an image with torch, numpy,
# pyarrow, tiktoken, requests, psutil...): our tokenizer, chat_web's server, and torchao for gpu_check --suite's fp8
# comparison. Downloaded here for CPython 3.12 on x86-64 Linux, at the versions uv.lock pins, into one folder:
#
#   bash dev/offline_wheels.sh .whl        # then, on the GPU machine:
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# torchao is pinned to 0.17.0, the release built for torch 2.11 (its C++ extensions load only on >= 2.11; its float8
# training is Python over torch._scaled_mm either way).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.whl}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
mkdir -p "$OUT"
uv export --no-hashes --no-dev --frozen --format requirements-txt \
    | grep -iE '^(rustbpe|fastapi|starlette|pydantic|pydantic-core|annotated-types|annotated-doc|typing-inspection|typing-extensions|uvicorn)==' \
    | grep -v "< '3.11'" | sed 's/ ;.*//' > "$OUT/requirements.txt"
echo "torchao==0.17.0" >> "$OUT/requirements.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" -r "$OUT/requirements.txt"
echo "$(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1), in $OUT: $(tr '\n' ' ' < "$OUT/requirements.txt")"
