"""The executor's point-to-point plumbing: one batched post, the record of each posted message, a pass's
outstanding messages, and the error a silent peer raises.

Every point-to-point call of the wave executor (:mod:`.executor`) goes through :func:`post_p2p`, which goes
through :mod:`megatron_spindle.comm` (the one module that calls ``torch.distributed``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torch import Tensor

from .. import comm
from ..planner.step.plan import Message, Transfer


class SpindleTimeout(comm.PeerError):
    """A peer did not answer in time (dead or hung): names the wave, the slice and the peer."""


def post_p2p(ops: Sequence[tuple[str, Tensor, int, int]]) -> list:
    """Post ``("send" | "recv", tensor, peer, tag)`` operations in one ``batch_isend_irecv`` (through
    :mod:`megatron_spindle.comm`, which moves a send to the communication device; a receive buffer must be
    there already, :func:`megatron_spindle.comm.empty`). The executor's only point-to-point call; returns the
    works in ``ops`` order."""
    p2p = []
    for kind, t, peer, tag in ops:
        if kind == "send":
            p2p.append(comm.send_op(t, peer, tag=tag))
        elif kind == "recv":
            p2p.append(comm.recv_op(t, peer, tag=tag))
        else:
            raise ValueError(f"point-to-point operation {kind!r} is neither 'send' nor 'recv'")
    return comm.batch_isend_irecv(p2p)


@dataclass
class Posted:
    """One posted message: its work, what the timeout error names, its trace span and where it goes."""

    work: object
    desc: str
    span: str
    t0: float
    wave: int
    e: Transfer
    msg: Message
    buf: Tensor | None
    tensor: Tensor  # kept alive until the wait


@dataclass
class PassTransfers:
    """A pass's outstanding messages: sends (waited at the end of the pass), receives by the slice that
    consumes them, and per boundary the seconds the host spent posting and blocked waiting."""

    sends: list[Posted] = field(default_factory=list)
    recvs: dict[str, list[Posted]] = field(default_factory=dict)
    blocked: dict[int, float] = field(default_factory=dict)
