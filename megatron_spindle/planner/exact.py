"""Machine-independent arithmetic: why a plan is the same bytes on every machine.

A plan decides how a cluster trains, so the same inputs must give the same plan on a laptop, a CI runner and
every node of a job. Float results that depend on the machine come from three places, and the planner avoids
each:

1. **BLAS and LAPACK** (``numpy.dot``, ``@``, ``numpy.linalg``): OpenBLAS picks a kernel per CPU
   (``OPENBLAS_CORETYPE``), and kernels of different SIMD widths sum in different orders. The planner calls
   none of them: :func:`dot` and the curve fit (:func:`.curves.fit_piecewise`) sum with :func:`math.fsum`,
   which is correctly rounded, so the order of the terms does not matter. ``tests/test_determinism.py`` scans
   the planner's source for them.
2. **Vectorised transcendental functions** (``numpy.exp``, ``numpy.log``, ``numpy.power``): numpy has
   AVX-512 versions whose last bits differ from the scalar ones. The planner uses none; the analytic curve's
   one power is Python's (the C library's, the same on every x86-64 machine to within an ulp), and
   :func:`on_grid` absorbs that ulp.
3. **Limits by the clock**: a solver or search stopped after so many seconds stops at a different place on
   a slower or busier machine. Every search is bounded by counts (iterations, nodes, rounds); HiGHS runs
   single-threaded with fixed options. Its time limits (:data:`SOLVER_SAFETY_S`) are only a safety net far
   above any level's work, and striking one is logged.

**The integer grid.** One layer's time on a valid count (:meth:`.curves.ScalingCurve.count_time`), from
which every slice, wave and level duration is built, is rounded to a multiple of :data:`GRID_MS` =
2⁻³⁰ ms (0.93 ps). Such numbers are integers scaled by a power of two, so sums and differences of them, and
their products with layer counts, are exact in float64 while they stay under 2²³ ms (2.3 hours; a level's
span is seconds at most): a span is the same in any order of summation, and two schedules compare equal
exactly when they are equal, not by float noise. Ties between equal spans are broken by the order of the candidates
(a fixed order: MetaOps by name within a level), never by the last bits of a sum.

>>> on_grid(1.0 / 3.0) * 2 ** 30 == round(2 ** 30 / 3)
True
>>> dot([0.1, 0.2, 0.3], [1.0, 1.0, 1.0]) == 0.6
True
"""
from __future__ import annotations

import math
from typing import Iterable

from ..log import get_logger

log = get_logger(__name__)

#: The planner's time grid, ms: 2⁻³⁰ ms ≈ 0.93 ps, far below any kernel's time (a relative step under 1e-9
#: for the shortest layers, 1 µs) and far above float noise (an ulp of 1 ms is 2⁻⁵² ms).
GRID_MS = 2.0 ** -30
_SCALE = 2.0 ** 30

#: HiGHS time limit per model, s: a safety net only (work is bounded by nodes and rounds; the largest bench
#: level needs under 0.5 s of it on a 2-core machine). If it strikes, the plan may differ on a faster machine.
SOLVER_SAFETY_S = 60.0


def on_grid(t_ms: float) -> float:
    """``t_ms`` rounded to the nearest multiple of :data:`GRID_MS` (non-finite values unchanged)."""
    if not math.isfinite(t_ms):
        return t_ms
    return round(t_ms * _SCALE) / _SCALE


def dot(a: Iterable[float], b: Iterable[float]) -> float:
    """``Σ a_i·b_i``, correctly rounded (every product is exact IEEE rounding, :func:`math.fsum` the sum):
    the same result whatever the order or the vector unit, unlike BLAS's ``ddot``."""
    return math.fsum(float(x) * float(y) for x, y in zip(a, b, strict=True))


def note_safety_limit(what: str) -> None:
    """Log that HiGHS stopped at :data:`SOLVER_SAFETY_S` (the plan may then depend on this machine's speed)."""
    log.warning(f"planner: {what} stopped at its {SOLVER_SAFETY_S:g} s safety limit, not its work limit: "
                f"this plan may differ on a faster machine")
