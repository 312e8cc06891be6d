#!/usr/bin/env bash
# The whole nanochat pipeline, start to finish.
#   bash speedrun.sh                  # CPU (no CUDA found): small preset on the built-in corpus, offline
#   NANOCHAT_RUN=d20 bash speedrun.sh # with a CUDA GPU node: the GPU recipe (needs network for data)
# Artifacts go to $NANOCHAT_BASE_DIR (default ~/.cache/nanochat).
set -euo pipefail
cd "$(dirname "$0")"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-}"
[ -z "$OMP_NUM_THREADS" ] && unset OMP_NUM_THREADS
RUN="${NANOCHAT_RUN:-dummy}"   # wandb run name; 'dummy' disables wandb

command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet uv
uv sync
PY="uv run python"

if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
    echo "== GPU preset: $NGPU GPU(s) =="
    export NANOCHAT_DATA_SOURCE="${NANOCHAT_DATA_SOURCE:-climbmix}"
    $PY -m nanochat.report reset
    # Eight shards for the tokenizer now; the rest of pretraining's data streams in while it trains.
    $PY -m nanochat.dataset -n 8
    $PY -m nanochat.dataset -n 240 &
    DATASET_PID=$!
    $PY -m scripts.tok_train --max-chars=2000000000 --vocab-size=32768
    $PY -m scripts.tok_eval
    wait $DATASET_PID
    TORCHRUN="uv run torchrun --standalone --nproc_per_node=$NGPU"
    $TORCHRUN -m scripts.base_train -- --depth=20 --target-param-data-ratio=20 --run="$RUN"
    $TORCHRUN -m scripts.base_loss
    $TORCHRUN -m scripts.base_eval
else
    echo "== CPU preset: built-in corpus, offline =="
    export NANOCHAT_DATA_SOURCE=builtin
    $PY -m nanochat.report reset
    $PY -m nanochat.corpus
    $PY -m scripts.tok_train --max-chars=20000000 --vocab-size=4096
    $PY -m scripts.tok_eval
    $PY -m scripts.base_train --depth=4 --max-seq-len=256 --device-batch-size=8 --total-batch-size=2048 \
        --num-iterations=700 --eval-every=100 --eval-tokens=32768 --core-metric-every=-1 --sample-every=350 \
        --save-every=100 --run="$RUN"
    $PY -m scripts.base_loss --device-batch-size=8 --split-tokens=65536
    $PY -m scripts.base_eval --eval-bundle=builtin
fi
$PY -m nanochat.report generate
