"""Resource allocation per MetaLevel: the relaxed optimum by bisection, then bi-point discretization.

Relaxed problem (continuous devices and layers). The MetaOps of one level are independent; MetaOp ``m`` has
``L_m`` layers and one layer takes ``T_m(n)`` on ``n`` devices (positive, non-increasing). With ``N``
devices this is malleable project scheduling, and its optimum (Weglarz) has

1. every MetaOp start at time 0 and finish at the same time ``C*``:  ``L_m · T_m(n*_m) = C*``;
2. all devices in use:  ``Σ_m n*_m = N``,  i.e.  ``g(C) = Σ_m T_m⁻¹(C / L_m)`` equals ``N`` at ``C = C*``.

``g`` is non-increasing in ``C``, so ``C*`` is found by bisection between ``low = max_m L_m·T_m(N)``
(no MetaOp can finish faster) and ``high = Σ_m L_m·T_m(1)`` (everything on one device, one after another).
If even ``low`` needs fewer than ``N`` devices (every MetaOp already at its largest useful count), ``C* = low``
and some devices stay idle. No schedule of the level beats ``C*``: it is the level's lower bound, and the sum
over levels is the plan's.

Bi-point discretization. ``n*`` is real; a MetaOp runs on *valid* counts only (see
:meth:`MetaOp.valid_counts`). Take the nearest valid counts ``n_lo ≤ n* ≤ n_hi`` and split the layers so that
work and finish time are kept::

    l_hi + l_lo = L,      T(n_hi)·l_hi + T(n_lo)·l_lo = C*
    ⇒  l_hi = (C* − L·T(n_lo)) / (T(n_hi) − T(n_lo))

then round ``l_hi`` to the nearest integer. ``n_lo = 0`` (``n* < n_min``) is the paper's dummy: the MetaOp
runs all its layers on ``n_hi`` and leaves the device free for part of the level.

Worked example (the paper's MetaOp 2): ``n* = 1.5`` devices over ``L = 12`` layers with ``T(1) = 1`` and
``T(2) = 0.5`` ms and ``C* = 7.8`` ms gives ``l_hi = (7.8 − 12)/(0.5 − 1) = 8.4`` layers on 2 devices and
``3.6`` on 1, rounded to 8 and 4:

>>> from megatron_spindle.planner.workload.curves import ScalingCurve, Segment
>>> curve = ScalingCurve(batch=2, segments=(Segment(0.0, 1e-9, 0.5),))   # T(n) = 1/n ms
>>> [(t.devices, t.layers, round(t.layers_exact, 2)) for t in bipoint(12, curve, 1.5, 7.8, (1, 2))]
[(2, 8, 8.4), (1, 4, 3.6)]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..workload.curves import ScalingCurve


@dataclass(frozen=True)
class AllocTuple:
    """``layers`` layers of a MetaOp on ``devices`` devices (the paper's allocation tuple)."""

    devices: int
    layers: int
    layers_exact: float


@dataclass(frozen=True)
class LevelAllocation:
    c_star_ms: float
    """The level's relaxed optimum (common finish time)."""
    n_star: Mapping[str, float]
    """Relaxed device count per MetaOp."""


#: Levels already allocated, by their layers, curve objects, devices and tolerance (the scheduler and every
#: baseline's relaxed bound ask for the same levels): ``key -> (the curves, kept so their ids stay theirs,
#: c*, n*)``.
_DONE: dict[tuple, tuple] = {}


def allocate_level(layers: Mapping[str, int], curves: Mapping[str, ScalingCurve], num_devices: int,
                   *, rel_tol: float = 1e-10) -> LevelAllocation:
    """Bisection for ``C*`` of one level; ``layers`` maps MetaOp name -> number of layers (a pure function of
    its arguments, remembered for the last few levels)."""
    used = tuple(curves[m] for m in layers)
    key = (tuple(layers.items()), tuple(map(id, used)), num_devices, rel_tol)
    got = _DONE.get(key)
    if got is None:
        a = _allocate(layers, curves, num_devices, rel_tol)
        if len(_DONE) >= 256:
            _DONE.clear()
        got = _DONE[key] = (used, a.c_star_ms, dict(a.n_star))
    return LevelAllocation(c_star_ms=got[1], n_star=dict(got[2]))


def _allocate(layers: Mapping[str, int], curves: Mapping[str, ScalingCurve], num_devices: int,
              rel_tol: float) -> LevelAllocation:
    if num_devices <= 0:
        raise ValueError(f"need at least one device, got {num_devices}")
    names = list(layers)
    N = float(num_devices)

    def need(c: float) -> float:
        return sum(curves[m].inverse(c / layers[m], n_cap=N) for m in names)

    low = max(layers[m] * curves[m].time(N) for m in names)
    high = sum(layers[m] * curves[m].time(1.0) for m in names)
    high = max(high, low)
    if need(low) <= N * (1 + 1e-12):
        c = low
    else:
        lo, hi = low, high
        for _ in range(300):
            mid = 0.5 * (lo + hi)
            if need(mid) > N:
                lo = mid
            else:
                hi = mid
            if hi - lo <= rel_tol * hi:
                break
        c = hi
    return LevelAllocation(c_star_ms=c, n_star={m: curves[m].inverse(c / layers[m], n_cap=N) for m in names})


def bipoint(num_layers: int, curve: ScalingCurve, n_star: float, c_star: float,
            valid: Sequence[int]) -> list[AllocTuple]:
    """Split ``num_layers`` layers over the two valid counts around ``n_star`` (see the module docstring)."""
    if not valid:
        raise ValueError("no valid device count")
    L = num_layers
    for v in valid:
        if abs(v - n_star) <= 1e-9 * max(1.0, n_star):
            return [AllocTuple(v, L, float(L))]
    lo = max((v for v in valid if v < n_star), default=0)
    hi = min((v for v in valid if v > n_star), default=None)
    if hi is None:  # beyond the largest valid count: the flat part of the curve
        return [AllocTuple(valid[-1], L, float(L))]
    if lo == 0:  # the paper's dummy: everything on n_hi
        return [AllocTuple(hi, L, float(L))]
    t_hi, t_lo = curve.count_time(hi), curve.count_time(lo)
    if t_lo - t_hi <= 1e-15 * t_lo:  # no speed-up between the two counts: the cheaper one suffices
        return [AllocTuple(lo, L, float(L))]
    l_hi = (c_star - L * t_lo) / (t_hi - t_lo)
    l_hi = min(max(l_hi, 0.0), float(L))
    k = int(math.floor(l_hi + 0.5))
    out = []
    if k > 0:
        out.append(AllocTuple(hi, k, l_hi))
    if L - k > 0:
        out.append(AllocTuple(lo, L - k, L - l_hi))
    return out
