"""A bound above the configuration LP's: no integer cover by the LP's near-optimal patterns.

With the LP of :mod:`.patterns` solved, its duals ``π ≥ 0`` (scaled so that ``π·a_p ≤ D_p`` for every
pattern no longer than the span to beat: Farley's ``θ``) price every pattern at its *reduced cost*
``r_p = D_p − π·a_p ≥ 0``. A wave schedule runs every layer once (``Σ_p a_p·x_p = L``), so its span is::

    Σ_p D_p·x_p = π·L + Σ_p r_p·x_p

``π·L`` is the LP's bound; the schedule pays ``Σ r_p·x_p`` on top. If no whole-number ``x`` covers ``L``
exactly with patterns of reduced cost under ``δ`` at a total under ``δ``, every schedule pays at least ``δ``
(one pattern of ``r ≥ δ`` is enough to pay it), and ``π·L + δ`` is a bound. The patterns under ``δ`` are
few when ``δ`` is small (every layer left out of a pattern costs its MetaOp's ``π``): they are enumerated
exactly (:func:`_near`: for every candidate duration, a depth-first search over the MetaOps, cut by the
knapsack's best value of the MetaOps not yet chosen), and the cover is an integer program (HiGHS).

Identical MetaOps (same curve, same layers) make that program hard to refute, so the duals are averaged
over them (the LP's dual polytope is symmetric in them and convex, so the average is feasible with the same
``π·L``) and the program counts layers per *type* of MetaOp (a relaxation: any exact cover maps to one,
each type's column at the least reduced cost of the patterns that map to it). A pattern that uses a count
slower than a smaller one is left out: the smaller count gives the same layers no later, on fewer devices.

``δ`` climbs :data:`LADDER` (shares of the LP's bound) while the program is refuted within
:data:`MAX_NODES` branch-and-bound nodes and the patterns and columns stay under :data:`MAX_PATTERNS` and
:data:`MAX_COLUMNS`; at the first rung it does not refute, its dual bound (valid for the enumerated
patterns, hence ``min(δ, dual)`` for all) ends the climb. Work is bounded by those counts, so the bound
does not depend on the machine.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .anneal import fast_counts, fit_tables, fit_wave
from ..exact import SOLVER_SAFETY_S, dot, note_safety_limit
from ..workload.metaops import MetaOp

try:
    import highspy
except ImportError:  # pragma: no cover - the caller runs this only with HiGHS
    highspy = None

#: Rungs of δ, as shares of the LP's bound.
LADDER = (0.0002, 0.0003, 0.0004, 0.0005, 0.0006, 0.0007, 0.0008, 0.001, 0.0012, 0.0015, 0.002)
#: Most near-optimal patterns enumerated for one rung, most columns (per type) of its integer program (up to
#: about 90 HiGHS refuted it in hundredths of a second on the bench levels, at 100-150 in 0.2-0.9 s), and
#: branch-and-bound nodes.
MAX_PATTERNS = 4000
MAX_COLUMNS = 80
MAX_NODES = 20


def near_optimal_bound(pool, metaops: Sequence[MetaOp]) -> float:
    """``π·L + δ`` for the largest rung ``δ`` refuted (module docstring), from ``pool``'s solved LP (a
    :class:`.patterns._Pool` whose restricted LP was just solved); ``0.0`` when HiGHS is missing or fails."""
    if highspy is None:
        return 0.0
    got = pool.solve()
    if got is None:
        return 0.0
    _, pi, _ = got
    value = pool.price(pi, np.arange(len(pool.Ds)))
    theta = float((value / pool.Ds).max())
    if theta <= 0:
        return 0.0
    pi = pi / theta
    types: dict[tuple, list[int]] = {}
    for i, m in enumerate(metaops):
        types.setdefault((m.num_layers, tuple(pool.counts[i]), tuple(pool.T[i].tolist())), []).append(i)
    groups = list(types.values())
    for g in groups:
        pi[g] = math.fsum(pi[g]) / len(g)
    z = dot(pi, pool.L)
    fast = [fast_counts(cs, ts.tolist()) for cs, ts in zip(pool.counts, pool.T)]
    counts, T = [c for c, _ in fast], [t for _, t in fast]
    tables = _tables(pool, pi, counts, T)
    proven = 0.0
    for share in LADDER:
        delta = share * z
        near = _near(pool, pi, counts, T, tables, delta, MAX_PATTERNS)
        if near is None:
            break
        low = _refute(near, groups, pool.L)
        if low is None:
            break
        proven = max(proven, min(delta, low))
        if low < delta:
            break
    return z + proven


def _tables(pool, pi: np.ndarray, counts, T) -> tuple[list[int], list[np.ndarray], dict[int, list[np.ndarray]]]:
    """The search's order (largest dual first), ``suffix[i][r, d]``: the best ``Σ π·a`` of the MetaOps
    ``order[i:]`` on at most ``d`` devices within duration ``Ds[r]``, and ``most[m][k][r]``: the most layers
    of MetaOp ``m`` on its ``k``-th count within ``Ds[r]``."""
    M, N, L, Ds = pool.M, pool.N, pool.L, pool.Ds
    order = sorted(range(M), key=lambda m: -pi[m])
    suffix = [np.zeros((len(Ds), N + 1))]
    most = {}
    for i in range(M - 1, -1, -1):
        m = order[i]
        prev = suffix[0]
        new = prev.copy()
        most[m] = [np.minimum(L[m], np.floor(Ds / t * (1 + 1e-12))) for t in T[m]]
        for k, c in enumerate(counts[m]):
            np.maximum(new[:, c:], prev[:, :-c] + (pi[m] * most[m][k])[:, None], out=new[:, c:])
        suffix.insert(0, np.maximum.accumulate(new, axis=1))
    return order, suffix, most


def _near(pool, pi: np.ndarray, counts, T, tables, delta: float, limit: int) -> dict[tuple, float] | None:
    """Every layer vector whose wave (on its best counts) has reduced cost under ``delta``, with that reduced
    cost; ``None`` past ``limit`` of them. A depth-first search per candidate duration, cut where the
    MetaOps not yet chosen cannot bring the value within ``delta`` of the duration (:func:`_tables`)."""
    M, N, Ds = pool.M, pool.N, pool.Ds
    order, suffix, most = tables
    fits = fit_tables(counts, T, N)
    found: dict[tuple, float] = {}
    a = [0] * M
    for r in np.nonzero(suffix[0][:, N] > Ds - delta - 1e-9 * Ds)[0]:
        floor_ = float(Ds[r]) - delta - 1e-9 * float(Ds[r])  # a little under, so rounding drops no pattern

        def dfs(i: int, d: int, v: float) -> bool:
            if v + suffix[i][r, d] <= floor_:
                return True
            if i == M:
                key = tuple(a)
                if any(key) and key not in found:
                    dur = fit_wave(key, fits, N)[0]
                    found[key] = dur - dot(pi, key)
                    if len(found) > limit:
                        return False
                return True
            m = order[i]
            if not dfs(i + 1, d, v):
                return False
            for k, c in enumerate(counts[m]):
                if c > d:
                    break
                for n in range(int(most[m][k][r]), 0, -1):
                    if v + pi[m] * n + suffix[i + 1][r, d - c] <= floor_:
                        break
                    a[m] = n
                    if not dfs(i + 1, d - c, v + pi[m] * n):
                        a[m] = 0
                        return False
                a[m] = 0
            return True

        if not dfs(0, N, 0.0):
            return None
    return {key: rc for key, rc in found.items() if rc < delta}


def _refute(near: dict[tuple, float], groups: Sequence[Sequence[int]], L: np.ndarray) -> float | None:
    """A lower bound on ``Σ r·x`` over exact whole-number covers of ``L`` by ``near`` counted per type
    (``inf`` when there is none): the integer program's dual bound after :data:`MAX_NODES` nodes; ``None``
    past :data:`MAX_COLUMNS` columns."""
    cols: dict[tuple, float] = {}
    for key, rc in near.items():
        agg = tuple(sum(key[m] for m in g) for g in groups)
        cols[agg] = min(rc, cols.get(agg, math.inf))
    if not cols:
        return math.inf
    if len(cols) > MAX_COLUMNS:
        return None
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_max_nodes", MAX_NODES)
    h.setOptionValue("mip_allow_restart", False)  # a restart after presolve doubled the time to refute
    h.setOptionValue("time_limit", SOLVER_SAFETY_S)  # a safety net only: the node limit bounds the work
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cols), len(groups)
    lp.col_cost_ = list(cols.values())
    lp.col_lower_, lp.col_upper_ = [0.0] * len(cols), [inf] * len(cols)
    rows = [float(sum(L[m] for m in g)) for g in groups]
    lp.row_lower_, lp.row_upper_ = rows, rows
    starts, index, values = [], [], []
    for agg in cols:
        starts.append(len(index))
        for t, n in enumerate(agg):
            if n:
                index.append(t)
                values.append(float(n))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = starts + [len(index)], index, values
    lp.integrality_ = [highspy.HighsVarType.kInteger] * len(cols)
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kTimeLimit:
        note_safety_limit("the near-optimal cover's integer program")
    if status == highspy.HighsModelStatus.kInfeasible:
        return math.inf
    if status == highspy.HighsModelStatus.kOptimal:
        return float(h.getInfo().objective_function_value)
    dual = float(h.getInfo().mip_dual_bound)
    return dual if math.isfinite(dual) else 0.0
