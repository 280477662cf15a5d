"""Polish a level's wave schedule by moving layers between its waves (a descent on the span).

Algorithm 1 (:mod:`.waves`) fixes each wave's slices from allocation tuples; the waves it builds often
leave a wave ending on a few slices while other waves have room. The waves of one level commute (its
MetaOps are independent), so a schedule stays valid when a layer of MetaOp ``m`` moves from one wave to
another, as long as every wave keeps at most one slice of ``m``, whole layers on valid counts and at most
``N`` devices (the layers are renumbered in wave order afterwards). Moves, longest wave first:

* **shed**: every slice that ends wave ``w`` gives up one layer (so ``w`` gets shorter), each to the wave
  where it lengthens the schedule least: into ``m``'s slice there, or as a new slice of ``m`` on free devices
  (the valid count that fits and adds least);
* **widen**: the one slice that ends wave ``w`` moves to a larger valid count that fits the wave's free
  devices.

The polished waves keep the order of the waves they came from (an emptied wave drops out).

A move is made only when it shortens the level's span (``Σ`` wave durations) by more than a relative
``1e-9``; it stops when no move does or after :data:`MAX_MOVES` moves, so it never lengthens a schedule
and its result depends only on its input.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from ..workload.curves import ScalingCurve
from ..workload.metaops import MetaOp
from .waves import Wave, build_waves

#: Work limit: moves made per call.
MAX_MOVES = 200
_EPS = 1e-9


def polish(waves: Sequence[Wave], metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve],
           num_devices: int, times: Mapping[str, Mapping[int, float]] | None = None, *,
           memo: dict | None = None) -> list[Wave]:
    """A schedule of the same level no longer than ``waves`` (the input is not changed; fewer than two waves
    come back as they are, more as new objects); ``times`` as for :func:`.waves.schedule_level`. ``memo``: the
    result's slices by the input's, for a caller that polishes many schedules of one level (same MetaOps,
    devices and times), which then polishes each distinct input once."""
    if len(waves) < 2:
        return list(waves)
    N = num_devices
    order = [m.name for m in metaops]
    key = None
    if memo is not None and times is not None:  # the result depends on each wave's (MetaOp, devices, layers)
        key = tuple(tuple([(s.metaop, s.devices, s.layers) for s in w.slices]) for w in waves)
        got = memo.get(key)
        if got is not None:
            return build_waves(waves[0].level, got, times, waves[0].start_ms)
    valid = {m.name: m.valid_counts(N) for m in metaops}
    T = times if times is not None else {n: {c: curves[n].count_time(c) for c in valid[n]} for n in order}
    # state: per wave, MetaOp -> [devices, layers]
    state = [{s.metaop: [s.devices, s.layers] for s in w.slices} for w in waves]

    def dur(w: dict) -> float:  # the longest slice (0 for an empty wave)
        d = 0.0
        for n, (c, k) in w.items():
            t = k * T[n][c]
            if t > d:
                d = t
        return d

    D = [dur(w) for w in state]
    F = [N - sum(c for c, _ in w.values()) for w in state]
    scanned: dict[int, tuple] = {}
    for _ in range(MAX_MOVES):
        if not _move(state, D, F, T, valid, sum(D) * _EPS, dur, scanned):
            break
    choices = [[(n, *w[n]) for n in order if n in w] for w in state if w]
    if key is not None:
        memo[key] = choices
    return build_waves(waves[0].level, choices, T, waves[0].start_ms)


def _scan(w, d: float, T) -> tuple[list[str], float]:
    """The slices that end wave ``w`` of duration ``d`` and its duration once each gives up a layer."""
    d1 = d * (1 - 1e-12)
    crit = []
    new1 = 0.0  # the wave's duration once every slice in crit gives up a layer (dur of t1 below)
    for n, (c, k) in w.items():
        t = k * T[n][c]
        if t >= d1:
            crit.append(n)
            if k == 1:
                continue
            t = (k - 1) * T[n][c]
        if t > new1:
            new1 = t
    return crit, new1


def _widen(w, w1, crit, D, F, T, valid, eps, dur) -> bool:
    """Widen: a single slice ends the wave and free devices let it run faster; whether it did."""
    n = crit[0]
    c, k = w[n]
    for c2 in valid[n]:
        if c < c2 <= c + F[w1] and T[n][c2] < T[n][c]:
            w[n] = [c2, k]
            d = dur(w)
            if d < D[w1] - eps:
                D[w1] = d
                F[w1] -= c2 - c
                return True
            w[n] = [c, k]
    return False


def _move(state, D, F, T, valid, eps, dur, scanned: dict[int, tuple]) -> bool:
    """Make the first improving move (waves longest first); whether one was made. ``D``, ``F``: each wave's
    duration and free devices, kept up to date. ``scanned``: per wave, :func:`_scan`'s result from an earlier
    call, with the wave's dict and ``D`` it holds for (a wave changes by a new dict, or in place by a
    widening, which changes ``D``)."""
    W = len(state)
    for w1 in sorted(range(W), key=D.__getitem__, reverse=True):  # stable: as by (-D[i], i)
        w = state[w1]
        if not w:
            continue
        got = scanned.get(w1)
        if got is not None and got[0] is w and got[1] == D[w1]:
            crit, new1 = got[2], got[3]
        else:
            crit, new1 = _scan(w, D[w1], T)
            scanned[w1] = (w, D[w1], crit, new1)
        if len(crit) == 1 and F[w1] > 0 and _widen(w, w1, crit, D, F, T, valid, eps, dur):
            return True
        # shed: every slice ending the wave gives up one layer to the wave where it costs least
        gain = D[w1] - new1
        if gain <= eps:
            continue
        t1 = dict(w)
        f1 = F[w1]
        for n in crit:
            c, k = t1[n]
            if k == 1:
                del t1[n]
                f1 += c
            else:
                t1[n] = [c, k - 1]
        changed: dict[int, dict] = {}  # destination waves, changed copies
        tD, tF = {}, {}
        for n in crit:
            # the least (cost, count, wave): waves come in order, so a later one wins only on cost or count
            bc, bw, bcount, bk = math.inf, -1, 0, 0
            Tn, vn = T[n], valid[n]
            vmin = vn[0]  # every slice runs on a valid count, so none is smaller
            for w2 in range(W):
                if w2 == w1:
                    continue
                x = changed[w2] if w2 in changed else state[w2]
                d2 = tD[w2] if w2 in tD else D[w2]
                if n in x:
                    c2, k2 = x[n]
                    cost = (k2 + 1) * Tn[c2] - d2
                    if cost < 0.0:
                        cost = 0.0
                    if cost < bc or (cost == bc and c2 < bcount):
                        bc, bw, bcount, bk = cost, w2, c2, k2 + 1
                else:
                    room = tF[w2] if w2 in tF else F[w2]
                    for c2 in vn:
                        if c2 > room:
                            break
                        cost = Tn[c2] - d2
                        if cost < 0.0:
                            cost = 0.0
                        if cost < bc or (cost == bc and c2 < bcount):
                            bc, bw, bcount, bk = cost, w2, c2, 1
                        if cost == 0.0:  # a larger count here costs no less and is larger: never wins
                            break
                if bc == 0.0 and bcount <= vmin:  # no later wave beats cost 0 on the smallest count
                    break
            if bw < 0:
                gain = -1.0
                break
            cost, w2, c2, k2 = bc, bw, bcount, bk
            x = changed.setdefault(w2, dict(state[w2]))
            if n not in x:
                tF[w2] = tF.get(w2, F[w2]) - c2
            x[n] = [c2, k2]
            tD[w2] = max(tD.get(w2, D[w2]), k2 * Tn[c2])
            gain -= cost
            if gain <= eps:
                break
        if gain > eps:
            state[w1], D[w1], F[w1] = t1, new1, f1
            for w2, x in changed.items():
                state[w2], D[w2] = x, tD[w2]
                F[w2] = tF.get(w2, F[w2])
            return True
    return False
