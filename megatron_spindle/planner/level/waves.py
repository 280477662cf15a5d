"""Wavefront scheduling (the paper's Algorithm 1), one MetaLevel at a time.

Input: for every MetaOp of the level a queue of allocation tuples ``⟨n, l⟩`` from bi-point discretization.
Each wave is built in four steps, repeated until every layer is scheduled:

(a) **Propose.** Take each MetaOp's head tuple; sort by devices (largest first), then by remaining time
    ``l·T(n)`` (longest first); add greedily while devices remain. At most one slice per MetaOp per wave.
(b) **Extend.** While devices are idle, move a candidate to its next larger valid count that fits, preferring
    the MetaOp with the most remaining work (all of its tuples). The extension holds for this wave only.
    Our addition: if no candidate can extend, a waiting MetaOp whose head tuple did not fit runs at its
    largest valid count that does (so devices are not left idle while work is waiting).
(c) **Align.** The wave lasts as long as its shortest candidate (all of its remaining layers); every other
    candidate runs only the layers that fit in that span (``⌊span / T(n)⌋``, at least one when a layer is no
    longer than ``1 + ALIGN_SLACK`` spans), and its remaining layers go back to its queue. A candidate that
    fits no layer drops out of the wave.
(d) **Commit.** Set start times and advance the clock by the wave's duration (its longest slice).

Each wave completes at least one tuple, so a level has at most ``2 × MetaOps`` waves. Consecutive waves in
which every MetaOp continues on the same device count are merged afterwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .allocate import AllocTuple
from ..workload.curves import ScalingCurve
from ..workload.metaops import MetaOp

#: A candidate whose one layer is at most this much longer than the wave's span still runs one layer
#: (stretching the wave slightly) instead of leaving its devices idle.
ALIGN_SLACK = 0.25


@dataclass
class WaveSlice:
    """A slice before placement: ``layers`` layers of ``metaop`` from ``layer_start`` on ``devices`` devices."""

    metaop: str
    layer_start: int
    layers: int
    devices: int
    time_ms: float


@dataclass
class Wave:
    level: int
    start_ms: float
    duration_ms: float
    slices: list[WaveSlice] = field(default_factory=list)
    phase: int = 0
    """The plan's execution phase (:attr:`..assembly.plan.WavePlan.phase`)."""


def schedule_level(level: int, metaops: Sequence[MetaOp], tuples: Mapping[str, list[AllocTuple]],
                   curves: Mapping[str, ScalingCurve], num_devices: int, start_ms: float = 0.0,
                   *, propose: str = "all", align: str = "finisher", across_levels: bool = False,
                   times: Mapping[str, Mapping[int, float]] | None = None) -> list[Wave]:
    """Algorithm 1 for one level; returns its waves in time order, starting at ``start_ms``.

    ``across_levels=True`` schedules MetaOps of several levels together (the paper's readiness rule: a
    MetaOp is proposed only once all its producers among ``metaops`` finished in earlier waves); a wave's
    ``level`` is then the highest level it has reached so far (so levels never go back). ``times``: the
    curves' ``count_time`` of every MetaOp on every valid count, when the caller has them already.
    """
    N = num_devices
    order, by_name, producers, valid, nextv = _context(metaops, N)
    queue = {m.name: [[t.devices, t.layers] for t in tuples[m.name] if t.layers > 0] for m in metaops}
    next_layer = dict.fromkeys(order, 0)
    table = times if times is not None else {
        name: {c: curves[name].count_time(c) for c in valid[name]} for name in by_name}
    has_producers = any(producers.values())

    waves: list[Wave] = []
    clock = start_ms
    left = sum(1 for n in order if queue[n])  # MetaOps with layers to schedule
    guard = 0
    works: dict[str, float] = {}
    while left:
        guard += 1
        if guard > 100 * (len(order) + 1) * 4:
            raise RuntimeError(f"wavefront scheduler made no progress on level {level}")
        # (a) propose: every waiting MetaOp at the smallest count of its remaining tuples, then
        # upgrades to its larger tuple, longest remaining work first
        if has_producers:
            heads = [n for n in order if queue[n] and not any(queue[p] for p in producers[n])]
        else:
            heads = [n for n in order if queue[n]]
        # remaining work (all of a MetaOp's tuples) does not change before the commit step (kept in
        # ``works`` until a commit changes that MetaOp's queue)
        work = {}
        for n in heads:
            w = works.get(n)
            if w is None:
                tn = table[n]
                w = works[n] = sum([l * tn[d] for d, l in queue[n]])
            work[n] = w
        free = N
        cand: dict[str, int] = {}
        pick: dict[str, int] = {}
        if propose == "paper":
            for n in sorted(heads, key=lambda n: (-queue[n][0][0], -queue[n][0][1] * table[n][queue[n][0][0]])):
                d = queue[n][0][0]
                if d <= free:
                    cand[n], pick[n] = d, 0
                    free -= d
        else:
            by_work = sorted(heads, key=work.__getitem__, reverse=True)  # stable: as by -work
            for n in by_work:
                q = queue[n]
                i = 0  # the first tuple with the fewest devices
                for j in range(1, len(q)):
                    if q[j][0] < q[i][0]:
                        i = j
                d = q[i][0]
                if d <= free:
                    cand[n], pick[n] = d, i
                    free -= d
            for n in (by_work if len(cand) == len(by_work) else sorted(cand, key=work.__getitem__, reverse=True)):
                q = queue[n]
                i = 0  # the first tuple with the most devices
                for j in range(1, len(q)):
                    if q[j][0] > q[i][0]:
                        i = j
                d = q[i][0]
                if d > cand[n] and d - cand[n] <= free:
                    free -= d - cand[n]
                    cand[n], pick[n] = d, i
        # (b) extend: the largest (work, name) that can, again and again. Work is fixed here and the free
        # devices only shrink, so one that cannot stays so: the candidates are gone through once, largest
        # first, each extended while it can. A waiting MetaOp filling the rest takes the largest count that
        # fits, so no candidate can extend after it.
        if free > 0:
            for n in sorted(cand, key=lambda n: (work[n], n), reverse=True):
                c = cand[n]
                v = nextv[n][c]
                while v <= c + free:
                    free -= v - c
                    cand[n] = c = v
                    v = nextv[n][c]
        while free > 0:
            fill = [(work[n], n) for n in heads if n not in cand and valid[n] and valid[n][0] <= free]
            if not fill:
                break
            _, n = max(fill)
            v = max(v for v in valid[n] if v <= free)
            cand[n], pick[n] = v, 0
            free -= v
        # (c) align
        layers = _align_items([(n, table[n][c], queue[n][pick[n]][1], c) for n, c in cand.items()], N,
                              align == "shortest")
        # (d) commit
        if across_levels:
            level = max([level] + [by_name[n].level for n in layers])
        slices = []
        dur = 0.0
        for n in order:
            k = layers.get(n)
            if k is None:
                continue
            d = cand[n]
            t = k * table[n][d]
            first = next_layer[n]
            slices.append(WaveSlice(n, first, k, d, t))
            if t > dur:
                dur = t
            next_layer[n] = first + k
            del works[n]
            q = queue[n]
            q[pick[n]][1] -= k
            if q[pick[n]][1] == 0:
                q.pop(pick[n])
                if not q:
                    left -= 1
        waves.append(Wave(level, clock, dur, slices))
        clock += dur
    return merge_waves(waves)


#: Per MetaOp sequence and device count, what Algorithm 1 reads of the MetaOps (the sequence's MetaOps
#: checked one by one: the same objects, which are frozen), for the few sequences a planner run schedules.
_CONTEXTS: dict[tuple[int, int], tuple] = {}


def _context(metaops: Sequence[MetaOp], N: int) -> tuple:
    """``(names in order, MetaOps by name, producers among them, valid counts, next larger valid count of each
    valid count)`` (infinite for the largest)."""
    key = (id(metaops), N)
    got = _CONTEXTS.get(key)
    if got is not None and len(got[0]) == len(metaops) and all(a is b for a, b in zip(got[0], metaops)):
        return got[1]
    by_name = {m.name: m for m in metaops}
    valid = {m.name: m.valid_counts(N) for m in metaops}
    ctx = ([m.name for m in metaops], by_name,
           {m.name: [p for p in m.producers if p in by_name] for m in metaops}, valid,
           {n: {c: (v[i + 1] if i + 1 < len(v) else math.inf) for i, c in enumerate(v)} for n, v in valid.items()})
    if len(_CONTEXTS) >= 64:
        _CONTEXTS.clear()
    _CONTEXTS[key] = (tuple(metaops), ctx)
    return ctx


def _align(cands: Mapping[str, tuple[float, int, int]], num_devices: int, *,
           shortest_only: bool = False) -> dict[str, int]:
    """Layers per candidate for one wave; ``cands`` maps name -> (time per layer, layers left, devices).

    The wave ends when one candidate finishes its tuple. The paper picks the shortest candidate; we try
    every candidate as the one that finishes, give the others the whole number of layers that best fills
    that span (rounded down, or up when the overshoot is within ``ALIGN_SLACK`` of a layer), and keep the
    choice with the least idle device-time per unit of work done (ties: the shortest wave).
    """
    return _align_items([(n, t1, left, d) for n, (t1, left, d) in cands.items()], num_devices, shortest_only)


def _align_items(items: Sequence[tuple[str, float, int, int]], num_devices: int,
                 shortest_only: bool) -> dict[str, int]:
    """:func:`_align` of ``(name, time per layer, layers left, devices)`` items: each span's key first, the
    layers of the best span (the first of equal keys) after."""
    rest = [(t1, left, d, t1 * left) for _, t1, left, d in items]  # ... and the time of all layers left
    spans = [e[3] for e in rest]
    shortest = min(spans)
    slack = 1 + ALIGN_SLACK
    best_r = best_dur = best_span = None
    tried = set()
    for span in spans:
        # candidates finishing at the same span give the same wave: try each span once
        if (shortest_only and span > shortest) or span in tried:
            continue
        tried.add(span)
        hi = span * slack
        dur = 0.0
        work = 0.0
        for t1, left, d, whole in rest:
            if span >= whole:  # all its layers fit (the floor below is then at least ``left``)
                t = whole
            else:
                k = int(span / t1 * (1 + 1e-9))  # floor: the quotient is not negative
                if k >= left:
                    k = left
                elif (k + 1) * t1 <= hi:
                    k += 1
                if k == 0:
                    continue
                t = k * t1
            if t > dur:
                dur = t
            work += t * d
        r = (num_devices * dur - work) / work  # the key (r, dur), compared as that pair
        if best_r is None or r < best_r or (r == best_r and dur < best_dur):
            best_r, best_dur, best_span = r, dur, span
    span = best_span
    hi = span * slack
    layers = {}
    for n, t1, left, _ in items:
        k = int(span / t1 * (1 + 1e-9))
        if k >= left:
            k = left
        elif (k + 1) * t1 <= hi:
            k += 1
        if k > 0:
            layers[n] = k
    return layers


def build_waves(level: int, choices: Sequence[Sequence[tuple[str, int, int]]],
                times: Mapping[str, Mapping[int, float]], start_ms: float) -> list[Wave]:
    """Waves back to back from ``start_ms``, one per entry of ``choices`` (its ``(MetaOp, devices, layers)``
    slices in the given order), each MetaOp's layers numbered from 0 in time order; merged (:func:`merge_waves`)."""
    out, nxt, clock = [], {}, start_ms
    for ch in choices:
        slices, dur = [], 0.0
        for n, c, k in ch:
            t = k * times[n][c]
            first = nxt.get(n, 0)
            slices.append(WaveSlice(n, first, k, c, t))
            nxt[n] = first + k
            if t > dur:  # max(dur, t)
                dur = t
        out.append(Wave(level, clock, dur, slices))
        clock += dur
    return merge_waves(out)


def copy_waves(waves: Sequence[Wave]) -> list[Wave]:
    """New objects with the same fields (for a caller that hands out the same schedule twice)."""
    return [Wave(w.level, w.start_ms, w.duration_ms,
                 [WaveSlice(s.metaop, s.layer_start, s.layers, s.devices, s.time_ms) for s in w.slices], w.phase)
            for w in waves]


def merge_waves(waves: list[Wave]) -> list[Wave]:
    """Merge consecutive waves whose MetaOps and device counts are identical and whose layers continue."""
    out: list[Wave] = []
    for w in waves:
        prev = out[-1] if out else None
        if (prev is not None and prev.level == w.level
                and [(s.metaop, s.devices) for s in prev.slices] == [(s.metaop, s.devices) for s in w.slices]
                and all(a.layer_start + a.layers == b.layer_start for a, b in zip(prev.slices, w.slices))):
            for a, b in zip(prev.slices, w.slices):
                a.layers += b.layers
                a.time_ms += b.time_ms
            prev.duration_ms = max(s.time_ms for s in prev.slices)
            continue
        out.append(w)
    clock = out[0].start_ms if out else 0.0
    for w in out:
        w.start_ms = clock
        clock += w.duration_ms
    return out
