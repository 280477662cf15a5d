"""The configuration LP over a level's wave *patterns*: a lower bound (column generation), and schedules
(price-and-dive).

The area bound (:mod:`.area`) prices device-time but not that a wave lasts as long as its longest slice. A
wave is a *pattern* ``p``: for some MetaOps ``m`` a valid count ``c`` and ``a_{m,p} ≥ 1`` whole layers
(``Σ c ≤ N``), lasting ``D_p = max_m a_{m,p}·T_m(c)``. Any wave schedule uses patterns ``x_p`` times with
``Σ_p a_{m,p}·x_p = L_m`` and spans ``Σ_p D_p·x_p``, so the LP::

    min Σ_p D_p·x_p   s.t.   Σ_p a_{m,p}·x_p ≥ L_m  (every MetaOp),   x ≥ 0

is below every schedule. It has a column per pattern, so it is solved by column generation: a restricted
LP over a few patterns (HiGHS) gives duals ``π ≥ 0``; the *pricing* problem finds the pattern of largest
``Σ_m π_m·a_{m,p} / D_p``. For a duration ``D`` every MetaOp independently takes, at each count, the most
layers that fit (``⌊D / T_m(c)⌋``, at most ``L_m``): a multiple-choice knapsack over the ``N`` devices, solved
by dynamic programming for every candidate duration at once (numpy; the candidates are the ``l·T_m(c)``, so
the best pattern's own duration is among them).

Whatever the restricted LP's duals, with ``θ = max_p π·a_p / D_p`` the point ``π / θ`` is feasible for the
dual, so ``Σ_m π_m·L_m / θ`` (Farley's bound) is a valid lower bound after any number of rounds. Patterns
longer than ``max_span`` (the heuristic's span of the level) are left out of pricing: a schedule that beats
the heuristic has no wave that long, so the bound (capped at ``max_span``) still holds for the best schedule.
The restricted LP starts from the heuristic's own waves and one single-layer pattern per MetaOp.

Each round adds the best pattern of each of the :data:`COLUMNS` durations with the most negative reduced
costs; pricing runs over every duration every :data:`FULL_EVERY` rounds (those rounds give the bound) and
over the most promising ones in between. Work is limited by the rounds asked for (deterministic) and by
:data:`MAX_CELLS` (candidate durations × devices).

**Schedules** (:func:`improve`). The LP's optimum uses a few waves *fractionally* (on the big encoder levels
its value lies 2-6% under the best schedules found), but its patterns are good waves. A *dive* commits the
pattern the LP uses most as one wave (its layers trimmed to what is left), re-solves the LP of the layers
still to schedule (column generation again, from every pattern found so far; the candidate durations shrink
with the layers left) and repeats until every layer is scheduled. Dive ``t < DIVES`` starts from the root's
``t``-th most used pattern; up to :data:`RANDOM_DIVES` more take the LP's second or third pattern instead at
random (a fixed seed per level). A residual already solved by an earlier dive is not solved again; a dive
stops once what it committed plus its residual's Farley bound is :data:`DIVE_SLACK` over the best span known;
every finished dive is polished (:mod:`.polish`). Work is limited by column-generation rounds
(:data:`DIVE_BUDGET`, deterministic). Branching on the LP's whole-number quantities (waves, waves per MetaOp,
per MetaOp and count) to raise the bound was tried and not kept: 200 nodes moved it by under 0.1% on these
levels.
"""
from __future__ import annotations

import math
import random
from typing import Mapping, Sequence

import numpy as np

from ..workload.curves import ScalingCurve
from ..exact import dot
from ..workload.metaops import MetaOp
from .near_optimal import near_optimal_bound
from .polish import polish
from .waves import Wave, build_waves

try:  # optional: without HiGHS there is no restricted LP, and no pattern bound
    import highspy
except ImportError:  # pragma: no cover - exercised by the no-solver test
    highspy = None

#: Column-generation rounds per level (each: one restricted LP, one pricing over every candidate duration).
ROUNDS = 60
#: Patterns added per round: the best of each of the durations with the most negative reduced costs.
COLUMNS = 24
#: Pricing over every candidate duration every FULL_EVERY rounds (and the last, which gives the bound); in
#: between over the PARTIAL durations that gained most at the last full pricing.
FULL_EVERY = 8
PARTIAL = 128
#: Largest pricing table (candidate durations × (devices + 1)) worth building, and the most work of one full
#: pricing (table cells × valid counts of all MetaOps) worth spending rounds on.
MAX_CELLS = 400_000
MAX_ROUND_WORK = 8_000_000
#: Most table cells (durations × (devices + 1) × (MetaOps + 1)) a pricing keeps for :meth:`_Pool.backtrack`
#: (8 bytes each: 32 MiB); from a larger one, :meth:`_Pool.patterns` prices the durations it needs again.
MAX_KEPT = 4_000_000
#: Dives from the root LP (:func:`improve`): one from each of its DIVES most used patterns, then up to
#: RANDOM_DIVES that sometimes take the LP's second or third pattern; column-generation rounds per dive step.
DIVES = 8
RANDOM_DIVES = 16
DIVE_ROUNDS = 30
#: A dive stops once it cannot end within this share above the best span known, before polishing.
DIVE_SLACK = 0.03
#: Column-generation rounds all dives of a level may spend together (a deterministic work limit), fewer in
#: proportion on levels whose full pricing costs more than DIVE_WORK (table cells × valid counts).
DIVE_BUDGET = 100
DIVE_WORK = 2_000_000
#: ... and none on levels whose full pricing costs more than this (the bound alone is worth its time there).
MAX_DIVE_WORK = 5_000_000


class _Pool:
    """A level's patterns in one restricted LP (HiGHS; new patterns are added as columns and the simplex
    restarts from the last basis), with the pricing tables of the layers still to schedule."""

    def __init__(self, metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], N: int, max_span: float,
                 heuristic: Sequence[Wave], work: int) -> None:
        self.N, self.M = N, len(metaops)
        self.work = work
        """One full pricing's work at the start (:func:`_work`)."""
        self.names = [m.name for m in metaops]
        self.counts = [m.valid_counts(N) for m in metaops]
        self.T = [np.array([curves[m.name].count_time(c) for c in self.counts[i]]) for i, m in enumerate(metaops)]
        L = np.array([m.num_layers for m in metaops], dtype=float)
        self.max_span = max_span
        self.rounds_run = 0
        self._priced = None
        inf = highspy.kHighsInf
        self.h = highspy.Highs()
        self.h.setOptionValue("output_flag", False)
        self.h.setOptionValue("threads", 1)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = 0, self.M
        lp.row_lower_, lp.row_upper_ = [float(v) for v in L], [inf] * self.M
        self.h.passModel(lp)
        self.cols: list[tuple[float, np.ndarray, np.ndarray]] = []   # (duration, layers a, count index k)
        self.set_left(L)
        index = {n: i for i, n in enumerate(self.names)}
        start = []
        for i in range(self.M):  # one layer alone: the restricted LP is always feasible
            a, k = np.zeros(self.M), np.full(self.M, -1)
            k[i] = int(np.argmin(self.T[i]))
            a[i] = 1.0
            start.append((float(self.T[i][k[i]]), a, k))
        for w in heuristic:
            a, k = np.zeros(self.M), np.full(self.M, -1)
            for s in w.slices:
                i = index[s.metaop]
                a[i], k[i] = s.layers, self.counts[i].index(s.devices)
            start.append((float(w.duration_ms), a, k))
        self.add(start)

    def set_left(self, L: np.ndarray) -> None:
        """The layers still to schedule: the cover rows, the candidate durations (a pattern of the layers left
        is no longer than ``l·T_m(c)`` for some ``l`` left) and the pricing tables follow."""
        self.L = np.array(L, dtype=float)
        inf = highspy.kHighsInf
        for i in range(self.M):
            self.h.changeRowBounds(i, float(self.L[i]), inf)
        self.Ds = _durations(self.T, self.L, self.max_span)
        # layers[i][d, k]: the most layers of MetaOp i on count k that fit in duration Ds[d]
        self.layers = [np.minimum(self.L[i], np.floor(self.Ds[:, None] / self.T[i][None, :] * (1 + 1e-12)))
                       for i in range(self.M)]

    def add(self, cols: Sequence[tuple[float, np.ndarray, np.ndarray]]) -> None:
        starts, idx, val = [], [], []
        for _, a, _ in cols:
            starts.append(len(idx))
            nz = np.nonzero(a)[0]
            idx.extend(nz.tolist())
            val.extend(a[nz].tolist())
        n = len(cols)
        self.h.addCols(n, np.array([c[0] for c in cols], dtype=np.float64), np.zeros(n),
                       np.full(n, highspy.kHighsInf), len(idx), np.array(starts, dtype=np.int32),
                       np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))
        self.cols.extend(cols)

    def solve(self) -> tuple[float, np.ndarray, np.ndarray] | None:
        """Optimum, row duals (clipped at 0) and column values, or ``None`` if HiGHS does not solve it."""
        self.h.run()
        if self.h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        sol = self.h.getSolution()
        return (self.h.getInfo().objective_function_value, np.maximum(np.array(sol.row_dual, dtype=float), 0.0),
                np.array(sol.col_value, dtype=float))

    def _active(self, pi: np.ndarray) -> list[int]:
        """MetaOps worth a place in a pattern: a positive dual and layers left (the others add nothing to
        ``Σ π·a``, so the knapsack never picks them)."""
        return [i for i in range(self.M) if pi[i] > 0 and self.L[i] > 0]

    def _options(self, i: int, pi: np.ndarray, rows, value: np.ndarray) -> np.ndarray:
        """``(R, 1 + counts, N + 1)``: the knapsack's value with MetaOp ``i`` left out (0) or on each of its
        valid counts (``k + 1``), from ``value`` (the MetaOps before it), for at most ``n`` devices."""
        counts = self.counts[i]
        R, W = value.shape
        top = counts[-1]
        padded = np.full((R, W + top), -np.inf)
        padded[:, top:] = value
        shifted = padded[:, (top - np.asarray(counts))[:, None] + np.arange(W)]   # (R, K, W)
        gains = pi[i] * self.layers[i][rows]                                        # (R, K)
        return np.concatenate([value[:, None, :], shifted + gains[:, :, None]], axis=1)

    def price(self, pi: np.ndarray, rows: np.ndarray, *, keep: bool | None = None) -> np.ndarray:
        """Best ``Σ π·a`` of a pattern of at most ``N`` devices for each duration ``Ds[rows]`` (the recurrence of
        :meth:`_options`, one count at a time: over every duration the stacked form moves 3x the memory). The
        table is kept devices-major (a shift by a count is a contiguous block) in two buffers; every entry is
        the same maximum of the same sums as in any layout. ``keep``: keep every MetaOp's table for
        :meth:`backtrack` (default: when they hold at most :data:`MAX_KEPT` cells)."""
        R, W = len(rows), self.N + 1
        full = R == len(self.Ds) and bool((rows == np.arange(R)).all())  # every duration, in order: no gather
        value, tmp = np.zeros((W, R)), np.empty((W, R))
        active = self._active(pi)
        keep = R * W * (len(active) + 1) <= MAX_KEPT if keep is None else keep
        tables = [value] if keep else None
        for i in active:
            gains = pi[i] * (self.layers[i] if full else self.layers[i][rows])  # (R, counts)
            counts = self.counts[i]
            new, best = np.empty_like(value), value  # best: the MetaOp left out, then the counts so far
            new[:counts[0]] = value[:counts[0]]      # (a pool's MetaOps have valid counts: see __init__)
            for k, c in enumerate(counts):
                np.add(value[:W - c], gains[:, k], out=tmp[:W - c])
                np.maximum(best[c:], tmp[:W - c], out=new[c:])
                best = new
            value = new
            if keep:
                tables.append(value)
        self._priced = (pi, rows, active, tables) if keep else None
        return value[self.N].copy()

    def backtrack(self, pi: np.ndarray, rows: np.ndarray, positions: Sequence[int]
                  ) -> list[tuple[float, np.ndarray, np.ndarray]] | None:
        """The knapsack's best pattern for each duration ``Ds[rows[positions]]``, read from the tables the last
        :meth:`price` of ``(pi, rows)`` kept (``None`` when it kept none): each MetaOp's choice is the first
        of (left out, its counts in order) whose sum is the largest (a tie keeps the fewer devices). A
        duration's column of the tables does not depend on the other durations priced with it, so the
        patterns are the same whichever ``rows`` were priced together."""
        got = self._priced
        if got is None or got[0] is not pi or got[1] is not rows:
            return None
        _, _, active, tables = got
        pos = np.asarray(positions, dtype=np.int64)
        R, N = len(pos), self.N
        sel = rows[pos]
        n = np.full(R, N)
        A, K, dur = np.zeros((R, self.M)), np.full((R, self.M), -1, dtype=np.int64), np.zeros(R)
        for j in range(len(active) - 1, -1, -1):
            i, before = active[j], tables[j]          # the table before MetaOp i was added
            counts = np.asarray(self.counts[i])
            gains = pi[i] * self.layers[i][sel]       # (R, counts)
            left = n[:, None] - counts[None, :]
            ok = left >= 0
            opts = np.empty((R, len(counts) + 1))
            opts[:, 0] = before[n, pos]
            opts[:, 1:] = np.where(ok, before[np.where(ok, left, 0), pos[:, None]] + gains, -np.inf)
            k = opts.argmax(axis=1) - 1               # the first largest: left out, then the smallest count
            has = k >= 0
            kc = np.where(has, k, 0)
            a = np.where(has, self.layers[i][sel, kc], 0.0)
            A[:, i], K[:, i] = a, k
            dur = np.maximum(dur, np.where(a > 0, a * self.T[i][kc], 0.0))
            n = n - np.where(has, counts[kc], 0)
        return [(float(dur[r]), A[r].copy(), K[r].copy()) for r in range(R) if A[r].any()]

    def patterns(self, pi: np.ndarray, rows: Sequence[int]) -> list[tuple[float, np.ndarray, np.ndarray]]:
        """The knapsack's best pattern for each duration ``Ds[rows]``, each with its own duration (its longest
        slice): those durations priced alone, their tables kept, then backtracked (:meth:`backtrack`)."""
        rows = np.asarray(rows, dtype=np.int64)
        self.price(pi, rows, keep=True)
        return self.backtrack(pi, rows, range(len(rows)))

    def generate(self, rounds: int) -> tuple[float, float, np.ndarray] | None:
        """Column generation on the layers left (module docstring): ``(best Farley bound, last restricted
        optimum, its column values)``, or ``None`` if HiGHS fails."""
        best, got, subset = 0.0, None, None
        D = self.Ds
        self.rounds_run = 0
        for r in range(rounds):
            self.rounds_run += 1
            got = self.solve()
            if got is None:
                return None
            z, pi, _ = got
            tol = 1e-9 * max(z, 1e-12)
            full = subset is None or r % FULL_EVERY == 0 or r == rounds - 1
            rows = np.arange(len(D)) if full else subset
            value = self.price(pi, rows)
            gain = value - D[rows]  # minus the reduced cost of each duration's best pattern
            if full:
                theta = float((value / D).max())
                if theta <= 0:
                    break
                best = max(best, dot(pi, self.L) / theta * (1 - 1e-9))
                subset = np.argsort(-gain, kind="stable")[:PARTIAL]
            if gain.max() <= tol:
                if full:  # no pattern improves the LP: it is solved
                    best = max(best, z * (1 - 1e-9))
                    break
                subset = None  # nothing among the partial durations: price them all next round
                continue
            best_d = [int(d) for d in np.argsort(-gain, kind="stable")[:COLUMNS] if gain[d] > tol]
            found = self.backtrack(pi, rows, best_d)
            self.add(found if found is not None else self.patterns(pi, [int(rows[d]) for d in best_d]))
        z, _, x = got
        return best, z, np.concatenate([x, np.zeros(len(self.cols) - len(x))])


def _durations(T: Sequence[np.ndarray], L: np.ndarray, max_span: float) -> np.ndarray:
    """The candidate wave durations: every ``l·T_m(c)`` for ``l`` up to the layers left, at most ``max_span``."""
    Ds = np.unique(np.concatenate([np.outer(np.arange(1, int(L[i]) + 1), T[i]).ravel() for i in range(len(T))]))
    return Ds[Ds <= max_span * (1 + 1e-9)]


def _work(metaops, curves, num_devices: int, max_span: float) -> tuple[int, int]:
    """``(candidate durations, one full pricing's work: table cells × valid counts)`` of a level."""
    counts = [m.valid_counts(num_devices) for m in metaops]
    T = [np.array([curves[m.name].count_time(c) for c in cs]) for m, cs in zip(metaops, counts)]
    n = len(_durations(T, np.array([m.num_layers for m in metaops]), max_span))
    return n, n * (num_devices + 1) * sum(len(c) for c in counts)


def _pool(metaops, curves, num_devices, heuristic, max_span) -> _Pool | None:
    """The level's pattern pool, or ``None`` without HiGHS or when pricing is too big (module docstring;
    checked before the pool is built)."""
    if highspy is None or not metaops:
        return None
    durations, work = _work(metaops, curves, num_devices, max_span)
    if durations == 0 or durations * (num_devices + 1) > MAX_CELLS or work > MAX_ROUND_WORK:
        return None
    return _Pool(metaops, curves, num_devices, max_span, heuristic, work)


def pattern_bound(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int, *,
                  heuristic: Sequence[Wave] = (), max_span: float = math.inf, rounds: int = ROUNDS,
                  near: bool = False) -> float:
    """The best Farley bound of the configuration LP found in ``rounds`` rounds (ms; 0 if not computed);
    ``near``: raised where no whole-number cover by the LP's near-optimal patterns exists
    (:mod:`.near_optimal`)."""
    p = _pool(metaops, curves, num_devices, heuristic, max_span) if rounds >= 1 else None
    got = p.generate(rounds) if p is not None else None
    if got is None:
        return 0.0
    b = max(got[0], near_optimal_bound(p, metaops)) if near else got[0]
    return min(b, max_span)


def improve(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int,
            heuristic: Sequence[Wave], *, level: int = 0, start_ms: float = 0.0,
            rounds: int | None = None, dive: bool = True) -> tuple[float, list[Wave]]:
    """The pattern bound of the level (as :func:`pattern_bound`, with the heuristic's span as ``max_span``)
    and the best dive's schedule, polished (:mod:`.polish`), when it is shorter than ``heuristic`` (else
    ``[]``; ``dive=False``: the bound only). A dive is abandoned once what it committed plus its residual's
    bound is :data:`DIVE_SLACK` over the best span known (polishing often takes a few percent off)."""
    rounds = ROUNDS if rounds is None else rounds
    span = sum(w.duration_ms for w in heuristic)
    p = _pool(metaops, curves, num_devices, heuristic, span)
    root = p.generate(rounds) if p is not None else None
    if root is None:
        return 0.0, []
    bound, _, x_root = root
    times = {m.name: {c: curves[m.name].count_time(c) for c in m.valid_counts(num_devices)} for m in metaops}
    L0, best, best_waves = p.L.copy(), span, []
    left = int(DIVE_BUDGET * min(1.0, DIVE_WORK / p.work)) if dive and p.work <= MAX_DIVE_WORK else 0
    rng = random.Random(level)
    first = [int(j) for j in np.argsort(-x_root, kind="stable") if x_root[j] > 1e-9]
    seen: dict[tuple, tuple | None] = {}
    for t in range(DIVES + RANDOM_DIVES):
        if left <= 0:
            break
        p.set_left(L0)
        done, cost, x = [], 0.0, x_root
        while left > 0:
            top = [int(j) for j in np.argsort(-x, kind="stable")[:3] if x[j] > 1e-9]
            if not top:
                break
            if not done and t < min(DIVES, len(first)):  # dive t starts from the root's t-th pattern
                j = first[t]
            elif t < DIVES or len(top) == 1 or rng.random() < 0.6:  # ... then follows the LP
                j = top[0]
            else:  # later dives take one of the LP's next two patterns 40% of the time
                j = rng.choice(top[1:])
            _, a, k = p.cols[j]
            a = np.minimum(a, p.L)
            if not a.any():  # degenerate: the pattern has nothing left to run
                break
            w = [(p.names[i], p.counts[i][k[i]], int(a[i])) for i in np.nonzero(a)[0]]
            done.append(w)
            cost += max(n * times[m][c] for m, c, n in w)
            p.set_left(p.L - a)
            if not p.L.any():
                waves = polish(build_waves(level, done, times, start_ms), metaops, curves, num_devices, times)
                s = sum(w.duration_ms for w in waves)
                if s < best * (1 - 1e-9):
                    best, best_waves = s, waves
                break
            key = tuple(int(v) for v in p.L)
            got = seen.get(key)
            if got is None:  # a residual an earlier dive solved is not solved again
                got = seen[key] = p.generate(min(DIVE_ROUNDS, left))
                left -= p.rounds_run
            if got is None or cost + got[0] >= best * (1 + DIVE_SLACK):  # got[0]: a bound of what is left
                break
            x = got[2]
    p.set_left(L0)
    return min(bound, span), best_waves
