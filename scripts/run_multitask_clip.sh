#!/usr/bin/env bash
# Launch Multitask-CLIP pretraining with Spindle under torchrun.
#
# Environment (defaults in brackets):
#   NNODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29517]
#   GPUS_PER_NODE [all GPUs torch sees; 4 CPU ranks with gloo when it sees none; more than it sees: refused]
#   MODEL_SIZE [full on GPU, tiny on CPU]   TASKS [4]   TRAIN_ITERS [30; not with --train-samples]
#   MICRO_BATCH [on GPU: the model's smallest per-task batch of one pass over the ranks, at least 1; CPU_MICRO_BATCH (4)
#     on CPU]: samples per task per rank in one pass (as in Megatron); a pass of the plan carries MICRO_BATCH x ranks
#     samples of every task
#   OUT [out/multitask_clip in the checkout]: plan.png and trace.json go here; a relative OUT, like every relative
#     path in the flags, is relative to the directory the script is started from
#   SPINDLE [1]: 0 runs every task over all ranks one after another (Megatron's way) for comparison
#   TORCHRUN_ARGS: more torchrun flags, e.g. "--max-restarts 2" (a killed rank's group restarts and resumes
#     from the last checkpoint in --save)
#   SHUTDOWN_TIMEOUT [120]: seconds torchrun gives the workers after forwarding SIGINT/SIGTERM (finish the step,
#     and with --exit-signal-handler save) before it kills them; torchrun's own default is 30
# Extra arguments pass through to examples/pretrain_multitask_clip.py (see its --help). Where they leave out a training
# flag Megatron-LM's loop cannot start without (--micro-batch-size on GPU; under Megatron-LM's loop --lr: the built-in
# loop's default, --eval-interval 1000 --eval-iters 10), the script adds it and says so in its second line
# (megatron_spindle/megatron/job/launch_defaults.py).
#
# Every flag and input file is checked first, in this one process (exit status 2 and one line, no worker
# started); then torchrun runs through megatron_spindle.launch, which ends as the workers say (one line each,
# exit status 2 bad input, 3 a failed peer, 130/143 stopped by SIGINT/SIGTERM) instead of torchrun's traceback.
set -euo pipefail
# No cd: relative paths the user gives (OUT, --save, --load, --spindle-data...) mean where the user stands.
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
SCRIPT=${SCRIPT:-$REPO/examples/pretrain_multitask_clip.py}
SCRIPT_MODEL=${SCRIPT_MODEL:-multitask-clip}  # the model SCRIPT trains unless --spindle-model names another
OUT=${OUT:-$REPO/out/multitask_clip}
PY=${PYTHON:-$( [ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3 )}
# The device is what torch sees (not a driver file); one line says what was chosen. GPUS_PER_NODE asking for
# more GPUs than torch sees, or for GPUs where the driver is there but torch sees none, is refused (exit 2).
read -r NGPU GPU_NAME <<<"$("$PY" -c 'import torch; n = torch.cuda.device_count()
print(n, torch.cuda.get_device_name(0).replace(" ", "_") if n else "-")' 2>/dev/null || echo "0 -")"
case "${GPUS_PER_NODE:-1}" in ''|*[!0-9]*|0) echo "error: GPUS_PER_NODE=${GPUS_PER_NODE} must be a positive integer" >&2; exit 2;; esac
if [ "$NGPU" -gt 0 ]; then
  if [ "${GPUS_PER_NODE:-$NGPU}" -gt "$NGPU" ]; then
    echo "error: GPUS_PER_NODE=$GPUS_PER_NODE asks for more GPUs than torch sees on this node: $NGPU (${GPU_NAME//_/ })" >&2
    exit 2
  fi
  GPUS_PER_NODE=${GPUS_PER_NODE:-$NGPU}; MODEL_SIZE=${MODEL_SIZE:-full}; MICRO=${MICRO_BATCH:-}
  DEVICE="$GPUS_PER_NODE x ${GPU_NAME//_/ } per node (NCCL)"
  # the workers' own choice (hooks.choose_backend): Megatron-LM's loop where megatron.training imports
  BACKEND=${SPINDLE_BACKEND:-$("$PY" -c "import megatron.training.training" >/dev/null 2>&1 && echo megatron || echo loop)}
else
  if [ -n "${GPUS_PER_NODE:-}" ] && [ -e /proc/driver/nvidia/version ]; then
    echo "error: GPUS_PER_NODE=$GPUS_PER_NODE: this node has an NVIDIA driver but torch ($PY) sees no CUDA device (a CPU build of torch, or CUDA_VISIBLE_DEVICES empty)" >&2
    exit 2
  fi
  GPUS_PER_NODE=${GPUS_PER_NODE:-4}; MODEL_SIZE=${MODEL_SIZE:-tiny}; MICRO=${MICRO_BATCH:-${CPU_MICRO_BATCH:-4}}
  DEVICE="$GPUS_PER_NODE CPU processes per node (gloo; torch sees no CUDA device)"
  BACKEND=${SPINDLE_BACKEND:-loop}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
fi
export SPINDLE_BACKEND=$BACKEND  # the check below and every worker run the loop this line names
echo "spindle launch: backend $BACKEND ($([ "$BACKEND" = megatron ] && echo "Megatron-LM's pretrain" || echo "built-in megatron.core loop")), device $DEVICE, model size $MODEL_SIZE, ranks $(( ${NNODES:-1} * GPUS_PER_NODE )) (${NNODES:-1} node(s) x $GPUS_PER_NODE)"
ARGS=(--spindle-size "$MODEL_SIZE" --log-interval "${LOG_INTERVAL:-5}" --spindle-trace "$OUT")
case " $* " in  # the run's length: TRAIN_ITERS, unless the command gives it in samples (Megatron takes one of them)
  *" --train-samples "*|*" --train-samples="*) ;;
  *) ARGS+=(--train-iters "${TRAIN_ITERS:-30}") ;;
esac
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('matplotlib') is None)" 2>/dev/null; then
  ARGS+=(--spindle-gantt "$OUT/plan.png")  # the plan's picture, where matplotlib is installed
fi
[ -n "${TASKS-4}" ] && ARGS+=(--spindle-tasks "${TASKS:-4}")
[ -n "$MICRO" ] && ARGS+=(--micro-batch-size "$MICRO")
[ "${SPINDLE:-1}" = 1 ] && ARGS+=(--spindle)
for a in "$@"; do
  if [ "$a" = "--help" ] || [ "$a" = "-h" ]; then exec "$PY" "$SCRIPT" --help; fi
done
ADDED=$(WORLD_SIZE=$(( ${NNODES:-1} * GPUS_PER_NODE )) "$PY" -m megatron_spindle.megatron.job.launch_defaults \
  "$SCRIPT_MODEL" "${ARGS[@]}" "$@") || exit $?
if [ -n "$ADDED" ]; then
  mapfile -t MORE <<<"$ADDED"
  ARGS+=("${MORE[@]}")
  echo "spindle launch: added ${MORE[*]} (your flags leave them out; docs/training.md)"
fi
mkdir -p "$OUT"
SPINDLE_PREFLIGHT=1 WORLD_SIZE=$(( ${NNODES:-1} * GPUS_PER_NODE )) LOCAL_WORLD_SIZE=$GPUS_PER_NODE \
  "$PY" "$SCRIPT" "${ARGS[@]}" "$@" || exit $?
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of flags
exec "$PY" -m megatron_spindle.launch --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --nproc-per-node "$GPUS_PER_NODE" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29517}" \
  --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}" ${TORCHRUN_ARGS:-} "$SCRIPT" "${ARGS[@]}" "$@"
