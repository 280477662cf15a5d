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

from typing import Mapping, Sequence

import numpy as np

from .allocate import AllocTuple
from ..workload.metaops import MetaOp
from .waves import Wave, build_waves


def _best_wave(todo: Mapping[str, int], valid, T, a_min, N: int, durations: Sequence[float]):
    """The wave, as ``((name, devices, layers), ...)``, that does the most useful work per device-time of its
    own length among the best-filled waves of the given durations (each the knapsack over devices of most
    useful work within ``D``, every duration at once in numpy); ``()`` if none runs a layer."""
    D = np.asarray(durations, dtype=float)[:, None]
    R = len(D)
    D1 = D[:, 0] * (1 + 1e-9)
    value = np.zeros((R, N + 1))           # most useful work with at most n devices
    length = np.zeros((R, N + 1))          # ... and the longest slice of that choice
    picks = []
    for n, r in todo.items():
        new_v, new_l = value.copy(), length.copy()
        pick = np.full((R, N + 1), -1, dtype=np.int32)
        tn = np.array([T[n][c] for c in valid[n]])[:, None]
        k = np.minimum(r, np.floor(D1[None, :] / tn))       # (counts, R): each count's layers in each duration
        ok = (k >= 1)[:, :, None]
        work, slice_ms = (k * a_min[n])[:, :, None], (k * tn)[:, :, None]
        for ci, c in enumerate(valid[n]):
            cand = value[:, :-c] + work[ci]
            better = ok[ci] & (cand > new_v[:, c:] * (1 + 1e-12))
            np.copyto(new_v[:, c:], cand, where=better)   # the same entries as np.where, in place
            np.copyto(new_l[:, c:], np.maximum(length[:, :-c], slice_ms[ci]), where=better)
            np.copyto(pick[:, c:], ci, where=better)
        picks.append((n, r, pick))
        value, length = new_v, new_l
    work, dur = value[:, N], length[:, N]
    score = np.where(work > 0, work / (N * np.maximum(dur, 1e-300)), -np.inf)
    row = int(np.argmax(score))            # the first of equal scores: the shortest duration
    if not np.isfinite(score[row]):
        return ()
    out, used = [], N
    for n, r, pick in reversed(picks):
        ci = int(pick[row, used])
        if ci >= 0:
            c = valid[n][ci]
            out.append((n, c, int(min(r, np.floor(D[row, 0] * (1 + 1e-9) / T[n][c])))))
            used -= c
    return tuple(reversed(out))


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
        ch = _best_wave(todo, valid, T, a_min, N, durations)
        if not ch:  # every duration fits a layer of some MetaOp, so this cannot happen
            raise RuntimeError(f"throughput waves: no wave fits on level {metaops[0].level}")
        chosen.append(ch)
        for n, _, k in ch:
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
