"""Where a batch-first activation lives on a slice's devices, and which messages move it to another slice.

A slice with ranks ``r`` and tensor-parallel degree ``tp`` has ``dp = len(r) / tp`` data-parallel replicas.
Replica ``i`` is the ranks ``r[i·tp:(i+1)·tp]`` (one tensor-parallel group) and holds samples
``[i·B/dp, (i+1)·B/dp)`` of the global batch ``B``, replicated on its ``tp`` ranks (Megatron's tensor-parallel
layers take and return replicated activations).

Moving an activation from layout S to layout D (forward), every rank of D needs its replica's samples. For
each destination rank and each source replica that overlaps its range we pick one source rank: the
destination itself when it holds the samples (a local copy), else a rank in the same island, else the
replica's rank at the destination's index in its layout modulo the replica size, so the choice is
deterministic and spreads load over the replica.
Backward (gradients) is the mirror image: every rank of S needs the gradient of its samples, taken from one
holder in D chosen by the same rule. Pure Python: the planner counts the bytes, the runtime executes the
same messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Layout:
    ranks: tuple[int, ...]
    tp: int
    batch: int

    def __post_init__(self) -> None:
        if self.tp <= 0 or len(self.ranks) % self.tp:
            raise ValueError(f"{len(self.ranks)} ranks are not a multiple of tp={self.tp}")
        dp = len(self.ranks) // self.tp
        if self.batch % dp:
            raise ValueError(f"batch {self.batch} does not split over dp={dp} replicas")
        object.__setattr__(self, "_dp", dp)
        object.__setattr__(self, "_per", self.batch // dp)
        object.__setattr__(self, "_pos", {r: i for i, r in enumerate(self.ranks)})

    @property
    def dp(self) -> int:
        return self._dp

    def replica(self, i: int) -> tuple[int, ...]:
        return self.ranks[i * self.tp:(i + 1) * self.tp]

    def samples(self, i: int) -> tuple[int, int]:
        return i * self._per, (i + 1) * self._per

    def rank_samples(self, rank: int) -> tuple[int, int]:
        """Sample range held by ``rank`` (raises ``KeyError`` if the rank is not in the layout)."""
        return self.samples(self._pos[rank] // self.tp)

    def holds(self, rank: int) -> bool:
        return rank in self._pos


@dataclass(frozen=True)
class Message:
    """Samples ``[start, stop)`` go from ``src`` to ``dst`` (``src == dst``: a local copy)."""

    src: int
    dst: int
    start: int
    stop: int


def _pick(holders: Sequence[int], dst: int, position: int, island_of) -> int:
    if dst in holders:
        return dst
    if island_of is not None:
        same = [h for h in holders if island_of(h) == island_of(dst)]
        if same:
            return same[position % len(same)]
    return holders[position % len(holders)]


def messages(src: Layout, dst: Layout, *, island_of=None) -> list[Message]:
    """Forward messages moving ``src``'s activation into ``dst``'s layout (same global batch)."""
    if src.batch != dst.batch:
        raise ValueError(f"batch differs between layouts: {src.batch} vs {dst.batch}")
    out: list[Message] = []
    for j in range(dst.dp):
        a, b = dst.samples(j)
        first = a // src._per  # source replicas are contiguous equal ranges: only these overlap
        last = (b - 1) // src._per
        for pos, d in enumerate(dst.replica(j)):
            for i in range(first, last + 1):
                s0, s1 = src.samples(i)
                lo, hi = max(a, s0), min(b, s1)
                if lo < hi:  # spread over the source replica by the destination's index in its layout
                    out.append(Message(_pick(src.replica(i), d, j * dst.tp + pos, island_of), d, lo, hi))
    return out


def grad_messages(src: Layout, dst: Layout, *, island_of=None) -> list[Message]:
    """Backward messages: gradients of the activation flow from ``dst``'s layout back to ``src``'s."""
    return messages(dst, src, island_of=island_of)


def gather_layout(ranks: Sequence[int], batch: int) -> Layout:
    """A layout holding the whole batch on one rank (a MetaOp that cannot split its batch)."""
    return Layout(tuple(ranks), len(ranks), batch)
