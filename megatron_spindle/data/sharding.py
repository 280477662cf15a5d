"""Which samples of each task's global batch a rank reads: derived from the plan, pure Python.

A slice whose operators read ``data:<task>:<stream>`` inputs holds, on each rank, the samples of its
data-parallel replica (:mod:`megatron_spindle.planner.assembly.dataflow`): replica ``i`` of ``dp`` holds
``[i·B/dp, (i+1)·B/dp)`` of the task's global batch ``B``. Only those ranks read that stream, and only
those samples.

Different slices of one task can have different layouts (the vision embedding on 2 ranks, the text embedding
on 4), yet sample ``j`` of a step must be the same sample for every stream. So the task's dataset is cut
into ``L`` **lanes**, ``L`` the least common multiple of the data-parallel degrees of the task's reading
slices (it divides ``B``): lane ``k`` supplies positions ``[k·B/L, (k+1)·B/L)`` of every step, and reads its
own contiguous part of the dataset (energon's rank ``k`` of ``L``). A rank reads exactly the lanes that cover
its replicas' positions, each once per step, whatever the number of streams it consumes; every lane is read
by the ranks of every replica that covers it, so no sample is missed and none is read twice by one rank.

>>> lanes_for([2, 4], batch=16)
4
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from ..planner.assembly.dataflow import Layout, slice_layout
from ..planner.workload.graph import DATA_PREFIX, TaskGraph
from ..planner.assembly.plan import Plan


@dataclass(frozen=True)
class StreamRead:
    """One slice reading one data stream: its ranks and data-parallel layout."""

    task: str
    stream: str
    slice: str
    ranks: tuple[int, ...]
    dp: int
    batch: int

    def samples(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of the global batch that ``rank`` holds for this read (the data-flow layout's rule)."""
        return Layout(self.ranks, len(self.ranks) // self.dp, self.batch).rank_samples(rank)


def stream_reads(plan: Plan, graph: TaskGraph) -> list[StreamRead]:
    """Every (slice, data stream) pair of the plan, in plan order."""
    metaops = {m.name: m for m in plan.metaops}
    out = []
    for s in plan.slices():
        m = metaops[s.metaop]
        layout = slice_layout(m, s.ranks)
        for layer in range(s.layer_start, s.layer_stop):
            for name in graph[m.operators[layer]].inputs:
                if name.startswith(DATA_PREFIX):
                    task, stream = name[len(DATA_PREFIX):].rsplit(":", 1)
                    out.append(StreamRead(task=task, stream=stream, slice=s.name, ranks=tuple(s.ranks),
                                          dp=layout.dp, batch=m.batch))
    return out


def lanes_for(dps: Iterable[int], batch: int) -> int:
    """Lanes of a task: the least common multiple of its reading slices' data-parallel degrees."""
    lanes = 1
    for d in dps:
        lanes = lanes * d // math.gcd(lanes, d)
    if batch % lanes:
        raise ValueError(f"global batch {batch} does not split into {lanes} lanes")
    return lanes


@dataclass(frozen=True)
class RankReads:
    """What one rank reads of one task per step."""

    task: str
    batch: int
    lanes_total: int
    lanes: tuple[int, ...]
    """The lanes this rank reads, sorted (empty when it runs none of the task's reading slices)."""
    streams: dict
    """``{stream: (start, stop)}`` of the global batch this rank holds for each stream it consumes."""


def rank_reads(plan: Plan, graph: TaskGraph, rank: int) -> dict[str, RankReads]:
    """``{task: RankReads}`` for every task of the plan (tasks this rank reads nothing of included)."""
    reads = stream_reads(plan, graph)
    out = {}
    for task in plan.tasks:
        mine = [r for r in reads if r.task == task]
        if not mine:
            raise ValueError(f"task {task!r} reads no data stream in the plan")
        batch = mine[0].batch
        total = lanes_for((r.dp for r in mine), batch)
        per = batch // total
        streams: dict[str, tuple[int, int]] = {}
        lanes: set[int] = set()
        for r in mine:
            if rank not in r.ranks:
                continue
            a, b = r.samples(rank)
            old = streams.setdefault(r.stream, (a, b))
            if old != (a, b):
                raise ValueError(f"rank {rank} reads stream {task}:{r.stream} as samples {old} and {(a, b)}")
            lanes.update(range(a // per, b // per))
        out[task] = RankReads(task=task, batch=batch, lanes_total=total, lanes=tuple(sorted(lanes)),
                              streams=streams)
    return out
