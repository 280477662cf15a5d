#!/usr/bin/env bash
# Launch Qwen-VAL pretraining with Spindle under torchrun: the same environment variables as
# scripts/run_multitask_clip.sh (TASKS is fixed at 3; OUT defaults to out/qwen_val, MICRO_BATCH to 1 per rank on CPU).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)  # no cd: the user's relative paths mean where the user stands
export SCRIPT=$REPO/examples/pretrain_qwen_val.py SCRIPT_MODEL=qwen-val OUT=${OUT:-$REPO/out/qwen_val} TASKS=${TASKS:-3}
export CPU_MICRO_BATCH=${CPU_MICRO_BATCH:-1}  # CPU ranks (torch sees no GPU): 1 sample per rank unless MICRO_BATCH
exec "$REPO/scripts/run_multitask_clip.sh" "$@"
