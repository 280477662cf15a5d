"""From a task graph to a placed, validated plan: the planner's front door.

``make_plan(graph, cluster)`` runs contraction, curves, per-level allocation and wavefront scheduling,
placement, and assembles the :class:`~.plan.Plan` (:mod:`.assemble`); among Spindle's waves, their naive
placement and the baselines' schedules it keeps the shortest simulated step (:mod:`.choose`), then checks it
against the validation rules. :func:`plan_system` gives the plan of any system (Spindle or a baseline).
"""
from __future__ import annotations

import dataclasses

from ..workload.analytic import CurvesFile, DeviceModel, build_curves
from .assemble import assemble_plan, device_memory, make_metaops, schedule  # noqa: F401 - the planner's API
from .baselines import SYSTEMS, plan_intra_task, plan_sequential, plan_task_level
from .choose import choose_whole_step
from ..workload.cluster import Cluster
from ..workload.graph import TaskGraph
from .placement import place, sequential_placement
from .plan import LevelInfo, Plan
from .validate import check_plan


def make_plan(graph: TaskGraph, cluster: Cluster, *, curves_file: CurvesFile | None = None,
              device: DeviceModel | None = None, search: bool = True, placement: str = "spindle",
              validate: bool = True, passes: int = 1) -> Plan:
    """Plan one training step of ``graph`` (one pass) on ``cluster``; candidates are compared on a step of
    ``passes`` passes and one gradient sync, and the plan says ``passes`` (``plan.passes``: the runtime runs it).

    ``search=False`` runs only the paper's pipeline per level; ``placement="sequential"`` is the naive
    placement ablation (consecutive devices in slice order).
    """
    metaops = make_metaops(graph, cluster)
    curves = build_curves(metaops, cluster.num_devices, curves_file=curves_file, device=device)
    sched = schedule(metaops, curves, cluster.num_devices, search=search)
    waves = [w for ls in sched for w in ls.waves]
    if placement == "spindle":
        ranks = place(metaops, waves, cluster)
    elif placement == "sequential":
        ranks = sequential_placement(waves)
    else:
        raise ValueError(f"unknown placement {placement!r}; choose 'spindle' or 'sequential'")
    level_info = [LevelInfo(index=ls.level, c_star_ms=ls.allocation.c_star_ms,
                            n_star=tuple((m, float(n)) for m, n in ls.allocation.n_star.items()),
                            variant=ls.variant, bound_ms=ls.bound_ms, bound_kind=ls.bound_kind) for ls in sched]
    plan = assemble_plan(graph, cluster, metaops, curves, level_info, waves, ranks,
                         system="spindle" if placement == "spindle" else "spindle-naive-placement")
    if placement == "spindle":
        # The island-aware search is greedy; the naive layout and the baselines' schedules are candidates
        # too, and the shortest simulated step wins (see :mod:`.choose`).
        naive = assemble_plan(graph, cluster, metaops, curves, level_info, waves, sequential_placement(waves),
                              system="spindle")
        plan = choose_whole_step([("spindle", plan), ("spindle, naive placement", naive)], graph, cluster,
                                 metaops, curves, baselines=search, level_schedules=sched, passes=passes)
    plan = _with_passes(plan, passes)
    if validate:
        check_plan(plan)
    return plan


def _with_passes(plan: Plan, passes: int) -> Plan:
    """The plan made for ``passes`` passes per step says so (the candidates are assembled per pass)."""
    return plan if plan.passes == passes else dataclasses.replace(plan, passes=passes)


def plan_system(system: str, graph: TaskGraph, cluster: Cluster, *, curves_file: CurvesFile | None = None,
                device: DeviceModel | None = None, validate: bool = True, report: dict | None = None,
                passes: int = 1) -> Plan:
    """The plan of ``system`` (one of :data:`SYSTEMS`) for ``graph`` on ``cluster``.

    ``report``, when given, receives ``ideal_makespan_ms`` for the baselines: the compute time with their
    concurrent lanes running freely instead of in aligned waves (the alignment loss is the difference).
    """
    kw = dict(curves_file=curves_file, device=device, validate=validate)
    if system == "spindle":  # Spindle's candidates are compared on a step of ``passes`` passes
        return make_plan(graph, cluster, passes=passes, **kw)
    if system == "spindle-naive-placement":
        return make_plan(graph, cluster, placement="sequential", passes=passes, **kw)
    if system == "sequential":
        return _with_passes(plan_sequential(graph, cluster, report=report, **kw), passes)
    if system == "task-level":
        return _with_passes(plan_task_level(graph, cluster, report=report, **kw), passes)
    if system == "intra-task":
        return _with_passes(plan_intra_task(graph, cluster, report=report, **kw), passes)
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
