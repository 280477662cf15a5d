#!/usr/bin/env bash
# The GPU check: a first smoke test on one GPU of a node (yours, or a lent single-GPU machine: Python 3.12, torch
# with CUDA, no megatron-core, no network). One command, under 8 minutes in all: every step has a time budget and
# the budgets add to 475 s. Prepare first where the package registry is reachable: scripts/gpu_check_prepare.sh
# puts the wheels the machine lacks in .whl/ (ignored by git; carry it, under 64 MiB); this repository goes on
# PYTHONPATH.
#
#   OUT=/path/to/results scripts/gpu_check.sh            # on the GPU
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh             # (or --dry-run) the same steps, tiny sizes, on the CPU
#
# Steps (budget in seconds):
#   wheels    20  install .whl/*.whl into a private folder (none: use what is installed)
#   nccl      25  NCCL's batch semantics on the real NCCL, one rank: works returned per batch of sends and
#                 receives to itself (scripts/gpu_check_nccl.py)
#   runtime   45  the runtime's one-device checks (scripts/gpu_check_runtime.py): device memory per new_group; a
#                 replan with AdamW state on the device (a weight's copy sent to itself, state dtypes and devices
#                 kept); 3 trainer iterations under torch.cuda.set_sync_debug_mode("warn"), the host's waits
#                 per iteration and where; a rank waiting for a message nobody sends ends with one line, exit 3
#   fp32      45  tiny Multitask-CLIP trained on 1 GPU by the built-in loop (SPINDLE_BACKEND=loop: never
#                 Megatron's, even where megatron.training imports) with --spindle-check-equivalence
#   bf16      45  the same with --bf16 (equivalence against an fp32 reference on the same device)
#   megatron  90  Megatron-LM's own pretrain through our hooks on 1 GPU, 5 steps with evaluation, --bf16
#   curves   165  measured curves of every distinct MetaOp shape of full-size Multitask-CLIP-10, OFASys-7 and
#                 Qwen-VAL in bf16, per-device batches from the whole batch down to 1 sample, tensor parallelism
#                 1; what one GPU cannot measure is named in each file's not_measured (scripts/gpu_check_curves.py)
#   compare   40  spindle compare (every system at one configuration) on those curves, the GPU's cluster preset
#
# What comes back, at most 8 files, all in $OUT: gpu_check.json (the summary, rewritten after EVERY step: a run
# cut off anywhere still reports; "pending" names the steps that did not run), logs.tar.gz (every step's log
# and compare output, also rewritten after every step), curves_<gpu>_multitask_clip_10.json,
# curves_<gpu>_ofasys_7.json, curves_<gpu>_qwen_val.json (copy them to docs/results/).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${GPU_CHECK_DRY_RUN:-0}
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
SITE=$WORK/site
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1} PYTHONUNBUFFERED=1
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PORT=${MASTER_PORT:-29631}
STEPS=(wheels:20 nccl:25 runtime:45 fp32:45 bf16:45 megatron:90 curves:165 compare:40)
if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""
  SIZE=tiny; MICRO=4; QUICK=(--quick); GPUS=4; MLM_DTYPE=()
else
  SIZE=full; MICRO=8; QUICK=(); GPUS=8,16,32; MLM_DTYPE=(--bf16)
fi

# the run's plan (device, budgets): WORK/plan.json; prints "GPU TAG PRESET"
read -r GPU TAG PRESET < <("$PY" - "$WORK" "$DRY" "${STEPS[@]}" <<'PY'
import datetime, importlib.util, json, sys
import torch
from megatron_spindle.megatron.job.gpu_node import preset_for_gpu
from megatron_spindle.planner.workload.cluster import DEFAULT_PRESET
work, dry, steps = sys.argv[1], sys.argv[2] == "1", [s.split(":") for s in sys.argv[3:]]
gpu = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if gpu else "cpu"
preset = (preset_for_gpu(name) if gpu else None) or DEFAULT_PRESET
tag = "".join(c for c in name.split()[-1].lower() if c.isalnum()) if gpu else "cpu"
run = {"dry_run": dry, "gpu": gpu, "device": name, "tag": tag, "preset": preset,
       "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if gpu else None,
       "python": sys.version.split()[0], "torch": torch.__version__,
       "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
       "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
with open(f"{work}/plan.json", "w") as f:
    json.dump({"run": run, "steps": [[n, int(b)] for n, b in steps]}, f)
print(int(gpu), tag, preset)
PY
)
[ -n "${TAG:-}" ] || { echo "error: $PY cannot import torch and this repository (see above)" >&2; exit 2; }
declare -A BUDGET
for s in "${STEPS[@]}"; do BUDGET[${s%%:*}]=${s##*:}; done

report() { "$PY" scripts/gpu_check_report.py "$WORK" "$OUT" >"$WORK/report.out" 2>&1 \
  || { echo "warning: the summary could not be written:"; tail -3 "$WORK/report.out"; }; }
run1() {  # run1 NAME CMD...: one step within its budget; log, exit status and seconds in WORK; then the summary
  local name=$1 t=${BUDGET[$1]} t0=$SECONDS; shift
  timeout --kill-after=5 "$t" "$@" >"$WORK/$name.log" 2>&1
  echo $? >"$WORK/$name.rc"
  echo $((SECONDS - t0)) >"$WORK/$name.seconds"
  report
  echo "== $name: exit $(cat "$WORK/$name.rc") after $(cat "$WORK/$name.seconds") s (budget $t s)"
}
report  # every step pending: even a run cut off in the first step leaves a summary
echo "== gpu check on $( [ "$GPU" = 1 ] && echo "GPU $TAG (preset $PRESET)" || echo "CPU (dry run: tiny sizes)" ); summary: $OUT/gpu_check.json"

install_wheels() {
  if [ "$DRY" = 1 ] || ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "nothing to install ($( [ "$DRY" = 1 ] && echo "dry run" || echo "no .whl/" )): using what $PY has"; return 0
  fi
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || return 1
  else  # no pip: a wheel is a zip of the installed tree
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$SITE" || return 1; done
  fi
  for w in .whl/*.whl; do echo "installed $(basename "$w")"; done
}
export -f install_wheels; export DRY SITE PY
run1 wheels bash -c install_wheels
run1 nccl env MASTER_PORT=$((PORT + 5)) "$PY" scripts/gpu_check_nccl.py
run1 runtime env MASTER_PORT=$((PORT + 7)) "$PY" scripts/gpu_check_runtime.py
TRAIN=(examples/pretrain_multitask_clip.py --spindle --spindle-size tiny --spindle-tasks 4 --micro-batch-size "$MICRO"
       --lr 1e-3 --log-interval 1 --spindle-predict-interval 0)
# one-rank jobs started as plain processes (the trainer's own init_distributed; torchrun adds nothing for one rank)
run1 fp32 env SPINDLE_BACKEND=loop MASTER_PORT="$PORT" "$PY" "${TRAIN[@]}" --train-iters 4 --spindle-check-equivalence
run1 bf16 env SPINDLE_BACKEND=loop MASTER_PORT=$((PORT + 1)) "$PY" "${TRAIN[@]}" --train-iters 4 \
  --spindle-check-equivalence --bf16
run1 megatron env SPINDLE_BACKEND=megatron "$PY" -m torch.distributed.run --nproc-per-node 1 \
  --master-port $((PORT + 2)) "${TRAIN[@]}" --train-iters 5 --global-batch-size $((2 * MICRO)) \
  --eval-iters 1 --eval-interval 5 "${MLM_DTYPE[@]}"
run1 curves env MASTER_PORT=$((PORT + 6)) "$PY" scripts/gpu_check_curves.py --size "$SIZE" --out-dir "$OUT" \
  --tag "$TAG" "${QUICK[@]}"
compare_all() {  # the three models at once (separate processes, one core each)
  local pids=() m
  for m in "multitask-clip 10 multitask_clip_10" "ofasys 7 ofasys_7" "qwen-val 3 qwen_val"; do
    set -- $m
    "$PY" -m megatron_spindle.cli compare --model "$1" --tasks "$2" --size "$SIZE" --gpus "$GPUS" \
      --cluster "$PRESET" --fixed-passes --curves "$OUT/curves_${TAG}_$3.json" --json >"$WORK/compare_$3.json" &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}
export -f compare_all; export WORK OUT TAG SIZE GPUS PRESET
run1 compare bash -c compare_all
"$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); print(json.dumps({'gpu_check': d['gpu_check'], \
'steps': {k: v['ok'] for k, v in d['steps'].items()}}))" "$OUT/gpu_check.json"
rm -rf "$WORK"
