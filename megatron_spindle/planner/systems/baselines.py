"""Baseline planners: what people run today, written in Spindle's plan format so one simulator times them all.

Every baseline uses Spindle's own MetaOps, scaling curves and plan assembly (:func:`..step.build.assemble_plan`),
and its plan passes the same validation rules (:func:`..assembly.validate.check_plan`): each is an executable plan, not
a formula. They differ only in how devices are shared.

* ``sequential`` (Megatron-LM / DeepSpeed as used today). Tasks run one after another, each on the whole
  cluster. Every MetaOp of the task runs in level order, alone in its wave, at its *best valid split*: the
  valid device count ``≤ N`` with the shortest time (ties: the largest count, as data parallelism over the
  whole cluster does), on devices ``0 … n-1``. So every weight lives on every device and its gradient is
  all-reduced once per step over all ``N`` devices (Megatron accumulates gradients over the tasks, then
  reduces once).
* ``task-level`` (Optimus-style). Each task gets a fixed device share, found by greedy marginal gain: start
  every task at its smallest runnable share, then repeatedly give ``n' - n`` more devices to the task with the
  largest ``(T(n) - T(n')) / (n' - n)``, where ``T(n)`` is the task's time with each of its MetaOps at its
  best split ``≤ n`` and ``n'`` the next share at which ``T`` drops. Tasks run concurrently, each task's
  MetaOps one after another on its share. With more tasks than devices, tasks are first packed into ``N``
  lanes (longest processing time first) that share a device group.
* ``intra-task`` (DistMM-MT). Tasks run one after another. Inside a task, the independent branches that feed
  its first join (the modality encoders before a contrastive loss or an LLM) run concurrently on device
  shares chosen to finish together (the shares minimizing the slowest branch); the join and everything after
  it run on the whole cluster at their best split.

Concurrent lanes run in waves like every plan: a wave ends when the first lane finishes its current MetaOp
(possibly a little later, up to :data:`.waves.ALIGN_SLACK` of that span, when that lets the other lanes
finish a whole layer); every other lane runs the whole layers that fit and continues in the next wave.
This alignment is the price of a wave runtime and is reported (``report["ideal_makespan_ms"]``).

Wave levels. A baseline's waves mix MetaLevels (task after task), so their ``level`` field holds the wave's
position instead (monotone, so validation rule 6 "levels never go back" holds unchanged); the plan's
``levels`` still carry the relaxed optimum ``C*`` of every MetaLevel, so ``lower_bound_ms`` is the same
``Σ C*`` as Spindle's plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..level.allocate import allocate_level
from ..workload.analytic import CurvesFile, DeviceModel, build_curves
from ..assembly.assemble import assemble_plan, make_metaops
from ..workload.cluster import Cluster
from ..workload.curves import ScalingCurve
from ..workload.graph import TaskGraph
from ..workload.metaops import MetaOp, levels
from ..assembly.plan import LevelInfo, Plan
from .shares import (best_count, finish_together_shares, group_time, marginal_gain_shares, metaop_time, min_share,
                     task_metaops)
from ..assembly.validate import check_plan
from ..level.waves import ALIGN_SLACK, Wave, WaveSlice

#: Every system the comparison knows, Spindle first.
SYSTEMS = ("spindle", "sequential", "task-level", "intra-task", "static-grids", "spindle-naive-placement")
#: The baselines written as plans (the static grids, :mod:`.static_grids`, pipeline micro-batches across grids,
#: which a wave plan cannot express: they are timed with the simulator's cost primitives instead).
BASELINES = ("sequential", "task-level", "intra-task")


# --------------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------------
def relaxed_levels(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int,
                   system: str) -> list[LevelInfo]:
    """``C*`` of every MetaLevel on the whole cluster (the lower bound, whatever the system)."""
    out = []
    for lv in levels(metaops):
        a = allocate_level({m.name: m.num_layers for m in lv}, curves, num_devices)
        out.append(LevelInfo(index=lv[0].level, c_star_ms=a.c_star_ms,
                             n_star=tuple((m, float(n)) for m, n in a.n_star.items()), variant=system))
    return out


@dataclass
class Segment:
    """The layers of one MetaOp a lane still has to run."""

    metaop: str
    devices: int
    left: int
    """Layers not yet scheduled."""
    layer_ms: float
    """Time of one layer on ``devices``."""
    next_layer: int = 0


@dataclass
class Lane:
    """MetaOps run one after another on ``ranks`` (each on the first ``devices`` of them)."""

    ranks: tuple[int, ...]
    queue: list[Segment]

    @classmethod
    def of(cls, ranks: Sequence[int], ms: Sequence[MetaOp], curves: Mapping[str, ScalingCurve],
           num_devices: int) -> "Lane":
        q = []
        for m in ms:
            n = best_count(m, curves[m.name], len(ranks), num_devices)
            if n is None:
                raise ValueError(f"MetaOp {m.name!r} cannot run on a share of {len(ranks)} devices "
                                 f"(valid counts {m.valid_counts(num_devices)})")
            q.append(Segment(m.name, n, m.num_layers, curves[m.name].time(n)))
        return cls(tuple(ranks), q)

    def ideal_ms(self) -> float:
        return sum(seg.left * seg.layer_ms for seg in self.queue)


class PlanBuilder:
    """Accumulates waves and ranks (keyed by (wave index, slice index)) as the baselines emit them."""

    def __init__(self) -> None:
        self.waves: list[Wave] = []
        self.ranks: dict[tuple[int, int], tuple[int, ...]] = {}
        self.clock = 0.0
        self.ideal_ms = 0.0  # the same phases without wave alignment (lanes run freely)

    phase = 0
    """The phase of the waves emitted next (sequential and intra-task: one per task, as Megatron-LM frees a
    task's activations after its backward)."""

    def wave(self, parts: Sequence[tuple[WaveSlice, tuple[int, ...]]]) -> None:
        wi = len(self.waves)
        w = Wave(level=wi, start_ms=self.clock, duration_ms=max(s.time_ms for s, _ in parts),
                 slices=[s for s, _ in parts], phase=self.phase)
        for si, (_, r) in enumerate(parts):
            self.ranks[(wi, si)] = r
        self.waves.append(w)
        self.clock += w.duration_ms

    def solo(self, m: MetaOp, curve: ScalingCurve, n: int) -> None:
        t = metaop_time(m, curve, n)
        self.wave([(WaveSlice(metaop=m.name, layer_start=0, layers=m.num_layers, devices=n, time_ms=t),
                    tuple(range(n)))])
        self.ideal_ms += t

    def lanes(self, lanes: Sequence[Lane], num_devices: int) -> None:
        """Run concurrent lanes as waves (see the module docstring)."""
        self.ideal_ms += max((lane.ideal_ms() for lane in lanes), default=0.0)

        def fits(seg: Segment, span: float) -> int:
            return min(seg.left, int(math.floor(span / seg.layer_ms * (1 + 1e-9))))

        while any(lane.queue for lane in lanes):
            active = [lane for lane in lanes if lane.queue]
            heads = [lane.queue[0] for lane in active]
            first = min(seg.left * seg.layer_ms for seg in heads)
            # candidate wave lengths: the first finisher's span, or a later layer boundary within the slack
            spans = {first}
            for seg in heads:
                k = fits(seg, first)
                if k < seg.left and (k + 1) * seg.layer_ms <= first * (1 + ALIGN_SLACK):
                    spans.add((k + 1) * seg.layer_ms)
            best = None
            for span in sorted(spans):
                take = [fits(seg, span) for seg in heads]
                dur = max(k * seg.layer_ms for k, seg in zip(take, heads))
                work = sum(k * seg.layer_ms * seg.devices for k, seg in zip(take, heads))
                key = ((num_devices * dur - work) / work, dur)
                if best is None or key < best[0]:
                    best = (key, take)
            parts = []
            for lane, seg, k in zip(active, heads, best[1]):
                if k == 0:
                    continue
                parts.append((WaveSlice(metaop=seg.metaop, layer_start=seg.next_layer, layers=k, devices=seg.devices,
                                        time_ms=k * seg.layer_ms), lane.ranks[:seg.devices]))
                seg.left -= k
                seg.next_layer += k
                if seg.left == 0:
                    lane.queue.pop(0)
            self.wave(parts)


def finish_plan(builder: PlanBuilder, graph: TaskGraph, cluster: Cluster, metaops, curves, system: str,
            validate: bool, report: dict | None, *, passes: int = 1, distributed_optimizer: bool = False,
            memory_by: str = "phase") -> Plan:
    if report is not None:
        report["ideal_makespan_ms"] = builder.ideal_ms
    plan = assemble_plan(graph, cluster, metaops, curves, relaxed_levels(metaops, curves, cluster.num_devices, system),
                         builder.waves, builder.ranks, system=system, passes=passes,
                         distributed_optimizer=distributed_optimizer, memory_by=memory_by)
    if validate:
        check_plan(plan)
    return plan


def _prepare(graph: TaskGraph, cluster: Cluster, curves_file: CurvesFile | None, device: DeviceModel | None,
             prepared=None):
    if prepared is not None:  # (metaops, curves) already built by the caller (Spindle's whole-step choice)
        return prepared
    metaops = make_metaops(graph, cluster)
    curves = build_curves(metaops, cluster.num_devices, curves_file=curves_file, device=device)
    return metaops, curves


def share_blocks(shares: Sequence[int]) -> list[tuple[int, ...]]:
    """Contiguous device blocks for ``shares``, largest first from device 0 (powers of two stay in islands)."""
    order = sorted(range(len(shares)), key=lambda i: (-shares[i], i))
    out: list[tuple[int, ...]] = [()] * len(shares)
    nxt = 0
    for i in order:
        out[i] = tuple(range(nxt, nxt + shares[i]))
        nxt += shares[i]
    return out


# --------------------------------------------------------------------------------------------------
# sequential
# --------------------------------------------------------------------------------------------------
def plan_sequential(graph: TaskGraph, cluster: Cluster, *, curves_file: CurvesFile | None = None,
                    device: DeviceModel | None = None, validate: bool = True,
                    report: dict | None = None, prepared=None, passes: int = 1,
                    distributed_optimizer: bool = False) -> Plan:
    """Megatron-LM / DeepSpeed: each task on the whole cluster, one after another (one phase per task:
    a task's activations are freed after its backward)."""
    metaops, curves = _prepare(graph, cluster, curves_file, device, prepared)
    N = cluster.num_devices
    b = PlanBuilder()
    for i, task in enumerate(graph.tasks):
        b.phase = i
        for m in task_metaops(metaops, task):
            b.solo(m, curves[m.name], best_count(m, curves[m.name], N, N))
    return finish_plan(b, graph, cluster, metaops, curves, "sequential", validate, report, passes=passes,
                   distributed_optimizer=distributed_optimizer)


# --------------------------------------------------------------------------------------------------
# task-level (Optimus-style)
# --------------------------------------------------------------------------------------------------

def pack_lanes(tasks: Sequence[Sequence[MetaOp]], curves: Mapping[str, ScalingCurve],
               num_devices: int) -> list[list[int]]:
    """Task indices per lane: one lane per task when their smallest shares fit, else LPT-packed lanes."""
    N = num_devices
    mins = [min_share(t, N) for t in tasks]
    if sum(mins) <= N:
        return [[i] for i in range(len(tasks))]
    order = sorted(range(len(tasks)), key=lambda i: -group_time(tasks[i], curves, N, N))
    for k in range(min(len(tasks), N), 0, -1):
        lanes: list[list[int]] = [[] for _ in range(k)]
        load = [0.0] * k
        for i in order:
            j = min(range(k), key=lambda j: (load[j], j))
            lanes[j].append(i)
            load[j] += group_time(tasks[i], curves, max(mins[i], N // k), N)
        if sum(max(mins[i] for i in lane) for lane in lanes if lane) <= N:
            return [sorted(lane) for lane in lanes if lane]
    raise ValueError(f"a task needs more than the cluster's {N} devices")


def plan_task_level(graph: TaskGraph, cluster: Cluster, *, curves_file: CurvesFile | None = None,
                    device: DeviceModel | None = None, validate: bool = True,
                    report: dict | None = None, prepared=None, passes: int = 1,
                    distributed_optimizer: bool = False) -> Plan:
    """Optimus-style: each task a fixed share by greedy marginal gain, tasks concurrent. Its memory is its
    own runtime's: each lane runs its tasks one after another, freeing a task's activations after its
    backward (``memory_by="task"``)."""
    metaops, curves = _prepare(graph, cluster, curves_file, device, prepared)
    N = cluster.num_devices
    tasks = [task_metaops(metaops, t) for t in graph.tasks]
    lanes_idx = pack_lanes(tasks, curves, N)
    groups = [[m for i in lane for m in tasks[i]] for lane in lanes_idx]
    shares = marginal_gain_shares(groups, curves, N)
    b = PlanBuilder()
    b.lanes([Lane.of(r, g, curves, N) for r, g in zip(share_blocks(shares), groups)], N)
    return finish_plan(b, graph, cluster, metaops, curves, "task-level", validate, report, passes=passes,
                   distributed_optimizer=distributed_optimizer, memory_by="task")


# --------------------------------------------------------------------------------------------------
# intra-task (DistMM-MT)
# --------------------------------------------------------------------------------------------------
def branches(ms: Sequence[MetaOp]) -> tuple[list[list[MetaOp]], list[MetaOp]]:
    """Split one task's MetaOps into the independent branches before its first join, and the rest.

    A join is a MetaOp with two or more producers; it and everything downstream of it form the rest. The
    branches are the connected components of the remaining MetaOps, in order of their first MetaOp.
    """
    names = {m.name for m in ms}
    after: set[str] = set()
    for m in ms:  # level order: producers come first
        prods = [p for p in m.producers if p in names]
        if len(prods) >= 2 or any(p in after for p in prods):
            after.add(m.name)
    pre = [m for m in ms if m.name not in after]
    comp: dict[str, int] = {}
    parent = list(range(len(pre)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    idx = {m.name: i for i, m in enumerate(pre)}
    for m in pre:
        for p in m.producers:
            if p in idx:
                parent[find(idx[m.name])] = find(idx[p])
    for m in pre:
        comp.setdefault(find(idx[m.name]), len(comp))
    out: list[list[MetaOp]] = [[] for _ in range(len(comp))]
    for m in pre:
        out[comp[find(idx[m.name])]].append(m)
    return out, [m for m in ms if m.name in after]



def plan_intra_task(graph: TaskGraph, cluster: Cluster, *, curves_file: CurvesFile | None = None,
                    device: DeviceModel | None = None, validate: bool = True,
                    report: dict | None = None, prepared=None, passes: int = 1,
                    distributed_optimizer: bool = False) -> Plan:
    """DistMM-MT: inside a task, its branches on shares that finish together; tasks one after another (one
    phase per task)."""
    metaops, curves = _prepare(graph, cluster, curves_file, device, prepared)
    N = cluster.num_devices
    b = PlanBuilder()
    for i, task in enumerate(graph.tasks):
        b.phase = i
        pre, rest = branches(task_metaops(metaops, task))
        if len(pre) == 1:
            rest = pre[0] + rest
        elif pre:
            shares = finish_together_shares(pre, curves, N)
            b.lanes([Lane.of(r, g, curves, N) for r, g in zip(share_blocks(shares), pre)], N)
        for m in rest:
            b.solo(m, curves[m.name], best_count(m, curves[m.name], N, N))
    return finish_plan(b, graph, cluster, metaops, curves, "intra-task", validate, report, passes=passes,
                   distributed_optimizer=distributed_optimizer)


# --------------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------------
def lower_bound_ms(graph: TaskGraph, cluster: Cluster, *, curves_file: CurvesFile | None = None,
                   device: DeviceModel | None = None) -> float:
    """``Σ C*`` over the MetaLevels of ``graph`` on ``cluster`` (what every plan's ``lower_bound_ms`` holds)."""
    metaops, curves = _prepare(graph, cluster, curves_file, device)
    return sum(lv.c_star_ms for lv in relaxed_levels(metaops, curves, cluster.num_devices, "bound"))
