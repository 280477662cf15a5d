"""Moving a batch-first activation (and its gradient) between two rank layouts: inter-wave transfers.

A :class:`Layout` is ``(ranks, tp, batch)``: ``dp = len(ranks) / tp`` data-parallel groups, group ``i`` is
``ranks[i*tp:(i+1)*tp]`` and holds samples ``[i*B/dp, (i+1)*B/dp)`` of the global batch ``B``, replicated on
its ``tp`` ranks. A transfer moves one tensor from a source layout S (the producing slice) to a destination
layout D (the consuming slice). An operator with several inputs gets one transfer per input; the caller
concatenates (graph convention 2).

Planning is pure (:func:`forward_messages`, :func:`backward_messages`): a list of :class:`Message`
``(src rank, dst rank, samples [start, stop))``, the same on every rank.

* Forward: every rank of a D group needs all its group's samples. For each overlapping S group, the
  source is the destination rank itself when it is in that S group (a local copy), otherwise the S group's
  tp replica number ``k % S.tp``, where ``k`` is the destination's index in ``D.ranks`` (spreads the load
  over the replicas deterministically).
* Backward: gradients flow from D back to S. Every rank of an S group must receive the full gradient of its
  group's samples. megatron tp layers return replicated input gradients, so when several D ranks (tp
  replicas) hold the gradient of the same samples exactly one is used: the S rank itself when it is in
  that D group, otherwise D replica ``k % D.tp`` with ``k`` the S rank's index in ``S.ranks``.

A pair of ranks exchanges at most one message per transfer (a rank is in one group of each layout).

Execution (:func:`reshard_forward`, :func:`reshard_backward`, or :func:`run_transfers` for several at once)
posts all of this rank's sends and receives in ONE ``torch.distributed.batch_isend_irecv``; local copies
need no communication. Results are new tensors without autograd history: the wave executor detaches at wave
boundaries and feeds gradients back explicitly. With NCCL, the first ``batch_isend_irecv`` on a group must
involve all its ranks (torch's rule): run a barrier or a warm-up collective first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where a batch-first tensor lives: ``ranks`` in dp-major order, ``tp`` replicas per dp group."""

    ranks: tuple[int, ...]
    tp: int = 1
    batch: int
    """Global batch (samples)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        r = self.ranks
        if not r or len(set(r)) != len(r) or min(r) < 0:
            raise ValueError(f"layout ranks must be distinct non-negative ints, got {list(r)}")
        if self.tp < 1 or len(r) % self.tp:
            raise ValueError(f"layout of {len(r)} ranks {list(r)} cannot have tp={self.tp}")
        if self.batch < 1 or self.batch % self.dp:
            raise ValueError(f"global batch {self.batch} does not split over dp={self.dp} "
                             f"(ranks {list(r)}, tp={self.tp})")

    @property
    def dp(self) -> int:
        return len(self.ranks) // self.tp

    @property
    def local_batch(self) -> int:
        return self.batch // self.dp

    def group(self, i: int) -> tuple[int, ...]:
        """Ranks of data-parallel group ``i`` (its tp replicas)."""
        return self.ranks[i * self.tp:(i + 1) * self.tp]

    def samples(self, i: int) -> tuple[int, int]:
        """Samples ``[start, stop)`` of data-parallel group ``i``."""
        return i * self.local_batch, (i + 1) * self.local_batch

    def dp_index(self, rank: int) -> int | None:
        return self.ranks.index(rank) // self.tp if rank in self.ranks else None

    def local_samples(self, rank: int) -> tuple[int, int] | None:
        """Samples held by ``rank``, None when it is not in the layout."""
        i = self.dp_index(rank)
        return None if i is None else self.samples(i)

    def __str__(self) -> str:
        return f"[{','.join(map(str, self.ranks))}]tp{self.tp}b{self.batch}"


@dataclass(frozen=True)
class Message:
    """Samples ``[start, stop)`` sent from ``src`` to ``dst`` (a local copy when they are equal)."""

    src: int
    dst: int
    start: int
    stop: int

    @property
    def local(self) -> bool:
        return self.src == self.dst

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}[{self.start}:{self.stop}]"


def _check_pair(src: Layout, dst: Layout) -> None:
    if src.batch != dst.batch:
        raise ValueError(f"cannot reshard between layouts with different global batches: {src} -> {dst}")


def _route(have: Layout, need: Layout) -> list[Message]:
    """Every rank of every ``need`` group receives its group's samples from ``have``'s holders.

    The routing is the planner's (:func:`megatron_spindle.planner.layout.messages`), so the bytes the
    planner counts are the bytes this module moves.
    """
    from ..planner import layout as P
    msgs = P.messages(P.Layout(have.ranks, have.tp, have.batch), P.Layout(need.ranks, need.tp, need.batch))
    return sorted((Message(m.src, m.dst, m.start, m.stop) for m in msgs), key=lambda m: (m.dst, m.start))


def forward_messages(src: Layout, dst: Layout) -> list[Message]:
    """Messages that give every rank of ``dst`` its samples of an activation laid out as ``src``."""
    _check_pair(src, dst)
    return _route(src, dst)


def backward_messages(src: Layout, dst: Layout) -> list[Message]:
    """Messages that return the gradient of a ``src -> dst`` transfer: every rank of ``src`` gets the
    gradient of all its samples, each piece from one deterministic ``dst`` replica."""
    _check_pair(src, dst)
    return _route(dst, src)


@dataclass
class _Posted:
    ops: list
    pieces: list  # (start, tensor or receive buffer)
    want: tuple[int, int] | None


def _post(messages: Sequence[Message], *, rank: int, local: Tensor | None, have: tuple[int, int] | None,
          want: tuple[int, int] | None, sample_shape: tuple[int, ...], dtype: torch.dtype,
          device, tag: int) -> _Posted:
    if have is not None:
        n = have[1] - have[0]
        if local is None or tuple(local.shape) != (n, *sample_shape) or local.dtype != dtype:
            got = None if local is None else (local.dtype, list(local.shape))
            raise ValueError(f"rank {rank} holds samples {have}: expected a {dtype} tensor "
                             f"{[n, *sample_shape]}, got {got}")
        local = local.detach()
    ops, pieces = [], []
    for m in messages:
        if m.src == rank and m.dst != rank:
            chunk = local[m.start - have[0]:m.stop - have[0]].contiguous()
            ops.append(dist.P2POp(dist.isend, chunk, m.dst, tag=tag))
        elif m.dst == rank and m.src != rank:
            buf = torch.empty((m.stop - m.start, *sample_shape), dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, m.src, tag=tag))
            pieces.append((m.start, buf))
        elif m.local and m.src == rank:
            pieces.append((m.start, local[m.start - have[0]:m.stop - have[0]]))
    return _Posted(ops, pieces, want)


def _finish(p: _Posted) -> Tensor | None:
    if p.want is None:
        return None
    pieces = sorted(p.pieces, key=lambda x: x[0])
    covered = sum(t.shape[0] for _, t in pieces)
    if not pieces or pieces[0][0] != p.want[0] or covered != p.want[1] - p.want[0]:
        raise RuntimeError(f"reshard assembled samples {[(s, s + t.shape[0]) for s, t in pieces]}, "
                           f"wanted {p.want}")
    return torch.cat([t for _, t in pieces], dim=0)


@dataclass(frozen=True, kw_only=True)
class TransferSpec:
    """One tensor to move: its layouts, direction and per-sample shape and dtype."""

    src: Layout
    dst: Layout
    sample_shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    backward: bool = False
    """False: activation from ``src`` to ``dst``; True: its gradient from ``dst`` back to ``src``."""


def run_transfers(specs: Sequence[TransferSpec], tensors: Sequence[Tensor | None], *,
                  rank: int | None = None, device=None) -> list[Tensor | None]:
    """Run several transfers with one ``batch_isend_irecv``; every rank passes the same ``specs``.

    ``tensors[n]`` is this rank's local tensor for transfer ``n`` (None where it holds nothing: not in the
    sending layout). Returns, per transfer, this rank's received tensor (None where it is not a receiver).
    Transfer ``n`` uses tag ``n``, so two transfers between the same pair of ranks do not mix.
    """
    if len(specs) != len(tensors):
        raise ValueError(f"{len(specs)} transfer specs but {len(tensors)} tensors")
    rank = dist.get_rank() if rank is None else rank
    posted, ops = [], []
    for n, (spec, x) in enumerate(zip(specs, tensors)):
        if spec.backward:
            msgs, have_layout, want_layout = backward_messages(spec.src, spec.dst), spec.dst, spec.src
        else:
            msgs, have_layout, want_layout = forward_messages(spec.src, spec.dst), spec.src, spec.dst
        dev = device if device is not None else (x.device if x is not None else torch.device("cpu"))
        p = _post(msgs, rank=rank, local=x, have=have_layout.local_samples(rank),
                  want=want_layout.local_samples(rank), sample_shape=tuple(spec.sample_shape),
                  dtype=spec.dtype, device=dev, tag=n)
        posted.append(p)
        ops.extend(p.ops)
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return [_finish(p) for p in posted]


def reshard_forward(x: Tensor | None, src: Layout, dst: Layout, *, sample_shape: Sequence[int],
                    dtype: torch.dtype = torch.float32, rank: int | None = None,
                    device=None) -> Tensor | None:
    """Move an activation from ``src`` to ``dst``; returns this rank's ``dst`` samples (None outside
    ``dst``). ``x`` is this rank's ``src`` samples (None outside ``src``). Collective over both layouts."""
    spec = TransferSpec(src=src, dst=dst, sample_shape=tuple(sample_shape), dtype=dtype)
    return run_transfers([spec], [x], rank=rank, device=device)[0]


def reshard_backward(grad: Tensor | None, src: Layout, dst: Layout, *, sample_shape: Sequence[int],
                     dtype: torch.dtype = torch.float32, rank: int | None = None,
                     device=None) -> Tensor | None:
    """Return the gradient of a ``src -> dst`` transfer: ``grad`` is this rank's gradient of its ``dst``
    samples (None outside ``dst``); returns the gradient of its ``src`` samples (None outside ``src``)."""
    spec = TransferSpec(src=src, dst=dst, sample_shape=tuple(sample_shape), dtype=dtype, backward=True)
    return run_transfers([spec], [grad], rank=rank, device=device)[0]
