"""Backfilling: run a later level's ready MetaOps on the devices a level-by-level schedule leaves idle.

A level-by-level wave schedule (:mod:`.scheduler`) leaves devices idle in some waves, while MetaOps of the
next levels wait for the whole level to end even when their own producers finished long before. The
paper's readiness rule allows more: a MetaOp may run as soon as its producers have finished. Backfilling
keeps every wave and its duration and, walking the waves in time order:

1. finds the devices the wave leaves free and the MetaOps that are *ready* there (every producer's last layer
   lies in an earlier wave), are not in the wave and still have layers in later waves;
2. adds a slice of the ready MetaOp that removes the most time from its later slices: on a valid count that
   fits the free devices, as many of its next layers as fit in the wave's duration (ties: fewer devices);
3. takes those layers off the MetaOp's later slices (their layer ranges shift; a slice left with no layer
   disappears) and repeats while devices are free and something is ready.

Every wave keeps its duration or gets shorter, so the makespan never grows; dependencies hold because a
slice only moves earlier when its producers are already done, and a MetaOp's layers stay in order. The
result is not a level-by-level schedule, so ``Σ C*`` does not bound it.
"""
from __future__ import annotations

import copy
import math
from typing import Mapping, Sequence

from ..workload.curves import ScalingCurve
from ..workload.metaops import MetaOp
from ..level.waves import Wave, WaveSlice, merge_waves


def backfill(waves: Sequence[Wave], metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve],
             num_devices: int) -> list[Wave]:
    """The waves with later levels' ready layers moved onto idle devices (see the module docstring)."""
    N = num_devices
    by_name = {m.name: m for m in metaops}
    producers = {m.name: [p for p in m.producers if p in by_name] for m in metaops}
    out = [copy.deepcopy(w) for w in waves]
    T = {m.name: {c: curves[m.name].count_time(c) for c in m.valid_counts(N)} for m in metaops}

    def last_wave(name: str) -> int:
        return max((i for i, w in enumerate(out) for s in w.slices if s.metaop == name), default=-1)

    for wi, w in enumerate(out):
        while True:
            free = N - sum(s.devices for s in w.slices)
            if free <= 0:
                break
            present = {s.metaop for s in w.slices}
            best = None
            for m in metaops:
                name = m.name
                if name in present or any(last_wave(p) >= wi for p in producers[name]):
                    continue
                later = [s for w2 in out[wi + 1:] for s in w2.slices if s.metaop == name]
                if not later:
                    continue
                left = sum(s.layers for s in later)
                for c, t in T[name].items():
                    if c > free:
                        continue
                    k = min(left, int(math.floor(w.duration_ms / t * (1 + 1e-9))))
                    if k <= 0:
                        continue
                    saved, need = 0.0, k  # time taken off the later slices, first layers first
                    for s in later:
                        take = min(need, s.layers)
                        saved += take * T[name][s.devices]
                        need -= take
                        if need == 0:
                            break
                    key = (saved, -c)
                    if best is None or key > best[0]:
                        best = (key, name, c, k)
            if best is None:
                break
            _, name, c, k = best
            later = [s for w2 in out[wi + 1:] for s in w2.slices if s.metaop == name]
            start = later[0].layer_start
            w.slices.append(WaveSlice(metaop=name, layer_start=start, layers=k, devices=c, time_ms=k * T[name][c]))
            nxt, need = start + k, k
            for s in later:
                take = min(need, s.layers)
                need -= take
                s.layers -= take
                s.layer_start = nxt
                nxt += s.layers
                s.time_ms = s.layers * T[name][s.devices]
        for w2 in out[wi + 1:]:
            w2.slices = [s for s in w2.slices if s.layers > 0]
            w2.duration_ms = max((s.time_ms for s in w2.slices), default=0.0)
    out = merge_waves([w for w in out if w.slices])
    return out
