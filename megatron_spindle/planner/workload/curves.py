"""Scaling curves: one layer's time of a MetaOp against its device count.

The model (the paper's piecewise alpha-beta). Let ``B`` be the MetaOp's global batch and ``x = B / n`` the
per-device workload in samples (for a tensor-parallel MetaOp with ``n = tp·d`` this is also the share of
work per device: ``B/d`` samples split ``tp`` ways). One layer's forward+backward time is a piecewise
linear function of ``x``::

    f(x) = α_k + β_k · x     for  x_k ≤ x < x_{k+1}      (x_0 = 0, the last segment extends to ∞)

Each segment has its own ``(α, β)``: kernels change with the per-device workload, so one alpha-beta line
does not fit (``α_0`` is the latency term, ``f(0)``). The curve of the MetaOp is ``T(n) = f(B/n)``.

Properties the allocator relies on (Weglarz's theorem needs them): ``T`` is positive and non-increasing in
``n``. Both follow from (1) ``α_0 > 0``, (2) ``β_k ≥ 0`` and (3) no downward jump at a breakpoint
(``f_k(x_k) ≥ f_{k-1}(x_k)``). :func:`fit_piecewise` repairs a fit that breaks them (isotonic regression of
the points first, then clamping slopes and lifting segments); :meth:`ScalingCurve.validate` rejects a curve
given directly that breaks them.

The relaxed curve (real ``n``, used by the allocator). When the curve knows the MetaOp's valid counts, its
*rate* ``1/T(n)`` is the upper concave envelope of the points ``(0, 0)`` and ``(c, 1/T(c))`` for every valid
count ``c``, flat beyond the largest. Between neighbouring counts on the envelope this interpolates the
speed-up linearly, as the paper's released planner does, and it is exactly what time-sharing two valid
counts achieves: a fraction ``λ`` of the time on ``n_hi`` and the rest on ``n_lo`` uses
``λ·n_hi + (1-λ)·n_lo`` devices on average at rate ``λ/T(n_hi) + (1-λ)/T(n_lo)``. Taking the concave
envelope (not just the neighbours) matters when a curve scales super-linearly somewhere: Weglarz's
theorem needs concave rates, and with the envelope every real schedule's rate at any moment is below the
relaxed one, so ``C*`` is a true lower bound (a brute-force test checks this). Below the smallest count the
device is time-shared (the rate falls linearly to 0). Without valid counts, ``T(n) = f(B/n)`` between
``n_min`` and ``n_max``.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..exact import on_grid


@dataclass(frozen=True)
class Segment:
    """``f(x) = alpha_ms + beta_ms · x`` for ``x ≥ x_start`` (until the next segment's start)."""

    x_start: float
    alpha_ms: float
    beta_ms: float

    def at(self, x: float) -> float:
        return self.alpha_ms + self.beta_ms * x


@dataclass(frozen=True, kw_only=True)
class ScalingCurve:
    """Piecewise alpha-beta curve of one layer's time (ms) against the device count."""

    batch: int
    """The MetaOp's global batch: per-device work is ``batch / n``."""
    segments: tuple[Segment, ...]
    n_min: float = 1.0
    """Smallest valid device count (below it: time sharing)."""
    n_max: float = math.inf
    """Largest useful device count (beyond it: no further speed-up)."""
    counts: tuple[int, ...] = ()
    """The MetaOp's valid device counts (ascending); when given, the relaxed curve interpolates the
    speed-up between them and ``n_min``/``n_max`` are the first and last."""
    points: tuple[tuple[float, float], ...] = ()
    """The (devices, ms) points the curve was fitted to."""
    fit_error: float = 0.0
    """Largest relative error of the fit at its points."""
    source: str = "analytic"
    """``analytic``, ``measured`` or ``file``."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending value unless the curve is positive and non-increasing."""
        segs = self.segments
        if not segs:
            raise ValueError("scaling curve has no segments")
        if self.batch <= 0:
            raise ValueError(f"scaling curve batch must be positive, got {self.batch}")
        if segs[0].x_start != 0:
            raise ValueError(f"first segment must start at x=0, got x_start={segs[0].x_start}")
        for i, s in enumerate(segs):
            if not all(math.isfinite(v) for v in (s.x_start, s.alpha_ms, s.beta_ms)):
                raise ValueError(f"segment {i} has a non-finite value: {s}")
            if s.beta_ms < 0:
                raise ValueError(f"segment {i}: beta_ms={s.beta_ms} < 0 makes time decrease with work "
                                 f"(time would grow with devices)")
            if i and s.x_start <= segs[i - 1].x_start:
                raise ValueError(f"segment {i}: x_start={s.x_start} not after {segs[i - 1].x_start}")
            if i and s.at(s.x_start) < segs[i - 1].at(s.x_start) * (1 - 1e-9) - 1e-12:
                raise ValueError(f"segment {i}: time drops from {segs[i - 1].at(s.x_start):.6g} to "
                                 f"{s.at(s.x_start):.6g} ms at x={s.x_start:.6g} (not monotone)")
        if segs[0].alpha_ms <= 0:
            raise ValueError(f"latency alpha_ms={segs[0].alpha_ms} must be positive")
        if self.counts:
            if any(b <= a for a, b in zip(self.counts, self.counts[1:])) or self.counts[0] <= 0:
                raise ValueError(f"valid counts must be positive and ascending, got {self.counts}")
            object.__setattr__(self, "n_min", float(self.counts[0]))
            object.__setattr__(self, "n_max", float(self.counts[-1]))
            object.__setattr__(self, "_hull", _concave_envelope(
                [(0.0, 0.0)] + [(float(c), 1.0 / self.count_time(c)) for c in self.counts]))
            object.__setattr__(self, "_hull_x", tuple(h[0] for h in self._hull))
        if not (0 < self.n_min <= self.n_max):
            raise ValueError(f"need 0 < n_min <= n_max, got n_min={self.n_min}, n_max={self.n_max}")

    # -- evaluation ---------------------------------------------------------------------------------
    def f(self, x: float) -> float:
        """Time (ms) of one layer at per-device work ``x`` samples."""
        seg = self.segments[0]
        for s in self.segments[1:]:
            if x >= s.x_start:
                seg = s
            else:
                break
        return seg.at(x)

    def time(self, n: float) -> float:
        """One layer's time (ms) on ``n`` devices (real ``n`` allowed: the relaxed curve)."""
        if n <= 0:
            return math.inf
        if self.counts:
            hull = self._hull
            if n >= hull[-1][0]:
                return 1.0 / hull[-1][1]
            i = bisect.bisect_right(self._hull_x, n)
            (n0, r0), (n1, r1) = hull[i - 1], hull[i]
            return 1.0 / (r0 + (r1 - r0) * (n - n0) / (n1 - n0))
        if n < self.n_min:
            return self.f(self.batch / self.n_min) * self.n_min / n
        return self.f(self.batch / min(n, self.n_max))

    def count_time(self, n: int) -> float:
        """Time of one layer on a valid integer count: the fitted curve itself, no relaxation, on the
        planner's time grid (:func:`.exact.on_grid`: sums of these are exact, so spans compare exactly)."""
        cache = self.__dict__.setdefault("_count_times", {})
        t = cache.get(n)
        if t is None:
            t = cache[n] = on_grid(self.f(self.batch / n))
        return t

    def inverse(self, t_ms: float, *, n_cap: float = 1e9) -> float:
        """Smallest real ``n`` with ``time(n) ≤ t_ms`` (``inf`` when even ``n_cap`` devices are too slow)."""
        if self.time(n_cap) > t_ms:
            return math.inf
        if self.counts and t_ms > 0:  # the relaxed rate is piecewise linear in n: solve on its segment
            rate = 1.0 / t_ms
            hull = self._hull
            for (n0, r0), (n1, r1) in zip(hull, hull[1:]):
                if r1 >= rate * (1 - 1e-15):
                    n = n0 + (rate - r0) * (n1 - n0) / (r1 - r0) if r1 > r0 else n0
                    return min(max(n, n0), n1)
            return hull[-1][0]
        lo, hi = 0.0, max(self.n_min, 1.0)
        while self.time(hi) > t_ms:
            lo, hi = hi, hi * 2
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if mid <= 0:
                break
            if self.time(mid) <= t_ms:
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-12 * hi:
                break
        return hi

    def scaled(self, factor: float) -> "ScalingCurve":
        """The same curve with every time multiplied by ``factor`` (a MetaOp that recomputes, or runs less
        backward: :func:`.recompute.time_factor`); positive and non-increasing like this one."""
        if factor == 1.0:
            return self
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"curve scale factor must be positive and finite, got {factor!r}")
        segs = tuple(Segment(s.x_start, s.alpha_ms * factor, s.beta_ms * factor) for s in self.segments)
        return dataclasses.replace(self, segments=segs, points=tuple((n, t * factor) for n, t in self.points))

    # -- JSON -----------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"batch": self.batch,
                "segments": [{"x_start": s.x_start, "alpha_ms": s.alpha_ms, "beta_ms": s.beta_ms}
                             for s in self.segments],
                "n_min": self.n_min, "n_max": self.n_max if math.isfinite(self.n_max) else None,
                "counts": list(self.counts),
                "points": [list(p) for p in self.points], "fit_error": self.fit_error,
                "source": self.source}

    @classmethod
    def from_json(cls, obj: Mapping) -> "ScalingCurve":
        try:
            segs = tuple(Segment(float(s["x_start"]), float(s["alpha_ms"]), float(s["beta_ms"]))
                         for s in obj["segments"])
            return cls(batch=int(obj["batch"]), segments=segs, n_min=float(obj.get("n_min", 1.0)),
                       n_max=math.inf if obj.get("n_max") is None else float(obj["n_max"]),
                       counts=tuple(int(c) for c in obj.get("counts", ())),
                       points=tuple((float(a), float(b)) for a, b in obj.get("points", ())),
                       fit_error=float(obj.get("fit_error", 0.0)), source=str(obj.get("source", "file")))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed scaling curve {dict(obj)!r}: {e}") from None


def _concave_envelope(points: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Upper concave hull of points sorted by x (Andrew's monotone chain, upper part)."""
    hull: list[tuple[float, float]] = []
    for p in sorted(points):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) >= 0:  # hull[-1] is not above the chord
                hull.pop()
            else:
                break
        hull.append(p)
    return tuple(hull)


# --------------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------------
def _isotonic_increasing(y: Sequence[float], w: Sequence[float] | None = None) -> list[float]:
    """Pool-adjacent-violators: the closest non-decreasing sequence in weighted least squares."""
    w = list(w) if w is not None else [1.0] * len(y)
    blocks: list[list[float]] = []  # [value, weight, count]
    for v, wi in zip(y, w):
        blocks.append([v, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    out: list[float] = []
    for v, _, c in blocks:
        out.extend([v] * c)
    return out


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x`` with relative weights ``w = 1/y²``; returns (a, b, weighted SSE).

    Centred normal equations summed with :func:`math.fsum` (correctly rounded: no BLAS or LAPACK, whose
    kernels differ by machine, :mod:`.exact`): ``x̄ = Σwx/Σw``, ``b = Σw(x-x̄)y / Σw(x-x̄)²``,
    ``a = ȳ - b·x̄``."""
    xs = [float(x) for x in xs]
    ys = [float(y) for y in ys]
    wts = [1.0 / max(y, 1e-30) ** 2 for y in ys]
    sw = math.fsum(wts)
    ybar = math.fsum(w * y for w, y in zip(wts, ys)) / sw
    xbar = math.fsum(w * x for w, x in zip(wts, xs)) / sw
    sxx = math.fsum(w * (x - xbar) ** 2 for w, x in zip(wts, xs))
    if len(xs) == 1 or sxx <= 0:
        a, b = ybar, 0.0
    else:
        b = math.fsum(w * (x - xbar) * y for w, x, y in zip(wts, xs, ys)) / sxx
        a = ybar - b * xbar
    return a, b, math.fsum(w * (y - a - b * x) ** 2 for w, x, y in zip(wts, xs, ys))


#: Candidate breakpoints considered by :func:`fit_piecewise` (all points when there are no more than this).
MAX_BREAKPOINTS = 24


def fit_piecewise(points: Sequence[tuple[float, float]], *, batch: int, max_segments: int = 3,
                  n_min: float = 1.0, n_max: float = math.inf, counts: Sequence[int] = (),
                  source: str = "analytic") -> ScalingCurve:
    """Fit a positive, non-increasing piecewise alpha-beta curve to ``(devices, ms)`` points.

    1. Convert to per-device work ``x = batch / n`` and sort by ``x``.
    2. Repair: isotonic regression makes the times non-decreasing in ``x`` (a measured point that is
       slower with more devices is pooled with its neighbour).
    3. Choose breakpoints among the points (among :data:`MAX_BREAKPOINTS` evenly spaced ones when there
       are more, e.g. the hundreds of valid counts of a batch with many divisors): every split of the
       sorted points into at most ``max_segments`` contiguous runs (neighbouring runs share their boundary
       point, so the fit is near-continuous), each run fitted by relative least squares; the split with the
       smallest ``SSE · (1 + 0.05·segments)`` wins (fewer segments unless more clearly help).
    4. Repair: clamp negative slopes to 0 (refit the level), keep ``α_0`` positive, lift a segment that
       would start below its predecessor's end.
    5. ``fit_error`` is the largest relative error at the original points.

    >>> c = fit_piecewise([(1, 8.0), (2, 4.0), (4, 2.0), (8, 1.5), (16, 1.25)], batch=16)
    >>> round(c.time(4), 6), round(c.time(16), 6)
    (2.0, 1.25)
    """
    if not points:
        raise ValueError("cannot fit a scaling curve to no points")
    for n, t in points:
        if not (n > 0 and t > 0 and math.isfinite(n) and math.isfinite(t)):
            raise ValueError(f"invalid curve point (devices={n}, ms={t}): both must be positive and finite")
    merged: dict[float, list[float]] = {}
    for n, t in points:
        merged.setdefault(batch / n, []).append(t)
    xs = np.array(sorted(merged))
    ys_raw = np.array([float(statistics.median(merged[x])) for x in xs])
    ys = np.array(_isotonic_increasing(ys_raw))
    k = len(xs)
    best = None
    positions = range(1, k - 1) if k - 2 <= MAX_BREAKPOINTS else \
        sorted({1 + round(i * (k - 3) / (MAX_BREAKPOINTS - 1)) for i in range(MAX_BREAKPOINTS)})
    for nseg in range(1, min(max_segments, max(1, k - 1)) + 1):
        for cuts in itertools.combinations(positions, nseg - 1):
            bounds = (0, *cuts, k - 1)
            segs, sse = [], 0.0
            for i in range(nseg):
                lo, hi = bounds[i], bounds[i + 1]
                a, b, e = _line(xs[lo:hi + 1], ys[lo:hi + 1])
                segs.append((float(xs[lo]) if i else 0.0, a, b))
                sse += e
            score = sse * (1 + 0.05 * nseg) + 1e-18 * nseg
            if best is None or score < best[0] - 1e-15:
                best = (score, segs)
    segments = _repair([list(s) for s in best[1]], xs, ys)
    curve = ScalingCurve(batch=batch, segments=segments, n_min=n_min, n_max=n_max, counts=tuple(counts),
                         points=tuple((float(n), float(t)) for n, t in points), source=source)
    err = max(abs(curve.f(batch / n) - t) / t for n, t in points)
    return dataclasses.replace(curve, fit_error=float(err))


def _repair(segs: list[list[float]], xs: np.ndarray, ys: np.ndarray) -> tuple[Segment, ...]:
    starts = [s[0] for s in segs] + [math.inf]
    for i, s in enumerate(segs):
        if s[2] < 0:  # negative slope: flat at the mean of its points
            mask = (xs >= starts[i]) & (xs <= starts[i + 1])
            s[1], s[2] = math.fsum(ys[mask]) / int(mask.sum()) if mask.any() else s[1], 0.0
    floor = max(1e-9, 1e-6 * float(np.min(ys)))
    if segs[0][1] < floor:  # keep the latency positive; shift the line up to stay above zero
        segs[0][1] = floor
    for i in range(1, len(segs)):
        prev_end = segs[i - 1][1] + segs[i - 1][2] * segs[i][0]
        here = segs[i][1] + segs[i][2] * segs[i][0]
        if here < prev_end:
            segs[i][1] += prev_end - here
    return tuple(Segment(*s) for s in segs)
