"""``spindle compare``: Spindle against the baselines, each at its own best configuration, timed by one simulator.

For each device count every system of :data:`..planner.systems.baselines.SYSTEMS` is tuned to its own best step
(:mod:`..planner.tuning.tune`: passes per step, activation recompute, the distributed optimizer, tensor
parallelism, Spindle's phases, each under that system's own runtime memory), simulated on the cluster
(:func:`..planner.simulation.simulate.simulate`; the static grids by :mod:`..planner.systems.static_grids`), and printed
as a table: step time, Spindle's speedup over the system, the configuration each chose, the breakdown
(compute, inter-wave transfer, parameter sync, idle; the paper's Figure 10) and peak memory per device.
``--fixed-passes`` instead holds every system to one configuration (the spec's passes, nothing recomputed:
the comparison of earlier releases); a plan that then exceeds memory is timed all the same and flagged.
``--plot`` draws grouped bars of throughput relative to ``sequential`` (the paper's Figure 8); ``--json``
prints one object, with every configuration each tuner tried.

Spindle's whole-step choice has the baselines' schedules among its candidates at their own best
configurations (:mod:`..planner.step.choose`), so it is never slower than a baseline whose schedule the wave
runtime can execute within memory; the table says when a baseline's schedule won. The exit status is 2 when
Spindle itself has no plan for a requested device count.

Curves: the analytic device model takes the cluster's peak rate and memory (``--cluster h200`` plans with
H200 curves); a ``--curves`` file replaces it entirely.

Beside every step: the model TFLOP/s per device and MFU (model FLOPs over the cluster's peak), and, with the
analytic curves, the step at the fast and slow edges of the published anchors with whether the winner or the ranking
changes between the edges (:mod:`.band`; ``--no-band`` skips it).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Sequence

from ..argtypes import add_workload_args, passes_of, positive_int_list, workload_of
from ..atomic import check_output, write_file
from .band import band_lines, fill_band, fill_mfu
from .explain import explain_row
from .memory import memory_line, memory_stats, plot_memory
from ..planner.systems.baselines import BASELINES, SYSTEMS
from ..planner.step.build import make_plan
from ..planner.assembly.execution import Execution
from ..planner.simulation.simulate import StepSimulation, simulate
from ..planner.tuning.tune_spindle import tune_with_baselines
from ..planner.tuning.tune import Tuned, Workload, tune_baseline, tune_static_grids
from ..planner.workload.analytic import CurvesFile, DeviceModel
from ..planner.workload.cluster import DEFAULT_PRESET, PRESETS, load_cluster
from ..planner.level.solver import available as highs_available
from ..plan_output import HIGHS_NOTE
from ..planner.assembly.render import check_plotting

#: The paper's Figure 8 labels for our systems.
LABELS = {"spindle": "Spindle", "sequential": "sequential (Megatron-LM/DeepSpeed)",
          "task-level": "task-level (Optimus-style)", "intra-task": "intra-task (DistMM-MT)",
          "static-grids": "module grids (megatron.core MIMO)", "spindle-naive-placement": "Spindle, naive placement"}


@dataclass
class SystemResult:
    system: str
    sim: StepSimulation | None = None
    error: str | None = None
    execution: Execution | None = None
    """The configuration the system runs at (its best, or the fixed one)."""
    over_memory: str | None = None
    """Set (``--fixed-passes`` only) when the plan exceeds the cluster's memory; it is timed all the same."""
    schedule: str | None = None
    """Spindle: the baseline whose schedule won the whole-step choice (:mod:`..planner.step.choose`), else ``None``."""
    tuned: Tuned | None = None
    model_flops: float | None = None
    """Model FLOPs of one step (forward + backward at the system's passes, recompute not counted)."""
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    """Model FLOPs utilization: ``tflops_per_gpu`` over the cluster's peak per device."""
    slow_ms: float | None = None
    """The step at the slow edge of the analytic model's band (the same configuration re-planned)."""

    @property
    def ok(self) -> bool:
        return self.sim is not None

    @property
    def level_by_level(self) -> bool:
        """Whether the system's plan runs its waves level by level (:attr:`..planner.assembly.plan.Plan.level_by_level`):
        only then is its per-pass compute makespan bounded by Σ C*."""
        plan = self.tuned.plan if self.tuned is not None else None
        return plan is not None and plan.level_by_level and self.sim is not None and self.sim.system == plan.system

    def to_json(self) -> dict:
        if not self.ok:
            d = {"error": self.error}
        else:
            s = self.sim
            d = {"step_ms": s.step_ms, "breakdown": s.breakdown.to_json(), "shares": s.breakdown.shares(),
                 "peak_memory_gib": s.max_memory_gib, "peak_memory_spread_gib": s.memory_spread_gib,
                 "memory": memory_stats(s.peak_memory_bytes), "num_waves": len(s.waves),
                 "level_by_level": self.level_by_level,
                 "makespan_ms": s.makespan_ms if self.level_by_level else None, "model_flops": self.model_flops,
                 "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                 "band_ms": None if self.slow_ms is None else {"fitted": s.step_ms, "slow": self.slow_ms}}
        if self.execution is not None:
            d["configuration"] = {**self.execution.to_json(), "label": self.execution.label()}
        if self.over_memory:
            d["over_memory"] = self.over_memory
        if self.schedule:
            d["schedule"] = self.schedule
        if self.tuned is not None:
            d["tried"] = [t.to_json() for t in self.tuned.tried]
            details = {k: v for k, v in self.tuned.extra.items() if k in ("grids", "micro_batches")}
            if details:
                d["details"] = details
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
    """Σ C* of one pass at Spindle's passes (0 without a Spindle plan): a bound of level-by-level waves only."""
    results: dict[str, SystemResult] = field(default_factory=dict)
    tuned: bool = True
    """Every system at its own best configuration (``False``: ``--fixed-passes``)."""
    peak_tflops: float = 0.0
    """The cluster's peak per device, the MFU's denominator."""
    curves: str = "analytic"
    """``analytic`` (the device model) or ``file`` (a ``--curves`` file: measured, no band)."""
    band: dict | None = None
    """The band's edges, rankings and whether the winner changes (:func:`.band.fill_band`); ``None``
    with measured curves or ``band=False``."""
    explanation: object | None = None
    """Where Spindle and the best baseline differ, the winning candidate, the bounds (:mod:`.explain`)."""
    usable_memory_gib: float = 0.0
    """Memory per device a plan may use (the cluster's memory times its usable fraction)."""

    def step_ms(self, system: str) -> float | None:
        r = self.results.get(system)
        return r.sim.step_ms if r is not None and r.ok else None

    def speedup(self, system: str, over: str) -> float | None:
        """How much faster ``system`` is than ``over`` (step time ratio), ``None`` if either has no plan."""
        a, b = self.step_ms(system), self.step_ms(over)
        return b / a if a and b else None

    def memory(self) -> dict[str, dict]:
        """Every system with a plan: :func:`.memory.memory_stats` of its devices' peaks."""
        return {k: memory_stats(r.sim.peak_memory_bytes) for k, r in self.results.items() if r.ok}

    @property
    def passes(self) -> int:
        r = self.results.get("spindle")
        return r.execution.passes if r is not None and r.execution is not None else 0

    def to_json(self) -> dict:
        return {"model": self.model, "tasks": self.tasks, "gpus": self.gpus, "cluster": self.cluster,
                "lower_bound_ms": self.lower_bound_ms, "tuned": self.tuned, "peak_tflops": self.peak_tflops,
                "curves": self.curves, "band": self.band, "usable_memory_gib": self.usable_memory_gib,
                "memory_note": memory_line(self.memory(), self.usable_memory_gib),
                "systems": {k: r.to_json() for k, r in self.results.items()},
                **({"explain": self.explanation.to_json()} if self.explanation is not None else {})}


def _result(t: Tuned, cluster, fixed: bool) -> SystemResult:
    r = SystemResult(t.system, tuned=t, execution=t.execution)
    if t.sim is not None:
        r.sim = t.sim
    elif fixed and t.extra.get("over_sim") is not None:  # held to one configuration: timed all the same
        r.sim, r.execution = t.extra["over_sim"], t.extra["over_execution"]
        r.over_memory = t.extra["over_memory"]
    else:
        r.error = t.error
    if t.plan is not None and t.system == "spindle":
        won = t.plan.levels[0].variant if t.plan.levels else ""
        r.schedule = won.split(" schedule")[0] if "whole step" in won else None
    return r


def compare(workload: Workload, gpus: Sequence[int], *, cluster: str | None = DEFAULT_PRESET,
            curves_file: CurvesFile | None = None, systems: Sequence[str] = SYSTEMS,
            fixed: Execution | None = None, band: bool = True) -> list[Comparison]:
    """Every system of ``systems`` on every device count, each at its own best configuration (``fixed``: all at
    that one), with its MFU and (``band``, analytic curves only) its step at the slow edge of the band."""
    out = []
    for n in gpus:
        cl = load_cluster(cluster, num_devices=n)
        device = None if curves_file else DeviceModel(peak_tflops=cl.peak_tflops, memory_gib=cl.memory_gib)
        kw = dict(curves_file=curves_file, device=device, fixed=fixed)
        baselines = [s for s in systems if s in BASELINES]
        if "spindle" in systems or "spindle-naive-placement" in systems:  # as `spindle plan` tunes it
            tuned = tune_with_baselines(workload, cl, baselines=baselines, **kw)
        else:
            tuned = {system: tune_baseline(system, workload, cl, **kw) for system in baselines}
        if "static-grids" in systems:
            tuned["static-grids"] = tune_static_grids(workload, cl, **kw)
        graph0 = workload.graph(1)
        spindle = tuned.get("spindle")
        cmp = Comparison(model=graph0.model, tasks=len(graph0.tasks), gpus=n, cluster=cl.name,
                         gpus_per_node=cl.gpus_per_node, tuned=fixed is None, peak_tflops=cl.peak_tflops,
                         curves="file" if curves_file else "analytic",
                         lower_bound_ms=spindle.plan.lower_bound_ms if spindle and spindle.plan else 0.0,
                         usable_memory_gib=cl.memory_limit_bytes / 2**30)
        for system in systems:
            if system == "spindle-naive-placement":
                cmp.results[system] = _naive(workload, cl, spindle, curves_file, device)
            else:
                cmp.results[system] = _result(tuned[system], cl, fixed is not None)
        fill_mfu(cmp.results, workload, n, cl.peak_tflops)
        if band and device is not None and fixed is None:
            cmp.band = fill_band(cmp.results, workload, cl, device)
        if len(cmp.results) > 1:  # a row with something to compare against
            cmp.explanation = explain_row(cmp, workload, cl, curves_file=curves_file, device=device)
        out.append(cmp)
    return out


def _naive(workload: Workload, cl, spindle: Tuned | None, curves_file, device) -> SystemResult:
    """The ablation: Spindle's own waves at its configuration, placed on consecutive devices."""
    if spindle is None or spindle.execution is None:
        return SystemResult("spindle-naive-placement", error="Spindle has no plan here")
    ex = spindle.execution
    try:
        plan = make_plan(workload.graph(ex.passes), cl, curves_file=curves_file, device=device, validate=False,
                         placement="sequential", execution=ex)
    except (ValueError, KeyError) as e:
        return SystemResult("spindle-naive-placement", error=str(e).splitlines()[0], execution=ex)
    over = max(plan.device_memory_bytes) > cl.memory_limit_bytes * (1 + 1e-9)
    return SystemResult("spindle-naive-placement", sim=simulate(plan, cl, check_memory=False), execution=ex,
                        over_memory="over the memory limit" if over else None)


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------
def format_table(cmp: Comparison) -> str:
    how = "each system at its own best configuration" if cmp.tuned else "every system at one configuration"
    head = (f"{cmp.model} ({cmp.tasks} tasks) on {cmp.gpus} devices, cluster {cmp.cluster} "
            f"({cmp.gpus_per_node} per island), {how}")
    cols = ("system", "step ms", "Spindle speedup", "configuration", "TFLOP/s/GPU", "MFU", "slow-edge ms", "compute",
            "transfer", "sync", "idle", "mem max GiB", "mem spread GiB")
    rows = []
    notes = []
    for name, r in cmp.results.items():
        conf = r.execution.label() if r.execution is not None else ""
        if not r.ok:
            rows.append((name, "-", "-", conf, "", "", "", "", "", "", "", "", ""))
            notes.append(f"  {name}: {r.error}")
            continue
        sh = r.sim.breakdown.shares()
        sp = cmp.speedup("spindle", name)
        rows.append((name, f"{r.sim.step_ms:.1f}", "-" if name == "spindle" or sp is None else f"{sp:.2f}x", conf,
                     f"{r.tflops_per_gpu:.1f}", f"{r.mfu:.1%}", "-" if r.slow_ms is None else f"{r.slow_ms:.1f}",
                     f"{sh['compute']:.1%}", f"{sh['transfer']:.1%}", f"{sh['sync']:.1%}", f"{sh['idle']:.1%}",
                     f"{r.sim.max_memory_gib:.1f}" + ("!" if r.over_memory else ""), f"{r.sim.memory_spread_gib:.1f}"))
        if r.over_memory:
            notes.append(f"  {name}: {r.over_memory}")
    width = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def line(vals):
        return "  ".join(v.ljust(width[i]) if i in (0, 3) else v.rjust(width[i]) for i, v in enumerate(vals))

    lines = [head, line(cols), "-" * len(line(cols))] + [line(r) for r in rows]
    sp = cmp.results.get("spindle")
    if sp is not None and sp.ok and cmp.lower_bound_ms > 0 and sp.level_by_level:
        s = sp.sim
        lines.append(f"Spindle's waves run level by level: compute makespan {s.makespan_ms:.1f} ms per pass, "
                     f"{s.makespan_ms / cmp.lower_bound_ms:.3f} x ΣC* ({cmp.lower_bound_ms:.1f} ms per pass at its "
                     f"{cmp.passes} pass{'es' if cmp.passes != 1 else ''} per step)")
    mem = memory_line(cmp.memory(), cmp.usable_memory_gib)
    if mem:
        lines.append(mem)
    if sp is not None and sp.ok and sp.schedule:
        lines.append(f"Spindle's plan is the {sp.schedule} schedule: its simulated step was the shortest of Spindle's "
                     f"candidates (see planner/step/choose.py)")
    lines.append(f"MFU: model FLOPs per step (recompute not counted) / (step · {cmp.gpus} devices · "
                 f"{cmp.peak_tflops:g} TFLOP/s peak); for scale: DistTrain 54.7 %, OrchMLLM 41.6 % end to end")
    if cmp.band is not None or cmp.curves == "file":
        lines.extend(band_lines(cmp.band, cmp.results))
    if cmp.explanation is not None:
        lines.extend(cmp.explanation.lines())
    grids = cmp.results.get("static-grids")
    if grids is not None and grids.ok and grids.tuned is not None and grids.tuned.extra.get("grids"):
        g = grids.tuned.extra["grids"]
        lines.append("static grids (devices per module): " + ", ".join(f"{k} {v['ranks']}" for k, v in g.items()))
    if notes:
        lines.append("no plan, or over the memory limit (!):")
        lines.extend(notes)
    return "\n".join(lines)


def to_json(cmps: Sequence[Comparison]) -> dict:
    return {"results": [c.to_json() for c in cmps]}


def plot(groups: Sequence[tuple[str, Sequence[Comparison]]], path: str, *,
         systems: Sequence[str] = ("sequential", "task-level", "intra-task", "static-grids", "spindle-naive-placement",
                                   "spindle"),
         reference: str = "sequential", paper: dict | None = None) -> None:
    """Grouped bars (one panel per workload, one group per device count): throughput relative to ``reference``,
    and under each panel every system's memory per device (:func:`.memory.plot_memory`: peak, and the range over
    the devices).

    ``paper`` maps ``(panel title, gpus)`` to the paper's speedup of Spindle, drawn as a marker.
    """
    try:
        import matplotlib  # optional: matplotlib (--plot only)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: matplotlib (--plot only)
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    colors = {"sequential": "#8c8c8c", "task-level": "#4c72b0", "intra-task": "#55a868", "static-grids": "#8172b3",
              "spindle-naive-placement": "#dd8452", "spindle": "#c44e52"}
    k = len(groups)
    cols = min(3, k)
    rows = -(-k // cols)
    fig, grid_axes = plt.subplots(2 * rows, cols, figsize=(max(7.0, 4.2 * cols), 5.2 * rows + 0.6), squeeze=False,
                                  gridspec_kw={"height_ratios": [3.2, 2.0] * rows})
    axes = [grid_axes[2 * (i // cols)][i % cols] for i in range(rows * cols)]
    mem_axes = [grid_axes[2 * (i // cols) + 1][i % cols] for i in range(rows * cols)]
    width = 0.8 / len(systems)
    for ax, mx, (title, cmps) in zip(axes, mem_axes, groups):
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
        plot_memory(mx, cmps, systems, colors)
    for ax in axes[k:] + mem_axes[k:]:
        ax.axis("off")
    handles, labels = axes[0].get_legend_handles_labels()
    seen = {}
    for h, lab in zip(handles, labels):
        seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen.keys()), loc="lower center", ncol=3, fontsize=7)
    fig.tight_layout(rect=(0, 0.6 / (5.2 * rows + 0.6), 1, 1))
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
                   help=f"cluster preset ({', '.join(PRESETS)}) or a JSON file of cluster fields (default {DEFAULT_PRESET})")
    p.add_argument("--fixed-passes", action="store_true",
                   help="hold every system to one configuration (--passes, default the model's; nothing recomputed) "
                        "instead of tuning each to its own best")
    p.add_argument("--no-band", action="store_true",
                   help="skip the fast- and slow-edge re-plans of every system (the analytic model's band; "
                        "no band with --curves)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="draw grouped bars of the speedups")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=cmd_compare)
    return p


def cmd_compare(args) -> int:
    load_cluster(args.cluster, num_devices=max(args.gpus))  # bad preset / file: fail before planning
    if args.plot:
        check_output(args.plot, "--plot")
        check_plotting("--plot")  # matplotlib missing: one line now, not after the planning
    workload = workload_of(args)
    graph = workload.graph(1)  # bad model, tasks, size or batch: fail before planning
    fixed = None
    if args.fixed_passes or args.passes not in (None, "auto"):
        passes = passes_of(args)
        workload.graph(passes)  # passes that do not divide a task's batch: fail now
        fixed = Execution(passes=passes)
    curves = CurvesFile.load(args.curves) if args.curves else None
    if not highs_available():
        print(HIGHS_NOTE, file=sys.stderr)
    cmps = compare(workload, args.gpus, cluster=args.cluster, curves_file=curves, fixed=fixed,
                   band=not args.no_band and fixed is None)
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
