"""The executor's point-to-point plumbing: one batched post, the record of each posted message, a pass's
outstanding messages, the error a silent peer raises, and :class:`Transfers`, the object that posts, waits for
and accounts a rank's messages of the plan, given what it needs when built.

Every point-to-point call of the wave executor (:mod:`.executor`) goes through :func:`post_p2p`, which goes
through :mod:`megatron_spindle.comm` (the one module that calls ``torch.distributed``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torch import Tensor

from .. import comm
from ..planner.assembly.plan import Message, Transfer


class SpindleTimeout(comm.PeerError):
    """A peer did not answer in time (dead or hung): names the wave, the slice and the peer."""


def post_p2p(ops: Sequence[tuple[str, Tensor, int, int]]) -> list:
    """Post ``("send" | "recv", tensor, peer, tag)`` operations in one ``batch_isend_irecv`` (through
    :mod:`megatron_spindle.comm`, which moves a send to the communication device; a receive buffer must be
    there already, :func:`megatron_spindle.comm.empty`). The executor's only point-to-point call; returns the
    work that completes each operation, in ``ops`` order: its own under gloo, the batch's one coalesced work
    under NCCL (:func:`megatron_spindle.comm.works_per_op`)."""
    p2p = []
    for kind, t, peer, tag in ops:
        if kind == "send":
            p2p.append(comm.send_op(t, peer, tag=tag))
        elif kind == "recv":
            p2p.append(comm.recv_op(t, peer, tag=tag))
        else:
            raise ValueError(f"point-to-point operation {kind!r} is neither 'send' nor 'recv'")
    return comm.works_per_op(comm.batch_isend_irecv(p2p), len(p2p))


@dataclass
class Posted:
    """One posted message: its work, what the timeout error names, its trace span and where it goes."""

    work: object
    desc: str
    span: str
    t0: object  # a mark of the trace's clock (:mod:`.trace`)
    wave: int
    e: Transfer
    msg: Message
    buf: Tensor | None
    tensor: Tensor  # kept alive until the wait
    key: str = ""  # the message's name on both ranks (:func:`message_key`)


def message_key(wave: int, backward: bool, tag: int, src: int, dst: int) -> str:
    """A message's name in the trace, the same on its sender and its receiver (``w3 fwd #12 0->1``): the tag
    numbers a pass's messages of a pair. The sender records ``<key> posted`` (its post, ending when the backend
    has the message), the receiver ``<key> awaited`` (blocked on it), a sender ``<key> send awaited`` (blocked on
    its completion at the pass's end); with the ranks' clocks on one host these split a receiver's wait into
    waiting for its peer to get there and waiting for the message."""
    return f"w{wave} {'bwd' if backward else 'fwd'} #{tag} {src}->{dst}"


@dataclass
class PassTransfers:
    """A pass's outstanding messages: sends (waited at the end of the pass), receives by the slice that
    consumes them, per boundary the spans spent posting and blocked waiting, and the works
    already waited for (under NCCL every message of a batch shares one work, waited once)."""

    sends: list[Posted] = field(default_factory=list)
    recvs: dict[str, list[Posted]] = field(default_factory=dict)
    blocked: dict[int, list] = field(default_factory=dict)  # wave -> [(mark, mark)] posting and waiting
    done: dict[int, object] = field(default_factory=dict)  # id() -> waited work (kept: ids stay unique)


class Transfers:
    """A rank's messages of the plan: posts batches of ``(wire tag, edge, message)`` items, waits for them in
    order and hands received buffers on, and accounts each boundary's exposed time on the trace.

    Built with everything it reads: the rank, the wire dtype and the device received tensors go to, the timeout
    of a wait, the trace, and ``shape_of(edge, message)``, a message's tensor shape. :meth:`post` posts a batch
    (local copies at once), :meth:`complete` waits for posted items, :meth:`inputs_of` waits for exactly one
    slice's receives, :meth:`pass_end` closes a phase's forward or backward. ``outstanding`` holds the pass's
    posted messages (:class:`PassTransfers`).
    """

    def __init__(self, *, rank: int, dtype, device, timeout, trace, shape_of) -> None:
        self.rank, self.dtype, self.device, self.timeout, self.trace = rank, dtype, device, timeout, trace
        self.shape_of = shape_of
        self.outstanding = PassTransfers()

    def begin(self) -> None:
        """A new pass direction: nothing outstanding."""
        self.outstanding = PassTransfers()

    def wait(self, works, what: list[str]) -> None:
        """:func:`comm.wait_all`, its failure raised as :class:`SpindleTimeout` naming this rank."""
        try:
            comm.wait_all(works, what, self.timeout)
        except TimeoutError as e:
            raise SpindleTimeout(f"rank {self.rank}: {e}") from e.__cause__

    def inputs_of(self, slice_name: str, recv_into) -> None:
        """Wait for exactly the receives posted for ``slice_name`` and hand them to ``recv_into``."""
        self.complete(self.outstanding.recvs.pop(slice_name, []), recv_into)

    def post(self, wave: int, backward: bool, items, send_of, recv_into) -> None:
        """Post ``(wire tag, edge, message)`` items in one batch at a point of wave ``wave`` (nothing when there
        are none): local copies at once, sends and receives through :func:`post_p2p`, recorded in ``outstanding``
        to be waited later. The time it takes counts as that wave's exposed transfer."""
        if not items:
            return
        t_start = self.trace.now()
        self._post_batch(backward, items, send_of, recv_into)
        self.outstanding.blocked.setdefault(wave, []).append((t_start, self.trace.now()))

    def _post_batch(self, backward: bool, items, send_of, recv_into) -> None:
        phase = "bwd" if backward else "fwd"
        ops, recs = [], []
        for wire, e, msg in items:
            wave = e.wave  # the boundary the message belongs to (its consumer's wave) names it
            if msg.local:
                recv_into(e, msg, send_of(e, msg))
            elif msg.src == self.rank:
                ops.append(("send", send_of(e, msg), msg.dst, wire))
                recs.append((None, f"wave {wave} {'backward' if backward else 'forward'}: send of {e.src} -> "
                             f"{e.dst} samples [{msg.start}, {msg.stop}) to rank {msg.dst}",
                             f"w{wave} {phase} send {e.src} -> {e.dst} to rank {msg.dst}", e, msg, None))
            else:
                buf = comm.empty(self.shape_of(e, msg), dtype=self.dtype)
                ops.append(("recv", buf, msg.src, wire))
                recs.append(((e.src if backward else e.dst), f"wave {wave} {'backward' if backward else 'forward'}: "
                             f"receive for {e.dst} from {e.src} samples [{msg.start}, {msg.stop}) from rank "
                             f"{msg.src}", f"w{wave} {phase} recv {e.src} -> {e.dst} from rank {msg.src}",
                             e, msg, buf))
        if not ops:
            return
        t0 = self.trace.now()
        works = post_p2p(ops)
        t_posted = self.trace.now()
        if len(ops) > 1 and all(w is works[0] for w in works):  # one work for the batch (NCCL): a failed wait
            peers = sorted({op[2] for op in ops})              # may be any of its messages' peers
            recs = [(owner, f"{desc} (one work for the boundary's batch with ranks {peers})", *rest)
                    for owner, desc, *rest in recs]
        for work, (owner, desc, span, e, msg, buf), op in zip(works, recs, ops):
            key = message_key(e.wave, backward, op[3], self.rank if owner is None else op[2],
                              op[2] if owner is None else self.rank)
            item = Posted(work, desc, span, t0, e.wave, e, msg, buf, op[1], key)
            (self.outstanding.sends if owner is None else self.outstanding.recvs.setdefault(owner, [])).append(item)
            if owner is None:
                self.trace.span("transfer", f"{key} posted", t0, t_posted)

    def complete(self, items: list[Posted], recv_into=None) -> None:
        """Wait for ``items`` in order (bounded by the timeout), record each one's post->complete span and the
        blocked time per boundary, and hand received buffers to ``recv_into``."""
        for it in items:
            t0 = self.trace.now()
            if id(it.work) not in self.outstanding.done:
                self.wait([it.work], [it.desc])
                self.outstanding.done[id(it.work)] = it.work
            t1 = self.trace.now()  # on a GPU: where the stream has waited for the message
            self.trace.span("transfer", it.span, it.t0, t1)
            self.trace.span("transfer", f"{it.key} {'awaited' if it.buf is not None else 'send awaited'}", t0, t1)
            self.outstanding.blocked.setdefault(it.wave, []).append((t0, t1))
            if recv_into is not None:
                recv_into(it.e, it.msg, it.buf.to(self.device))

    def pass_end(self, backward: bool, waves: Sequence[int]) -> None:
        """Wait for the sends of this phase's forward (or backward) ``waves`` (no message crosses a phase, so
        every one of them was posted and consumed inside it); record each boundary's exposed (posting +
        blocked) time."""
        self.complete(self.outstanding.sends)
        left = [it.desc for items in self.outstanding.recvs.values() for it in items]
        if left:
            raise RuntimeError(f"rank {self.rank}: receives posted but never consumed: {left[:3]}")
        phase = "bwd" if backward else "fwd"
        now = self.trace.now()
        for w in waves:
            self.trace.exposed("transfer", f"w{w} {phase} transfer", self.outstanding.blocked.get(w, []), now)
        self.outstanding = PassTransfers()
