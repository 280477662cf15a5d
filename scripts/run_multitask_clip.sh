#!/usr/bin/env bash
# Launch Multitask-CLIP pretraining with Spindle under torchrun.
#
# Environment (defaults in brackets):
#   NNODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29517]
#   GPUS_PER_NODE [all GPUs; 4 CPU ranks with gloo when there is no GPU]
#   MODEL_SIZE [full on GPU, tiny on CPU]   TASKS [4]   TRAIN_ITERS [30]
#   MICRO_BATCH [model default on GPU; 4 on CPU]: samples per task per rank in one pass (as in Megatron);
#     a pass of the plan carries MICRO_BATCH x ranks samples of every task
#   OUT [out/multitask_clip]: plan.png, trace.json and checkpoints go here
#   SPINDLE [1]: 0 runs every task over all ranks one after another (Megatron's way) for comparison
# Extra arguments pass through to examples/pretrain_multitask_clip.py (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT=${SCRIPT:-examples/pretrain_multitask_clip.py}
OUT=${OUT:-out/multitask_clip}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$NGPU" -gt 0 ]; then
  GPUS_PER_NODE=${GPUS_PER_NODE:-$NGPU}; MODEL_SIZE=${MODEL_SIZE:-full}; MICRO=${MICRO_BATCH:-}
else
  GPUS_PER_NODE=${GPUS_PER_NODE:-4}; MODEL_SIZE=${MODEL_SIZE:-tiny}; MICRO=${MICRO_BATCH:-4}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
fi
ARGS=(--spindle-size "$MODEL_SIZE" --train-iters "${TRAIN_ITERS:-30}" --log-interval "${LOG_INTERVAL:-5}"
      --spindle-gantt "$OUT/plan.png" --spindle-trace "$OUT")
[ -n "${TASKS-4}" ] && ARGS+=(--spindle-tasks "${TASKS:-4}")
[ -n "$MICRO" ] && ARGS+=(--micro-batch-size "$MICRO")
[ "${SPINDLE:-1}" = 1 ] && ARGS+=(--spindle)
mkdir -p "$OUT"
if [ "${NODE_RANK:-0}" = 0 ] && ! "$PY" -c 'import socket, sys; socket.socket().bind(("", int(sys.argv[1])))' \
    "${MASTER_PORT:-29517}" 2>/dev/null; then  # torchrun would end in a traceback of its own
  echo "error: MASTER_PORT ${MASTER_PORT:-29517} is already in use (another job?): set MASTER_PORT to a free port" >&2
  exit 2
fi
exec "$PY" -m torch.distributed.run --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --nproc-per-node "$GPUS_PER_NODE" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29517}" \
  "$SCRIPT" "${ARGS[@]}" "$@"
