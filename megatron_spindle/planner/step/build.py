"""From a task graph to a placed, validated plan: the planner's front door.

``make_plan(graph, cluster)`` runs contraction, curves, per-level allocation and wavefront scheduling,
placement, and assembles the :class:`~..assembly.plan.Plan` (:mod:`..assembly.assemble`); among Spindle's waves, their naive
placement and the baselines' schedules it keeps the shortest simulated step (:mod:`.choose`), then checks it
against the validation rules. :func:`plan_system` gives the plan of any system (Spindle or a baseline).
"""
from __future__ import annotations

import dataclasses

from ..workload.analytic import CurvesFile, DeviceModel, build_curves
from ..assembly.assemble import assemble_plan, fits_memory, make_metaops, schedule
from ..systems.baselines import SYSTEMS, plan_intra_task, plan_sequential, plan_task_level
from .choose import choose_whole_step
from ..assembly.execution import Execution, configure
from ..workload.cluster import Cluster
from ..workload.graph import TaskGraph
from ..workload.metaops import MetaOp
from ..assembly.placement import NODE_BUDGET, PlacementError, place, sequential_placement
from ..assembly.plan import TRANSFER_POSTINGS, LevelInfo, Plan
from ..assembly.validate import check_plan
from ..level.scheduler import LevelSchedule


def make_plan(graph: TaskGraph, cluster: Cluster, *, curves_file: CurvesFile | None = None,
              device: DeviceModel | None = None, search: bool = True, placement: str = "spindle",
              validate: bool = True, passes: int | None = None, execution: Execution | None = None,
              placement_budget: int = NODE_BUDGET, report: dict | None = None,
              postings: tuple[str, ...] = TRANSFER_POSTINGS) -> Plan:
    """Plan one pass of ``graph`` on ``cluster`` under ``execution`` (default: one pass per step, nothing
    recomputed, one phase); candidates are compared on a step of ``execution.passes`` passes and one gradient
    sync. ``passes`` is a shorthand for ``Execution(passes=passes)``.

    With several task groups (``execution.groups``) each group is scheduled on its own (its levels after the
    previous group's) and its waves form one phase. ``search=False`` runs only the paper's pipeline per level;
    ``placement="sequential"`` is the naive placement ablation (consecutive devices in slice order);
    ``placement_budget``: the placement search's node limit (the tuner's feasibility probes use a small one);
    ``report``: receives the whole-step choice's scoreboard (:func:`.choose.choose_whole_step`);
    ``postings``: the transfer postings the plan may take (:data:`..assembly.plan.TRANSFER_POSTINGS`, the
    shorter step's; ``("boundary",)``: the paper's runtime).
    """
    if execution is None:
        execution = Execution(passes=1 if passes is None else passes)
    elif passes is not None and passes != execution.passes:
        raise ValueError(f"passes={passes} contradicts the execution's passes={execution.passes}")
    metaops = configure(make_metaops(graph, cluster), execution, cluster)
    curves = build_curves(metaops, cluster.num_devices, curves_file=curves_file, device=device)
    sched = grouped_schedule(metaops, curves, cluster.num_devices, execution.groups, search)
    waves = [w for ls in sched for w in ls.waves]
    zero1 = execution.distributed_optimizer
    unplaced: PlacementError | None = None
    if placement == "spindle":
        try:
            ranks = place(metaops, waves, cluster, distributed_optimizer=zero1, node_budget=placement_budget)
        except PlacementError as e:  # Spindle's own waves fit nowhere; the other candidates may (below)
            if not search:
                raise
            unplaced, ranks = e, sequential_placement(waves)
    elif placement == "sequential":
        ranks = sequential_placement(waves)
    else:
        raise ValueError(f"unknown placement {placement!r}; choose 'spindle' or 'sequential'")
    level_info = [LevelInfo(index=ls.level, c_star_ms=ls.allocation.c_star_ms,
                            n_star=tuple((m, float(n)) for m, n in ls.allocation.n_star.items()),
                            variant=ls.variant, bound_ms=ls.bound_ms, bound_kind=ls.bound_kind) for ls in sched]
    kw = dict(passes=execution.passes, distributed_optimizer=zero1)
    plan = assemble_plan(graph, cluster, metaops, curves, level_info, waves, ranks,
                         system="spindle" if placement == "spindle" else "spindle-naive-placement", **kw)
    if placement == "spindle":
        # The island-aware search is greedy; the naive layout and the baselines' schedules are candidates
        # too, and the shortest simulated step wins (see :mod:`.choose`).
        naive = assemble_plan(graph, cluster, metaops, curves, level_info, waves, sequential_placement(waves),
                              system="spindle", **kw)
        own = [("spindle, naive placement", naive)] if unplaced else [("spindle", plan), ("spindle, naive placement", naive)]
        plan = choose_whole_step(own, graph, cluster, metaops, curves, baselines=search,
                                 level_schedules=None if unplaced else sched, execution=execution,
                                 placement_budget=placement_budget, report=report, postings=postings)
        if unplaced is not None and not fits_memory(plan, cluster):
            raise unplaced  # no candidate fits either: the placement's message says where memory ran out
    if plan.transfer_posting not in postings:  # the naive placement ablation: no whole-step choice
        plan = dataclasses.replace(plan, transfer_posting=postings[0])
    if validate:
        check_plan(plan)
    return plan


def grouped_schedule(metaops: tuple[MetaOp, ...], curves, num_devices: int, groups, search: bool
                      ) -> list[LevelSchedule]:
    """Every level's schedule; with task groups, each group's levels in turn, its waves in one phase and its
    levels numbered after the previous group's (so waves' levels never go back)."""
    if len(groups) <= 1:
        return schedule(metaops, curves, num_devices, search=search)
    out: list[LevelSchedule] = []
    offset, clock = 0, 0.0
    for phase, tasks in enumerate(groups):
        ms = tuple(m for m in metaops if m.task in tasks)
        if not ms:
            raise ValueError(f"task group {list(tasks)} has no MetaOps")
        part = schedule(ms, curves, num_devices, search=search)
        for ls in part:
            _tag(ls, phase, offset, set())
        for ls in part:
            for w in ls.waves:
                w.start_ms, clock = clock, clock + w.duration_ms
        offset += len(part)
        out += part
    missing = {m.task for m in metaops} - {t for g in groups for t in g}
    if missing:
        raise ValueError(f"tasks {sorted(missing)} are in no task group")
    return out


def _tag(ls: LevelSchedule, phase: int, offset: int, seen: set) -> None:
    """Set the phase and the offset level on a level schedule's waves and on its alternatives'."""
    if id(ls) in seen:
        return
    seen.add(id(ls))
    ls.level += offset
    for w in ls.waves:
        w.phase, w.level = phase, w.level + offset
    for alt in (*ls.alternatives, ls.first_search):
        if alt is not None:
            _tag(alt, phase, offset, seen)


def plan_system(system: str, graph: TaskGraph, cluster: Cluster, *, curves_file: CurvesFile | None = None,
                device: DeviceModel | None = None, validate: bool = True, report: dict | None = None,
                passes: int | None = None, execution: Execution | None = None) -> Plan:
    """The plan of ``system`` (one of :data:`SYSTEMS`) for ``graph`` on ``cluster`` under ``execution``.

    ``report``, when given, receives ``ideal_makespan_ms`` for the baselines: the compute time with their
    concurrent lanes running freely instead of in aligned waves (the alignment loss is the difference).
    """
    if execution is None:
        execution = Execution(passes=1 if passes is None else passes)
    kw = dict(curves_file=curves_file, device=device, validate=validate)
    if system == "spindle":  # Spindle's candidates are compared on a step of ``passes`` passes
        return make_plan(graph, cluster, execution=execution, **kw)
    if system == "spindle-naive-placement":
        return make_plan(graph, cluster, placement="sequential", execution=execution, **kw)
    builders = {"sequential": plan_sequential, "task-level": plan_task_level, "intra-task": plan_intra_task}
    if system not in builders:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    metaops = configure(make_metaops(graph, cluster), execution, cluster)
    curves = build_curves(metaops, cluster.num_devices, curves_file=curves_file, device=device)
    return builders[system](graph, cluster, report=report, prepared=(metaops, curves), passes=execution.passes,
                            distributed_optimizer=execution.distributed_optimizer, **kw)
