"""Simulated annealing and ruin-and-recreate on a level's layer assignment: searches past the local optima of
:mod:`.polish`.

A level's wave schedule is, up to device counts, a table ``a[w][m]``: the layers of MetaOp ``m`` in wave ``w``
(the waves of one level commute, so any table whose rows sum to every MetaOp's layers is a schedule). Given a
wave's layers, its shortest duration on ``N`` devices is found greedily (:func:`fit_wave`): every MetaOp starts on
its smallest valid count, and the slice that ends the wave moves to its next count while the devices allow;
when it cannot, no shorter duration fits (each count taken is the least that MetaOp needs to finish under the
wave's current end).

**Annealing** moves, at random (a seeded generator per level, so plans do not depend on the machine):

* one layer of a MetaOp from one wave to another (the MetaOp taken among the slices that end the source wave
  half of the time), or into a new wave;
* a swap: that layer one way, one or two layers of another MetaOp the other way;
* **shed** (:data:`SHED`): every slice that ends a wave (chosen in proportion to its duration) gives up one
  layer, each to a random wave or to the one where it costs least — the only move that shortens a wave
  several slices end together.

A move that shortens the span is always taken, a longer one with probability ``exp(-Δ / t)``, the temperature
``t`` falling geometrically from :data:`T_START` to :data:`T_END` of the span.

**Ruin and recreate** (:func:`rebuild`, when :func:`anneal` is given ``rebuild_work``): larger moves that
take many layers out at once (the slices that end a wave, a whole wave, or one MetaOp across waves) and put
them back one by one, slowest first, each into the first wave it does not lengthen or else the one it
lengthens least; kept by the same rule at a higher temperature. On the big encoder levels it reaches
schedules the one-layer moves do not (Multitask-CLIP-10 / 32 GPUs: 83.81 -> 83.44 ms). A run mostly finds
its best early or not at all, so :data:`REBUILD_STARTS` short runs with their own seeds start from the
annealing's best, until one reaches the caller's goal (:mod:`.assemble` asks for the span that certifies
the plan within 3%, and for none on a plan already that close) or :data:`REBUILD_FRUITLESS` runs in a row
find nothing shorter than the best so far (such a level rarely yields to the next runs either).

Every table found shorter than the input (the annealing's best, each run's best) is returned as waves,
polished (:mod:`.polish`, which sometimes takes a near-best table below the best), and the shortest is kept.
Work is limited by the moves tried and the wave fits counted, so the result depends only on the input and
the level.
"""
from __future__ import annotations

import heapq
import math
import random
from typing import Mapping, Sequence

from ..workload.curves import ScalingCurve
from ..workload.metaops import MetaOp
from .polish import polish
from .waves import Wave, build_waves

#: Temperatures at the first and the last move, as shares of the input's span.
T_START = 0.002
T_END = 0.0001
#: Share of moves that shed a wave's ending slices, and of shed layers sent to the wave where they cost least.
SHED = 0.3
SHED_GREEDY = 0.5
#: Temperatures of the ruin-and-recreate search (:func:`rebuild`) at its start and end, as shares of the span.
R_START = 0.01
R_END = 0.0005
#: Runs of the ruin-and-recreate search, each from the annealing's best with its own seed (a run mostly
#: finds its best early or not at all: several short ones reach more than one long one).
REBUILD_STARTS = 6
#: ... and no more after this many runs in a row found nothing shorter than the best so far (in
#: ``make_plan`` on the bench rows that run it, Multitask-CLIP-10 / 64 GPUs and OFASys-7 / 32 went 6 of 6
#: fruitless, and the rule changed no plan; what it can lose: on Multitask-CLIP-7 / 16 GPUs' encoders, searched
#: on their own, the sixth seed finds 0.5%, tests/test_solver.py).
REBUILD_FRUITLESS = 2
_heapify, _heapreplace = heapq.heapify, heapq.heapreplace


class _Level:
    """Per MetaOp its counts that run faster than the ones below (a slower larger count is never worth its
    devices) and their per-layer times; wave fits cached by layer tuple."""

    def __init__(self, metaops: Sequence[MetaOp], times: Mapping[str, Mapping[int, float]], N: int) -> None:
        self.N, self.names = N, [m.name for m in metaops]
        self.counts, self.T = [], []
        for m in metaops:
            cs = sorted(times[m.name])
            cs, ts = fast_counts(cs, [times[m.name][c] for c in cs])
            self.counts.append(cs)
            self.T.append(ts)
        self.cache: dict[tuple, tuple[float, tuple]] = {}
        self.tables = fit_tables(self.counts, self.T, N)

    def fit(self, w: tuple) -> tuple[float, tuple]:
        """``(shortest duration, device count per MetaOp)`` of a wave running ``w[m]`` layers of each MetaOp
        (``inf`` when its MetaOps do not fit the devices even on their smallest counts)."""
        got = self.cache.get(w)
        if got is None:
            got = self.cache[w] = fit_wave(w, self.tables, self.N)
        return got

    def plus(self, w: tuple, m: int) -> tuple[tuple, float]:
        """``w`` with one layer more of MetaOp ``m`` and its shortest duration. When the layer fits under the
        wave's end on the counts it has (with ``m`` on its smallest count if it was not in the wave), that end
        is the shortest duration (no shorter one fits ``w`` already) and no fit is needed."""
        x = w[:m] + (w[m] + 1,) + w[m + 1:]
        got = self.cache.get(x)
        if got is not None:
            return x, got[0]
        return x, self.plus_new(w, m, x)

    def plus_new(self, w: tuple, m: int, x: tuple) -> float:
        """:meth:`plus`'s duration of ``x`` (``w`` with one layer more of ``m``) when ``x`` is not cached."""
        d, k = self.fit(w)
        if w[m]:
            if x[m] * self.T[m][k[m]] <= d:
                self.cache[x] = (d, k)
                return d
        elif self.T[m][0] <= d:
            counts = self.counts
            used = 0
            i = 0
            for a in w:
                if a:
                    used += counts[i][k[i]]
                i += 1
            if used + counts[m][0] <= self.N:
                self.cache[x] = (d, k)
                return d
        return self.fit(x)[0]


def fast_counts(counts: Sequence[int], times: Sequence[float]) -> tuple[list[int], list[float]]:
    """Of ascending ``counts`` with per-layer ``times``, those faster than every smaller one, and their times
    (a slower larger count is never worth its devices)."""
    cs, ts = [], []
    for c, t in zip(counts, times):
        if not ts or t < ts[-1]:
            cs.append(c)
            ts.append(t)
    return cs, ts


def fit_tables(counts: Sequence[Sequence[int]], T: Sequence[Sequence[float]], N: int) -> tuple:
    """What :func:`fit_wave` reads of per-MetaOp ascending ``counts`` (those of :func:`fast_counts`) and their
    times ``T``: each MetaOp's smallest count, the devices each count adds to the one below (then ``N + 1``:
    no count after the last, so one test ends the search either way) and the times negated."""
    return ([cs[0] for cs in counts], [[0] + [b - a for a, b in zip(cs, cs[1:])] + [N + 1] for cs in counts],
            [[-t for t in ts] for ts in T])


def fit_wave(w: tuple, tables: tuple, N: int) -> tuple[float, tuple]:
    """``(shortest duration, count index per MetaOp)`` of a wave of ``w[m]`` layers of each MetaOp on at most
    ``N`` devices, over :func:`fit_tables` of the counts of :func:`fast_counts` (module docstring: greedy;
    ``a * -T`` is ``-a * T`` exactly)."""
    first, steps, neg_T = tables
    k = [0] * len(w)
    heap = []
    used = 0
    m = 0
    for a in w:
        if a:
            heap.append((a * neg_T[m][0], m))
            used += first[m]
        m += 1
    if not heap:
        return 0.0, tuple(k)
    if used > N:
        return math.inf, tuple(k)
    _heapify(heap)
    while True:
        t, m = heap[0]
        i = k[m] + 1
        used += steps[m][i]
        if used > N:
            return -t, tuple(k)
        k[m] = i
        _heapreplace(heap, (w[m] * neg_T[m][i], m))


def _ending(lv: _Level, w: tuple, d: float) -> list[int]:
    """The MetaOps whose slice ends a wave of duration ``d``."""
    k = lv.fit(w)[1]
    return [m for m, a in enumerate(w) if a and a * lv.T[m][k[m]] >= d * (1 - 1e-9)]


def anneal(waves: Sequence[Wave], metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve],
           num_devices: int, *, moves: int, level: int = 0, start_ms: float = 0.0,
           times: Mapping[str, Mapping[int, float]] | None = None, rebuild_work: int = 0,
           rebuild_goal_ms: float = 0.0) -> list[Wave]:
    """A shorter schedule of the level than ``waves`` found in ``moves`` annealing moves and, when
    ``rebuild_work`` > 0, up to :data:`REBUILD_STARTS` ruin-and-recreate runs sharing that many wave fits
    (no more once a table spans ``rebuild_goal_ms`` or less); polished, or ``[]``."""
    if not waves or moves <= 0:
        return []
    N = num_devices
    times = times if times is not None else {
        m.name: {c: curves[m.name].count_time(c) for c in m.valid_counts(N)} for m in metaops}
    lv = _Level(metaops, times, N)
    M, index = len(metaops), {m.name: i for i, m in enumerate(metaops)}
    empty = (0,) * M
    table = []
    for w in waves:
        row = [0] * M
        for s in w.slices:
            row[index[s.metaop]] += s.layers
        table.append(tuple(row))
    table.append(empty)  # one empty wave: a layer may always move to a wave of its own
    D = [lv.fit(w)[0] for w in table]
    span = sum(w.duration_ms for w in waves)
    best, best_table = span, None
    rng = random.Random(level)
    for it in range(moves):
        temp = span * T_START * (T_END / T_START) ** (it / moves)
        W = len(table)
        new = {}
        if rng.random() < SHED:
            i1 = rng.choices(range(W), weights=D)[0]
            ending = _ending(lv, table[i1], D[i1])
            if not ending:
                continue
            row = list(table[i1])
            for m in ending:
                row[m] -= 1
            new[i1] = tuple(row)
            for m in ending:
                if rng.random() < SHED_GREEDY:
                    best_cost, j_best, x_best = math.inf, -1, None
                    for j in range(W):
                        if j == i1:
                            continue
                        old = new.get(j, table[j])
                        x = old[:m] + (old[m] + 1,) + old[m + 1:]
                        cost = lv.fit(x)[0] - lv.fit(old)[0]
                        if cost < best_cost:
                            best_cost, j_best, x_best = cost, j, x
                    new[j_best] = x_best
                else:
                    j = rng.randrange(W - 1)
                    j += j >= i1
                    old = new.get(j, table[j])
                    new[j] = old[:m] + (old[m] + 1,) + old[m + 1:]
        else:
            if rng.random() < 0.5:
                i1 = rng.choices(range(W), weights=D)[0]
                ms = _ending(lv, table[i1], D[i1])
            else:
                i1 = rng.randrange(W)
                ms = [m for m in range(M) if table[i1][m]]
            if not ms:
                continue
            m = rng.choice(ms)
            i2 = rng.randrange(W - 1)
            i2 += i2 >= i1
            r1, r2 = list(table[i1]), list(table[i2])
            r1[m] -= 1
            r2[m] += 1
            if rng.random() >= 0.7:  # a swap: another MetaOp's layers the other way
                others = [k for k in range(M) if r2[k] and k != m]
                if not others:
                    continue
                m2 = rng.choice(others)
                d2 = rng.randint(1, min(2, r2[m2]))
                r1[m2] += d2
                r2[m2] -= d2
            new[i1], new[i2] = tuple(r1), tuple(r2)
        delta = sum(lv.fit(x)[0] - D[j] for j, x in new.items())
        if delta > 1e-12 * span and rng.random() >= math.exp(-delta / temp):
            continue
        for j, x in new.items():
            table[j], D[j] = x, lv.fit(x)[0]
        empties = [j for j in range(len(table)) if table[j] == empty]
        for j in reversed(empties[1:]):
            del table[j], D[j]
        if not empties:
            table.append(empty)
            D.append(0.0)
        if sum(D) < best * (1 - 1e-9):
            best, best_table = sum(D), list(table)
    start = best_table or [w for w in table if w != empty]
    tables = [best_table] if best_table is not None else []
    fruitless = 0  # runs in a row that found nothing shorter than the best so far
    for r in range(REBUILD_STARTS if rebuild_work > 0 else 0):  # each from the annealing's best, own seed
        if best <= rebuild_goal_ms or fruitless >= REBUILD_FRUITLESS:
            break
        got = rebuild(start, lv, rebuild_work // REBUILD_STARTS, random.Random(1000 * r + level))
        fruitless = 0 if got[0] < best * (1 - 1e-9) else fruitless + 1
        if got[0] < span * (1 - 1e-9) and got[1] not in tables:
            tables.append(got[1])
            best = min(best, got[0])
    out, out_span = [], span * (1 - 1e-9)
    for t in tables:  # polished, each: polishing may take a near-best table below the best
        choices = []
        for row in t:
            if row != empty:
                k = lv.fit(row)[1]
                choices.append([(lv.names[m], lv.counts[m][k[m]], a) for m, a in enumerate(row) if a])
        waves = polish(build_waves(level, choices, times, start_ms), metaops, curves, N, times)
        s = sum(w.duration_ms for w in waves)
        if s < out_span:
            out, out_span = waves, s
    return out


def rebuild(table: Sequence[tuple], lv: _Level, work: int, rng: random.Random) -> tuple[float, list[tuple]]:
    """Ruin and recreate from ``table`` (rows of layers per MetaOp): ``(best span, its table)``.

    Each step takes layers out (:func:`_ruin`) and puts them back one by one, the slowest first (per layer, on
    the MetaOp's smallest count, with ±20% noise), each into the first wave it does not lengthen, else the one
    it lengthens least or a wave of its own;
    the result is kept like an annealing move (temperature :data:`R_START` -> :data:`R_END` of the span).
    Work is counted in wave fits tried (``work``)."""
    M = len(lv.T)
    empty = (0,) * M
    table = [tuple(r) for r in table if any(r)]
    cur = sum(lv.fit(r)[0] for r in table)
    best, best_table, span, done = cur, list(table), cur, 0
    get, plus_new = lv.cache.get, lv.plus_new
    ones: dict[int, tuple] = {}  # MetaOp -> (one layer of it alone, that wave's duration)
    while done < work:
        temp = span * R_START * (R_END / R_START) ** (done / work)
        done += 1
        rows, removed = _ruin(table, lv, rng)
        if not removed:
            continue
        removed.sort(key=lambda m: -lv.T[m][0] * (0.8 + 0.4 * rng.random()))
        rows = [r for r in rows if r != empty]
        D = [lv.fit(r)[0] for r in rows]
        tried = [{} for _ in rows]  # per row while it is unchanged: MetaOp -> (row plus a layer, its d, cost)
        for m in removed:
            cost, j = math.inf, -1
            for i, r in enumerate(rows):  # the first wave it does not lengthen, else the least lengthened
                done += 1
                e = tried[i].get(m)
                if e is None:  # lv.plus(r, m), its cached case inline (a second ask is always cached)
                    x = r[:m] + (r[m] + 1,) + r[m + 1:]
                    got = get(x)
                    d = got[0] if got is not None else plus_new(r, m, x)
                    e = tried[i][m] = (x, d, d - D[i])
                if e[2] < cost:
                    best_x, best_d, cost = e
                    j = i
                    if cost <= 0:
                        break
            got = ones.get(m)
            if got is None:  # a layer of m alone, and its wave's duration (lv.fit, once per MetaOp)
                one = empty[:m] + (1,) + empty[m + 1:]
                got = ones[m] = (one, lv.fit(one)[0])
            one, d_one = got
            if d_one < cost:
                rows.append(one)
                D.append(d_one)
                tried.append({})
            else:
                rows[j], D[j] = best_x, best_d
                tried[j] = {}
        new = sum(D)
        if new < cur - 1e-12 * span or rng.random() < math.exp(-(new - cur) / temp):
            table, cur = rows, new
            if cur < best * (1 - 1e-9):
                best, best_table = cur, list(table)
    return best, best_table


def _ruin(table: Sequence[tuple], lv: _Level, rng: random.Random) -> tuple[list[tuple], list[int]]:
    """Layers taken out of ``table``, a third of the time each way: the slices that end a random wave lose up
    to half their layers; a whole wave; or one MetaOp's layers, in each wave with probability 1/2, 1 to all.
    Returns the rows left and the MetaOp of every layer taken."""
    rows = [list(r) for r in table]
    removed: list[int] = []
    kind, i = rng.random(), rng.randrange(len(rows))
    if kind < 1 / 3:
        for m in _ending(lv, table[i], lv.fit(table[i])[0]):
            k = rng.randint(1, max(1, rows[i][m] // 2))
            rows[i][m] -= k
            removed += [m] * k
    elif kind < 2 / 3:
        for m, a in enumerate(rows[i]):
            removed += [m] * a
            rows[i][m] = 0
    else:
        m = rng.randrange(len(lv.T))
        for r in rows:
            if r[m] and rng.random() < 0.5:
                k = rng.randint(1, r[m])
                r[m] -= k
                removed += [m] * k
    return [tuple(r) for r in rows], removed
