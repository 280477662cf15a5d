"""Spindle's waves inside task lanes: a whole-step candidate that pays neither the transfers of waves that move a
MetaOp between device sets nor the idle devices of fixed power-of-two task shares.

On thin per-device batches the whole step is decided by what Spindle's level-by-level waves pay beyond
compute: a MetaOp that moves between device sets from wave to wave moves its activations (across islands,
often), and a shared weight spread over many devices pays a large all-reduce. The task-level baseline pays
neither (each task stays on its own devices) but idles a third of the cluster: its shares are whole valid
counts and its lanes finish at different times. This candidate keeps the lanes and fills them:

1. **Lanes.** Within each phase (the execution's task groups; one phase: every task), one lane per task on a
   contiguous block of devices. Lane sizes balance the lanes' estimated makespans: a lane's estimate on ``n``
   devices is the sum over its levels of ``C*`` (:func:`..level.allocate.allocate_level`, the relaxed optimum
   the waves approach), and devices move from the lane that would finish first to the one that would finish
   last while that lowers the latest (halving the step, from an eighth of the smaller lane down to one device).
   Sizes need not be valid counts: Spindle's bi-point waves use every device of a lane.
2. **Waves per lane.** Each lane's MetaOps are scheduled by the level scheduler (:func:`..assembly.assemble.schedule`,
   the paper's pipeline) on the lane's devices, each wave's slices on consecutive devices of the lane, a slice
   of a MetaOp that ran in the lane's previous wave starting where that one started (its activations mostly
   stay where they are).
3. **Merging.** The ``k``-th waves of a phase's lanes form one wave (lanes on disjoint devices run at their own
   pace in the simulator and the runtime: no barrier at a wave's end), phase after phase.
4. **Islands and the step.** Lane sizes balanced over whole islands or divisors of one (:func:`island_sizes`)
   keep each node's NIC to one lane's all-reduces; and the better side-by-side layout has its sizes searched
   by the simulated step (:func:`size_search`), since the step is decided as much by when a shared weight's
   gradient is ready and over which nodes it is reduced as by the lanes' compute.

The whole-step choice (:mod:`.choose`) times it with the others; it wins only where its simulated step is the
shortest, so it can make no plan slower.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..level.allocate import allocate_level
from ..level.waves import Wave, WaveSlice
from ..systems.shares import min_share
from ..workload.curves import ScalingCurve
from ..workload.metaops import MetaOp, levels
from ..assembly.assemble import assemble_plan, fits_memory, schedule
from ..simulation.simulate import step_time_ms
from .step_search import critical_tasks

#: Clusters larger than this get no lane candidates: their packing and the two more plans to time cost about
#: two seconds at 1024 devices, where planning must stay under 3 s (the paper's planning time), and they did
#: not win there.
LANES_MAX_DEVICES = 512
#: The suffix of the name of a candidate whose lane sizes :func:`size_search` chose.
SIZED = "sized by step"
#: Bisection steps on the lanes' common makespan target.
TARGET_STEPS = 40


def _phases(metaops: Sequence[MetaOp], groups: Sequence[Sequence[str]]) -> list[list[list[MetaOp]]]:
    """Per phase (the execution's task groups; one phase: every task), each of its tasks' MetaOps, a lane each
    (tasks with none left out)."""
    names = [list(g) for g in groups] or [list(dict.fromkeys(m.task for m in metaops))]
    return [[ms for ms in ([m for m in metaops if m.task == t] for t in ns) if ms] for ns in names]


def lane_estimate(ms: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], n: int) -> float:
    """A lane's makespan on ``n`` devices, estimated per level: a level of one MetaOp runs at its best valid
    count ``≤ n`` (one slice per wave: devices beyond it idle), a level of several at ``C*``."""
    out = 0.0
    for lv in levels(ms):
        if len(lv) == 1:
            m = lv[0]
            counts = [c for c in m.valid_counts(n) if c <= n]
            out += m.num_layers * min((curves[m.name].count_time(c) for c in counts), default=float("inf"))
        else:
            out += allocate_level({m.name: m.num_layers for m in lv}, curves, n).c_star_ms
    return out


def _estimates(lanes: Sequence[Sequence[MetaOp]], curves: Mapping[str, ScalingCurve], memo: dict | None):
    """``t(i, n)``: lane ``i``'s :func:`lane_estimate` on ``n`` devices, remembered in ``memo`` by task and size."""
    memo = {} if memo is None else memo

    def t(i: int, n: int) -> float:
        key = ("estimate", lanes[i][0].task, n)
        if key not in memo:
            memo[key] = lane_estimate(lanes[i], curves, n)
        return memo[key]
    return t


def lane_sizes(lanes: Sequence[Sequence[MetaOp]], curves: Mapping[str, ScalingCurve], num_devices: int,
               island: int = 8, allowed: Sequence[int] | None = None, memo: dict | None = None
               ) -> list[int] | None:
    """Devices per lane (summing to ``num_devices``), ``None`` when the lanes' smallest sizes do not fit: the
    smallest sizes whose estimates (:func:`lane_estimate`, non-increasing in ``n``) meet a common target,
    the target bisected to the least that fits; devices left over go to the lane estimated to finish last
    while that shortens it. With ``allowed`` (ascending), every size is one of them: leftovers go to the
    lane finishing last in steps to its next allowed size while one fits and shortens it, the rest stay
    free. ``memo``: the estimates by task and size, shared across calls."""
    N = num_devices
    mins = [min_share(ms, N) for ms in lanes]
    sizes_of = [list(range(m, N + 1)) if allowed is None else [n for n in allowed if m <= n <= N] for m in mins]
    if any(not c for c in sizes_of) or sum(c[0] for c in sizes_of) > N:
        return None
    t = _estimates(lanes, curves, memo)

    def need(i: int, target: float) -> int:
        c = sizes_of[i]  # the smallest allowed n with t(i, n) <= target (the largest when none)
        lo, hi = 0, len(c) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if t(i, c[mid]) <= target:
                hi = mid
            else:
                lo = mid + 1
        return c[lo]

    k = range(len(lanes))
    lo = max(t(i, sizes_of[i][-1]) for i in k)
    hi = max(t(i, sizes_of[i][0]) for i in k)
    best = [c[0] for c in sizes_of]
    for _ in range(TARGET_STEPS):
        mid = (lo + hi) / 2
        sizes = [need(i, mid) for i in k]
        if sum(sizes) <= N:
            hi, best = mid, sizes
        else:
            lo = mid
    sizes = [need(i, hi) for i in k] if sum(need(i, hi) for i in k) <= N else best
    if allowed is not None:
        while True:  # leftovers: the lane that would finish last takes its next allowed size, while it fits
            i = max(k, key=lambda i: (t(i, sizes[i]), -i))
            nxt = next((n for n in sizes_of[i] if n > sizes[i]), None)
            if nxt is None or sum(sizes) - sizes[i] + nxt > N or not t(i, nxt) < t(i, sizes[i]) * (1 - 1e-12):
                return sizes
            sizes[i] = nxt
    for _ in range(N - sum(sizes)):  # leftovers: to the lane that would finish last, while that helps
        i = max(k, key=lambda i: (t(i, sizes[i]), -i))
        if not t(i, sizes[i] + 1) < t(i, sizes[i]) * (1 - 1e-12):
            i = min(k, key=lambda i: (sizes[i], i))  # none helps: the smallest lane
        sizes[i] += 1
    return sizes


def island_sizes(lanes: Sequence[Sequence[MetaOp]], curves: Mapping[str, ScalingCurve], num_devices: int,
                 island: int = 8, memo: dict | None = None) -> list[int] | None:
    """:func:`lane_sizes` over sizes that keep lanes off each other's islands: whole islands, or a divisor
    of an island (lanes of those share an island among themselves, :func:`island_order`). A node whose
    devices serve two lanes carries both lanes' weights' all-reduces on its NIC; on whole islands it carries
    one lane's."""
    return lane_sizes(lanes, curves, num_devices, island,
                      allowed=sorted({d for d in range(1, island + 1) if island % d == 0}
                                     | set(range(island, num_devices + 1, island))), memo=memo)


def island_order(sizes: Sequence[int], island: int) -> list[int]:
    """Lanes in the order they sit side by side (:func:`lane_waves`' ``order``): the lanes of whole islands in
    task order, then the smaller ones, largest first (divisors of the island: each then starts at a multiple
    of its size, and none crosses an island)."""
    return [i for i in range(len(sizes)) if sizes[i] % island == 0] + \
        sorted((i for i in range(len(sizes)) if sizes[i] % island), key=lambda i: (-sizes[i], i))


def _lane_ranks(waves: Sequence[Wave], first: int, size: int) -> list[list[tuple[int, ...]]]:
    """Ranks of every slice of a lane's waves on devices ``first .. first + size - 1``: a MetaOp that ran in
    the previous wave starts where it started when that block is free; the others take the first free
    consecutive block (the first free devices when no block is left), in slice order."""
    out: list[list[tuple[int, ...]]] = []
    prev: dict[str, int] = {}  # MetaOp -> first device offset in the previous wave
    for w in waves:
        used: set[int] = set()
        got: list[tuple[int, ...] | None] = [None] * len(w.slices)
        for si, s in enumerate(w.slices):
            o = prev.get(s.metaop)
            if o is not None and o + s.devices <= size and not used & set(range(o, o + s.devices)):
                got[si] = tuple(range(o, o + s.devices))
                used.update(got[si])
        for si, s in enumerate(w.slices):
            if got[si] is None:
                o = next((o for o in range(size - s.devices + 1) if not used & set(range(o, o + s.devices))), None)
                got[si] = tuple(range(o, o + s.devices)) if o is not None else \
                    tuple([d for d in range(size) if d not in used][:s.devices])
                used.update(got[si])
        prev = {s.metaop: r[0] for s, r in zip(w.slices, got)}
        out.append([tuple(first + d for d in r) for r in got])
    return out


def _best_valid(ms: Sequence[MetaOp], curves, n: int, memo) -> int:
    """The smallest size ``≤ n`` with the same estimate as ``n`` (devices beyond it would idle)."""
    t = memo(n)
    while n > 1 and memo(n - 1) <= t * (1 + 1e-12):
        n -= 1
    return n


#: Orders in which :func:`pack` places the tasks: longest first, largest area first, widest first.
ORDERS = ("time", "area", "size")
#: Rounds of the size search in :func:`pack_sizes`.
SIZE_ROUNDS = 3


def pack(sizes: Sequence[int], times: Sequence[float], num_devices: int, island: int, order: str = "time"
         ) -> tuple[float, list[tuple[int, float]]]:
    """List scheduling of task blocks: tasks in ``order`` (:data:`ORDERS`), each on the contiguous block of
    its size (aligned to its size within an island, to whole islands beyond) that frees first, lowest device
    first on ties. ``(makespan, [(first device, start)] per task)``."""
    key = {"time": lambda i: (-times[i], i), "area": lambda i: (-times[i] * sizes[i], i),
           "size": lambda i: (-sizes[i], -times[i], i)}[order]
    free = np.zeros(num_devices)
    out: list = [None] * len(sizes)
    for i in sorted(range(len(sizes)), key=key):
        n = sizes[i]
        align = n if n <= island and island % n == 0 else (island if n % island == 0 else 1)
        if align > 1:
            offsets = np.arange(0, num_devices - n + 1, align)
        else:  # the lowest earliest block starts where the free times change (sliding left never hurts)
            offsets = np.concatenate(([0], np.flatnonzero(np.diff(free)) + 1))
            offsets = offsets[offsets <= num_devices - n]
        starts = sliding_window_view(free, n)[offsets].max(axis=1)
        j = int(np.argmin(starts))  # the first of the earliest
        o, start = int(offsets[j]), float(starts[j])
        free[o:o + n] = start + times[i]
        out[i] = (o, start)
    return float(free.max()), out


def best_pack(sizes: Sequence[int], times: Sequence[float], num_devices: int, island: int):
    """The shortest of :func:`pack` over :data:`ORDERS`: ``(makespan, order, placement)``."""
    return min(((*pack(sizes, times, num_devices, island, o), o) for o in ORDERS),
               key=lambda r: (r[0], ORDERS.index(r[2])))


def pack_sizes(lanes: Sequence[Sequence[MetaOp]], curves, num_devices: int, island: int, memo: dict | None = None
               ) -> list[int] | None:
    """Sizes for :func:`pack`: the balanced lane sizes (:func:`lane_sizes`) cut to the devices their
    estimates use, then improved by :data:`SIZE_ROUNDS` rounds of the best move among doubling or halving one
    task's size or doubling two, judged by :func:`best_pack`'s makespan."""
    sizes = lane_sizes(lanes, curves, num_devices, island, memo=memo)
    if sizes is None:
        return None
    mins = [min_share(ms, num_devices) for ms in lanes]
    t = _estimates(lanes, curves, memo)

    def span(sz):
        return best_pack(sz, [t(i, n) for i, n in enumerate(sz)], num_devices, island)[0]

    sizes = [_best_valid(lanes[i], curves, n, lambda k, i=i: t(i, k)) for i, n in enumerate(sizes)]
    best = span(sizes)
    k = len(lanes)
    for _ in range(SIZE_ROUNDS):
        moves = [{i: f} for i in range(k) for f in (2, 0.5)] + \
            [{i: 2, j: 2} for i in range(k) for j in range(i + 1, k)]
        found = None
        for mv in moves:
            trial = [int(n * mv.get(i, 1)) for i, n in enumerate(sizes)]
            if any(n < mins[i] or n > num_devices for i, n in enumerate(trial)) or trial == sizes:
                continue
            got = span(trial)
            if got < (found[0] if found else best) * (1 - 1e-9):
                found = (got, trial)
        if found is None:
            break
        best, sizes = found
    return sizes


def lane_waves(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int,
               groups: Sequence[Sequence[str]] = (), island: int = 8, *, packed: bool = True,
               islands: bool = False, sizes: Sequence[Sequence[int]] | None = None,
               order: Sequence[Sequence[int]] | None = None, memo: dict | None = None
               ) -> tuple[list[Wave], dict[tuple[int, int], tuple[int, ...]]] | None:
    """The candidate's waves and ranks (module docstring), ``None`` when the lanes do not fit; ``packed``:
    tasks packed in time (:func:`pack_sizes`), else every task from the start on its lane, the lanes side by
    side: balanced (:func:`lane_sizes`) in task order, or with ``islands`` on whole islands or divisors of
    one (:func:`island_sizes`, :func:`island_order`), or ``sizes`` given per phase (side by side in ``order``,
    lane indices per phase; default task order). ``memo``: each lane's estimates and waves by its task and
    size, kept across calls (the size search, :func:`size_search`, re-times a few lanes per trial)."""
    memo = {} if memo is None else memo
    waves: list[Wave] = []
    ranks: dict[tuple[int, int], tuple[int, ...]] = {}
    clock = 0.0
    for phase, lanes in enumerate(_phases(metaops, groups)):
        if sizes is not None:
            sz = list(sizes[phase])
        else:
            sz = (pack_sizes if packed else island_sizes if islands else lane_sizes)(lanes, curves, num_devices,
                                                                                     island, memo=memo)
        if sz is None:
            return None
        own = []
        for ms, n in zip(lanes, sz):
            key = ("waves", ms[0].task, n)
            if key not in memo:
                memo[key] = [w for ls in schedule(ms, curves, n, search=False) for w in ls.waves]
            own.append(memo[key])
        if packed and sizes is None:
            where = best_pack(sz, [sum(w.duration_ms for w in lw) for lw in own], num_devices, island)[1]
        else:
            seq = list(order[phase]) if order is not None else \
                island_order(sz, island) if islands and sizes is None else list(range(len(lanes)))
            where, at = [(0, 0.0)] * len(lanes), 0
            for i in seq:
                where[i], at = (at, 0.0), at + sz[i]
        for i in sorted(range(len(lanes)), key=lambda i: (where[i][1], where[i][0])):  # tasks by start
            for w, rs in zip(own[i], _lane_ranks(own[i], where[i][0], sz[i])):
                out = Wave(level=len(waves), start_ms=clock, duration_ms=w.duration_ms, phase=phase)
                for s, r in zip(w.slices, rs):
                    ranks[(len(waves), len(out.slices))] = r
                    out.slices.append(WaveSlice(metaop=s.metaop, layer_start=s.layer_start, layers=s.layers,
                                                devices=s.devices, time_ms=s.time_ms))
                clock += w.duration_ms
                waves.append(out)
    return waves, ranks


def size_search(build, sizes: Sequence[Sequence[int]], mins: Sequence[Sequence[int]], tasks: Sequence[Sequence[str]],
                cluster, trials: int, start: tuple[object, float] | None = None):
    """Lane sizes judged by the whole step: from ``sizes`` (per phase; ``build(sizes)`` makes the plan, ``None``
    when it does not fit memory), ``d`` devices (an island, half of one, ... one) move between a *critical*
    task's lane and another lane of its phase, either way (:func:`.step_search.critical_tasks`: the task whose
    slice completes the bucket that ends the sync last or that starts the sync floor, else the one finishing
    last), no lane below its least share ``mins``; the first move that shortens the step (by more than a
    relative 1e-9) is kept and the critical tasks are found again, until no move does or ``trials`` plans are
    timed. ``(step, sizes, plan)`` of the best found, ``None`` when ``sizes`` do not fit. ``start``: the plan of
    ``sizes`` and its step, when the caller has them (not built or timed again).

    The lanes' estimates (:func:`lane_estimate`) balance compute; the step is decided as much by when each
    shared weight's gradient is ready and which nodes' NICs carry its all-reduce, which the sizes move in
    ways no estimate of a lane alone sees (a lane one island smaller holds its weights on one NIC fewer; a
    lane a few devices smaller splits its MetaOps' layers over other devices, its weights over more groups)."""
    where = {t: (ph, i) for ph, names in enumerate(tasks) for i, t in enumerate(names)}
    best = [list(s) for s in sizes]
    plan, step = start if start is not None else (build(best), None)
    if plan is None:
        return None
    step, used = step_time_ms(plan, cluster) if step is None else step, 0
    steps = [cluster.gpus_per_node >> k for k in range(cluster.gpus_per_node.bit_length())]

    def moves():
        for t in critical_tasks(plan, cluster):
            ph, i = where[t]
            for j in range(len(best[ph])):
                for d in steps:
                    for sign in (1, -1):
                        trial = [list(s) for s in best]
                        trial[ph][i] += sign * d
                        trial[ph][j] -= sign * d
                        if j != i and trial[ph][i] >= mins[ph][i] and trial[ph][j] >= mins[ph][j]:
                            yield trial

    while used < trials:
        found = None
        for trial in moves():
            if used >= trials:
                break
            used += 1
            q = build(trial)
            if q is not None and (got := step_time_ms(q, cluster)) < step * (1 - 1e-9):
                found = (got, trial, q)
                break
        if found is None:
            break
        step, best, plan = found
    return step, best, plan


def size_trials(num_devices: int) -> int:
    """Plans :func:`size_search` may time: a quarter of the cluster's devices, from 8 to 64 (a trial re-schedules
    two lanes and simulates the plan: ~10 ms at 64 devices, ~15 ms at 256; 16 trials at 64
    devices, where planning must stay under a second, 64 from 256 on)."""
    return min(64, max(8, num_devices // 4))


def lane_plans(own, graph, cluster, metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve],
               groups: Sequence[Sequence[str]] = ()) -> list[tuple[str, object]]:
    """The candidates as ``(name, plan)`` (balanced lanes, lanes on whole islands, packed lanes, then the
    better of the first two with its sizes searched, :func:`size_search`; none where the lanes do not fit),
    with ``own``'s levels, passes and optimizer (``own``: Spindle's own plan)."""
    if cluster.num_devices > LANES_MAX_DEVICES:
        return []
    N, island = cluster.num_devices, cluster.gpus_per_node
    memo: dict = {}

    def plan_of(got):
        return assemble_plan(graph, cluster, metaops, curves, own.levels, got[0], got[1], system="spindle",
                             passes=own.passes, distributed_optimizer=own.distributed_optimizer)

    out, side = [], []
    for name, packed, islands in (("spindle, task lanes", False, False),
                                  ("spindle, task lanes, whole islands", False, True),
                                  ("spindle, task lanes, packed", True, False)):
        got = lane_waves(metaops, curves, N, groups, island, packed=packed, islands=islands, memo=memo)
        if got is not None:
            out.append((name, plan_of(got)))
            if not packed:
                side.append((step_time_ms(out[-1][1], cluster), len(side), islands, out[-1][0], out[-1][1]))
    if not side:
        return out
    lanes = _phases(metaops, groups)
    tasks = [[ms[0].task for ms in ls] for ls in lanes]
    step, _, islands, name, start = min(side, key=lambda c: c[:2])
    sizes = [(island_sizes if islands else lane_sizes)(ls, curves, N, island, memo=memo) for ls in lanes]
    order = [island_order(sz, island) if islands else list(range(len(sz))) for sz in sizes]
    mins = [[min_share(ms, N) for ms in ls] for ls in lanes]

    def build(sz):
        if any(sum(s) > N for s in sz):
            return None
        got = lane_waves(metaops, curves, N, groups, island, packed=False, sizes=sz, order=order, memo=memo)
        plan = plan_of(got)
        return plan if fits_memory(plan, cluster) else None

    found = size_search(build, sizes, mins, tasks, cluster, size_trials(N),
                        start=(start, step) if fits_memory(start, cluster) else None)
    if found is not None:
        out.append((f"{name}, {SIZED}", found[2]))
    return out
