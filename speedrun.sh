#!/usr/bin/env bash
# The whole nanochat pipeline, from raw text to a model you can chat with.
#
#   bash speedrun.sh                      # picks the preset from the hardware: gpu with CUDA, else cpu
#   NANOCHAT_PRESET=cpu bash speedrun.sh  # force a preset (gpu | cpu)
#   NANOCHAT_RUN=d24 bash speedrun.sh     # also log the training stages to wandb under this run name
#   DRY_RUN=1 bash speedrun.sh            # print every command with its flags, run none
#   FORCE=1 bash speedrun.sh              # redo every stage, even finished ones
#   NANOCHAT_RL=0|1 bash speedrun.sh      # skip or run chat_rl (default: on for gpu, off for cpu, where it does not pay)
#   NANOCHAT_SEED=43 bash speedrun.sh     # another initialisation of the base model
#   NANOCHAT_COMPONENTS=none bash speedrun.sh  # base_train --components: 'none' = the plain recipe, or a list
#                                              # (default: base_train's, docs/pretraining.md "Recipe components")
#   NANOCHAT_DEVICE_BATCH=8 bash speedrun.sh   # gpu preset: rows per GPU per micro-step (default 16; less memory, same run)
#   NANOCHAT_DATA_SOURCE=mine bash speedrun.sh  # pretrain on your own text, imported first with
#                                               # python -m nanochat.dataset import mine FILES... (docs/data.md)
#   NANOCHAT_TIME_BUDGET=5m bash speedrun.sh    # the whole pipeline in 5 minutes, planned at the start for the best
#                                               # chat model here; too short a budget is refused (docs/time_budget.md)
#   NANOCHAT_PYTHON=python3 bash speedrun.sh    # run in this Python's environment as it is, without uv (a cluster's
#                                               # image with torch and the project's packages already installed)
#
# Run it again after a crash or a kill: finished stages are skipped (their checkpoint or report section is
# there) and a killed training stage resumes from its last checkpoint. Artifacts go to $NANOCHAT_BASE_DIR
# (default ~/.cache/nanochat); the report card to report.md here and in $NANOCHAT_BASE_DIR/report/.
set -euo pipefail
cd "$(dirname "$0")"

START_TIME=$(date +%s)
RUN="${NANOCHAT_RUN:-dummy}"
SEED="${NANOCHAT_SEED:-42}"  # the base model's initialisation
COMPONENTS="${NANOCHAT_COMPONENTS:-}"  # the base model's recipe components; empty = base_train's default
DRY_RUN="${DRY_RUN:-0}"
FORCE="${FORCE:-0}"
BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
export NANOCHAT_BASE_DIR="$BASE_DIR"

if [ -z "${NANOCHAT_PYTHON:-}" ] && [ "$DRY_RUN" != 1 ]; then
    command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet uv
    uv sync --quiet
fi
PY="${NANOCHAT_PYTHON:-uv run --no-sync python}"
if [ -n "${NANOCHAT_PYTHON:-}" ] && [ "$DRY_RUN" != 1 ] && ! $PY -c "import torch, nanochat" >/dev/null 2>&1; then
    echo "NANOCHAT_PYTHON=$NANOCHAT_PYTHON cannot import torch and nanochat here: give a Python whose environment has" \
         "the project's packages, or unset it to run with uv" >&2
    exit 1
fi
TORCHRUN=$([ -n "${NANOCHAT_PYTHON:-}" ] && echo "$PY -m torch.distributed.run" || echo "uv run --no-sync torchrun")

BUDGET="${NANOCHAT_TIME_BUDGET:-}"  # empty: the presets' fixed sizes
if [ -n "$BUDGET" ]; then
    if [ "$DRY_RUN" = 1 ] && [ -z "${NANOCHAT_PYTHON:-}" ] && ! command -v uv >/dev/null 2>&1; then BUDGET_SECONDS=1800; BUDGET_LABEL=$BUDGET
    else read -r BUDGET_SECONDS BUDGET_LABEL < <($PY -m scripts.speedrun_plan budget "$BUDGET" || echo "0 -")
    fi
    [ "$BUDGET_SECONDS" -gt 0 ] || exit 1
    DEADLINE=$((START_TIME + BUDGET_SECONDS))
fi

# -----------------------------------------------------------------------------
# The preset: the hardware decides unless NANOCHAT_PRESET does

NGPU="${NANOCHAT_NGPU:-}"
if [ -z "$NGPU" ]; then
    if [ "$DRY_RUN" = 1 ] && [ -z "${NANOCHAT_PYTHON:-}" ] && ! command -v uv >/dev/null 2>&1; then NGPU=0
    else NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
    fi
fi
PRESET="${NANOCHAT_PRESET:-$([ "$NGPU" -gt 0 ] && echo gpu || echo cpu)}"
if [ "$PRESET" = gpu ] && [ "$NGPU" -lt 1 ]; then
    echo "NANOCHAT_PRESET=gpu but no CUDA GPU is visible; drop it to run the cpu preset" >&2
    exit 1
fi
if [ "$PRESET" != gpu ] && [ "$PRESET" != cpu ]; then
    echo "NANOCHAT_PRESET must be gpu or cpu (got $PRESET)" >&2
    exit 1
fi

if [ "$PRESET" = gpu ]; then
    # GPT-2 grade in a few hours on one 8xH100 node, every number scaled from the reasoning here:
    # - depth 24: n_embd 1536, 12 heads, ~730M parameters that cost FLOPs (the reference reaches CORE ~0.26 there),
    #   plus base_train's default components: 12 value-embedding tables, 0.6B parameters that cost memory, not FLOPs.
    # - 10 tokens per parameter (--target-param-data-ratio): ~7.3B tokens, ~14,000 steps of 2^19 tokens.
    # - 150 climbmix shards (~60M tokens each, ~9B tokens) cover the budget without repeating data; 8 go first
    #   for the tokenizer, the rest download in the background while it trains.
    # - device batch 16 x 2048 tokens fits an 80 GB H100 at d24 in bf16 with the value embeddings (gpu_check measured
    #   a 68.8 GiB peak on an H100 and an H200; 32 does not fit); gradient accumulation makes up the 2^19-token batch on any GPU count:
    #   2^19 / (16 x 2048 x NGPU) = 16 / NGPU micro-steps (exact for 1, 2, 4, 8).
    #   A GPU with less memory takes a smaller NANOCHAT_DEVICE_BATCH (python -m scripts.gpu_check says which fits);
    #   the global batch, and so the run, stays the same.
    export NANOCHAT_DATA_SOURCE="${NANOCHAT_DATA_SOURCE:-climbmix}"
    DEPTH=24; TAG=d24; DEVICE_BATCH="${NANOCHAT_DEVICE_BATCH:-16}"; SHARDS=150
    if ! [[ "$DEVICE_BATCH" =~ ^[1-9][0-9]*$ ]] || [ $((256 % DEVICE_BATCH)) -ne 0 ]; then
        echo "NANOCHAT_DEVICE_BATCH must divide 256, the rows of 2048 tokens in a 2^19-token batch (got $DEVICE_BATCH)" >&2
        exit 1
    fi
    if [ $((256 % (DEVICE_BATCH * NGPU))) -ne 0 ]; then
        echo "the gpu preset needs 1, 2, 4, 8 or 16 GPUs for an exact 2^19-token batch at device batch 16 (found $NGPU;" \
             "device batch $DEVICE_BATCH x $NGPU GPUs must divide 256)" >&2
        exit 1
    fi
    LAUNCH="$TORCHRUN --standalone --nproc_per_node=$NGPU -m"
    SEP="--"  # torchrun hands what follows to the stage untouched (without it, it took --run=... for its --run-path)
    TOK_FLAGS="--max-chars=2000000000 --vocab-size=32768"
    # The record's schedule: the lr falls over the last 65 % of the steps to 5 % of its peak (karpathy/nanochat's default
    # since its d24-d26 runs); here it helped at d4 and d6 on Brown, both seeds beyond their spread (BENCHMARKS.md
    # "Recipe components"). The cpu preset keeps base_train's own (0.4 to 0): its laws and figures were fitted to it, and
    # there the warmdown made a better base model but no better chat model over two seeds (dev/LOG.md, 2026-12-06).
    SCHEDULE_FLAGS="--warmdown-ratio=0.65 --final-lr-frac=0.05"
    BASE_FLAGS="--depth=$DEPTH --target-param-data-ratio=10 --device-batch-size=$DEVICE_BATCH $SCHEDULE_FLAGS --save-every=1000 \
--eval-bundle=dclm"
    LOSS_FLAGS="--device-batch-size=$DEVICE_BATCH"
    EVAL_FLAGS="--max-per-task=500"
    MID_STEPS=-1; MID_FLAGS="--device-batch-size=$DEVICE_BATCH --save-every=500"
    SFT_STEPS=-1; SFT_FLAGS="--device-batch-size=4 --save-every=200"
    RL_STEPS=-1; RL_FLAGS="--save-every=60"
    CHAT_EVAL_FLAGS="-x 500"
    BASE_CHAT_EVAL=""  # the built-in world's fact completion means nothing for a model of web text
    RUN_RL="${NANOCHAT_RL:-1}"  # GSM8K rewards what SFT leaves unsolved
else
    # The cpu preset: the built-in corpus about an invented world, no network, the whole pipeline in
    # about 5 minutes on 2 cores; the model is small but visibly learns its world (docs/speedrun.md: "The CPU preset").
    export NANOCHAT_DATA_SOURCE="${NANOCHAT_DATA_SOURCE:-builtin}"
    SHARDS=8  # only if NANOCHAT_DATA_SOURCE names a hub source
    DEPTH=4; TAG=d4
    LAUNCH="$PY -m"; SEP=""
    TOK_FLAGS="--max-chars=20000000 --vocab-size=4096"
    BASE_FLAGS="--depth=4 --max-seq-len=256 --device-batch-size=8 --total-batch-size=2048 --num-iterations=700 \
--eval-every=100 --eval-tokens=32768 --core-metric-every=-1 --sample-every=350 --save-every=100"
    LOSS_FLAGS="--device-batch-size=8 --split-tokens=65536"
    EVAL_FLAGS="--eval-bundle=builtin --max-per-task=100"
    # Mid-training and SFT at a fraction of the base lrs: at the full lrs, 120 steps of conversations about the SFT
    # subjects overwrite what pretraining taught about the held-out ones (held-out QA 21-34 % after SFT). A short,
    # gentle mid-training (60 steps at 0.05) then 300 SFT steps at 0.1 did best over seeds 42-44 (docs/speedrun.md
    # "The CPU preset").
    MID_STEPS=60; MID_FLAGS="--device-batch-size=8 --total-batch-size=4096 --init-lr-frac=0.05 --save-every=30 --eval-steps=4"
    SFT_STEPS=300; SFT_FLAGS="--device-batch-size=16 --total-batch-size=32 --init-lr-frac=0.1 --save-every=100"
    RL_STEPS=30; RL_FLAGS="--total-batch-size=8 --num-samples=8 --device-batch-size=16 --max-new-tokens=48 --save-every=10 \
--eval-every=15 --eval-problems=64"
    CHAT_EVAL_FLAGS="-x 200 --max-new-tokens=48"
    BASE_CHAT_EVAL="WorldFacts"  # the base model completing facts in the wordings it read
    # RL does not pay here: SFT already solves 98 % of the built-in arithmetic, and 30 steps on the spelling task moved
    # nothing measurable (docs/speedrun.md). NANOCHAT_RL=1 runs it anyway.
    RUN_RL="${NANOCHAT_RL:-0}"
fi

if [ -n "$BUDGET" ]; then
    # One plan for the whole pipeline (nanochat/planning/pipeline_plan.py): it measures this machine, then gives every stage
    # its seconds or steps and decides which evaluations run; each stage asks for its flags as it starts, so a stage
    # that ran long takes from the ones after it. The models are tagged with the budget.
    TAG="budget-$BUDGET_LABEL"
    # ~60M tokens a climbmix shard, and about one GPU-minute of training at small depths to read one
    [ "$PRESET" = gpu ] && SHARDS=$(( NGPU * BUDGET_SECONDS / 60 + 8 < 150 ? NGPU * BUDGET_SECONDS / 60 + 8 : 150 ))
    # base_train: on a CPU the preset's model (d4, 256 wide), its tokens from the budget; on a GPU its own law's depth
    BASE_FLAGS=$([ "$PRESET" = gpu ] && echo "$SCHEDULE_FLAGS --save-every=1000 ${NANOCHAT_DEVICE_BATCH:+--device-batch-size=$DEVICE_BATCH}" \
        || echo "--depth=4 --aspect-ratio=64 --head-dim=128 --max-seq-len=256 --device-batch-size=8 --total-batch-size=2048 \
--eval-tokens=32768 --eval-every=-1 --save-every=200")
    [ "$PRESET" = cpu ] && LOSS_FLAGS="--device-batch-size=8 --split-tokens=16384"  # a quarter of the preset's
    MID_STEPS=""; SFT_STEPS=""; RL_STEPS=""
fi

# The pretraining text: the preset's default, or NANOCHAT_DATA_SOURCE (hub, built-in, brown, or your own import)
SOURCE="$NANOCHAT_DATA_SOURCE"
DEFAULT_SOURCE=$([ "$PRESET" = gpu ] && echo climbmix || echo builtin)
case "$SOURCE" in
    climbmix|fineweb-edu) SOURCE_KIND=hub ;;
    builtin|brown) SOURCE_KIND=$SOURCE ;;
    *)
        SOURCE_KIND=imported
        if [ "$DRY_RUN" != 1 ] && [ ! -f "$BASE_DIR/base_data/$SOURCE/import.json" ]; then
            echo "NANOCHAT_DATA_SOURCE=$SOURCE is not a source in $BASE_DIR/base_data: import your text first with" \
                 "python -m nanochat.dataset import $SOURCE FILES_OR_FOLDERS... (docs/data.md)" >&2
            exit 1
        fi ;;
esac
if [ "$SOURCE" != builtin ]; then
    BASE_CHAT_EVAL=""  # the built-in world's fact completion means nothing for a model of other text
fi
if [ "$PRESET" = gpu ] && [ "$SOURCE" = builtin ]; then
    # CORE on the built-in world's tasks: offline, as the rest of a built-in run (the published bundle is a download)
    EVAL_FLAGS="$EVAL_FLAGS --eval-bundle=builtin"
    BASE_FLAGS="${BASE_FLAGS/--eval-bundle=dclm/--eval-bundle=builtin}"
fi

# -----------------------------------------------------------------------------
# Running stages: skip what is finished, resume what was killed

plan_flags() {  # plan_flags STAGE: its flags from the budget's plan as it starts (nothing without a budget)
    [ -z "$BUDGET" ] && return
    $PY -m scripts.speedrun_plan flags "$1" --plan-file "$PLAN_FILE"
}

plan_runs() {  # plan_runs STAGE: does the budget's plan run this evaluation? (always, without a budget)
    [ -z "$BUDGET" ] && return 0
    [[ "$(plan_flags "$1")" != skip:* ]]
}

say() { echo "== $* ==" ; }

report_has() { [ -f "$BASE_DIR/report/$1.md" ]; }

has_checkpoint() { ls "$BASE_DIR/$1/$TAG"/step_*/meta.json >/dev/null 2>&1; }

finished() {  # finished STAGE_DIR: did the stage's latest checkpoint complete its run? (the loop records it in meta.json)
    local latest
    latest=$(ls -d "$BASE_DIR/$1/$TAG"/step_* 2>/dev/null | sort | tail -n 1)
    [ -n "$latest" ] && grep -q '"finished": true' "$latest/meta.json" 2>/dev/null
}

stage() {  # stage NAME DONE_TEST COMMAND...: run COMMAND unless DONE_TEST says the stage is finished
    local name=$1 done_test=$2
    shift 2
    if [ "$DRY_RUN" = 1 ]; then
        echo "$*"
        return
    fi
    if [ "$FORCE" != 1 ] && eval "$done_test"; then
        say "$name: done already, skipping (FORCE=1 redoes it)"
        return
    fi
    say "$name"
    local t0=$SECONDS
    "$@"
    say "$name: $((SECONDS - t0))s"
    echo "$name $((SECONDS - t0))" >> "$BASE_DIR/speedrun_times.txt"
}

train_stage() {  # train_stage NAME STAGE_DIR SECTION COMMAND...: fresh, resumed after a kill, or skipped when finished
    # Finished means the last checkpoint completed the run AND the stage wrote its report section: a kill during the
    # final evaluation leaves a finished checkpoint without a section, and --resume then redoes only that evaluation.
    local name=$1 stage_dir=$2 section=$3
    shift 3
    local resume=""
    if [ "$DRY_RUN" != 1 ] && [ "$FORCE" != 1 ] && has_checkpoint "$stage_dir" \
        && ! { finished "$stage_dir" && report_has "$section"; }; then
        resume="--resume"
    fi
    if [ "$DRY_RUN" != 1 ] && [ "$FORCE" = 1 ]; then
        rm -rf "${BASE_DIR:?}/$stage_dir/$TAG"
    fi
    stage "$name" "finished $stage_dir && report_has $section" "$@" $resume
}

# -----------------------------------------------------------------------------
# The pipeline

echo "speedrun: preset $PRESET, $NGPU GPU(s), base dir $BASE_DIR, wandb run $RUN${BUDGET:+, time budget $BUDGET_LABEL (ends by $(date -d @"$DEADLINE" +%H:%M:%S))}"

if [ -n "$COMPONENTS" ] && { [ "$DRY_RUN" != 1 ] || [ -n "${NANOCHAT_PYTHON:-}" ] || command -v uv >/dev/null 2>&1; }; then
    # a typo fails here, not in base_train after the data stages, with the base dir's signature recording it
    $PY -c "import sys
from nanochat.common import UserError
from nanochat.recipe import canonical_components
try: canonical_components(sys.argv[1])
except UserError as e: sys.exit(f'NANOCHAT_COMPONENTS: {e}')" "$COMPONENTS" || exit 1
fi
if [ "$DRY_RUN" = 1 ]; then
    echo "export NANOCHAT_BASE_DIR=$BASE_DIR NANOCHAT_DATA_SOURCE=$NANOCHAT_DATA_SOURCE"
else
    mkdir -p "$BASE_DIR"
    # A base dir holds one speedrun: continuing it with another preset or seed would mix their stages silently.
    SIGNATURE="preset=$PRESET seed=$SEED"  # RL may be added later: it only appends stages
    if [ -n "$BUDGET" ]; then SIGNATURE="$SIGNATURE budget=$BUDGET_LABEL"; fi
    if [ "$SOURCE" != "$DEFAULT_SOURCE" ]; then SIGNATURE="$SIGNATURE source=$SOURCE"; fi
    if [ -n "$COMPONENTS" ]; then SIGNATURE="$SIGNATURE components=$COMPONENTS"; fi
    if [ "$FORCE" != 1 ] && [ -f "$BASE_DIR/speedrun_config.txt" ] && [ "$(cat "$BASE_DIR/speedrun_config.txt")" != "$SIGNATURE" ]; then
        echo "$BASE_DIR holds a speedrun with $(cat "$BASE_DIR/speedrun_config.txt"), not $SIGNATURE: rerun with those" \
             "settings to continue it, FORCE=1 to redo everything here, or point NANOCHAT_BASE_DIR elsewhere" >&2
        exit 1
    fi
fi
if [ -n "$BUDGET" ]; then
    # the plan, before any stage: a budget too short for a chat model that answers is refused here, in one line
    PLAN_FILE=$([ "$DRY_RUN" = 1 ] && mktemp -u /tmp/nanochat_plan_XXXXXX.json || echo "$BASE_DIR/speedrun_plan.json")
    $PY -m scripts.speedrun_plan plan "$BUDGET" --preset "$PRESET" --started-at "$START_TIME" --data-source "$SOURCE_KIND" \
        --gpus "$NGPU" --rl "$([ -z "${NANOCHAT_RL:-}" ] && [ "$RUN_RL" = 1 ] && echo auto || echo "$RUN_RL")" \
        --base-chat-eval "$([ -n "$BASE_CHAT_EVAL" ] && echo 1 || echo 0)" --plan-file "$PLAN_FILE" \
        $([ "$DRY_RUN" = 1 ] && echo --dry-run) $([ "$FORCE" = 1 ] && echo --fresh) || exit 1
fi
[ "$DRY_RUN" != 1 ] && echo "$SIGNATURE" > "$BASE_DIR/speedrun_config.txt"
if [ "$DRY_RUN" != 1 ] && { [ "$FORCE" = 1 ] || [ ! -f "$BASE_DIR/report/header.json" ]; }; then
    $PY -m nanochat.report reset
    rm -f "$BASE_DIR/speedrun_times.txt"
fi

if [ "$SOURCE_KIND" = hub ]; then
    stage "data: first shards" "false" $PY -m nanochat.dataset -n 8
    if [ "$DRY_RUN" = 1 ]; then echo "$PY -m nanochat.dataset -n $SHARDS &"
    else
        $PY -m nanochat.dataset -n $SHARDS > "$BASE_DIR/dataset_download.log" 2>&1 & DATASET_PID=$!
        trap 'kill $DATASET_PID 2>/dev/null || true' EXIT  # a failed stage must not leave the download running
    fi
elif [ "$SOURCE_KIND" = builtin ]; then
    stage "data: built-in corpus" "[ -f '$BASE_DIR/base_data/builtin/corpus.json' ]" $PY -m nanochat.corpus
elif [ "$SOURCE_KIND" = brown ]; then
    stage "data: the Brown corpus" "[ -f '$BASE_DIR/base_data/brown/import.json' ]" $PY -m scripts.brown
else
    say "data: your source $SOURCE, imported into $BASE_DIR/base_data/$SOURCE"
fi
stage "tokenizer: train" "[ -f '$BASE_DIR/tokenizer/tokenizer.json' ] && report_has tokenizer-training" $PY -m scripts.tok_train $TOK_FLAGS
plan_runs tok_eval && stage "tokenizer: eval" "report_has tokenizer-evaluation" $PY -m scripts.tok_eval
if [ "$SOURCE_KIND" = hub ] && [ "$DRY_RUN" != 1 ]; then
    say "waiting for the shard download (log: $BASE_DIR/dataset_download.log)"
    wait "$DATASET_PID"
fi

train_stage "base_train" base_checkpoints base-model-training \
    $LAUNCH scripts.base_train $SEP $BASE_FLAGS $(plan_flags base_train) --model-tag=$TAG --seed=$SEED \
    ${COMPONENTS:+--components=$COMPONENTS} --run="$RUN"
plan_runs base_loss && stage "base_loss" "report_has base-model-loss" $LAUNCH scripts.base_loss $SEP $LOSS_FLAGS --model-tag=$TAG
plan_runs base_eval && stage "base_eval" "report_has base-model-evaluation" $LAUNCH scripts.base_eval $SEP $EVAL_FLAGS --model-tag=$TAG
if [ -n "$BASE_CHAT_EVAL" ] && plan_runs "chat_eval base"; then
    stage "chat_eval base" "report_has chat-evaluation-base" \
        $LAUNCH scripts.chat_eval $SEP -i base -g $TAG -a $BASE_CHAT_EVAL $CHAT_EVAL_FLAGS
fi

MID_PLAN=$(plan_flags mid_train)  # a budget can give mid_train's time to base_train: chat_sft then starts from base
if [[ "$MID_PLAN" != skip:* ]]; then
    train_stage "mid_train" mid_checkpoints midtraining \
        $LAUNCH scripts.mid_train $SEP -g $TAG ${MID_STEPS:+--num-iterations=$MID_STEPS} $MID_PLAN $MID_FLAGS --run="$RUN"
    plan_runs "chat_eval mid" && stage "chat_eval mid" "report_has chat-evaluation-mid" $LAUNCH scripts.chat_eval $SEP -i mid -g $TAG $CHAT_EVAL_FLAGS
fi
train_stage "chat_sft" chatsft_checkpoints chat-sft \
    $LAUNCH scripts.chat_sft $SEP -g $TAG ${SFT_STEPS:+--num-iterations=$SFT_STEPS} $(plan_flags chat_sft) $SFT_FLAGS --run="$RUN"
plan_runs "chat_eval sft" && stage "chat_eval sft" "report_has chat-evaluation-sft" $LAUNCH scripts.chat_eval $SEP -i sft -g $TAG $CHAT_EVAL_FLAGS
if [ "$RUN_RL" = 1 ] && plan_runs chat_rl; then  # a budget runs the gpu preset's chat_rl only where it fits
    train_stage "chat_rl" chatrl_checkpoints chat-rl \
        $LAUNCH scripts.chat_rl $SEP -g $TAG ${RL_STEPS:+--num-iterations=$RL_STEPS} $(plan_flags chat_rl) $RL_FLAGS --run="$RUN"
    stage "chat_eval rl" "report_has chat-evaluation-rl" $LAUNCH scripts.chat_eval $SEP -i rl -g $TAG $CHAT_EVAL_FLAGS
fi
[ -n "$BUDGET" ] && plan_flags report > /dev/null  # the plan's section of the report card, as it was kept
stage "report" "false" $PY -m nanochat.report generate

if [ "$DRY_RUN" != 1 ]; then
    FINAL=$([ "$RUN_RL" = 1 ] && plan_runs chat_rl 2>/dev/null && echo rl || echo sft)
    ENV=$([ "$BASE_DIR" = "$HOME/.cache/nanochat" ] || echo "NANOCHAT_BASE_DIR=$BASE_DIR ")
    echo
    echo "Done. Talk to your model:"
    echo "  ${ENV}${NANOCHAT_PYTHON:-uv run python} -m scripts.chat_cli -i $FINAL -g $TAG     # in the terminal"
    echo "  ${ENV}${NANOCHAT_PYTHON:-uv run python} -m scripts.chat_web -i $FINAL -g $TAG     # then open http://127.0.0.1:8000"
    echo "The report card is in report.md (and $BASE_DIR/report/)."
fi
