"""Whole-step local search: devices lent to the task that finishes last, shared weights whose sync is exposed
moved where it is not.

The whole-step choice (:mod:`.choose`) compares finished candidates; the best of them (task lanes, or a
baseline's schedule) often keeps each task on a block of its own and idles: the blocks' sizes are valid
counts and the tasks' work is not a multiple of them, so one block finishes last while others wait; and a
weight shared by every task, held by devices of every node, is all-reduced over every node's NIC, in part
after the pass. This search starts from such a plan and changes it by moves judged by the step simulator
(:func:`..simulation.simulate.step_time_ms`: compute, transfers and the gradient sync they cause):

1. **Time the plan.** One pass on the timeline (:func:`..simulation.timeline.dataflow_pass`) gives every
   slice's backward end; the *critical* tasks are the one whose slice ends last, the one whose slice
   completes the gradient bucket whose all-reduce ends last (the simulator's collectives), and the one that
   completes the bucket starting the plan's sync floor (:func:`..simulation.link_costs.sync_floor`: the
   device or NIC with the most all-reduce time left once a bucket of it is ready); a *donor* is any
   other task, its block the devices its slices use, ordered by when its last slice ends (earliest first,
   task order on ties: the order only decides which trial comes first, the step decides what is kept), and
   the devices no slice uses.
2. **Widen.** For a slice ``x`` of a critical task and a donor block ``D`` (the critical task's own devices,
   those its other slices leave free in a wave; one of the first :data:`MAX_DONORS`, or several of them
   together): ``x`` and every later slice of its task that runs
   inside ``x``'s devices grow onto the devices of ``D`` (those of ``x``'s islands first, then the lowest),
   each to the largest valid count (rule 3 of :mod:`..assembly.validate`) that the devices of ``D`` free in its wave
   allow (rule 2). A MetaOp's later layers and its consumers follow it, so the activations it hands on stay
   where they are; a donor's own waves still run first on its devices when they come first in wave order
   (a rank runs its slices in wave order); a weight spread over more devices is all-reduced over them.
3. **Sink.** Every slice of a MetaOp without producers (an embedding) in a wave of its own just before the
   first wave that uses it: a rank runs its backward in reverse wave order, so its backward then follows its
   consumers' instead of ending the pass, and its weight's all-reduce overlaps the rest of the backward.
4. **Gather a weight onto few islands.** A weight whose parameter device group spans islands costs every
   node of it ``2(n-1)/n`` of its bytes on the NIC (:mod:`..simulation.link_costs`), however little compute
   it carries. When every MetaOp holding it has no producers and its slices together take at most
   :data:`GATHER_SHARE` of the pass on ``c`` devices (``c`` the least count valid for all of them that
   ``k`` islands hold alike), they move to the first ``c / k`` devices of each of the ``k`` islands that hold
   most of the group (the lowest on ties), one wave per slice at the front of their phase, for each ``k`` of
   :data:`ISLANDS`: with ``k = 1`` the sync becomes intra-island, paid for with the outputs' transfer through
   one NIC; a larger ``k`` splits that transfer over ``k`` NICs for a ring over ``k`` nodes. Per ``k``, the
   :data:`MAX_GATHER` weights with the most cross-island bytes one by one, then all.
5. **Follow**, once the moves of items 2-4 find nothing shorter, in rounds of its own on its own budget
   (``(MAX_FOLLOW + 1) · MAX_ROUNDS`` trials). A slice with one input fed from other devices (a pooling head
   after its encoder, one layer's continuation on other devices) takes its producer's devices, where its
   MetaOp may run on that many and no other slice of its wave uses them: its input becomes a local copy.
6. **Keep the best.** Every move of a round is timed (under the start's transfer posting; the whole-step
   choice runs one search per posting, :mod:`.choose`); the shortest step that fits memory is kept when it
   beats the current one (by more than a relative 1e-9: no float tie decides), then the next round starts
   from it. At most :data:`MAX_ROUNDS` rounds and :func:`trial_budget` timed trials of items 2-4, then as many
   rounds of item 5.

The result is never slower than the start (a move is kept only when its step is shorter) and is the same
on every machine (the moves and their order are a function of the plan; no tie is decided by rounding).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

from ..simulation.link_costs import sync_floor
from ..simulation.simulate import simulate, step_time_ms
from ..simulation.timeline import dataflow_pass
from ..workload.cluster import Cluster
from ..workload.memory import slice_param_keys
from ..assembly.assemble import device_memory
from ..assembly.communicators import peak_memory_bytes
from ..assembly.dataflow import param_groups, transfers
from ..assembly.plan import Plan, SliceRef, WavePlan

#: Rounds of moves (each keeps the best move of the round).
MAX_ROUNDS = 12
#: Timed trials of the whole-step choice's searches together, times the cluster's devices (a trial re-derives
#: the plan's data flow and simulates it: ~3 ms at 32 devices, ~10 ms at 256): 96 trials at 64 devices (48
#: before gathers onto 2 and 4 islands joined the rounds: at 48, OFASys-7 on 64 devices ran out a round early,
#: 250.1 ms against 249.9 without them; at 96, 246.4 ms, planning still 0.4-0.8 s of CPU at 64-1024 devices).
TRIAL_DEVICES = 6144
#: ... but at least this many.
MIN_TRIALS = 8
#: Donor blocks tried per round (the earliest finishers).
MAX_DONORS = 3
#: Slices of the critical task tried per round as the start of a move (the longest first).
MAX_STARTS = 4
#: Weights gathered one at a time per round (then all of them together).
MAX_GATHER = 4
#: A gathered weight's slices may take at most this share of the pass on their new devices.
GATHER_SHARE = 0.02
#: Islands a weight is gathered onto (its outputs leave through that many NICs).
ISLANDS = (1, 2, 4)
#: Edges tried per round by the follow move, the most bytes moved first (then all of them together): at 4,
#: Multitask-CLIP-10 on 32 devices ends at 1243.8 ms, at 8 and at 16 at 1238.9 (`spindle compare --model
#: multitask-clip --tasks 10 --gpus 32`).
MAX_FOLLOW = 8


def relocate(plan: Plan, ranks: Mapping[tuple[int, int], Sequence[int]],
             order: Sequence[Sequence[tuple[int, int]]] | None = None) -> Plan:
    """``plan`` with new ``ranks`` for some slices ``(wave, slice index)`` and, when ``order`` is given, its
    slices regrouped into the waves it lists (each a list of ``(wave, slice index)``, in execution order; a
    wave takes the phase of its first slice and the least level of the waves from it on, so levels never go
    back): the slices' times
    from the curves, the waves' durations and starts, the data flow, parameter groups and memory derived
    again."""
    curves = dict(plan.curves)
    by_name = {m.name: m for m in plan.metaops}
    if order is None:
        order = [[(w.index, i) for i in range(len(w.slices))] for w in plan.waves]
    levels = [plan.waves[keys[0][0]].level for keys in order]
    for i in range(len(levels) - 2, -1, -1):
        levels[i] = min(levels[i], levels[i + 1])
    waves, clock = [], 0.0
    for new, keys in enumerate(order):
        sl = []
        for wi, si in keys:
            s = plan.waves[wi].slices[si]
            r = ranks.get((wi, si))
            if r is not None:
                s = dataclasses.replace(s, ranks=tuple(r), time_ms=s.num_layers * curves[s.metaop].time(len(r)))
            sl.append(dataclasses.replace(s, wave=new) if s.wave != new else s)
        d = max(s.time_ms for s in sl)
        waves.append(WavePlan(index=new, level=levels[new], phase=plan.waves[keys[0][0]].phase, start_ms=clock,
                              duration_ms=d,
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


def moves(plan: Plan, cluster: Cluster) -> list[tuple[dict, list | None]]:
    """The round's moves from ``plan`` (module docstring, item 2), in the order they are tried: ``(new ranks
    by (wave, slice index), new wave order or None)``."""
    curves = dict(plan.curves)
    slice_ms = {s.name: s.num_layers * curves[s.metaop].time(len(s.ranks)) for s in plan.slices()}
    pass_ms, done = dataflow_pass(plan, cluster, slice_ms)
    gathers = gather_moves(plan, cluster, pass_ms)
    one = [m for m in gathers if _islands_of(m[0], cluster) <= 1]  # onto one island (and the sink): first
    return one + [(c, None) for c in widen_moves(plan, cluster, done, _sync_critical(plan, cluster))] \
        + [m for m in gathers if _islands_of(m[0], cluster) > 1]


def follow_moves(plan: Plan) -> list[dict]:
    """Follow moves (module docstring, item 5): a slice with one input, fed from other devices, takes its
    producer's devices in its own wave where no other slice of that wave uses them, so its input stays where
    it is (a local copy); the :data:`MAX_FOLLOW` edges moving the most bytes one by one, then all of them
    together but those whose producer moves too (a together that puts two slices of a wave on one device is
    dropped by the search's rule check)."""
    by_name = {m.name: m for m in plan.metaops}
    where = {s.name: (w.index, i, s) for w in plan.waves for i, s in enumerate(w.slices)}
    into = collections.Counter(t.dst for t in plan.transfers)
    found = []
    for t in plan.transfers:
        moved = sum(m.bytes for m in t.forward if not m.local)
        (pw, pi, src), (cw, ci, dst) = where[t.src], where[t.dst]
        m = by_name[dst.metaop]
        if moved <= 0 or into[t.dst] != 1 or m.tp > 1 or by_name[src.metaop].tp > 1 \
                or len(src.ranks) not in m.valid_counts(plan.world_size) or set(src.ranks) == set(dst.ranks) \
                or any(set(src.ranks) & set(o.ranks) for j, o in enumerate(plan.waves[cw].slices) if j != ci):
            continue
        found.append((-moved, t.dst, {(cw, ci): src.ranks}, (pw, pi)))
    found.sort(key=lambda f: f[:2])
    picks = [f[2] for f in found[:MAX_FOLLOW]]
    # together: not a slice whose producer moves too (it would follow the producer to where it was)
    moving = {k for f in found[:MAX_FOLLOW] for k in f[2]}
    together = {k: v for f in found[:MAX_FOLLOW] if f[3] not in moving for k, v in f[2].items()}
    if len(together) > 1:
        picks.append(together)
    return picks


def _islands_of(change: Mapping, cluster: Cluster) -> int:
    """The most islands one moved slice's devices span (0 for no change)."""
    g = cluster.gpus_per_node
    return max((len({r // g for r in ranks}) for ranks in change.values()), default=0)


def _sync_critical(plan: Plan, cluster: Cluster) -> list[str]:
    """When the sync ends after the pass (it decides the step): the task of the slice whose backward completes
    the gradient bucket whose all-reduce ends last, then the task of the one that completes the bucket starting
    the plan's sync floor (:func:`..simulation.link_costs.sync_floor`: the busiest device or NIC's all-reduces
    from the first ready bucket on; readier sooner, the floor falls), each the first such slice of its wave."""
    sim = simulate(plan, cluster, check_memory=False)
    if not sim.collectives or sim.breakdown.sync_ms <= 0:
        return []
    task = _task_of(plan)

    def of(c) -> str | None:
        if c.wave is None:
            return None
        members = set(c.ranks)
        return next((task[s.metaop] for s in plan.waves[c.wave].slices if members & set(s.ranks)), None)

    found = [of(max(sim.collectives, key=lambda c: (c.end_ms, c.ranks)))]
    floor = sync_floor(((c.ranks, c.bytes, c.ready_ms) for c in sim.collectives), cluster)
    if floor is not None:
        on = [c for c in sim.collectives if c.ready_ms == floor.from_ms and _uses(c, floor.resource, cluster)]
        found += [of(c) for c in sorted(on, key=lambda c: c.ranks)]
    return [t for t in dict.fromkeys(found) if t is not None]


def critical_tasks(plan: Plan, cluster: Cluster) -> list[str]:
    """The tasks a search should speed up (:func:`_sync_critical`), else the task that finishes last."""
    found = _sync_critical(plan, cluster)
    if found:
        return found
    curves = dict(plan.curves)
    _, done = dataflow_pass(plan, cluster, {s.name: s.num_layers * curves[s.metaop].time(len(s.ranks))
                                            for s in plan.slices()})
    end = _task_ends(plan, done)[0]
    return [_last(plan, end)] if end else []


def _task_ends(plan: Plan, done: Mapping[str, float]) -> tuple[dict[str, float], dict[str, set[int]]]:
    """Per task: when its last slice's backward ends (``done``), and the devices its slices use."""
    task = _task_of(plan)
    end: dict[str, float] = {}
    block: dict[str, set[int]] = {}
    for s in plan.slices():
        t = task[s.metaop]
        end[t] = max(end.get(t, 0.0), done[s.name])
        block.setdefault(t, set()).update(s.ranks)
    return end, block


def _last(plan: Plan, end: Mapping[str, float]) -> str:
    """The task that finishes last (the first in task order on ties)."""
    order = list(plan.tasks)
    return max(end, key=lambda t: (end[t], -order.index(t)))


def _uses(c, resource: str, cluster: Cluster) -> bool:
    """Whether all-reduce ``c`` occupies ``resource`` (``"device d"`` or ``"node n NIC"``)."""
    kind, index = resource.split()[0], int(resource.split()[1])
    if kind == "device":
        return index in c.ranks
    return cluster.spans_islands(c.ranks) and any(r // cluster.gpus_per_node == index for r in c.ranks)


def widen_moves(plan: Plan, cluster: Cluster, done: Mapping[str, float], also: Sequence[str] = ()) -> list[dict]:
    """Widening moves (module docstring, item 2) given every slice's backward end ``done``, for the task that
    finishes last and then for the tasks ``also`` (:func:`_sync_critical`)."""
    end, block = _task_ends(plan, done)
    if len(end) < 2:
        return []
    first = _last(plan, end)
    out: list[dict] = []
    for critical in dict.fromkeys([first] + [t for t in also if t in end]):
        _widen(plan, cluster, critical, end, block, out)
    return out


def _widen(plan: Plan, cluster: Cluster, critical: str, end, block, out: list) -> None:
    """:func:`widen_moves` of one task, appended to ``out``."""
    task = _task_of(plan)
    by_name = {m.name: m for m in plan.metaops}
    order = list(plan.tasks)
    donors = sorted((t for t in end if t != critical), key=lambda t: (end[t], order.index(t)))[:MAX_DONORS]
    idle = set(range(plan.world_size)) - {r for b in block.values() for r in b}
    pools = ([idle] if idle else []) + [block[t] for t in donors]
    pools += [set().union(*pools[:k]) for k in range(2, len(pools) + 1)]  # several blocks together
    pools.insert(0, set(block[critical]))  # its own devices that other slices of it leave free in a wave
    mine = [(w.index, i, s) for w in plan.waves for i, s in enumerate(w.slices) if task[s.metaop] == critical]
    starts = sorted(mine, key=lambda x: (-x[2].time_ms, x[0], x[1]))[:MAX_STARTS]
    starts.sort(key=lambda x: (x[0], x[1]))
    used = {w.index: {r for s in w.slices for r in s.ranks} for w in plan.waves}
    g = cluster.gpus_per_node
    for donor in pools:
        for wi, si, x in starts:
            home = set(x.ranks)
            islands = {r // g for r in home}
            pool = sorted(donor - home, key=lambda r: (r // g not in islands, r))
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


def gather_moves(plan: Plan, cluster: Cluster, pass_ms: float) -> list[tuple[dict, list]]:
    """Gather moves (module docstring, item 4): ``(new ranks, new wave order)`` per island count and weight,
    heaviest sync first, then all of them together."""
    curves = dict(plan.curves)
    by_name = {m.name: m for m in plan.metaops}
    g = cluster.gpus_per_node
    holders: dict[str, list[tuple[int, int]]] = {}
    for w in plan.waves:
        for i, s in enumerate(w.slices):
            for k in slice_param_keys(by_name[s.metaop], s.layer_start, s.num_layers):
                holders.setdefault(k, []).append((w.index, i))
    found = []
    for grp in plan.param_groups:
        at = holders.get(grp.param_key, [])
        ms = {plan.waves[wi].slices[si].metaop for wi, si in at}
        if not cluster.spans_islands(grp.ranks) or any(by_name[m].producers or by_name[m].tp > 1 for m in ms):
            continue
        sl = [plan.waves[wi].slices[si] for wi, si in at]
        isl = collections.Counter(r // g for r in grp.ranks)
        homes = sorted(isl, key=lambda i: (-isl[i], i))  # the islands holding most of it, the lowest on ties
        for k in ISLANDS:
            if k > len(homes):
                break
            c = next((c for c in min((by_name[m].valid_counts(g * k) for m in ms), key=len)
                      if c % k == 0 and c // k <= g and all(c in by_name[m].valid_counts(g * k) for m in ms)
                      and sum(x.num_layers * curves[x.metaop].time(c) for x in sl) <= GATHER_SHARE * pass_ms),
                     None)
            if c is None:
                continue
            devices = tuple(sorted(h * g + j for h in homes[:k] for j in range(c // k)
                                   if h * g + j < plan.world_size))  # the last island may be short
            if len(devices) == c:
                found.append((k, -grp.params * (len(grp.ranks) - 1) / len(grp.ranks), grp.param_key,
                              {key: devices for key in at}))
    picks = []
    for k in ISLANDS:
        mine = sorted((f for f in found if f[0] == k), key=lambda f: (f[1], f[2]))
        picks += [f[3] for f in mine[:MAX_GATHER]]
        if len(mine) > 1:
            picks.append({key: v for f in mine for key, v in f[3].items()})
    out = [(change, _hoisted(plan, change)) for change in picks]
    sunk = _sunk(plan)
    if sunk is not None:
        out.insert(0, ({}, sunk))
    return out


def _sunk(plan: Plan, only: Mapping | None = None) -> list[list[tuple[int, int]]] | None:
    """The wave order with every slice of a MetaOp without producers (those in ``only``, when given) in a
    wave of its own just before the first wave that uses it (a consumer, or its MetaOp's later layers);
    ``None`` when no slice moves. A rank runs its backward in reverse wave order, so such a slice's backward
    then runs right after its consumers' instead of at the end of the pass, and its weight's gradient is
    all-reduced while the rest of the backward runs."""
    by_name = {m.name: m for m in plan.metaops}
    users: dict[str, int] = {}  # MetaOp -> first wave using it
    seen: dict[str, int] = {}
    for w in plan.waves:
        for s in w.slices:
            m = by_name[s.metaop]
            for p in m.producers:
                users.setdefault(p, w.index)
            if s.metaop in seen:
                users.setdefault(s.metaop, w.index)
            seen.setdefault(s.metaop, w.index)
    moved: dict[int, list[tuple[int, int]]] = {}
    keep: dict[int, list[tuple[int, int]]] = {}
    for w in plan.waves:
        for i, s in enumerate(w.slices):
            target = users.get(s.metaop)
            sink = not by_name[s.metaop].producers and target is not None and target > w.index + 1 \
                and (only is None or (w.index, i) in only) and plan.waves[target].phase == w.phase
            (moved.setdefault(target, []) if sink else keep.setdefault(w.index, [])).append((w.index, i))
    if not moved:
        return None
    out = []
    for w in plan.waves:
        out += [[k] for k in moved.get(w.index, [])]
        if keep.get(w.index):
            out.append(keep[w.index])
    return out


def _hoisted(plan: Plan, change: Mapping[tuple[int, int], Sequence[int]]) -> list[list[tuple[int, int]]]:
    """The wave order with every wave that holds a gathered slice (all its slices without producers and from
    their MetaOp's first layer, so any earlier wave may run them) split into one wave per slice and moved to
    the front of its phase."""
    by_name = {m.name: m for m in plan.metaops}
    front: dict[int, list] = {}
    rest: dict[int, list] = {}
    for w in plan.waves:
        keys = [(w.index, i) for i in range(len(w.slices))]
        if any(k in change for k in keys) and not any(by_name[s.metaop].producers or s.layer_start
                                                      for s in w.slices):
            front.setdefault(w.phase, []).extend([k] for k in keys)
        else:
            rest.setdefault(w.phase, []).append(keys)
    return [ks for ph in sorted(set(front) | set(rest)) for ks in front.get(ph, []) + rest.get(ph, [])]


def _ordered(plan: Plan) -> bool:
    """Validation's rule 5 as the data flow sees it: every edge's producer runs in an earlier wave."""
    return all(SliceRef.from_str(t.src).wave < t.wave for t in plan.transfers)


def _disjoint(plan: Plan) -> bool:
    """Validation's rule 2: no device twice in one wave."""
    return all(len({r for s in w.slices for r in s.ranks}) == sum(len(s.ranks) for s in w.slices)
               for w in plan.waves)


def search(start: Plan, cluster: Cluster, start_ms: float | None = None, *, trials: int | None = None
           ) -> tuple[Plan, float, int]:
    """``(best plan, its step, moves kept)`` from ``start`` (module docstring); ``start_ms``: its step when
    the caller has it; ``trials``: the most plans timed (default :func:`trial_budget`)."""
    limit = cluster.memory_limit_bytes * (1 + 1e-9)
    budget = trial_budget(cluster.num_devices) if trials is None else trials
    best = start
    best_ms = step_time_ms(start, cluster) if start_ms is None else start_ms
    kept = 0
    # the moves of items 2-4 first, then the follow moves from where they end, on a budget of their own: a
    # follow taken early leads some searches to a longer final step than they reach without it
    for propose, most in ((lambda p: moves(p, cluster), budget),
                          (lambda p: [(c, None) for c in follow_moves(p)], (MAX_FOLLOW + 1) * MAX_ROUNDS)):
        used = 0
        for _ in range(MAX_ROUNDS):
            found = None
            for change, order in propose(best):
                if used >= most:
                    break
                used += 1
                p = relocate(best, change, order)
                if max(peak_memory_bytes(p)) > limit or not _disjoint(p) or not _ordered(p):
                    continue
                t = step_time_ms(p, cluster)
                if t < (found[0] if found else best_ms) * (1 - 1e-9):
                    found = (t, p)
            if found is None:
                break
            best_ms, best = found
            kept += 1
    return best, best_ms, kept


def trial_budget(num_devices: int) -> int:
    """Plans the searches may time: :data:`TRIAL_DEVICES` over the cluster's devices (a trial's cost grows
    with them), at least :data:`MIN_TRIALS`."""
    return max(MIN_TRIALS, TRIAL_DEVICES // max(1, num_devices))
