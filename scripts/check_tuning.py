#!/usr/bin/env python3
"""Self-check of the tuner: no system's tuned step is slower than its best pass count swept by hand.

For one workload and device count, runs ``spindle compare --json`` (every system tuned to its own best) and
``spindle compare --fixed-passes --passes P --json`` for every valid pass count ``P`` up to ``--max-passes``
(what a user sweeping the pass count by hand would try: nothing recomputed, no distributed optimizer), both
through the command line in subprocesses, and checks for every system that its tuned step is at most the
fastest swept step among those that fit its own runtime's memory. Prints one row per system; exit status 1
if any tuned result is slower.

    python scripts/check_tuning.py --model multitask-clip --tasks 4 --gpus 8 [--size tiny] [--max-passes 16]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from megatron_spindle.planner.tuning.tune import Workload  # noqa: E402


def run_compare(args, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "megatron_spindle.cli", "compare", "--model", args.model, "--gpus", str(args.gpus),
           "--size", args.size, "--json", *extra]
    if args.tasks:
        cmd += ["--tasks", str(args.tasks)]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    if r.returncode not in (0, 2) or not r.stdout.strip():
        raise SystemExit(f"check_tuning: {' '.join(cmd[2:])} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout)["results"][0]["systems"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", type=int, default=None)
    ap.add_argument("--size", default="full")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--max-passes", type=int, default=16, help="largest pass count swept (default 16)")
    args = ap.parse_args(argv)
    opts = [p for p in Workload(model=args.model, tasks=args.tasks, size=args.size, batch=args.batch).pass_options()
            if p <= args.max_passes]
    tuned = run_compare(args, [])
    swept: dict[str, list[tuple[int, float]]] = {s: [] for s in tuned}
    for p in opts:
        for system, r in run_compare(args, ["--fixed-passes", "--passes", str(p)]).items():
            if "step_ms" in r and not r.get("over_memory"):
                swept[system].append((p, r["step_ms"]))
    bad = 0
    print(f"{'system':24s} {'tuned ms':>10s}  {'configuration':32s} {'best swept ms':>13s}  swept P fitting")
    for system, r in tuned.items():
        if system == "spindle-naive-placement":  # an ablation at Spindle's configuration, not tuned itself
            continue
        best = min(swept[system], key=lambda x: x[1], default=(None, math.inf))
        t = r.get("step_ms", math.inf)
        ok = t <= best[1] * (1 + 1e-9)
        bad += not ok
        conf = r.get("configuration", {}).get("label", r.get("error", "")[:32])
        print(f"{system:24s} {t:10.1f}  {conf:32s} {best[1]:13.1f}  "
              f"{','.join(str(p) for p, _ in swept[system]) or '-'}{'' if ok else '  <- SLOWER THAN SWEPT'}")
    print("ok: every tuned step is at most its best swept pass count" if not bad
          else f"FAILED: {bad} system(s) tuned slower than a swept pass count")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
