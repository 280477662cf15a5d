"""The data flow of a plan, computed once: slice layouts, edges, messages and parameter device groups.

The plan stores what this module computes (:class:`~.plan.Transfer` with its :class:`~.plan.Message` lists,
:class:`~.plan.ParamGroup`); the step simulator times exactly those messages and the wave executor posts
exactly those messages. Nothing else derives them. Pure Python.

1. **Layout.** A slice with ranks ``r`` and tensor-parallel degree ``tp`` has ``dp = len(r) / tp``
   data-parallel replicas. Replica ``i`` is the ranks ``r[i·tp:(i+1)·tp]`` (one tensor-parallel group) and
   holds samples ``[i·B/dp, (i+1)·B/dp)`` of the global batch ``B``, replicated on its ``tp`` ranks
   (Megatron's tensor-parallel layers take and return replicated activations). A MetaOp that cannot split its
   batch has one replica holding the whole batch (:func:`slice_layout`).
2. **Edges.** Slice ``D`` of MetaOp ``m`` reads, as input 0, the slice holding layer ``a-1`` of ``m`` when it
   starts at layer ``a > 0`` (a continuation); when it starts at layer 0 it reads the last layer of each
   producing MetaOp, input index = the position among ``m.inputs`` (``data:`` streams are read locally, not
   sent). Edges are listed by consumer wave, then slice order, then input index (:func:`transfers`).
3. **Forward messages** (:func:`messages`). Every rank of ``D`` needs its replica's samples. For each
   destination rank and each source replica overlapping its range one source rank sends them: the destination
   itself when it holds them (a local copy), else a rank of the same island, else the replica's rank at the
   destination's index in its layout modulo the replica size. The choice is deterministic and spreads the load
   over the replica.
4. **Backward messages**: the mirror image. Every rank of the producer ``S`` needs the gradient of its samples,
   taken from one holder in ``D`` chosen by the same rule (``messages(D, S)``); Megatron's tensor-parallel
   layers return replicated input gradients, so any holder will do. None when the producer's backward does
   not run (:func:`needs_output_grad`: frozen, and nothing before it trains).
5. **Bytes.** A message of ``n`` samples moves ``n · e · ACTIVATION_BYTES`` bytes (bf16 activations), ``e``
   the producer's output elements per sample, or, where the consumer reads one token of it (a ``cls`` or
   ``eos`` pool head: :func:`..workload.graph.read_token`), that token's (``Transfer.token`` names it; the
   producer sends that token, the consumer's layer takes it alone); its gradient moves as many.
6. **Tags.** The messages of one boundary (all edges into one wave) are numbered ``1, 2, ...`` in edge order,
   forward and backward separately (:func:`rank_messages`); every rank reads the same list, so a send and its
   receive carry the same tag. A pass numbers them all (:func:`rank_posts`): forward boundaries in wave order,
   then backward ones.
6b. **Posting points** (:func:`posting_key`, the plan's ``transfer_posting``). ``producer``: an edge's forward
   messages go in the batch posted right after its producer slice, its backward messages in the batch posted
   right after its consumer's backward (which makes them); ``boundary``: in the batch of the consumer's wave.
   Every rank walks the same points in one order (waves in order, each wave's slices in plan order; backward
   the reverse) and posts at each the messages it sends or receives there, so the batches of all ranks follow
   one global order (the argument NCCL's in-order streams need against deadlock).
6c. **Sending order** (:func:`sending_order`). A rank reaches a slice's point before it runs its own slice of
   that wave when that slice comes first in the wave's order, so it posts its receives for that slice's
   outputs before its own work and they travel while it computes; a wave's slices that send the most bytes to
   other devices first let the most of them travel so. Which order a plan takes is its step's to decide
   (:func:`..simulation.simulate.best_posting`).
7. **Parameter device groups** (:func:`param_groups`): one per (weight, tensor-parallel shard), the devices
   holding it; its gradient is all-reduced over exactly them, unless the weight is frozen
   (:func:`frozen_param_keys`: held, never synchronised).

Worked example: a producer on ranks ``(0,)`` and a consumer on ``(0, 1, 2, 3)`` with batch 8 move samples
``[0, 2)`` as a local copy on rank 0 and ``[2, 4)``, ``[4, 6)``, ``[6, 8)`` from rank 0 to ranks 1, 2, 3:

>>> [str(m) for m in messages(Layout((0,), 1, 8), Layout((0, 1, 2, 3), 1, 8))]
['0->0[0:2]', '0->1[2:4]', '0->2[4:6]', '0->3[6:8]']
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from ..workload.memory import slice_param_keys
from ..workload.metaops import MetaOp, edge_elems_per_sample, edge_token
from .plan import Message, ParamGroup, Plan, Slice, Transfer

#: Bytes per element of an activation (or its gradient) crossing a wave boundary (bf16).
ACTIVATION_BYTES = 2


@dataclass(frozen=True)
class Layout:
    """Where a batch-first tensor lives: ``ranks`` in replica-major order, ``tp`` ranks per replica."""

    ranks: tuple[int, ...]
    tp: int
    batch: int
    """Global batch (samples)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        r = self.ranks
        if not r or len(set(r)) != len(r) or min(r) < 0:
            raise ValueError(f"layout ranks must be distinct non-negative ints, got {list(r)}")
        if self.tp < 1 or len(r) % self.tp:
            raise ValueError(f"layout of {len(r)} ranks {list(r)} cannot have tp={self.tp}")
        dp = len(r) // self.tp
        if self.batch < 1 or self.batch % dp:
            raise ValueError(f"global batch {self.batch} does not split over dp={dp} replicas "
                             f"(ranks {list(r)}, tp={self.tp})")
        object.__setattr__(self, "_per", self.batch // dp)
        object.__setattr__(self, "_pos", {x: i for i, x in enumerate(r)})
        object.__setattr__(self, "_hash", hash((r, self.tp, self.batch)))

    def __hash__(self) -> int:  # the dataclass's own hash of the fields, computed once (layouts key caches)
        return self._hash

    @property
    def dp(self) -> int:
        return len(self.ranks) // self.tp

    def replica(self, i: int) -> tuple[int, ...]:
        """Ranks of data-parallel replica ``i`` (its tensor-parallel group)."""
        return self.ranks[i * self.tp:(i + 1) * self.tp]

    def samples(self, i: int) -> tuple[int, int]:
        """Samples ``[start, stop)`` of replica ``i``."""
        return i * self._per, (i + 1) * self._per

    def holds(self, rank: int) -> bool:
        return rank in self._pos

    def rank_samples(self, rank: int) -> tuple[int, int]:
        """Samples held by ``rank`` (``KeyError`` when the rank is not in the layout)."""
        return self.samples(self._pos[rank] // self.tp)


def slice_layout(m: MetaOp, ranks: Sequence[int]) -> Layout:
    """Where a slice of ``m`` on ``ranks`` keeps its activations (item 1)."""
    return _layout(tuple(ranks), m.tp if m.batch_splittable else len(ranks), m.batch)


#: Layouts and message lists kept for reuse: the placement search and every whole-step candidate's plan
#: (:mod:`..step.choose`) ask for the same ones again (each a pure function of its arguments).
CACHE_SIZE = 4096


def clear_caches() -> None:
    """Forget the remembered layouts and message lists (a benchmark's rows each start cold)."""
    _layout.cache_clear()
    island_messages.cache_clear()
    _forward.cache_clear()


@functools.lru_cache(maxsize=CACHE_SIZE)
def _layout(ranks: tuple[int, ...], tp: int, batch: int) -> Layout:
    return Layout(ranks, tp, batch)


def _pick(holders: Sequence[int], dst: int, position: int, island_of: Callable[[int], int] | None) -> int:
    if dst in holders:
        return dst
    if len(holders) == 1:  # the only holder is what the rules below pick too
        return holders[0]
    if island_of is not None:
        home = island_of(dst)
        same = [h for h in holders if island_of(h) == home]
        if same:
            return same[position % len(same)]
    return holders[position % len(holders)]


def messages(src: Layout, dst: Layout, *, island_of: Callable[[int], int] | None = None,
             bytes_per_sample: float = 0.0) -> list[Message]:
    """Messages that give every rank of ``dst`` its samples of a tensor laid out as ``src`` (item 3)."""
    if src.batch != dst.batch:
        raise ValueError(f"global batch differs between layouts: {src.batch} vs {dst.batch}")
    out: list[Message] = []
    per, dper = src.batch // src.dp, dst.batch // dst.dp  # samples per replica (Layout.samples)
    stp, dtp, sranks, dranks = src.tp, dst.tp, src.ranks, dst.ranks
    for j in range(dst.dp):
        a, b = j * dper, (j + 1) * dper
        overlapping = range(a // per, (b - 1) // per + 1)  # the source replicas overlapping [a, b)
        for pos in range(dtp):
            d = dranks[j * dtp + pos]
            for i in overlapping:
                lo, hi = max(a, i * per), min(b, (i + 1) * per)
                if lo < hi:
                    out.append(Message(src=_pick(sranks[i * stp:(i + 1) * stp], d, j * dtp + pos, island_of), dst=d,
                                       start=lo, stop=hi, bytes=(hi - lo) * bytes_per_sample))
    return out


@functools.lru_cache(maxsize=CACHE_SIZE)
def island_messages(src: Layout, dst: Layout, gpus_per_node: int, bytes_per_sample: float) -> tuple[Message, ...]:
    """:func:`messages` with islands of ``gpus_per_node`` devices (remembered: the same layouts meet often)."""
    return tuple(messages(src, dst, island_of=lambda r: r // gpus_per_node, bytes_per_sample=bytes_per_sample))


def _edges(by_name: Mapping[str, MetaOp], slices: Sequence[Slice]) -> Iterable[tuple[int, Slice, Slice]]:
    """``(input index, producer slice, consumer slice)`` in plan order (item 2)."""
    where: dict[tuple[str, int], Slice] = {}
    for s in slices:
        for layer in range(s.layer_start, s.layer_stop):
            where[(s.metaop, layer)] = s
    for s in slices:
        m = by_name[s.metaop]
        if s.layer_start > 0:
            wanted = [(0, (m.name, s.layer_start - 1))]
        else:
            wanted = [(i, (p, by_name[p].num_layers - 1)) for i, p in enumerate(m.inputs) if p in by_name]
        for idx, key in wanted:
            if key in where:  # an unscheduled producer is validation rule 4's to report
                yield idx, where[key], s


def needs_output_grad(m: MetaOp) -> bool:
    """Whether ``m``'s backward runs, so it needs its output's gradient: it trains, or a MetaOp before it
    does (``input_grad``). A frozen MetaOp with nothing trainable before it runs forward only."""
    return m.trainable or m.input_grad


def frozen_param_keys(metaops: Iterable[MetaOp]) -> set[str]:
    """The weights of frozen MetaOps: held where their slices run, never reduced (no gradient)."""
    return {k for m in metaops if not m.trainable for k in m.param_keys if k}


def transfers(metaops: Iterable[MetaOp], slices: Sequence[Slice], gpus_per_node: int) -> list[Transfer]:
    """Every slice-to-slice edge with its forward and backward messages (items 2-5)."""
    by_name = {m.name: m for m in metaops}
    out = []
    for idx, src, dst in _edges(by_name, slices):
        p, d = by_name[src.metaop], by_name[dst.metaop]
        a, b = slice_layout(p, src.ranks), slice_layout(d, dst.ranks)
        per_sample = float(ACTIVATION_BYTES * edge_elems_per_sample(p, d))
        fwd, cross = _forward(a, b, gpus_per_node, per_sample)
        bwd = island_messages(b, a, gpus_per_node, per_sample) if needs_output_grad(p) else ()
        out.append(Transfer(src=src.name, dst=dst.name, input_index=idx, forward=fwd, backward=bwd,
                            cross_island_bytes=cross, token=edge_token(p, d)))
    return out


@functools.lru_cache(maxsize=CACHE_SIZE)
def _forward(src: Layout, dst: Layout, gpus_per_node: int, bytes_per_sample: float
             ) -> tuple[tuple[Message, ...], float]:
    """An edge's forward messages and the bytes of those that cross islands (summed in message order)."""
    fwd = island_messages(src, dst, gpus_per_node, bytes_per_sample)
    return fwd, sum(x.bytes for x in fwd if x.src // gpus_per_node != x.dst // gpus_per_node)


def sending_order(plan: Plan) -> Plan:
    """``plan`` with each wave's slices ordered by the bytes they send to other devices, most first (ties in plan
    order), its edges listed again (item 6c); ``plan`` itself where no wave's order changes."""
    away: dict[str, float] = {}
    for t in plan.transfers:
        away[t.src] = away.get(t.src, 0.0) + sum(m.bytes for m in t.forward if not m.local)
    waves, moved = [], False
    for w in plan.waves:
        order = sorted(range(len(w.slices)), key=lambda i: (-away.get(w.slices[i].name, 0.0), i))
        if order != list(range(len(w.slices))):
            moved = True
            w = dataclasses.replace(w, slices=tuple(w.slices[i] for i in order))
        waves.append(w)
    if not moved:
        return plan
    slices = [s for w in waves for s in w.slices]
    return dataclasses.replace(plan, waves=tuple(waves), transfers=tuple(transfers(plan.metaops, slices,
                                                                                    plan.gpus_per_node)))


def plan_transfers(plan: Plan) -> list[Transfer]:
    """What :func:`transfers` gives for ``plan``'s slices (validation compares it with the stored ones)."""
    return transfers(plan.metaops, list(plan.slices()), plan.gpus_per_node)


def param_groups(metaops: Iterable[MetaOp], slices: Sequence[Slice]) -> list[ParamGroup]:
    """One group per (weight, tensor-parallel shard): the devices that hold it and all-reduce its gradient."""
    by_name = {m.name: m for m in metaops}
    groups: dict[tuple[str, int], set[int]] = {}
    info: dict[tuple[str, int], tuple[int, int]] = {}
    for s in slices:
        m = by_name[s.metaop]
        for k in slice_param_keys(m, s.layer_start, s.num_layers):
            for shard in range(min(m.tp, len(s.ranks))):  # position p holds shard p % tp
                key = (k, shard)
                groups.setdefault(key, set()).update(s.ranks[shard::m.tp])
                info[key] = (m.tp, m.params_per_layer // m.tp)
    return [ParamGroup(param_key=k, tp_rank=t, tp=info[(k, t)][0], ranks=tuple(sorted(groups[(k, t)])),
                       params=info[(k, t)][1]) for k, t in sorted(groups)]


def boundaries(plan: Plan) -> list[list[Transfer]]:
    """The plan's stored edges grouped by the wave of their consumer (item 6: the boundary before it)."""
    out: list[list[Transfer]] = [[] for _ in plan.waves]
    for t in plan.transfers:
        out[t.wave].append(t)
    return out


def rank_messages(boundary: Sequence[Transfer], rank: int, *,
                  backward: bool) -> list[tuple[int, Transfer, Message]]:
    """``(tag, edge, message)`` for every message of one boundary that ``rank`` sends or receives (item 6).

    Local copies (``src == dst == rank``) are included; the tag is the message's 1-based position among all
    of the boundary's messages of that direction, so it is the same on both ends.
    """
    out, tag = [], 0
    for t in boundary:
        for m in (t.backward if backward else t.forward):
            tag += 1
            if rank in (m.src, m.dst):
                out.append((tag, t, m))
    return out


def posting_key(plan: Plan, t: Transfer, *, backward: bool) -> str | int:
    """Where ``t``'s messages of one direction are posted (item 6b): the slice's name after which they are
    posted (``producer`` posting) or the consumer's wave (``boundary``)."""
    if plan.transfer_posting == "boundary":
        return t.wave
    return t.dst if backward else t.src


def rank_posts(plan: Plan, rank: int, *, backward: bool) -> dict[str | int, list[tuple[int, Transfer, Message]]]:
    """``{posting key: [(tag, edge, message)]}`` of every message of one direction that ``rank`` sends or
    receives, grouped by :func:`posting_key`, each list in edge order; the tag is the message's 1-based
    position in the pass (item 6: forward boundaries in wave order, then backward ones), the same on both ends."""
    bounds = boundaries(plan)
    tag = sum(len(t.forward) for b in bounds for t in b) if backward else 0
    out: dict[str | int, list[tuple[int, Transfer, Message]]] = {}
    for b in bounds:
        for t in b:
            for m in (t.backward if backward else t.forward):
                tag += 1
                if rank in (m.src, m.dst):
                    out.setdefault(posting_key(plan, t, backward=backward), []).append((tag, t, m))
    return out
