"""Throughput waves: build a level's waves one at a time, each the best-filled wave of some duration.

Algorithm 1 (:mod:`.waves`) ends a wave when one candidate finishes its tuple; on some levels a wave that
every MetaOp fills almost exactly (each on the count whose whole layers best fit the wave) does better.
This builds such waves greedily:

for a wave duration ``D`` each MetaOp with ``r`` layers left may run ``k = min(r, ⌊D / T(c)⌋)`` layers on
any valid count ``c``; the MetaOps' counts (at most one slice each, at most ``N`` devices together) are
chosen by a knapsack over devices that maximizes the *useful work* ``Σ k · a_min`` (``a_min``: the MetaOp's
least device-time per layer, so inefficiently wide slices count for less). Among the durations tried (the
slice times ``k · T(c)``, thinned to at most ``max_durations`` evenly spaced in sorted order, plus, with
``finishing``, the times ``r · T(c)`` that end a MetaOp, thinned alike), the wave with the most useful work per
device-time of its actual length ``N · max(k · T(c))`` is committed; repeat until every layer is scheduled.

Every wave runs at least one layer, so it ends; the result is a valid wave schedule of the level.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from .allocate import AllocTuple
from .metaops import MetaOp
from .waves import Wave, build_waves


def _knapsack(left: Mapping[str, int], valid, T, a_min, N: int, D: float):
    """Most useful work in a wave of at most ``D``: ``(work, ((name, devices, layers), ...))``."""
    best: dict[int, tuple[float, tuple]] = {0: (0.0, ())}
    for n, r in left.items():
        opts = []
        for c in valid[n]:
            k = min(r, int(math.floor(D * (1 + 1e-9) / T[n][c])))
            if k >= 1:
                opts.append((c, k, k * a_min[n]))
        if not opts:
            continue
        nxt = dict(best)
        for used, (v, ch) in best.items():
            for c, k, val in opts:
                u = used + c
                if u > N:
                    break  # counts ascend
                cur = nxt.get(u)
                if cur is None or v + val > cur[0] * (1 + 1e-12):
                    nxt[u] = (v + val, ch + ((n, c, k),))
        best = nxt
    return max(best.values(), key=lambda e: e[0])


def _thin(values, most: int) -> list[float]:
    """At most ``most + 1`` of ``values``, evenly spaced in sorted order (the largest always kept)."""
    out = sorted(values)
    if len(out) > most:
        step = len(out) / most
        out = [out[int(i * step)] for i in range(most)] + [out[-1]]
    return out


def throughput_waves(metaops: Sequence[MetaOp], times: Mapping[str, Mapping[int, float]], num_devices: int,
                     start_ms: float = 0.0, *, max_durations: int = 20, finishing: bool = True) -> list[Wave]:
    """The level's waves built as in the module docstring; ``times``: ``count_time`` per MetaOp and count."""
    N = num_devices
    valid = {m.name: m.valid_counts(N) for m in metaops}
    T = times
    a_min = {n: min(c * T[n][c] for c in valid[n]) for n in valid}
    left = {m.name: m.num_layers for m in metaops}
    chosen = []
    while any(left.values()):
        todo = {n: r for n, r in left.items() if r}
        durations = _thin({k * T[n][c] for n, r in todo.items() for c in valid[n] for k in range(1, r + 1)},
                          max_durations)
        if finishing:
            durations = sorted(set(durations) | set(_thin({r * T[n][c] for n, r in todo.items() for c in valid[n]},
                                                          max_durations)))
        best = None
        for D in durations:
            work, ch = _knapsack(todo, valid, T, a_min, N, D)
            if not ch:
                continue
            score = work / (N * max(k * T[n][c] for n, c, k in ch))
            if best is None or score > best[0] * (1 + 1e-12):
                best = (score, ch)
        chosen.append(best[1])
        for n, _, k in best[1]:
            left[n] -= k
    order = {m.name: i for i, m in enumerate(metaops)}
    return build_waves(metaops[0].level, [sorted(ch, key=lambda e: order[e[0]]) for ch in chosen], T, start_ms)


def tuples_of(waves: Sequence[Wave], metaops: Sequence[MetaOp]) -> dict[str, list[AllocTuple]]:
    """Allocation tuples that sum up a schedule: each MetaOp's layers per device count, widest first."""
    per: dict[str, dict[int, int]] = {m.name: {} for m in metaops}
    for w in waves:
        for s in w.slices:
            per[s.metaop][s.devices] = per[s.metaop].get(s.devices, 0) + s.layers
    return {n: [AllocTuple(c, k, float(k)) for c, k in sorted(d.items(), reverse=True)] for n, d in per.items()}
