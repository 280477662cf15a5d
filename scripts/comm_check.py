#!/usr/bin/env python3
"""Communication check at scale: every rank's calls, made by the executor itself, checked against NCCL's rules.

For each shipped model and device count: plan the full-size model (``make_plan``, the a800 preset, 8 devices
per node), run every rank of the plan once on torch's fake process group with its calls recorded
(:mod:`megatron_spindle.runtime.comm_dryrun`: the executor's own code; layers of the narrow twin of the graph),
and check the streams (:mod:`megatron_spindle.runtime.comm_check`: same group creation order, per-communicator
collective order, sends and receives matched in posting order, no deadlock under NCCL's in-order model).

Printed per row: groups per rank (communicators its collectives use, the default one included; and groups it
is a member of: what eager creation would hold on its GPU), P2P peers per rank, operations per pass (collectives
plus P2P operations), each as max/mean over the ranks, the verdict (``ok`` or the number of problems; the
first ones are printed below the table) and the seconds the dry run took. Exit status 1 when a row fails.

    python scripts/comm_check.py [--models a,b] [--ranks 8,64,256,1024] [--jobs N] [--markdown]

``--jobs N`` dry-runs the ranks in N processes (each rank is independent: its own fake group); the seconds in
the table are wall seconds of the dry run.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from megatron_spindle.planner.step.build import make_plan  # noqa: E402
from megatron_spindle.planner.workload.cluster import load_cluster  # noqa: E402
from megatron_spindle.planner.workload.spec import shipped_models  # noqa: E402
from megatron_spindle.planner.workload.workloads import build_graph  # noqa: E402

HEADER = ("model", "ranks", "groups used max/mean", "groups held max/mean", "peers max/mean",
          "ops/pass max/mean", "verdict", "dry run s")


def member_groups(events: list[tuple], rank: int) -> int:
    """Groups this rank is a member of (created collectively or locally), the default group included."""
    return 1 + sum(1 for e in events if e[0] == "new_group" and rank in e[1])


def _ranks_events(plan, graph, ranks: list[int]) -> list[list[tuple]]:
    from megatron_spindle.runtime.comm_dryrun import dry_run
    events = dry_run(plan, graph, ranks=ranks, timeout_s=60)
    return [events[r] for r in ranks]


def run_one(model: str, n: int, *, gpus_per_node: int, jobs: int = 1) -> dict:
    from megatron_spindle.runtime.comm_check import check, summary
    from megatron_spindle.runtime.comm_dryrun import for_graph, narrow_graph

    plan = make_plan(build_graph(model), load_cluster(None, num_devices=n, gpus_per_node=gpus_per_node))
    narrow = narrow_graph(model)
    plan = for_graph(plan, narrow)
    t0 = time.perf_counter()
    chunks = [list(range(n))[i::jobs] for i in range(min(jobs, n))]
    if len(chunks) == 1:
        parts = [_ranks_events(plan, narrow, chunks[0])]
    else:  # ranks are independent: each process joins its own fake group per rank
        with ProcessPoolExecutor(len(chunks), mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(_ranks_events, [plan] * len(chunks), [narrow] * len(chunks), chunks))
    events: list[list[tuple]] = [[] for _ in range(n)]
    for chunk, part in zip(chunks, parts):
        for r, ev in zip(chunk, part):
            events[r] = ev
    seconds = time.perf_counter() - t0
    errors = check(events)
    s = summary(events)
    held = [member_groups(ev, r) for r, ev in enumerate(events)]
    s["held"] = {"max": max(held), "mean": sum(held) / len(held)}
    return {"model": model, "ranks": n, "summary": s, "errors": errors, "seconds": seconds}


def _mm(d: dict) -> str:
    return f"{d['max']:g} / {d['mean']:.1f}"


def row(r: dict) -> tuple[str, ...]:
    s = r["summary"]
    verdict = "ok" if not r["errors"] else f"FAIL ({len(r['errors'])})"
    return (r["model"], str(r["ranks"]), _mm(s["groups"]), _mm(s["held"]), _mm(s["peers"]), _mm(s["ops"]),
            verdict, f"{r['seconds']:.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(shipped_models()), help="comma-separated shipped models")
    ap.add_argument("--ranks", default="8,64,256,1024", help="comma-separated device counts")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=1, help="processes that dry-run ranks side by side (default 1)")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in shipped_models()]
    if unknown:
        print(f"comm_check: unknown model {unknown[0]!r}; shipped: {', '.join(shipped_models())}", file=sys.stderr)
        return 2
    try:
        counts = [int(x) for x in args.ranks.split(",") if x]
    except ValueError:
        print(f"comm_check: --ranks {args.ranks!r} is not a comma-separated list of integers", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"comm_check: --jobs {args.jobs} must be at least 1", file=sys.stderr)
        return 2
    if not counts or min(counts) < 1:
        print(f"comm_check: --ranks {args.ranks!r} needs positive device counts", file=sys.stderr)
        return 2
    if args.markdown:
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "---|" * len(HEADER))
    else:
        print("  ".join(f"{h:>20}" if i > 1 else f"{h:<14}" for i, h in enumerate(HEADER)))
    failed = []
    for model in models:
        for n in counts:
            r = run_one(model, n, gpus_per_node=args.gpus_per_node, jobs=args.jobs)
            cells = row(r)
            if args.markdown:
                print("| " + " | ".join(cells) + " |", flush=True)
            else:
                print("  ".join(f"{c:>20}" if i > 1 else f"{c:<14}" for i, c in enumerate(cells)), flush=True)
            if r["errors"]:
                failed.append(r)
    for r in failed:
        print(f"\n{r['model']} at {r['ranks']} ranks:")
        for line in r["errors"][:12]:
            print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
