"""From a task graph to a placed, validated plan: the planner's front door.

``make_plan(graph, cluster)`` runs contraction, curves, per-level allocation and wavefront scheduling,
placement, and assembles the :class:`~.plan.Plan` (its data flow from :mod:`.dataflow`: transfers with their
messages and parameter device groups; memory), then checks it against the validation rules.
:func:`assemble_plan` turns any wave schedule with ranks into a plan, so the baselines emit the same format.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .analytic import CurvesFile, DeviceModel, build_curves
from .cluster import Cluster
from .curves import ScalingCurve
from .dataflow import param_groups, transfers
from .graph import TaskGraph
from .limits import check_inputs
from .memory import layer_state_bytes, slice_activation_bytes, slice_param_keys
from .metaops import MetaOp, contract, levels
from .placement import place, sequential_placement
from .plan import LevelInfo, Plan, Slice, WavePlan
from .scheduler import LevelSchedule, plan_level
from .validate import check_plan
from .waves import Wave


def make_metaops(graph: TaskGraph, cluster: Cluster) -> tuple[MetaOp, ...]:
    check_inputs(sorted({(op.task, op.batch) for op in graph.operators}), cluster.num_devices)
    return contract(graph, memory_bytes=cluster.memory_gib * 2**30, max_tp=cluster.gpus_per_node)


def schedule(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int,
             *, search: bool = True) -> list[LevelSchedule]:
    out, clock = [], 0.0
    for lv in levels(metaops):
        ls = plan_level(lv, curves, num_devices, clock, search=search)
        clock += ls.span_ms
        out.append(ls)
    return out


def make_plan(graph: TaskGraph, cluster: Cluster, *, curves_file: CurvesFile | None = None,
              device: DeviceModel | None = None, search: bool = True, placement: str = "spindle",
              validate: bool = True, passes: int = 1) -> Plan:
    """Plan one training step of ``graph`` (one pass) on ``cluster``; candidates are compared on a step of
    ``passes`` passes and one gradient sync.

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
        from .choose import choose_whole_step
        plan = choose_whole_step([("spindle", plan), ("spindle, naive placement", naive)], graph, cluster,
                                 metaops, curves, baselines=search, level_schedules=sched, passes=passes)
    if validate:
        check_plan(plan)
    return plan


def assemble_plan(graph: TaskGraph, cluster: Cluster, metaops: Sequence[MetaOp],
                  curves: Mapping[str, ScalingCurve], level_info: Sequence[LevelInfo], waves: Sequence[Wave],
                  ranks: Mapping[tuple[int, int], tuple[int, ...]], *, system: str) -> Plan:
    by_name = {m.name: m for m in metaops}
    wave_plans = []
    for wi, w in enumerate(waves):
        slices = tuple(Slice(wave=wi, metaop=s.metaop, layer_start=s.layer_start, num_layers=s.layers,
                             ranks=tuple(ranks[(wi, si)]), tp=by_name[s.metaop].tp, time_ms=s.time_ms)
                       for si, s in enumerate(w.slices))
        wave_plans.append(WavePlan(index=wi, level=w.level, start_ms=w.start_ms, duration_ms=w.duration_ms,
                                   slices=slices))
    all_slices = [s for w in wave_plans for s in w.slices]
    return Plan(
        system=system, model=graph.model, graph_fingerprint=graph.fingerprint(), tasks=graph.tasks,
        task_weights=graph.task_weights, world_size=cluster.num_devices, gpus_per_node=cluster.gpus_per_node,
        memory_limit_bytes=cluster.memory_limit_bytes, metaops=tuple(metaops),
        curves=tuple((m.name, curves[m.name]) for m in metaops), levels=tuple(level_info),
        waves=tuple(wave_plans), transfers=tuple(transfers(metaops, all_slices, cluster.gpus_per_node)),
        param_groups=tuple(param_groups(metaops, all_slices)),
        device_memory_bytes=tuple(device_memory(by_name, all_slices, cluster.num_devices)),
        makespan_ms=sum(w.duration_ms for w in wave_plans),
        lower_bound_ms=sum(lv.c_star_ms for lv in level_info))


def device_memory(by_name: Mapping[str, MetaOp], slices: Sequence[Slice], num_devices: int) -> list[float]:
    """Estimated peak bytes per device; a device holding two TP shards of one weight pays for both."""
    held: list[dict[tuple[str, int], float]] = [{} for _ in range(num_devices)]
    act = [0.0] * num_devices
    for s in slices:
        m = by_name[s.metaop]
        a = slice_activation_bytes(m, s.num_layers, len(s.ranks))
        for pos, r in enumerate(s.ranks):
            act[r] += a
            for k in slice_param_keys(m, s.layer_start, s.num_layers):
                held[r][(k, pos % m.tp)] = layer_state_bytes(m)
    return [act[d] + sum(held[d].values()) for d in range(num_devices)]

