"""Contraction, per-level scheduling and plan assembly: the pieces every planner of this package shares.

:func:`make_metaops` contracts a task graph into MetaOps (inputs checked against the limits), :func:`schedule`
plans each MetaLevel (allocation, discretization, waves), and :func:`assemble_plan` turns any wave schedule with
ranks into a :class:`~.plan.Plan` (its data flow from :mod:`.dataflow`: transfers with their messages and
parameter device groups; memory), so Spindle, the baselines and hand-made plans all emit the same format.
:mod:`..step.build` is the front door that chooses among them.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from ..level.anneal import anneal
from ..workload.cluster import Cluster
from ..workload.curves import ScalingCurve
from .communicators import peak_memory_bytes
from .dataflow import param_groups, transfers
from ..workload.graph import TaskGraph
from ..limits import check_inputs
from ..workload.memory import layer_state_bytes, slice_activation_bytes, slice_param_keys
from ..workload.metaops import MetaOp, contract, levels
from ..level.knapsack import tuples_of
from ..level.patterns import improve, pattern_bound
from .plan import LevelInfo, Plan, Slice, WavePlan
from ..level.scheduler import LevelSchedule, plan_level
from ..level.waves import Wave


def make_metaops(graph: TaskGraph, cluster: Cluster) -> tuple[MetaOp, ...]:
    check_inputs(sorted({(op.task, op.batch) for op in graph.operators}), cluster.num_devices)
    return contract(graph, memory_bytes=cluster.memory_gib * 2**30, max_tp=cluster.gpus_per_node)


def schedule(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int,
             *, search: bool = True, certify: bool = False) -> list[LevelSchedule]:
    """Every level's schedule (:func:`..step.scheduler.plan_level`); with ``search``, then the pattern LP
    (:mod:`..step.patterns`) on the levels whose gap to their bound is largest (:func:`tighten`). ``certify``: also
    raise the bounds of a plan not certified within :data:`REBUILD_GAP` (:func:`certify`; the waves are the
    same either way)."""
    out, clock, by_level = [], 0.0, []
    for lv in levels(metaops):
        ls = plan_level(lv, curves, num_devices, clock, search=search)
        clock += ls.span_ms
        out.append(ls)
        by_level.append(lv)
    if not search:
        return out
    out = tighten(out, by_level, curves, num_devices)
    return certify_bounds(out, by_level, curves, num_devices) if certify else out


#: A level whose span is within this share of the plan's makespan of its bound is not worth a pattern LP.
BOUND_WORTH = 0.002
#: ... and the pattern LP's dives only where it is more than this share (a level with less to gain keeps its
#: heuristic's waves; the dives cost a few tens of milliseconds per level).
DIVE_WORTH = 0.01
#: Annealing (:mod:`..step.anneal`) on a level whose gap is still more than DIVE_WORTH after the dives: its moves
#: are this work limit over the level's valid counts (a move's cost grows with MetaOps × counts).
ANNEAL_WORK = 80_000
#: ... then ruin and recreate (:func:`..step.anneal.rebuild`): the wave fits its runs try in all, on such a level
#: (0.02-0.1 s; a fit's cost grows with the level's MetaOps and devices).
REBUILD_WORK = 72_000
#: ... spent only while the level keeps the plan more than this fraction over its certified bound:
#: a plan already that close keeps its planning time.
REBUILD_GAP = 0.03


def tighten(scheds: Sequence[LevelSchedule], by_level: Sequence[Sequence[MetaOp]],
            curves: Mapping[str, ScalingCurve], num_devices: int) -> list[LevelSchedule]:
    """Largest gap first, while a level's gap is more than :data:`BOUND_WORTH` of the makespan (the small
    levels of embeddings, heads and losses move the plan's certified gap by less than that): raise the
    level's bound with the pattern LP and take its dives' best schedule where it is shorter
    (:func:`..step.patterns.improve`; the waves it replaces become the level's first alternative and, unless it had
    one, its first-search candidate, for :mod:`..step.choose`). Where the gap is still over :data:`DIVE_WORTH`, the
    annealing and, while the plan is more than :data:`REBUILD_GAP` over its certified bound, ruin and recreate
    (:mod:`..step.anneal`) search from there. Later levels' waves move with the level's new span."""
    out = list(scheds)
    total = sum(ls.span_ms for ls in scheds)
    for i in sorted(range(len(out)), key=lambda i: -(out[i].span_ms - out[i].bound_ms)):
        ls = out[i]
        if ls.span_ms - ls.bound_ms <= BOUND_WORTH * total:
            break
        start = ls.waves[0].start_ms if ls.waves else 0.0
        dive = ls.span_ms - ls.bound_ms > DIVE_WORTH * total
        b, waves = improve(by_level[i], curves, num_devices, ls.waves, level=ls.level, start_ms=start, dive=dive)
        if dive and sum(w.duration_ms for w in waves or ls.waves) - max(b, ls.bound_ms) > DIVE_WORTH * total:
            moves = ANNEAL_WORK // sum(len(m.valid_counts(num_devices)) for m in by_level[i])
            others = [o for j, o in enumerate(out) if j != i]  # the level's span that certifies the plan:
            goal = (1 + REBUILD_GAP) * (sum(o.bound_ms for o in others) + max(b, ls.bound_ms)) \
                - sum(o.span_ms for o in others)
            waves = anneal(waves or ls.waves, by_level[i], curves, num_devices, moves=moves, level=ls.level,
                           start_ms=start, rebuild_work=REBUILD_WORK, rebuild_goal_ms=goal) or waves
        if waves:  # the waves it replaces stay a whole-step candidate (they may transfer less)
            before = dataclasses.replace(ls, alternatives=(), first_search=None)
            ls = dataclasses.replace(ls, waves=waves, tuples=tuples_of(waves, by_level[i]),
                                     variant=ls.variant.split("+dive")[0] + "+dive",
                                     alternatives=(before,) + tuple(ls.alternatives),
                                     first_search=ls.first_search or before)
        if b > ls.bound_ms * (1 + 1e-9):
            ls = dataclasses.replace(ls, bound_ms=min(b, ls.span_ms),
                                     bound_kind="optimal" if b >= ls.span_ms * (1 - 1e-9) else "patterns")
        out[i] = ls
    clock = 0.0
    for ls in out:  # every level starts where the one before ends
        for w in ls.waves:
            w.start_ms, clock = clock, clock + w.duration_ms
    return out


def certify_bounds(scheds: Sequence[LevelSchedule], by_level: Sequence[Sequence[MetaOp]],
                   curves: Mapping[str, ScalingCurve], num_devices: int) -> list[LevelSchedule]:
    """The levels' bounds raised, when the plan is not certified within :data:`REBUILD_GAP`: every level's
    configuration LP, raised where no whole-number cover by its near-optimal patterns exists
    (:mod:`..step.near_optimal`), small levels' too. A certificate only (the waves stay; on Multitask-CLIP-10 / 64
    GPUs it costs more than the rest of the plan and raises the bound by 0.07%), so :func:`..step.build.make_plan`
    leaves it out and ``scripts/bench_planner.py`` asks for it."""
    out = list(scheds)
    if sum(o.span_ms for o in out) <= (1 + REBUILD_GAP) * sum(o.bound_ms for o in out):
        return out
    for i, ls in enumerate(out):
        if ls.span_ms <= ls.bound_ms * (1 + 1e-9):
            continue
        b = pattern_bound(by_level[i], curves, num_devices, heuristic=ls.waves, max_span=ls.span_ms, near=True)
        if b > ls.bound_ms * (1 + 1e-9):
            out[i] = dataclasses.replace(ls, bound_ms=min(b, ls.span_ms),
                                         bound_kind="optimal" if b >= ls.span_ms * (1 - 1e-9) else "cover")
    return out


def assemble_plan(graph: TaskGraph, cluster: Cluster, metaops: Sequence[MetaOp],
                  curves: Mapping[str, ScalingCurve], level_info: Sequence[LevelInfo], waves: Sequence[Wave],
                  ranks: Mapping[tuple[int, int], tuple[int, ...]], *, system: str, passes: int = 1,
                  distributed_optimizer: bool = False, memory_by: str = "phase") -> Plan:
    """The plan of placed waves. ``memory_by="task"``: the device memory of a system whose runtime frees a
    task's activations after that task's backward even when tasks run side by side (task-level lanes,
    each its own Megatron-LM run); ``"phase"``: the wave runtime's (:func:`device_memory`)."""
    by_name = {m.name: m for m in metaops}
    wave_plans = []
    for wi, w in enumerate(waves):
        slices = tuple(Slice(wave=wi, metaop=s.metaop, layer_start=s.layer_start, num_layers=s.layers,
                             ranks=tuple(ranks[(wi, si)]), tp=by_name[s.metaop].tp, time_ms=s.time_ms)
                       for si, s in enumerate(w.slices))
        wave_plans.append(WavePlan(index=wi, level=w.level, phase=w.phase, start_ms=w.start_ms,
                                   duration_ms=w.duration_ms, slices=slices))
    all_slices = [s for w in wave_plans for s in w.slices]
    if memory_by == "phase":
        phase_of = {w.index: w.phase for w in wave_plans}
    elif memory_by == "task":  # the activations that coexist are one task's: key them by task
        tasks = {t: i for i, t in enumerate(graph.tasks)}
        phase_of = {s.name: tasks[by_name[s.metaop].task] for s in all_slices}
    else:
        raise ValueError(f"memory_by must be 'phase' or 'task', got {memory_by!r}")
    return Plan(
        system=system, model=graph.model, graph_fingerprint=graph.fingerprint(), tasks=graph.tasks,
        task_weights=graph.task_weights, world_size=cluster.num_devices, gpus_per_node=cluster.gpus_per_node,
        memory_limit_bytes=cluster.memory_limit_bytes, metaops=tuple(metaops),
        curves=tuple((m.name, curves[m.name]) for m in metaops), levels=tuple(level_info),
        waves=tuple(wave_plans), transfers=tuple(transfers(metaops, all_slices, cluster.gpus_per_node)),
        param_groups=tuple(param_groups(metaops, all_slices)),
        device_memory_bytes=tuple(device_memory(by_name, all_slices, cluster.num_devices, phase_of=phase_of,
                                                distributed_optimizer=distributed_optimizer)),
        makespan_ms=sum(w.duration_ms for w in wave_plans),
        lower_bound_ms=sum(lv.c_star_ms for lv in level_info), passes=passes,
        distributed_optimizer=distributed_optimizer, communicator_bytes=cluster.communicator_bytes)


def fits_memory(plan: Plan, cluster: Cluster) -> bool:
    """Whether every device of ``plan``, its NCCL communicators included (:mod:`.communicators`), stays within
    ``cluster``'s usable memory (a relative 1e-9 of slack)."""
    return max(peak_memory_bytes(plan)) <= cluster.memory_limit_bytes * (1 + 1e-9)


def device_memory(by_name: Mapping[str, MetaOp], slices: Sequence[Slice], num_devices: int, *,
                  phase_of: Mapping | None = None, distributed_optimizer: bool = False) -> list[float]:
    """Estimated peak bytes per device (:mod:`..workload.memory`): the states of every layer shard it holds
    (a device holding two TP shards of one weight pays for both; the distributed optimizer splits a shard's
    optimizer state over its holders) plus its largest phase's stashed activations. ``phase_of`` maps a wave
    index (or a slice name) to the set of activations it belongs to."""
    holders: dict[tuple[str, int], set[int]] = {}
    act: dict[int, np.ndarray] = {}  # phase -> activations per device (0 where the device stashes none)
    for s in slices:
        m = by_name[s.metaop]
        a = slice_activation_bytes(m, s.num_layers, len(s.ranks))
        phase = (phase_of.get(s.name, phase_of.get(s.wave, 0))) if phase_of else 0
        if phase not in act:
            act[phase] = np.zeros(num_devices)
        idx = list(s.ranks)
        if len(set(idx)) == len(idx):  # distinct ranks (validation's rule 1): the same sums as np.add.at
            act[phase][idx] += a
        else:
            np.add.at(act[phase], idx, a)  # in slice order, as one by one
        keys = list(slice_param_keys(m, s.layer_start, s.num_layers))
        for shard in range(min(m.tp, len(s.ranks))):  # position p holds shard p % tp: (key, shard) first met
            ranks = s.ranks[shard::m.tp]                 # in the order of positions, then of keys
            for k in keys:
                holders.setdefault((k, shard), set()).update(ranks)
    owner = {}
    for m in by_name.values():
        for k in m.param_keys:
            if k:
                owner.setdefault(k, m)
    held = np.zeros(num_devices)
    for (k, shard), devs in holders.items():  # each device's states summed in the same order as one by one
        held[np.fromiter(devs, dtype=np.int64, count=len(devs))] += layer_state_bytes(
            owner[k], holders=len(devs), distributed_optimizer=distributed_optimizer)
    peak = np.maximum.reduce(list(act.values())) if act else np.zeros(num_devices)
    return (held + peak).tolist()
