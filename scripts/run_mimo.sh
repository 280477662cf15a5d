#!/usr/bin/env bash
# Launch your own Megatron MIMO model under torchrun: Spindle plans and trains the MimoModel your model provider
# returns (docs/mimo.md).
#
# Environment (defaults in brackets), as scripts/run_multitask_clip.sh (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
# GPUS_PER_NODE, TRAIN_ITERS, MICRO_BATCH, TORCHRUN_ARGS, SHUTDOWN_TIMEOUT) plus:
#   PROVIDER [examples.mimo.tiny_avlm:tiny_avlm]: your model provider, MODULE:FUNCTION, importable from PYTHONPATH
#     (this checkout and the directory you start from are on it)
#   TASKS_FILE [examples/mimo/tiny_tasks.toml]: its tasks ([[tasks]] name, modalities, batch)
#   OUT [out/mimo in the checkout]: plan.png and trace.json go here
#   SPINDLE [1]: 0 trains the same model with Megatron-LM's own loop and no Spindle (your provider, Megatron's DDP,
#     optimizer and checkpoints, every module on every rank: MIMO's colocated mode), the reference for speed and
#     checkpoints; it needs megatron.training (megatron-core >= 0.17: the .venv-mlm of this checkout by default)
# Extra arguments are Megatron-LM's training flags (and --spindle-*), passed through.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)  # no cd: the user's relative paths mean where the user stands
export PYTHONPATH="$REPO:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PROVIDER=${PROVIDER:-examples.mimo.tiny_avlm:tiny_avlm}
TASKS_FILE=${TASKS_FILE:-$REPO/examples/mimo/tiny_tasks.toml}
export OUT=${OUT:-$REPO/out/mimo} TASKS="" MODEL_SIZE=full  # the provider's model has its own tasks and size
if [ "${SPINDLE:-1}" = 0 ]; then
  export SCRIPT=$REPO/examples/mimo/megatron_mimo.py SPINDLE_BACKEND=megatron
  if [ -z "${PYTHON:-}" ] && [ -x "$REPO/.venv-mlm/bin/python" ]; then export PYTHON=$REPO/.venv-mlm/bin/python; fi
  PY=${PYTHON:-python3}
  "$PY" -c "import megatron.training.training" >/dev/null 2>&1 || {
    echo "error: SPINDLE=0 trains with Megatron-LM's own loop, but megatron.training does not import with $PY (it needs megatron-core >= 0.17 on Python >= 3.12, or a Megatron-LM checkout on PYTHONPATH; set PYTHON)" >&2
    exit 2; }
  EXTRA=(--eval-iters "${EVAL_ITERS:-1}")
else
  export SCRIPT=$REPO/examples/mimo/pretrain_mimo.py
  EXTRA=()
fi
exec "$REPO/scripts/run_multitask_clip.sh" --spindle-model-provider "$PROVIDER" --spindle-tasks-file "$TASKS_FILE" \
  "${EXTRA[@]}" "$@"
