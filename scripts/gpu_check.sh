#!/usr/bin/env bash
# The GPU checks the issues ask for, as ONE prepared script for a lent single-GPU machine (H200):
#   1. both launch scripts on the GPU (NCCL, TransformerEngine specs when TE imports), with step times and
#      the first-step equivalence check;
#   2. `spindle profile` of full-size Multitask-CLIP encoders on the one GPU across local batch sizes (the
#      per-device half of the scaling curves).
# Everything it prints also goes to $OUT/gpu_check.log. Budget: about 10 minutes.
# NOT YET RUN: no GPU has been lent to a session so far; expect to fix details on the first run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
$PY - <<'PY'
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
try:
    import transformer_engine  # noqa: F401
    print("transformer_engine: importable")
except Exception as e:  # noqa: BLE001
    print("transformer_engine: not importable:", type(e).__name__, e)
PY
echo "== 1a Multitask-CLIP, 4 tasks, full size, 1 GPU, batch 16 per task"
GPUS_PER_NODE=1 MODEL_SIZE=full MICRO_BATCH=16 TRAIN_ITERS=12 OUT=$OUT/clip timeout 240 \
  scripts/run_multitask_clip.sh --bf16 --spindle-check-equivalence --spindle-predict-interval 4 || echo "1a failed: $?"
echo "== 1b Qwen-VAL, tiny (the full 10B model needs more than one GPU), 1 GPU"
GPUS_PER_NODE=1 MODEL_SIZE=tiny MICRO_BATCH=8 TRAIN_ITERS=12 OUT=$OUT/qwen timeout 120 \
  scripts/run_qwen_val.sh --spindle-check-equivalence || echo "1b failed: $?"
echo "== 2 profile full-size Multitask-CLIP MetaOps on one GPU (local batch 128/n for n = 1..32)"
timeout 240 $PY -m megatron_spindle.cli profile --model multitask-clip --tasks 4 --size full --batch 128 \
  --nproc 1 --max-devices 32 --repeats 5 --out "$OUT/curves_clip_h200.json" || echo "2 failed: $?"
