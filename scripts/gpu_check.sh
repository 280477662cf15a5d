#!/usr/bin/env bash
# The GPU check for a session lent a single-GPU machine (H200: Python 3.12, torch with CUDA, no megatron-core,
# no network). Self-contained: wheels it needs travel in .whl/ (scripts/gpu_check_prepare.sh makes it; name
# ".whl" in the device tool's `carry`); this repository is put on PYTHONPATH. Under 10 minutes (every step
# has its own timeout). Ends with ONE JSON line: {"gpu_check": {...}, "steps": {name: {...}}}.
#
# Steps (each logs to $OUT/<step>.log):
#   fp32        tiny Multitask-CLIP on 1 rank (NCCL on a GPU) with --spindle-check-equivalence
#   bf16        the same in bf16 (equivalence against an fp32 reference on the same device)
#   megatron    Megatron-LM's own pretrain (megatron.training) through our hooks, 5 steps with evaluation
#               (--bf16 on a GPU: Megatron's mixed-precision optimizer)
#   profile     per-layer profile of every MetaOp of full-size Multitask-CLIP (10 tasks) and Qwen-VAL: curves
#               files $OUT/curves_<device>_<model>.json (copy them to docs/results/)
#   te          whether TransformerEngine imports (our layers then use TE specs)
# Without a GPU it runs the same steps on the CPU (gloo, tiny sizes, Megatron's loop with the CPU stand-ins)
# to check this script's logic: tests/test_gpu_check_script.py does that.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${SITE:-/tmp/spindle_site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >"$OUT/wheels.log" 2>&1 || { echo "installing .whl/ failed (see $OUT/wheels.log)"; exit 1; }
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$GPU" = 1 ]; then
  SIZE_NOTE="GPU"; MICRO=8; PROFILE_SIZE=full; PROFILE_T=200; MLM_DTYPE=(--bf16)
else
  SIZE_NOTE="CPU logic check"; MICRO=4; PROFILE_SIZE=tiny; PROFILE_T=200; MLM_DTYPE=()
fi
PORT=${MASTER_PORT:-29631}
run1() {  # run1 NAME TIMEOUT_S CMD...: one step, output to $OUT/NAME.log, status to $OUT/NAME.rc
  local name=$1 t=$2; shift 2
  echo "== $name ($SIZE_NOTE, at most ${t} s)"
  local t0=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1
  echo $? >"$OUT/$name.rc"
  echo $((SECONDS - t0)) >"$OUT/$name.seconds"
  echo "   exit $(cat "$OUT/$name.rc") after $(cat "$OUT/$name.seconds") s"
}
TRAIN=(examples/pretrain_multitask_clip.py --spindle --spindle-size tiny --spindle-tasks 4
       --micro-batch-size "$MICRO" --lr 1e-3 --log-interval 1 --spindle-predict-interval 0)
run1 fp32 90 "$PY" -m torch.distributed.run --nproc-per-node 1 --master-port "$PORT" \
  "${TRAIN[@]}" --train-iters 6 --spindle-check-equivalence
run1 bf16 90 "$PY" -m torch.distributed.run --nproc-per-node 1 --master-port $((PORT + 1)) \
  "${TRAIN[@]}" --train-iters 6 --spindle-check-equivalence --bf16
run1 megatron 150 env SPINDLE_BACKEND=megatron "$PY" -m torch.distributed.run --nproc-per-node 1 \
  --master-port $((PORT + 2)) "${TRAIN[@]}" --train-iters 5 --global-batch-size $((2 * MICRO)) \
  --eval-iters 1 --eval-interval 5 "${MLM_DTYPE[@]}"
DEV=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo unknown)
run1 profile_clip "$PROFILE_T" "$PY" -m megatron_spindle.cli profile --model multitask-clip --tasks 10 \
  --size "$PROFILE_SIZE" --nproc 1 --max-devices 32 --repeats 5 --no-link --no-cache \
  --out "$OUT/curves_${DEV}_multitask_clip.json"
run1 profile_qwen 120 "$PY" -m megatron_spindle.cli profile --model qwen-val --size "$PROFILE_SIZE" --nproc 1 \
  --max-devices 32 --repeats 5 --no-link --no-cache --out "$OUT/curves_${DEV}_qwen_val.json"
run1 te 60 "$PY" -c "
import torch, transformer_engine, transformer_engine.pytorch  # noqa: F401
from megatron_spindle.models.blocks import use_te_backend
print('transformer_engine', transformer_engine.__version__, '| layers use TE specs:', use_te_backend('auto'))"
OUT="$OUT" GPU="$GPU" DEV="$DEV" "$PY" - <<'PY'
import json, os, re
out = os.environ["OUT"]

def read(name, suffix):
    try:
        with open(os.path.join(out, f"{name}.{suffix}")) as f:
            return f.read()
    except OSError:
        return ""

def step(name, **found):
    rc = read(name, "rc").strip()
    log = read(name, "log")
    entry = {"ok": rc == "0", "exit": int(rc) if rc.lstrip("-").isdigit() else None,
             "seconds": int(read(name, "seconds") or 0)}
    for key, pattern in found.items():
        m = re.findall(pattern, log)
        entry[key] = m[-1] if m else None
    if not entry["ok"]:
        entry["tail"] = log.strip().splitlines()[-3:]
    return entry

steps = {}
for name in ("fp32", "bf16"):
    e = step(name, equivalence=r"equivalence: max relative difference (\S+)")
    summary = [l for l in read(name, "log").splitlines() if l.startswith('{"steps"')]
    if summary:
        s = json.loads(summary[-1])
        e.update(final_loss=s.get("final_loss"), step_time_s=s.get("step_time_s"))
    e["ok"] = e["ok"] and e["equivalence"] is not None
    steps[name] = e
e = step("megatron", last_iteration=r"iteration\s+(\d+)/\s*\d+ \|", grad_norm=r"grad norm: ([0-9.]+)",
         validation=r"validation loss at iteration \d+ (?:on validation set )?\| (.*?) \|")
e["ok"] = e["ok"] and e["last_iteration"] == "5" and e["validation"] is not None
steps["megatron"] = e
for name, model in (("profile_clip", "multitask_clip"), ("profile_qwen", "qwen_val")):
    e = step(name)
    path = os.path.join(out, f"curves_{os.environ['DEV']}_{model}.json")
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        e["curves_file"] = path
        e["curves"] = len(doc["curves"])
        e["metaops"] = sum(len(c["metaops"]) for c in doc["curves"])
    else:
        e["ok"] = False
    steps[name] = e
te = step("te", te=r"(transformer_engine .*)")
te = {"available": te["ok"], "detail": te["te"] if te["ok"] else
      "not importable here (transformer-engine-torch ships only as a source build against the local torch "
      "and CUDA, not as a wheel that can be carried)"}
steps["te"] = te
print(json.dumps({"gpu_check": {"gpu": os.environ["GPU"] == "1", "device": os.environ["DEV"],
                                "ok": all(v.get("ok", True) for k, v in steps.items() if k != "te")},
                  "steps": steps}))
PY
