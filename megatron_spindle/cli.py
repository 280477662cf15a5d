"""The ``spindle`` command line: ``spindle plan``, ``compare``, ``profile`` and ``hf`` (pretrained models).

Every command turns bad input into one line on stderr naming the offending value and exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import threading
import time

from .compare import cli as compare
from .argtypes import add_workload_args, passes_of, positive_int, workload_of
from .atomic import check_output
from .log import setup_logging
from .planner.workload.analytic import CurvesFile
from .planner.step.build import make_plan
from .planner.tuning.tune_spindle import tune_spindle
from .planner.workload.cluster import load_cluster
from .planner.simulation.simulate import simulate, step_sync_floor
from .planner.simulation.step_bound import plan_step_bound
from .planner.assembly.render import certified_bound_ms, gantt, grid, idle_devices, idle_warning, metaop_table, summary
from .hf import cli as hf_cli
from .profiler import cli as profiler_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spindle", description="Spindle wavefront planning for "
                                     "multi-task multi-modal training on Megatron-LM")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan one training step and print it as a wave x device grid")
    add_workload_args(p)
    p.add_argument("--gpus", type=positive_int, required=True, help="number of devices")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="devices per island (default 8)")
    p.add_argument("--memory-gib", type=float, default=None, help="memory per device in GiB (default 80)")
    p.add_argument("--no-search", action="store_true",
                   help="run only the paper's pipeline per level (no candidate search)")
    p.add_argument("--out", default=None, metavar="PLAN.json", help="write the plan as JSON")
    p.add_argument("--gantt", default=None, metavar="PLAN.png", help="draw the waves per device as a PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--progress-interval", type=float, default=10.0, metavar="S",
                   help="while planning, a 'planning: N s so far' line every S seconds (0: none; on stderr with "
                        "--json)")
    p.set_defaults(func=cmd_plan)
    compare.add_parser(sub)
    profiler_cli.add_parser(sub)
    hf_cli.add_parser(sub)
    return parser


def cmd_plan(args) -> int:
    auto = args.passes == "auto"
    workload = workload_of(args)
    passes = None if auto else passes_of(args)
    graph = workload.graph(passes or 1)
    curves = CurvesFile.load(args.curves) if args.curves else None
    cluster = load_cluster(None, num_devices=args.gpus, gpus_per_node=args.gpus_per_node,
                           memory_gib=args.memory_gib if args.memory_gib is not None else
                           (curves.device.memory_gib if curves else None))
    for path, what in ((args.out, "--out"), (args.gantt, "--gantt")):
        if path:
            check_output(path, what)  # before the planning, not after it
    t0 = time.perf_counter()
    with _progress(args, cluster, auto):
        plan, passes, graph = _make(args, workload, graph, cluster, curves, passes, auto)
    planning_s = time.perf_counter() - t0
    if args.out:
        plan.save(args.out)
    if args.gantt:
        gantt(plan, args.gantt)
    idle = idle_warning(plan)
    if idle:
        print(idle, file=sys.stderr)
    whole = plan_step_bound(plan, cluster)  # issue 32: the whole step's bound, beside Σ C*
    sim = simulate(plan, cluster, check_memory=False)
    step, floor = sim.step_ms, step_sync_floor(sim, cluster)
    if args.json:
        print(json.dumps({
            "model": plan.model, "tasks": len(plan.tasks), "gpus": plan.world_size,
            "makespan_ms": plan.makespan_ms, "lower_bound_ms": plan.lower_bound_ms,
            "ratio": plan.makespan_ms / plan.lower_bound_ms, "certified_bound_ms": certified_bound_ms(plan),
            "gap": plan.makespan_ms / certified_bound_ms(plan) - 1, "planning_s": planning_s,
            "num_waves": len(plan.waves), "num_metaops": len(plan.metaops), "num_levels": plan.num_levels,
            "max_memory_gib": max(plan.device_memory_bytes) / 2**30, "idle_devices": len(idle_devices(plan)),
            "passes": passes, "plan": args.out, "gantt": args.gantt, "step_ms": step,
            "step_bound_ms": whole.bound_ms, "step_bound": whole.to_json(),
            "sync_floor": None if floor is None else floor[0].to_json(floor[1])}))
        return 0
    if curves is not None:
        uncovered = [m for m, c in plan.curves if c.source == "analytic"]
        if uncovered:
            print(f"note: {len(uncovered)} MetaOp(s) not in {args.curves} use the analytic curve: "
                  f"{', '.join(uncovered[:4])}{' ...' if len(uncovered) > 4 else ''}", file=sys.stderr)
    print(metaop_table(plan))
    print()
    print(grid(plan))
    print()
    print(summary(plan, planning_s))
    print(f"step          {step:10.2f} ms   (simulated: {plan.passes} pass{'es' if plan.passes != 1 else ''}, "
          f"transfers and the gradient sync)")
    print(f"step bound    {whole.bound_ms:10.2f} ms   (every wave plan of this configuration: compute and paths "
          f"{whole.compute_ms:.2f} ms, the cheapest sync adds {whole.sync_ms:.2f}); step / bound "
          f"{step / whole.bound_ms:.3f}")
    if floor is not None:
        print(f"sync floor    {floor[1]:10.2f} ms   (this plan's {floor[0].resource}: {floor[0].busy_ms:.2f} ms of "
              f"gradient all-reduces once a bucket of it is ready at {floor[0].from_ms:.2f} ms)")
    if args.out:
        print(f"plan written to {args.out}")
    if args.gantt:
        print(f"Gantt chart written to {args.gantt}")
    return 0


def _make(args, workload, graph, cluster, curves, passes, auto: bool):
    """The plan of ``spindle plan``: ``(plan, passes, graph)``."""
    if auto:  # the pass count joins the choice: Spindle at its own best configuration (planner/step/tuning.py)
        tuned = tune_spindle(workload, cluster, curves_file=curves)
        if tuned.plan is None:
            raise ValueError(f"no configuration fits: {tuned.error}")
        plan, passes = tuned.plan, tuned.execution.passes
        graph = workload.graph(passes)
        print(f"configuration: {tuned.execution.label()} (best of {len(tuned.tried)} tried)", file=sys.stderr)
    else:
        plan = make_plan(graph, cluster, curves_file=curves, search=not args.no_search, passes=passes)
    return plan, passes, graph


@contextlib.contextmanager
def _progress(args, cluster, auto: bool):
    """A 'planning: N s so far' line every ``--progress-interval`` seconds while the planner runs (a large
    cluster or batch, ``--passes auto``: minutes), so a long plan is not taken for a hang."""
    every = args.progress_interval
    if not (math.isfinite(every) and every >= 0):
        raise ValueError(f"--progress-interval {every}: must be zero or more seconds")
    done = threading.Event()
    out = sys.stderr if args.json else sys.stdout
    what = (f"{args.model or args.model_provider}, {cluster.num_devices} devices, batch {args.batch or 'of the model'}"
            + (", every pass count (--passes auto)" if auto else ""))

    def beat():
        t0 = time.perf_counter()
        while not done.wait(every):
            print(f"planning: {time.perf_counter() - t0:.0f} s so far ({what})", file=out, flush=True)

    thread = threading.Thread(target=beat, name="spindle-plan-progress", daemon=True) if every > 0 else None
    if thread:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread:
            thread.join()


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(announce=False, stream=sys.stderr if getattr(args, "json", False) else None)  # stdout: JSON only
    try:
        return args.func(args)
    except (ValueError, KeyError) as e:  # bad input: one clear line
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        first = str(msg).splitlines()
        print(f"spindle {args.command}: error: {first[0] if first else msg}", file=sys.stderr)
        for line in first[1:]:
            print(line, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
