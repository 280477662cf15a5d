"""The ``spindle`` command line: ``spindle plan``, ``compare``, ``profile`` and ``hf`` (pretrained models).

Every command turns bad input into one line on stderr naming the offending value and exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import threading
import time

from .compare import cli as compare
from .argtypes import add_workload_args, positive_int, workload_of
from .atomic import check_output
from .log import setup_logging
from .mimo.grids import grids_json, grids_lines
from .planner.workload.analytic import CurvesFile, DeviceModel
from .planner.step.build import make_plan
from .planner.tuning.tune_spindle import tune_with_baselines
from .planner.tuning.tune import Workload, tune_static_grids
from .planner.workload.cluster import load_cluster
from .planner.simulation.simulate import simulate
from .planner.simulation.step_bound import plan_step_bound
from .planner.assembly.execution import Execution
from .planner.assembly.render import check_plotting, gantt, grid, grid_key, idle_warning, metaop_table, summary
from .planner.assembly.validate import check_plan
from .planner.level.solver import available as highs_available
from .plan_output import HIGHS_NOTE, Configured, pass_timeline, plan_json, step_lines, step_title
from .hf import cli as hf_cli
from .profiler import cli as profiler_cli


class OneLineParser(argparse.ArgumentParser):
    """Every argument error is one line naming the value (no usage block), exit status 2; the subcommands'
    parsers are of this class too (argparse makes them of their parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="spindle", description="Spindle wavefront planning for "
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
    p.add_argument("--mimo-grids", action="store_true",
                   help="with --model-provider: also the best static per-module layout as MIMO's module_to_grid_map "
                        "(each module's HyperCommGrid), beside Spindle's plan (docs/mimo.md)")
    p.add_argument("--progress-interval", type=float, default=10.0, metavar="S",
                   help="while planning, a 'planning: N s so far' line every S seconds (0: none; on stderr with "
                        "--json)")
    p.set_defaults(func=cmd_plan)
    compare.add_parser(sub)
    profiler_cli.add_parser(sub)
    hf_cli.add_parser(sub)
    return parser


def cmd_plan(args) -> int:
    given = args.passes not in (None, "auto")  # a user's --passes wins over the tuned configuration
    workload = workload_of(args)
    workload.graph(args.passes if given else 1)  # bad model, tasks, size, batch or passes: fail before planning
    if args.mimo_grids and not args.model_provider:
        raise ValueError("--mimo-grids: MIMO's grids are of a MimoModel; give --model-provider MODULE:FUNCTION")
    curves = CurvesFile.load(args.curves) if args.curves else None
    cluster = load_cluster(None, num_devices=args.gpus, gpus_per_node=args.gpus_per_node,
                           memory_gib=args.memory_gib if args.memory_gib is not None else
                           (curves.device.memory_gib if curves else None))
    if curves is not None and curves.measured.get("backend") == "gloo":  # curves of gloo ranks: a plan for them
        cluster = dataclasses.replace(cluster, communicator_mib=0.0)     # (no NCCL buffers on a device)
    device = None if curves else DeviceModel(peak_tflops=cluster.peak_tflops, memory_gib=cluster.memory_gib)
    for path, what in ((args.out, "--out"), (args.gantt, "--gantt")):
        if path:
            check_output(path, what)  # before the planning, not after it
    if args.gantt:
        check_plotting("--gantt")
    t0 = time.perf_counter()
    with _progress(args, cluster):
        plan, configured = _make(args, workload, cluster, curves, device, given)
    planning_s = time.perf_counter() - t0
    whole = plan_step_bound(plan, cluster)  # the whole step's bound: every wave plan of this configuration
    sim = simulate(plan, cluster, check_memory=False)
    if args.out:
        plan.save(args.out)
    if args.gantt:
        gantt(plan, args.gantt, timeline=pass_timeline(plan, cluster), step=step_title(sim))
    idle = idle_warning(plan)
    if idle:
        print(idle, file=sys.stderr)
    if not highs_available():
        print(HIGHS_NOTE, file=sys.stderr)
    static = tune_static_grids(workload, cluster, curves_file=curves, device=device) if args.mimo_grids else None
    if args.json:
        out = plan_json(plan, sim, whole, cluster, configured, planning_s=planning_s,
                        files={"plan": args.out, "gantt": args.gantt})
        if static is not None:
            out["mimo_grids"] = grids_json(static, sim.step_ms)
        print(json.dumps(out))
        return 0
    if curves is not None:
        uncovered = [m for m, c in plan.curves if c.source == "analytic"]
        if uncovered:
            print(f"note: {len(uncovered)} MetaOp(s) not in {args.curves} use the analytic curve: "
                  f"{', '.join(uncovered[:4])}{' ...' if len(uncovered) > 4 else ''}", file=sys.stderr)
    print(metaop_table(plan))
    print()
    print(grid(plan))
    print(grid_key(plan))
    print()
    print(summary(plan, planning_s, configuration=configured.line(), schedule=configured.schedule))
    print(step_lines(sim, whole, cluster))
    if static is not None:
        print()
        print(grids_lines(static, sim.step_ms))
    if args.out:
        print(f"plan written to {args.out}")
    if args.gantt:
        print(f"Gantt chart written to {args.gantt}")
    return 0


def _make(args, workload: Workload, cluster, curves, device, given: bool):
    """``(plan, configuration)`` of ``spindle plan``: at ``--passes`` when given, else at the configuration
    ``spindle compare`` picks for Spindle (:func:`.planner.tuning.tune_spindle.tune_with_baselines`: passes,
    recompute, ZeRO-1, phases), so both commands print one step for one workload."""
    if given:
        ex, report = Execution(passes=args.passes), {}
        plan = make_plan(workload.graph(ex.passes), cluster, curves_file=curves, device=device,
                         search=not args.no_search, execution=ex, report=report)
        return plan, Configured(ex, given=True, schedule=report.get("winner", "spindle"))
    tuned = tune_with_baselines(workload, cluster, curves_file=curves, device=device)["spindle"]
    if tuned.plan is None:
        raise ValueError(f"no configuration fits: {tuned.error}")
    ex, plan, schedule = tuned.execution, tuned.plan, tuned.extra.get("schedule", "spindle")
    if args.no_search:  # the paper's pipeline alone, at the tuned configuration
        report: dict = {}
        plan = make_plan(workload.graph(ex.passes), cluster, curves_file=curves, device=device, search=False,
                         execution=ex, report=report)
        schedule = report.get("winner", "spindle")
    else:
        check_plan(plan)  # the tuner plans without validation; what is printed and saved passes every rule
    return plan, Configured(ex, given=False, schedule=schedule, tried=len(tuned.tried))


@contextlib.contextmanager
def _progress(args, cluster):
    """A 'planning: N s so far' line every ``--progress-interval`` seconds while the planner runs (a large
    cluster or batch, the tuned default: up to a minute), so a long plan is not taken for a hang."""
    every = args.progress_interval
    if not (math.isfinite(every) and every >= 0):
        raise ValueError(f"--progress-interval {every}: must be zero or more seconds")
    done = threading.Event()
    out = sys.stderr if args.json else sys.stdout
    what = f"{args.model or args.model_provider}, {cluster.num_devices} devices, batch {args.batch or 'of the model'}"

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
