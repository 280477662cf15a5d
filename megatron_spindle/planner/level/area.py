"""The area bound of one level (model 1 of :mod:`.solver`), solved exactly without a MILP solver.

The model: integer ``x_{m,c}`` layers of MetaOp ``m`` on valid count ``c``, span ``C``::

    min C   s.t.   Σ_c x_{m,c} = L_m,   Σ_c T_m(c)·x_{m,c} ≤ C,   Σ_m Σ_c c·T_m(c)·x_{m,c} ≤ N·C.

The MetaOps are coupled only through ``C`` and the one area row, so it decomposes:

1. per MetaOp, the **Pareto frontier** of ``(time, area) = (Σ_c T(c)·x_c, Σ_c c·T(c)·x_c)`` over all ways of
   running its ``L`` layers (a dynamic program over the counts, one layer at a time; a point is kept only if
   no other is at most as long and at most as large in area);
2. for a span ``C``, MetaOp ``m`` needs at least ``A_m(C)``, the least area of its frontier points no longer
   than ``C``; ``C`` is feasible iff every MetaOp has such a point and ``Σ_m A_m(C) ≤ N·C``;
3. ``Σ_m A_m`` only changes at frontier times, so sweeping them in increasing order, the optimum is the
   least ``max(t, Σ_m A_m(t) / N)`` over the frontier times ``t`` from the largest per-MetaOp minimum time on.

That is the model's exact optimum (a lower bound of every wave schedule of the level, see :mod:`.solver`),
returned a hair (``1e-9``, relative) lower to absorb floating-point rounding in the sums. Frontiers hold a
few hundred points for tens of layers on a handful of counts, so a level takes milliseconds.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..workload.curves import ScalingCurve
from ..workload.metaops import MetaOp

#: Relative margin taken off the exact optimum (rounding in the frontier's sums).
MARGIN = 1e-9


def _pareto(t: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-dominated points, sorted by time ascending (so area strictly descending)."""
    if len(t) <= 1:
        return t, a
    o = np.lexsort((a, t))
    t, a = t[o], a[o]
    keep = np.empty(len(t), dtype=bool)
    keep[0] = True
    keep[1:] = a[1:] < np.minimum.accumulate(a)[:-1]
    return t[keep], a[keep]


def frontier(layers: int, times: Sequence[float], areas: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Pareto frontier of ``(Σ time, Σ area)`` over every multiset of ``layers`` items of the given kinds."""
    empty = np.empty(0)
    front = [(np.zeros(1), np.zeros(1))] + [(empty, empty)] * layers
    for t1, a1 in zip(times, areas):  # allow any number of layers on this kind, on top of the earlier kinds
        new = [front[0]]
        for k in range(1, layers + 1):
            new.append(_pareto(np.concatenate([front[k][0], new[k - 1][0] + t1]),
                               np.concatenate([front[k][1], new[k - 1][1] + a1])))
        front = new
    return front[layers]


def area_bound(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int) -> float:
    """The exact optimum of the area model of the level, less :data:`MARGIN` (ms); 0 for no MetaOps."""
    N = num_devices
    fronts = []
    seen: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # MetaOps alike (same layers, times) share one
    for m in metaops:
        counts = m.valid_counts(N)
        times = [curves[m.name].count_time(c) for c in counts]
        areas = [c * t for c, t in zip(counts, times)]
        key = (m.num_layers, tuple(times), tuple(areas))
        got = seen.get(key)
        if got is None:
            got = seen[key] = frontier(m.num_layers, times, areas)
        fronts.append(got)
    if not fronts:
        return 0.0
    start = max(float(t[0]) for t, _ in fronts)
    pos = [int(np.searchsorted(t, start, side="right")) - 1 for t, _ in fronts]
    total = sum(float(a[p]) for (_, a), p in zip(fronts, pos))
    best = max(start, total / N)
    events = sorted((float(t[j]), i, j) for i, (t, _) in enumerate(fronts) for j in range(pos[i] + 1, len(t)))
    for t, i, j in events:
        if t >= best:
            break
        a = fronts[i][1]
        total += float(a[j]) - float(a[pos[i]])
        pos[i] = j
        best = min(best, max(t, total / N))
    return best * (1 - MARGIN)
