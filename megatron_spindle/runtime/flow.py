"""Data flow of a plan between waves, computed purely: which slice feeds which, and the messages.

For every wave ``w`` the *boundary* before it holds every edge whose consumer slice runs in ``w``:

* a continuation: the same MetaOp goes on (layer ``a`` of a slice reads layer ``a-1``, which ran in an earlier
  wave), input index 0;
* a MetaOp input: the first layer of a MetaOp reads the last layer of each producing MetaOp, input index
  = the position among the operator's inputs (``data:`` streams are read locally, not sent).

Forward, each edge's activation moves with :func:`~megatron_spindle.planner.layout.messages` (the same routing
the planner used to count bytes); backward, its gradient moves with the mirror messages. Every rank walks
the same boundaries in the same order, and the order of edges and messages inside a boundary is fixed, so
send and receive pairs match (each message gets its own tag).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..planner.graph import DATA_PREFIX
from ..planner.layout import Layout, Message, messages
from ..planner.metaops import MetaOp
from ..planner.plan import Plan, Slice


def slice_layout(m: MetaOp, s: Slice) -> Layout:
    return Layout(tuple(s.ranks), m.tp if m.batch_splittable else len(s.ranks), m.batch)


@dataclass(frozen=True)
class Edge:
    src: Slice
    dst: Slice
    input_index: int
    forward: tuple[Message, ...]
    backward: tuple[Message, ...]


def boundaries(plan: Plan) -> list[list[Edge]]:
    """Edges grouped by the wave of their consumer, in plan order."""
    by_name = {m.name: m for m in plan.metaops}
    where: dict[tuple[str, int], Slice] = {}
    for s in plan.slices():
        for layer in range(s.layer_start, s.layer_stop):
            where[(s.metaop, layer)] = s
    island = lambda r: r // plan.gpus_per_node  # noqa: E731
    out: list[list[Edge]] = []
    for w in plan.waves:
        edges = []
        for s in w.slices:
            m = by_name[s.metaop]
            if s.layer_start > 0:
                first_op_inputs = [(0, where[(m.name, s.layer_start - 1)], m)]
            else:
                first_op_inputs = [(i, where[(p, by_name[p].num_layers - 1)], by_name[p])
                                   for i, p in enumerate(m.inputs) if not p.startswith(DATA_PREFIX)]
            for idx, src, pm in first_op_inputs:
                a, b = slice_layout(pm, src), slice_layout(m, s)
                edges.append(Edge(src=src, dst=s, input_index=idx,
                                  forward=tuple(messages(a, b, island_of=island)),
                                  backward=tuple(messages(b, a, island_of=island))))
        out.append(edges)
    return out


def rank_edges(edges: Sequence[Edge], rank: int) -> list[Edge]:
    """The edges a rank takes part in (as a sender or a receiver)."""
    return [e for e in edges if any(rank in (m.src, m.dst) for m in e.forward)]
