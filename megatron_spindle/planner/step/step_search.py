"""Whole-step local search: devices of a block that finishes early lent to the task that finishes last
(issue 32, part 1).

The whole-step choice (:mod:`.choose`) compares finished candidates; the best of them (task lanes, or a
baseline's schedule) often keeps each task on a block of its own and idles: the blocks' sizes are valid
counts and the tasks' work is not a multiple of them, so one block finishes last while others wait. This
search starts from such a plan and moves devices to the critical task, judged by the step simulator
(:func:`..simulation.simulate.step_time_ms`: compute, transfers and the gradient sync they cause):

1. **Time the plan.** One pass on the timeline (:func:`..simulation.timeline.dataflow_pass`) gives every
   slice's backward end; the *critical* task is the one whose slice ends last, a *donor* any other task, its
   block the devices its slices use, ordered by when its last slice ends (earliest first, task order on
   ties: the order only decides which trial comes first, the step decides what is kept).
2. **Moves.** For a slice ``x`` of the critical task and a donor block ``D``: ``x`` and every later slice of
   its task that runs inside ``x``'s devices grow onto the devices of ``D`` (the lowest first, those of
   ``x``'s islands before the others), each to the largest valid count (rule 3 of :mod:`.validate`) that
   the devices of ``D`` free in its wave allow (rule 2). A MetaOp's later layers and its consumers follow
   it, so the activations it hands on stay where they are; the donor's own waves still run first on its
   devices when they come first in wave order (a rank runs its slices in wave order), and a weight spread
   over more devices is all-reduced over them, which the simulator prices.
3. **Keep the best.** Every move of a round is timed; the shortest step that fits memory is kept when it
   beats the current one (by more than a relative 1e-9: no float tie decides), then the next round starts
   from it. At most :data:`MAX_ROUNDS` rounds and :data:`MAX_TRIALS` timed trials.

The result is never slower than the start (a move is kept only when its step is shorter) and is the same
on every machine (the moves and their order are a function of the plan; no tie is decided by rounding).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from ..simulation.timeline import dataflow_pass
from ..workload.cluster import Cluster
from .assemble import device_memory
from .dataflow import param_groups, transfers
from .plan import Plan, WavePlan

#: Rounds of moves (each keeps the best move of the round).
MAX_ROUNDS = 6
#: Timed trials in all (a trial re-derives the plan's data flow and simulates it: ~2 ms at 32 devices,
#: ~20 ms at 256).
MAX_TRIALS = 60
#: Donor blocks tried per round (the earliest finishers).
MAX_DONORS = 3
#: Slices of the critical task tried per round as the start of a move (the longest first).
MAX_STARTS = 4


def relocate(plan: Plan, ranks: Mapping[tuple[int, int], Sequence[int]]) -> Plan:
    """``plan`` with new ``ranks`` for some slices ``(wave, slice index)``: their times from the curves, the
    waves' durations and starts, the data flow, parameter groups and memory derived again."""
    curves = dict(plan.curves)
    by_name = {m.name: m for m in plan.metaops}
    waves, clock = [], 0.0
    for w in plan.waves:
        sl = []
        for i, s in enumerate(w.slices):
            r = ranks.get((w.index, i))
            if r is not None:
                s = dataclasses.replace(s, ranks=tuple(r), time_ms=s.num_layers * curves[s.metaop].time(len(r)))
            sl.append(s)
        d = max(s.time_ms for s in sl)
        waves.append(WavePlan(index=w.index, level=w.level, phase=w.phase, start_ms=clock, duration_ms=d,
                              slices=tuple(sl)))
        clock += d
    slices = [s for w in waves for s in w.slices]
    return dataclasses.replace(
        plan, waves=tuple(waves), makespan_ms=clock,
        transfers=tuple(transfers(plan.metaops, slices, plan.gpus_per_node)),
        param_groups=tuple(param_groups(plan.metaops, slices)),
        device_memory_bytes=tuple(device_memory(by_name, slices, plan.world_size,
                                                phase_of={w.index: w.phase for w in waves},
                                                distributed_optimizer=plan.distributed_optimizer)))


def _task_of(plan: Plan) -> dict[str, str]:
    return {m.name: m.task for m in plan.metaops}


def moves(plan: Plan, cluster: Cluster) -> list[dict[tuple[int, int], tuple[int, ...]]]:
    """The round's moves from ``plan`` (module docstring, items 1-2), in the order they are tried."""
    curves = dict(plan.curves)
    slice_ms = {s.name: s.num_layers * curves[s.metaop].time(len(s.ranks)) for s in plan.slices()}
    _, done = dataflow_pass(plan, cluster, slice_ms)
    task = _task_of(plan)
    by_name = {m.name: m for m in plan.metaops}
    order = list(plan.tasks)
    end: dict[str, float] = {}
    block: dict[str, set[int]] = {}
    for s in plan.slices():
        t = task[s.metaop]
        end[t] = max(end.get(t, 0.0), done[s.name])
        block.setdefault(t, set()).update(s.ranks)
    if len(end) < 2:
        return []
    critical = max(end, key=lambda t: (end[t], -order.index(t)))
    donors = sorted((t for t in end if t != critical), key=lambda t: (end[t], order.index(t)))[:MAX_DONORS]
    mine = [(w.index, i, s) for w in plan.waves for i, s in enumerate(w.slices) if task[s.metaop] == critical]
    starts = sorted(mine, key=lambda x: (-x[2].time_ms, x[0], x[1]))[:MAX_STARTS]
    starts.sort(key=lambda x: (x[0], x[1]))
    used = {w.index: {r for s in w.slices for r in s.ranks} for w in plan.waves}
    g = cluster.gpus_per_node
    out = []
    for donor in donors:
        for wi, si, x in starts:
            home = set(x.ranks)
            islands = {r // g for r in home}
            pool = sorted(block[donor] - home, key=lambda r: (r // g not in islands, r))
            change: dict[tuple[int, int], tuple[int, ...]] = {}
            taken: dict[int, set[int]] = {}  # devices given to an earlier slice of the same wave
            for wj, sj, y in mine:
                if (wj, sj) < (wi, si) or not set(y.ranks) <= home:
                    continue
                m = by_name[y.metaop]
                free = [r for r in pool if r not in used[wj] and r not in taken.get(wj, ())]
                n = max((c for c in m.valid_counts(len(y.ranks) + len(free)) if c > len(y.ranks)), default=0)
                if n == 0 or m.tp > 1:
                    continue
                change[(wj, sj)] = tuple(sorted(y.ranks + tuple(free[:n - len(y.ranks)])))
                taken.setdefault(wj, set()).update(change[(wj, sj)])
            if change and change not in out:
                out.append(change)
    return out


def search(start: Plan, cluster: Cluster, steps: Callable[[Plan], float] | None = None,
           ) -> tuple[Plan, float, int]:
    """``(best plan, its step, moves kept)`` from ``start`` (module docstring); ``steps``: how a plan is
    timed (default :func:`..simulation.simulate.step_time_ms`)."""
    from ..simulation.simulate import step_time_ms
    steps = steps or (lambda p: step_time_ms(p, cluster))
    limit = cluster.memory_limit_bytes * (1 + 1e-9)
    best, best_ms, kept, trials = start, steps(start), 0, 0
    for _ in range(MAX_ROUNDS):
        found = None
        for change in moves(best, cluster):
            if trials >= MAX_TRIALS:
                break
            trials += 1
            p = relocate(best, change)
            if max(p.device_memory_bytes) > limit:
                continue
            t = steps(p)
            if t < (found[0] if found else best_ms) * (1 - 1e-9):
                found = (t, p)
        if found is None:
            break
        best_ms, best = found
        kept += 1
    return best, best_ms, kept
