"""A lower bound of a level's wave schedules from wave *patterns* (a configuration LP, by column generation).

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
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from .curves import ScalingCurve
from .metaops import MetaOp
from .waves import Wave

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
MAX_ROUND_WORK = 4_000_000


class _Master:
    """The restricted LP, kept in one HiGHS instance: new patterns are added as columns and the simplex
    restarts from the last basis."""

    def __init__(self, L: np.ndarray) -> None:
        inf = highspy.kHighsInf
        self.h = highspy.Highs()
        self.h.setOptionValue("output_flag", False)
        self.h.setOptionValue("threads", 1)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = 0, len(L)
        lp.row_lower_, lp.row_upper_ = [float(v) for v in L], [inf] * len(L)
        self.h.passModel(lp)

    def add(self, cols: Sequence[tuple[float, np.ndarray]]) -> None:
        starts, idx, val = [], [], []
        for _, a in cols:
            starts.append(len(idx))
            nz = np.nonzero(a)[0]
            idx.extend(nz.tolist())
            val.extend(a[nz].tolist())
        n = len(cols)
        self.h.addCols(n, np.array([d for d, _ in cols], dtype=np.float64), np.zeros(n),
                       np.full(n, highspy.kHighsInf), len(idx), np.array(starts, dtype=np.int32),
                       np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))

    def solve(self) -> tuple[float, np.ndarray] | None:
        """Optimum and row duals (clipped at 0), or ``None`` if HiGHS does not solve it."""
        self.h.run()
        if self.h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        duals = np.maximum(np.array(self.h.getSolution().row_dual, dtype=float), 0.0)
        return self.h.getInfo().objective_function_value, duals


def pattern_bound(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int, *,
                  heuristic: Sequence[Wave] = (), max_span: float = math.inf, rounds: int = ROUNDS) -> float:
    """The best Farley bound of the configuration LP found in ``rounds`` rounds (ms; 0 if not computed)."""
    if highspy is None or not metaops or rounds < 1:
        return 0.0
    N = num_devices
    M = len(metaops)
    index = {m.name: i for i, m in enumerate(metaops)}
    L = np.array([m.num_layers for m in metaops], dtype=float)
    counts = [m.valid_counts(N) for m in metaops]
    T = [np.array([curves[m.name].count_time(c) for c in counts[i]]) for i, m in enumerate(metaops)]
    cap = max_span * (1 + 1e-9)
    Ds = np.unique(np.concatenate([np.outer(np.arange(1, m.num_layers + 1), T[i]).ravel()
                                   for i, m in enumerate(metaops)]))
    Ds = Ds[Ds <= cap]
    if (len(Ds) == 0 or len(Ds) * (N + 1) > MAX_CELLS
            or len(Ds) * (N + 1) * sum(len(c) for c in counts) > MAX_ROUND_WORK):
        return 0.0
    # layers[i][d, k]: the most layers of MetaOp i on count k that fit in duration Ds[d]
    layers = [np.minimum(L[i], np.floor(Ds[:, None] / T[i][None, :] * (1 + 1e-12))) for i in range(M)]
    cols: list[tuple[float, np.ndarray]] = []
    for i in range(M):  # one layer alone: the restricted LP is always feasible
        k = int(np.argmin(T[i]))
        a = np.zeros(M)
        a[i] = 1.0
        cols.append((float(T[i][k]), a))
    for w in heuristic:
        a = np.zeros(M)
        for s in w.slices:
            a[index[s.metaop]] = s.layers
        cols.append((float(w.duration_ms), a))
    master = _Master(L)
    master.add(cols)
    best, subset, tol = 0.0, None, 0.0
    for r in range(rounds):
        got = master.solve()
        if got is None:
            break
        z, pi = got
        tol = 1e-9 * max(z, 1e-12)
        full = subset is None or r % FULL_EVERY == 0 or r == rounds - 1
        rows = np.arange(len(Ds)) if full else subset
        value = np.zeros((len(rows), N + 1))  # best Σ π·layers using at most n devices, per duration
        for i in range(M):
            new = value.copy()
            for k, c in enumerate(counts[i]):
                new[:, c:] = np.maximum(new[:, c:], value[:, :-c] + pi[i] * layers[i][rows, k][:, None])
            value = new
        gain = value[:, N] - Ds[rows]  # minus the reduced cost of each duration's best pattern
        if full:
            theta = float((value[:, N] / Ds).max())
            if theta <= 0:
                break
            best = max(best, float(pi @ L) / theta * (1 - 1e-9))
            subset = np.argsort(-gain)[:PARTIAL]
        if gain.max() <= tol:
            if full:  # no pattern improves the LP: it is solved
                break
            subset = None  # nothing among the partial durations: price them all next round
            continue
        top = [int(rows[d]) for d in np.argsort(-gain)[:COLUMNS] if gain[d] > tol]
        master.add(_patterns(Ds[top], layers, top, pi, counts, T, N))
    return min(best, max_span)


def _patterns(durations: np.ndarray, layers, rows, pi: np.ndarray, counts, T, N: int
              ) -> list[tuple[float, np.ndarray]]:
    """The knapsack's best pattern for each of ``durations`` (rows ``rows`` of the layer tables),
    backtracked, each with its own duration (its longest slice)."""
    M, R = len(counts), len(rows)
    value = np.zeros((R, N + 1))
    picks = []
    for i in range(M):
        new, pick = value.copy(), np.full((R, N + 1), -1)
        for k, c in enumerate(counts[i]):
            cand = np.full((R, N + 1), -np.inf)
            cand[:, c:] = value[:, :-c] + pi[i] * layers[i][rows, k][:, None]
            better = cand > new
            new, pick = np.where(better, cand, new), np.where(better, k, pick)
        picks.append(pick)
        value = new
    out = []
    for r in range(R):
        a, n, dur = np.zeros(M), N, 0.0
        for i in reversed(range(M)):
            k = int(picks[i][r, n])
            if k >= 0:
                a[i] = layers[i][rows[r], k]
                if a[i] > 0:
                    dur = max(dur, a[i] * T[i][k])
                n -= counts[i][k]
        out.append((dur, a))
    return out
