#!/usr/bin/env python3
"""Planner benchmark: makespan / Σ C* and planning time for every built-in workload.

Prints one row per workload and device count (8, 16, 32, 64), then the planning time of 10-task
Multitask-CLIP on 256 and 1024 devices. The paper's targets: plans within 7% of Σ C*, planning under 3 s.
A workload that does not fit the devices' memory prints its placement error instead of numbers.

    python scripts/bench_planner.py [--markdown] [--no-search]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from megatron_spindle.planner.build import make_plan
from megatron_spindle.planner.cluster import load_cluster
from megatron_spindle.planner.workloads import build_graph

WORKLOADS = [("multitask-clip", 4), ("multitask-clip", 7), ("multitask-clip", 10),
             ("ofasys", 4), ("ofasys", 7), ("qwen-val", 3)]
GPUS = (8, 16, 32, 64)


def run_one(model: str, tasks: int, gpus: int, search: bool):
    graph = build_graph(model, tasks=tasks)
    t0 = time.perf_counter()
    try:
        plan = make_plan(graph, load_cluster(None, num_devices=gpus), search=search)
    except ValueError as e:
        return None, time.perf_counter() - t0, str(e).splitlines()[0]
    return plan, time.perf_counter() - t0, ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    ap.add_argument("--no-search", action="store_true", help="the paper's pipeline only (no candidate search)")
    args = ap.parse_args(argv)
    search = not args.no_search
    sep = " | " if args.markdown else "  "
    head = ["workload", "devices", "waves", "makespan ms", "sum C* ms", "ratio", "planning s"]
    rows, ratios = [], []
    for model, k in WORKLOADS:
        for n in GPUS:
            plan, dt, err = run_one(model, k, n, search)
            name = f"{model}-{k}"
            if plan is None:
                rows.append([name, str(n), "-", "-", "-", "-", f"{dt:.2f}", err])
                continue
            r = plan.makespan_ms / plan.lower_bound_ms
            ratios.append(r)
            rows.append([name, str(n), str(len(plan.waves)), f"{plan.makespan_ms:.1f}",
                         f"{plan.lower_bound_ms:.1f}", f"{r:.3f}", f"{dt:.2f}", ""])
    if args.markdown:
        print("| " + " | ".join(head) + " | note |")
        print("|" + "---|" * (len(head) + 1))
        for r in rows:
            print("| " + " | ".join(r[:-1]) + " | " + (("infeasible: " + r[-1][:90]) if r[-1] else "") + " |")
    else:
        width = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        print(sep.join(h.rjust(width[i]) for i, h in enumerate(head)))
        for r in rows:
            print(sep.join(v.rjust(width[i]) for i, v in enumerate(r[:-1])) + (f"  {r[-1][:110]}" if r[-1] else ""))
    print()
    print(f"ratio makespan / sum C*: max {max(ratios):.3f}, median {statistics.median(ratios):.3f}, "
          f"{sum(r <= 1.07 for r in ratios)}/{len(ratios)} within 1.07, "
          f"{sum(r <= 1.03 for r in ratios)}/{len(ratios)} within 1.03")
    for n in (256, 1024):
        plan, dt, err = run_one("multitask-clip", 10, n, search)
        extra = f"ratio {plan.makespan_ms / plan.lower_bound_ms:.3f}" if plan else err
        print(f"planning time multitask-clip-10 on {n} devices: {dt:.2f} s ({extra})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
