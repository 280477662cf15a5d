"""Integer-aware lower bounds and an exact solver for one MetaLevel's wave packing (HiGHS through ``highspy``).

``C*`` (:mod:`.allocate`) relaxes devices and layers to real numbers. A wave schedule of a level (the
runtime's model, :mod:`.waves`) has more structure: a slice runs whole layers on a *valid* count, a MetaOp
has at most one slice per wave, a wave's slices use disjoint devices (at most ``N`` together) and the wave
lasts as long as its longest slice. Two mixed-integer models of it:

1. **Area bound** (every level, fast). Let ``x_{m,c}`` be the number of layers MetaOp ``m`` runs on valid
   count ``c`` (integer) and ``C`` the level's span. Any wave schedule satisfies::

       Σ_c x_{m,c} = L_m                               (every layer runs once)
       Σ_c T_m(c)·x_{m,c} ≤ C                          (a MetaOp's slices lie in different waves)
       Σ_m Σ_c c·T_m(c)·x_{m,c} ≤ N·C                   (device-time: Σ_w Σ_s c_s·t_s ≤ Σ_w N·D_w)

   so ``min C`` is a lower bound of the level. Its LP relaxation is ``C*`` (time-sharing two counts is the
   concave envelope of the rates); the integer layers and counts are what make it tighter. It decomposes
   by MetaOp and :mod:`.area` solves it exactly in milliseconds, without HiGHS.

2. **Wave model** (small levels). ``K`` waves; ``y_{w,m,c} ∈ {0,1}`` (MetaOp ``m`` runs on ``c`` devices in
   wave ``w``), ``l_{w,m,c} ∈ ℤ`` its layers, ``D_w`` the wave's duration::

       min Σ_w D_w   s.t.   Σ_c y_{w,m,c} ≤ 1,     Σ_{m,c} c·y_{w,m,c} ≤ N,
                            y_{w,m,c} ≤ l_{w,m,c} ≤ L_m·y_{w,m,c},
                            D_w ≥ Σ_c T_m(c)·l_{w,m,c},   N·D_w ≥ Σ_{m,c} c·T_m(c)·l_{w,m,c},
                            Σ_{w,c} l_{w,m,c} = L_m,      D_1 ≥ D_2 ≥ … ≥ D_K   (waves of a level commute)

   The MetaOps of a level are independent, so any order of the waves is a valid schedule and every
   solution is one. Every wave runs at least one layer, so no schedule has more than ``Σ_m L_m`` waves:
   with ``K = Σ_m L_m`` the model is exact and its dual bound is a lower bound of *every* wave schedule of
   the level (used when that model is small, :data:`EXACT_MAX_CELLS`). With a smaller ``K`` (one more
   than the heuristic's wave count, where that model is small: :data:`IMPROVE_MAX_CELLS`) it is a search for a
   better schedule, warm-started from the heuristic's; its bound then holds only for schedules of at most
   ``K`` waves and is not reported.

Work is limited by branch-and-bound nodes (:data:`MAX_NODES`), so a plan does not depend on the machine's
speed or load; a wall-clock limit per model (:data:`.exact.SOLVER_SAFETY_S`, far above any level's work) is
only a safety net: if it strikes, every bound stays valid but the schedule may differ on a faster machine, and
a warning says so (training plans on rank 0 and broadcasts the plan, so ranks agree).

``highspy`` is optional: without it :func:`available` is false, :func:`level_bound` returns the area bound
(or ``C*``) and the planner keeps its heuristic schedules.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .area import area_bound  # noqa: F401 - model 1, solved exactly without HiGHS
from ..workload.curves import ScalingCurve
from ..exact import SOLVER_SAFETY_S, note_safety_limit
from ..workload.metaops import MetaOp
from .waves import Wave, WaveSlice, merge_waves

try:  # optional: the planner works (with C* as its bound) without it
    import highspy
except ImportError:  # pragma: no cover - exercised by the no-solver test
    highspy = None

#: Largest wave model (waves × (MetaOp, count) pairs) solved with ``K = Σ L`` for an exact bound.
EXACT_MAX_CELLS = 80
#: Largest wave model solved with ``K`` = the heuristic's waves to improve its schedule.
IMPROVE_MAX_CELLS = 40
#: Branch-and-bound nodes per model: a deterministic work limit (the time limit is only a safety net).
MAX_NODES = 10


def available() -> bool:
    """Whether HiGHS (``highspy``) is installed."""
    return highspy is not None


@dataclass(frozen=True)
class Solution:
    value: float
    """Objective of the best integer solution found (``inf`` if none)."""
    bound: float
    """Dual bound: no solution of the model is below it."""
    optimal: bool
    columns: tuple[float, ...] = ()


class _Model:
    """A small MILP in row form, handed to HiGHS in one piece."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[float, float, list[int], list[float]]] = []

    def var(self, lo: float, hi: float, cost: float = 0.0, integer: bool = False) -> int:
        self.cost.append(cost)
        self.lo.append(lo)
        self.hi.append(hi)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, lo: float, hi: float, terms: Mapping[int, float] | Sequence[tuple[int, float]]) -> None:
        items = list(terms.items()) if isinstance(terms, Mapping) else list(terms)
        self.rows.append((lo, hi, [i for i, _ in items], [v for _, v in items]))

    def solve(self, time_limit_s: float = SOLVER_SAFETY_S, start: Sequence[float] | None = None,
              max_nodes: int | None = None) -> Solution:
        inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_ = len(self.cost)
        lp.num_row_ = len(self.rows)
        lp.col_cost_ = self.cost
        lp.col_lower_ = self.lo
        lp.col_upper_ = [inf if math.isinf(v) else v for v in self.hi]
        lp.row_lower_ = [-inf if math.isinf(r[0]) else r[0] for r in self.rows]
        lp.row_upper_ = [inf if math.isinf(r[1]) else r[1] for r in self.rows]
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        starts, idx, val = [0], [], []
        for _, _, i, v in self.rows:
            idx.extend(i)
            val.extend(v)
            starts.append(len(idx))
        lp.a_matrix_.start_ = starts
        lp.a_matrix_.index_ = idx
        lp.a_matrix_.value_ = val
        lp.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous
                           for b in self.integer]
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        h.setOptionValue("time_limit", max(1e-3, float(time_limit_s)))
        h.setOptionValue("mip_rel_gap", 1e-6)
        if max_nodes is not None:
            h.setOptionValue("mip_max_nodes", int(max_nodes))
        h.passModel(lp)
        if start is not None:
            sol = highspy.HighsSolution()
            sol.col_value = list(start)
            sol.value_valid = True
            h.setSolution(sol)
        h.run()
        info = h.getInfo()
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kTimeLimit:
            note_safety_limit("a level's wave model")
        has = info.primal_solution_status >= 2
        value = info.objective_function_value if has else math.inf
        bound = info.mip_dual_bound
        if not math.isfinite(bound):
            bound = -math.inf
        optimal = status == highspy.HighsModelStatus.kOptimal
        if optimal:
            bound = max(bound, value * (1 - 1e-6))
        cols = tuple(h.getSolution().col_value) if has else ()
        return Solution(value=value, bound=bound, optimal=optimal, columns=cols)


def _counts(metaops: Sequence[MetaOp], N: int) -> dict[str, tuple[int, ...]]:
    return {m.name: m.valid_counts(N) for m in metaops}


@dataclass(frozen=True)
class WaveModelResult:
    waves: list[Wave]
    """The best schedule found (empty if none)."""
    span_ms: float
    bound_ms: float
    """Dual bound of the model (valid for all schedules only when ``exact``)."""
    exact: bool
    """``K = Σ L``: the model covers every wave schedule of the level."""
    optimal: bool


def wave_model(level: int, metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int,
               *, max_waves: int | None = None, start: Sequence[Wave] = (), start_ms: float = 0.0,
               time_limit_s: float = SOLVER_SAFETY_S, max_nodes: int | None = None) -> WaveModelResult | None:
    """Model 2 of the module docstring with ``K = max_waves`` (default ``Σ L``: exact); ``None`` without HiGHS."""
    if highspy is None:
        return None
    N = num_devices
    counts = _counts(metaops, N)
    total_layers = sum(m.num_layers for m in metaops)
    K = total_layers if max_waves is None else min(max_waves, total_layers)
    mdl = _Model()
    D = [mdl.var(0.0, math.inf, cost=1.0) for _ in range(K)]
    y: dict[tuple[int, str, int], int] = {}
    lay: dict[tuple[int, str, int], int] = {}
    for w in range(K):
        for m in metaops:
            for c in counts[m.name]:
                y[w, m.name, c] = mdl.var(0.0, 1.0, integer=True)
                lay[w, m.name, c] = mdl.var(0.0, m.num_layers, integer=True)
    T = {(m.name, c): curves[m.name].count_time(c) for m in metaops for c in counts[m.name]}
    for w in range(K):
        mdl.row(-math.inf, N, [(y[w, m.name, c], float(c)) for m in metaops for c in counts[m.name]])
        area = [(D[w], -float(N))]
        for m in metaops:
            mdl.row(-math.inf, 1.0, [(y[w, m.name, c], 1.0) for c in counts[m.name]])
            dur = [(D[w], -1.0)]
            for c in counts[m.name]:
                yv, lv = y[w, m.name, c], lay[w, m.name, c]
                mdl.row(-math.inf, 0.0, [(lv, 1.0), (yv, -float(m.num_layers))])
                mdl.row(0.0, math.inf, [(lv, 1.0), (yv, -1.0)])
                dur.append((lv, T[m.name, c]))
                area.append((lv, c * T[m.name, c]))
            mdl.row(-math.inf, 0.0, dur)
        mdl.row(-math.inf, 0.0, area)
        if w + 1 < K:
            mdl.row(0.0, math.inf, [(D[w], 1.0), (D[w + 1], -1.0)])
    for m in metaops:
        mdl.row(m.num_layers, m.num_layers, [(lay[w, m.name, c], 1.0) for w in range(K) for c in counts[m.name]])
    warm = _warm_start(mdl, start, K, D, y, lay, T) if start else None
    sol = mdl.solve(time_limit_s, warm, max_nodes=max_nodes)
    waves: list[Wave] = []
    if sol.columns:
        col = sol.columns
        nxt = {m.name: 0 for m in metaops}
        clock = start_ms
        for w in range(K):
            wave = Wave(level=level, start_ms=clock, duration_ms=0.0)
            for m in metaops:
                for c in counts[m.name]:
                    k = int(round(col[lay[w, m.name, c]]))
                    if k > 0 and col[y[w, m.name, c]] > 0.5:
                        t = k * T[m.name, c]
                        wave.slices.append(WaveSlice(metaop=m.name, layer_start=nxt[m.name], layers=k,
                                                     devices=c, time_ms=t))
                        nxt[m.name] += k
                        wave.duration_ms = max(wave.duration_ms, t)
            if wave.slices:
                waves.append(wave)
                clock += wave.duration_ms
        if any(nxt[m.name] != m.num_layers for m in metaops):  # numerical trouble: do not trust it
            waves = []
        waves = merge_waves(waves) if waves else []
    span = sum(w.duration_ms for w in waves) if waves else math.inf
    return WaveModelResult(waves=waves, span_ms=span, bound_ms=sol.bound, exact=K == total_layers,
                           optimal=sol.optimal)


def _warm_start(mdl: _Model, start: Sequence[Wave], K: int, D, y, lay, T) -> list[float] | None:
    """Columns of the model for an existing schedule (waves sorted longest first), or ``None`` if it does not fit."""
    waves = sorted(start, key=lambda w: -w.duration_ms)
    if len(waves) > K:
        return None
    col = [0.0] * len(mdl.cost)
    for w, wave in enumerate(waves):
        for s in wave.slices:
            key = (w, s.metaop, s.devices)
            if key not in y:
                return None
            col[y[key]] = 1.0
            col[lay[key]] += s.layers
        col[D[w]] = max((col[lay[w, s.metaop, s.devices]] * T[s.metaop, s.devices] for s in wave.slices),
                        default=0.0)
    return col


def model_cells(metaops: Sequence[MetaOp], num_devices: int, waves: int) -> int:
    """Size of the wave model: waves × (MetaOp, valid count) pairs."""
    return waves * sum(len(m.valid_counts(num_devices)) for m in metaops)


@dataclass(frozen=True)
class LevelSolve:
    bound_ms: float
    """Certified lower bound of every wave schedule of the level."""
    bound_kind: str
    """``C*`` (relaxed), ``area`` (model 1), ``patterns`` (:mod:`.patterns`, set by
    :func:`.assemble.schedule`), ``waves`` (dual bound of the exact model 2) or ``optimal``
    (model 2 solved: the level's best wave schedule is known)."""
    waves: list[Wave]
    """A schedule better than the heuristic's, or empty."""


def solve_level(level: int, metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int,
                c_star_ms: float, heuristic: Sequence[Wave], *, start_ms: float = 0.0,
                time_limit_s: float = SOLVER_SAFETY_S, gap_worth: float = 0.02, max_nodes: int | None = MAX_NODES,
                exact_max_cells: int = EXACT_MAX_CELLS) -> LevelSolve:
    """Bound one level and try to beat the heuristic's schedule.

    The wave model stops after ``max_nodes`` branch-and-bound nodes (the same work, hence the same plan, on
    any machine); ``time_limit_s`` is only a safety net (module docstring).

    1. Model 1 (area, solved exactly by :mod:`.area`, HiGHS or not) gives a bound; 2. when the exact wave
    model (``K = Σ L``) is small, it is solved, warm-started from the heuristic: its dual bound is certified,
    and its schedule is optimal when HiGHS proves it; 3. otherwise, when the heuristic is more than
    ``gap_worth`` above the bound, model 2 with one wave more than the heuristic searches for a better
    schedule in the time left. Without HiGHS only step 1 runs.
    """
    best, kind = c_star_ms, "C*"
    span = sum(w.duration_ms for w in heuristic) if heuristic else math.inf
    a = area_bound(metaops, curves, num_devices)
    if a > best * (1 + 1e-9):
        best, kind = a, "area"
    better: list[Wave] = []
    if span <= best * (1 + 1e-9):
        return LevelSolve(best, "optimal", [])
    if highspy is None:
        return LevelSolve(best, kind, [])
    total = sum(m.num_layers for m in metaops)
    exact = model_cells(metaops, num_devices, total) <= exact_max_cells
    K = None if exact else len(heuristic) + 1
    left = time_limit_s
    if (exact or (heuristic and span > best * (1 + gap_worth)
                                   and model_cells(metaops, num_devices, K) <= IMPROVE_MAX_CELLS)):
        r = wave_model(level, metaops, curves, num_devices, max_waves=K, start=heuristic, start_ms=start_ms,
                       time_limit_s=left, max_nodes=max_nodes)
        if r is not None:
            if r.waves and r.span_ms < span * (1 - 1e-9):
                better, span = r.waves, r.span_ms
            if r.exact and r.bound_ms > best * (1 + 1e-9):
                best, kind = min(r.bound_ms, span), "waves"
            if r.exact and r.optimal:
                best, kind = span, "optimal"
    return LevelSolve(best, kind, better)


def level_bound(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int,
                c_star_ms: float, *, time_limit_s: float = SOLVER_SAFETY_S) -> tuple[float, str]:
    """The best certified lower bound of one level and how it was found (see :class:`LevelSolve`)."""
    r = solve_level(-1, metaops, curves, num_devices, c_star_ms, [], time_limit_s=time_limit_s)
    return r.bound_ms, r.bound_kind
