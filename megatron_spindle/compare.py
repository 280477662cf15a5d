"""``spindle compare``: Spindle against the baselines, every plan timed by the same step simulator.

For each device count the command plans one step with every system of :data:`.planner.step.baselines.SYSTEMS`,
simulates it on the cluster (:func:`.planner.step.simulate.simulate`) and prints a table: step time, Spindle's
speedup over the system, the breakdown (compute, inter-wave transfer, parameter sync, idle; the paper's
Figure 10), peak memory per device (max and spread), and the lower bound ``Σ C*`` with Spindle's ratio to it.
Spindle's plan is chosen by this same simulated step among its own waves and the baselines' schedules
(:mod:`.planner.step.choose`), so it is never slower than a baseline; the table says when a baseline's schedule won.
``--plot`` draws grouped bars of throughput relative to ``sequential`` (the paper's Figure 8); ``--json``
prints one object instead of tables.

A system with no plan (no placement fits) is reported with its error instead of numbers. A plan whose only
fault is memory (validation rule 7: the wave runtime stashes every activation until the backward pass) is
still timed, and flagged as over the memory limit. The exit status is 2 when Spindle itself has no plan for
a requested device count.

Curves: the analytic device model takes the cluster's peak rate and memory (``--cluster h200`` plans with
H200 curves); a ``--curves`` file replaces it entirely.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Sequence

from .argtypes import add_workload_args, positive_int_list
from .atomic import check_output, write_file
from .planner.workload.analytic import CurvesFile, DeviceModel
from .planner.step.baselines import SYSTEMS, lower_bound_ms
from .planner.step.build import plan_system
from .planner.workload.cluster import DEFAULT_PRESET, load_cluster
from .planner.workload.graph import TaskGraph
from .planner.step.simulate import StepSimulation, simulate
from .planner.step.validate import PlanError, check_plan
from .planner.workload.workloads import build_graph, resolve_passes

#: The paper's Figure 8 labels for our systems.
LABELS = {"spindle": "Spindle", "sequential": "sequential (Megatron-LM/DeepSpeed)",
          "task-level": "task-level (Optimus-style)", "intra-task": "intra-task (DistMM-MT)",
          "spindle-naive-placement": "Spindle, naive placement"}


@dataclass
class SystemResult:
    system: str
    sim: StepSimulation | None = None
    error: str | None = None
    ideal_makespan_ms: float | None = None
    """Baselines: compute time with their concurrent lanes unaligned (see :mod:`.planner.step.baselines`)."""
    over_memory: str | None = None
    """Set when the plan exceeds the cluster's memory (it is timed all the same)."""
    schedule: str | None = None
    """Spindle: the baseline whose schedule won the whole-step choice (:mod:`.planner.step.choose`), else ``None``."""

    @property
    def ok(self) -> bool:
        return self.sim is not None

    def to_json(self) -> dict:
        if not self.ok:
            return {"error": self.error}
        s = self.sim
        d = {"step_ms": s.step_ms, "breakdown": s.breakdown.to_json(), "shares": s.breakdown.shares(),
             "peak_memory_gib": s.max_memory_gib, "peak_memory_spread_gib": s.memory_spread_gib,
             "makespan_ms": s.makespan_ms, "num_waves": len(s.waves)}
        if self.ideal_makespan_ms is not None:
            d["unaligned_makespan_ms"] = self.ideal_makespan_ms
        if self.over_memory:
            d["over_memory"] = self.over_memory
        if self.schedule:
            d["schedule"] = self.schedule
        return d


@dataclass
class Comparison:
    """Every system on one device count."""

    model: str
    tasks: int
    gpus: int
    cluster: str
    gpus_per_node: int
    lower_bound_ms: float
    results: dict[str, SystemResult] = field(default_factory=dict)
    passes: int = 1
    """Passes of the plan per optimizer step (gradient accumulation): a step is ``passes`` passes + one sync."""

    def step_ms(self, system: str) -> float | None:
        r = self.results.get(system)
        return r.sim.step_ms if r is not None and r.ok else None

    def speedup(self, system: str, over: str) -> float | None:
        """How much faster ``system`` is than ``over`` (step time ratio), ``None`` if either has no plan."""
        a, b = self.step_ms(system), self.step_ms(over)
        return b / a if a and b else None

    def to_json(self) -> dict:
        return {"model": self.model, "tasks": self.tasks, "gpus": self.gpus, "cluster": self.cluster,
                "lower_bound_ms": self.lower_bound_ms, "passes": self.passes,
                "systems": {k: r.to_json() for k, r in self.results.items()}}


def _first_line(e: Exception) -> str:
    if isinstance(e, PlanError):
        v = e.violations
        return f"invalid plan: {v[0]}" + (f" (and {len(v) - 1} more violations)" if len(v) > 1 else "")
    lines = str(e).splitlines()
    return lines[0] if lines else type(e).__name__


def _memory_note(e: PlanError) -> str:
    worst = max((v for v in e.violations), key=lambda v: v.message)
    return (f"out of memory on {len(e.violations)} device(s), e.g. device {worst.device}: "
            f"{worst.message}")


def compare(graph: TaskGraph, gpus: Sequence[int], *, cluster: str | None = DEFAULT_PRESET,
            curves_file: CurvesFile | None = None, systems: Sequence[str] = SYSTEMS,
            passes: int = 1) -> list[Comparison]:
    """Plan one pass of ``graph`` with every system on every device count and simulate a step of ``passes``
    passes (gradient accumulation) with one gradient sync."""
    out = []
    for n in gpus:
        cl = load_cluster(cluster, num_devices=n)
        device = None if curves_file else DeviceModel(peak_tflops=cl.peak_tflops, memory_gib=cl.memory_gib)
        cmp = Comparison(model=graph.model, tasks=len(graph.tasks), gpus=n, cluster=cl.name,
                         gpus_per_node=cl.gpus_per_node, passes=passes,
                         lower_bound_ms=lower_bound_ms(graph, cl, curves_file=curves_file, device=device))
        for system in systems:
            report: dict = {}
            try:
                plan = plan_system(system, graph, cl, curves_file=curves_file, device=device, report=report,
                                   validate=False, passes=passes)
                note = None
                try:
                    check_plan(plan)
                except PlanError as e:
                    if any(v.rule != 7 for v in e.violations):
                        raise
                    note = _memory_note(e)
                won = plan.levels[0].variant if system == "spindle" and plan.levels else ""
                cmp.results[system] = SystemResult(system, sim=simulate(plan, cl, check_memory=False, passes=passes),
                                                   ideal_makespan_ms=report.get("ideal_makespan_ms"),
                                                   over_memory=note,
                                                   schedule=won.split(" schedule")[0] if "whole step" in won else None)
            except (ValueError, KeyError) as e:
                cmp.results[system] = SystemResult(system, error=_first_line(e))
        out.append(cmp)
    return out


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------
def format_table(cmp: Comparison) -> str:
    head = (f"{cmp.model} ({cmp.tasks} tasks) on {cmp.gpus} devices, cluster {cmp.cluster} "
            f"({cmp.gpus_per_node} per island), {cmp.passes} pass{'es' if cmp.passes > 1 else ''} per step: "
            f"lower bound ΣC* = {cmp.lower_bound_ms:.1f} ms per pass")
    cols = ("system", "step ms", "Spindle speedup", "compute", "transfer", "sync", "idle", "mem max GiB",
            "mem spread GiB")
    rows = []
    notes = []
    for name, r in cmp.results.items():
        if not r.ok:
            rows.append((name, "-", "-", "", "", "", "", "", ""))
            notes.append(f"  {name}: {r.error}")
            continue
        sh = r.sim.breakdown.shares()
        sp = cmp.speedup("spindle", name)
        rows.append((name, f"{r.sim.step_ms:.1f}", "-" if name == "spindle" or sp is None else f"{sp:.2f}x",
                     f"{sh['compute']:.1%}", f"{sh['transfer']:.1%}", f"{sh['sync']:.1%}", f"{sh['idle']:.1%}",
                     f"{r.sim.max_memory_gib:.1f}" + ("!" if r.over_memory else ""),
                     f"{r.sim.memory_spread_gib:.1f}"))
        if r.over_memory:
            notes.append(f"  {name}: {r.over_memory}")
    width = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def line(vals):
        return "  ".join(v.ljust(width[0]) if i == 0 else v.rjust(width[i]) for i, v in enumerate(vals))

    lines = [head, line(cols), "-" * len(line(cols))] + [line(r) for r in rows]
    sp = cmp.results.get("spindle")
    if sp is not None and sp.ok and cmp.lower_bound_ms > 0:
        s = sp.sim
        lines.append(f"Spindle / ΣC*: compute makespan {s.makespan_ms / cmp.lower_bound_ms:.3f} "
                     f"({s.makespan_ms:.1f} ms per pass), whole step {s.step_ms / (cmp.passes * cmp.lower_bound_ms):.2f} "
                     f"(ΣC* bounds compute of level-by-level schedules only)")
    if sp is not None and sp.ok and sp.schedule:
        lines.append(f"Spindle's plan is the {sp.schedule} schedule: its simulated step was the shortest of Spindle's "
                     f"candidates (see planner/step/choose.py)")
    if notes:
        lines.append("no plan, or over the memory limit (!):")
        lines.extend(notes)
    return "\n".join(lines)


def to_json(cmps: Sequence[Comparison]) -> dict:
    return {"results": [c.to_json() for c in cmps]}


def plot(groups: Sequence[tuple[str, Sequence[Comparison]]], path: str, *,
         systems: Sequence[str] = ("sequential", "task-level", "intra-task", "spindle-naive-placement", "spindle"),
         reference: str = "sequential", paper: dict | None = None) -> None:
    """Grouped bars (one panel per workload, one group per device count): throughput relative to ``reference``.

    ``paper`` maps ``(panel title, gpus)`` to the paper's speedup of Spindle, drawn as a marker.
    """
    try:
        import matplotlib  # optional: matplotlib (--plot only)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: matplotlib (--plot only)
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    colors = {"sequential": "#8c8c8c", "task-level": "#4c72b0", "intra-task": "#55a868",
              "spindle-naive-placement": "#dd8452", "spindle": "#c44e52"}
    k = len(groups)
    cols = min(3, k)
    rows = -(-k // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(7.0, 4.2 * cols), 3.2 * rows + 0.6), squeeze=False)
    width = 0.8 / len(systems)
    for ax, (title, cmps) in zip(axes.flat, groups):
        for j, system in enumerate(systems):
            xs, ys = [], []
            for i, c in enumerate(cmps):
                v = c.speedup(system, reference)
                x = i + (j - (len(systems) - 1) / 2) * width
                r = c.results.get(system)
                if v is None:
                    ax.text(x, 0.05, "no plan", rotation=90, ha="center", va="bottom", fontsize=6)
                    continue
                xs.append(x)
                ys.append(v)
                if r is not None and r.over_memory:
                    ax.text(x, v, "OOM", rotation=90, ha="center", va="bottom", fontsize=6)
            ax.bar(xs, ys, width, color=colors.get(system), label=LABELS.get(system, system))
        if paper:
            for i, c in enumerate(cmps):
                if (title, c.gpus) in paper:
                    ax.plot([i + (len(systems) - 1) / 2 * width], [paper[(title, c.gpus)]], marker="*",
                            color="black", markersize=9, label="paper: Spindle" if i == 0 else None)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xticks(range(len(cmps)))
        ax.set_xticklabels([f"{c.gpus} GPUs" for c in cmps])
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(f"speedup over {reference}", fontsize=8)
    for ax in list(axes.flat)[k:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    seen = {}
    for h, lab in zip(handles, labels):
        seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen.keys()), loc="lower center", ncol=3, fontsize=7)
    fig.tight_layout(rect=(0, 0.6 / (3.2 * rows + 0.6), 1, 1))
    try:
        write_file(path, lambda fh: fig.savefig(fh, format="png", dpi=130), "plot")
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``spindle compare`` on the ``spindle`` command's subparsers."""
    p = subparsers.add_parser("compare", help="simulate Spindle and the baselines on one workload and compare")
    add_workload_args(p)
    p.add_argument("--gpus", type=positive_int_list, required=True, metavar="N[,N...]", help="device counts, e.g. 8,16,32")
    p.add_argument("--cluster", default=DEFAULT_PRESET, metavar="PRESET|FILE",
                   help=f"cluster preset (a800-8x8, h200) or a JSON file of cluster fields (default {DEFAULT_PRESET})")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="draw grouped bars of the speedups")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=cmd_compare)
    return p


def cmd_compare(args) -> int:
    load_cluster(args.cluster, num_devices=max(args.gpus))  # bad preset / file: fail before planning
    if args.plot:
        check_output(args.plot, "--plot")
    passes = resolve_passes(args.model, size=args.size, batch=args.batch, passes=args.passes)
    graph = build_graph(args.model, tasks=args.tasks, size=args.size, batch=args.batch, passes=passes,
                        freeze=args.freeze)
    curves = CurvesFile.load(args.curves) if args.curves else None
    cmps = compare(graph, args.gpus, cluster=args.cluster, curves_file=curves, passes=passes)
    if args.plot:
        plot([(f"{graph.model}, {len(graph.tasks)} tasks", cmps)], args.plot)
    if args.json:
        print(json.dumps(to_json(cmps)))
    else:
        print("\n\n".join(format_table(c) for c in cmps))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    failed = [c.gpus for c in cmps if not c.results["spindle"].ok]
    if failed:
        print(f"spindle compare: error: Spindle has no plan on {', '.join(map(str, failed))} devices: "
              f"{next(c.results['spindle'].error for c in cmps if not c.results['spindle'].ok)}", file=sys.stderr)
        return 2
    return 0
