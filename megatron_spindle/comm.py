"""The one place where tensors meet ``torch.distributed``: where a rank computes and communicates, and every
collective and point-to-point call of the package.

Why one module: NCCL only moves CUDA tensors and gloo only CPU tensors (gloo's CUDA support is partial), so a
CPU tensor handed to an all-reduce on an NCCL group fails on a GPU machine and nowhere else. Every call here
first puts its tensors on :func:`comm_device`; a test (``tests/test_comm_discipline.py``) proves that no
other module of the package, ``scripts/`` or ``examples/`` calls a collective or P2P function directly.
It imports only torch, so every layer may use it (models, runtime, profiler, the Megatron hooks).

API (``group=None`` is the world; ``timeout`` bounds the wait of an ``*_async`` result's ``wait``):

* :func:`comm_device` - the device of this rank: its CUDA device under NCCL, the CPU under gloo (and
  without ``torch.distributed``: the current CUDA device if there is one, else the CPU). Models build their
  parameters there, receive buffers are allocated there, references are built there.
* :func:`on_comm_device` - a tensor on that device (no copy when it is already there).
* :func:`empty` - a receive buffer on that device; :func:`host_to_device` - a host tensor copied there
  without the host waiting (pinned, non-blocking).
* :func:`all_reduce` (in place, returns the tensor that was reduced: the argument itself when it already
  lived on the device, else a copy that has been copied back into the argument), :func:`all_reduce_async`
  (returns ``(tensor on the device, work)``; the caller waits, then reads the returned tensor),
  :func:`all_gather`, :func:`broadcast`, :func:`barrier`.
* object collectives: :func:`broadcast_object_list`, :func:`all_gather_object`, :func:`gather_object`
  (torch pickles through the current device under NCCL; they carry no tensors of ours).
* point to point: :func:`send_op` and :func:`recv_op` make ``P2POp``\\ s (a send's tensor is moved to the
  device and made contiguous; a receive buffer must already be on the device, see :func:`empty`), and
  :func:`batch_isend_irecv` posts a list of them and returns the works to wait on: one per operation under
  gloo, ONE for the whole batch under NCCL (CUDA tensors go through ``_coalescing_manager``); callers must
  accept either (:func:`works_per_op`).
* :func:`wait_all` - wait for works, raising ``TimeoutError`` naming the message. Under gloo each wait is
  bounded by the timeout (the host blocks); under NCCL a wait makes the current CUDA stream wait on the work
  and the host goes on (a wait *with* a timeout would block the host until the GPU is done, once per
  message): the bound is the process group's own timeout, enforced by NCCL's watchdog.
* :class:`PeerError` - what every call here raises when ``torch.distributed`` fails (a peer died or stopped:
  gloo's "connection closed by peer", a timed-out wait, a store that is gone), naming this rank, the
  operation and the ranks it spans; :func:`is_peer_failure` recognises such a failure raised elsewhere
  (megatron.core's DDP and checkpointing call ``torch.distributed`` themselves). The entry points turn it into
  one line and exit status 3.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
import re
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["comm_device", "on_comm_device", "host_to_device", "empty", "all_reduce", "all_reduce_async",
           "all_gather", "broadcast", "barrier", "broadcast_object_list", "all_gather_object", "gather_object",
           "send_op", "recv_op", "batch_isend_irecv", "works_per_op", "wait_all", "is_nccl", "local_rank",
           "device_id", "nccl_error_handling", "ReduceOp", "PeerError", "is_peer_failure", "first_line", "during"]

ReduceOp = dist.ReduceOp

#: Words of torch.distributed / gloo / NCCL / TCPStore errors that mean a peer is gone or silent.
_PEER_WORDS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "socket",
               "gloo", "nccl", "tcpstore", "connection refused", "by peer")


class PeerError(RuntimeError):
    """A collective or point-to-point call failed: a peer died, stopped or is unreachable. The message names
    this rank, the operation and its ranks (``rank 0: all_reduce over ranks [0, 1] failed: ...``)."""


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, without gloo's source location and advice
    (``[.../pair.cc:553] Connection closed by peer [10.0.0.2]:4040. This is typically ...``)."""
    text = str(e).strip()
    line = text.splitlines()[0].strip() if text else type(e).__name__
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", line)
    return line.split(". This is typically")[0].rstrip(".")


@contextlib.contextmanager
def during(what: str):
    """Within the block, a :class:`PeerError` also says what the rank was doing (``iteration 4: saving``)."""
    try:
        yield
    except PeerError as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        text = str(e)
        prefix = f"rank {rank}: "
        raise type(e)(f"{prefix}{what}: {text[len(prefix):] if text.startswith(prefix) else text}") from e


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` (or anything in its cause chain) is a failed exchange with a peer, as opposed to a bug."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (PeerError, dist.DistError)):
            return True
        if isinstance(e, (RuntimeError, OSError, TimeoutError)) and any(
                w in str(e).lower() for w in _PEER_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


def _span(group) -> str:
    if group is None:
        return "all ranks"
    try:
        return f"ranks {dist.get_process_group_ranks(group)}"
    except (RuntimeError, ValueError):
        return "its group"


def _named(op: str):
    """Raise a failure of ``op`` as :class:`PeerError` naming this rank, ``op`` and the group's ranks."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            try:
                return fn(*a, **kw)
            except PeerError:
                raise
            except RuntimeError as e:  # DistError, DistBackendError, gloo transport errors
                if not is_peer_failure(e):
                    raise
                rank = dist.get_rank() if dist.is_initialized() else 0
                raise PeerError(f"rank {rank}: {op} over {_span(kw.get('group'))} failed: {first_line(e)}") from e
        return wrapper
    return deco


#: What launchers other than torchrun call a rank's index on its node (Slurm's srun, Open MPI, MPICH/Intel MPI).
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def local_rank(environ=None) -> int:
    """This rank's index on its node, from the launcher's environment: ``LOCAL_RANK`` (torchrun) or what Slurm
    and MPI launchers set; ``RANK`` modulo ``LOCAL_WORLD_SIZE`` when only those are set; 0 for a one-rank job.
    Anything else is refused in one line (``ValueError``): a default of 0 would put every rank of a node on
    GPU 0."""
    env = os.environ if environ is None else environ
    for name in _LOCAL_RANK_VARS:
        if env.get(name, "").strip():
            value = env[name].strip()
            if not value.isdigit():
                raise ValueError(f"{name}={value!r} is not a rank index on this node (a non-negative integer)")
            return int(value)
    world, rank = env.get("WORLD_SIZE", "1").strip() or "1", env.get("RANK", "0").strip() or "0"
    if env.get("LOCAL_WORLD_SIZE", "").strip().isdigit() and rank.isdigit() and int(env["LOCAL_WORLD_SIZE"]) > 0:
        return int(rank) % int(env["LOCAL_WORLD_SIZE"])
    if world == "1":
        return 0
    raise ValueError(f"LOCAL_RANK is not set (RANK={rank} of WORLD_SIZE={world}): which GPU of the node is this "
                     f"rank's is unknown; launch with torchrun (it sets LOCAL_RANK) or set LOCAL_RANK, or "
                     f"LOCAL_WORLD_SIZE for RANK modulo it")


#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` for this package's runs. What NCCL's watchdog does once a collective or
#: point-to-point call outlasts its process group's timeout (``--spindle-timeout``), per torch's
#: ``ProcessGroupNCCL.hpp``: 0 nothing, 1 abort the communicators and tear the process down, 2 abort the
#: communicators only, 3 tear down without aborting (torch's default; torchrun sets 1). A torn-down process
#: dies on an abort signal with the watchdog's log; with 2 the aborted communicators make the rank's next call
#: raise in Python, which the entry points turn into one line and exit status 3, as on gloo.
NCCL_ASYNC_ERROR_HANDLING = "2"


def nccl_error_handling(environ=None) -> None:
    """Set :data:`NCCL_ASYNC_ERROR_HANDLING` (before the NCCL process group is made: torch reads it then)."""
    env = os.environ if environ is None else environ
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ASYNC_ERROR_HANDLING


def device_id(backend: str) -> torch.device | None:
    """``init_process_group``'s ``device_id`` for ``backend``: under NCCL this rank's GPU (:func:`local_rank`),
    made the current device first, so the default communicator is created at once, bound to it, and later
    groups are split from it (``ncclCommSplit``) instead of each being created lazily by its first
    collective; None under gloo. Under NCCL it also sets the watchdog to abort, not kill
    (:func:`nccl_error_handling`)."""
    if "nccl" not in str(backend).lower():
        return None
    nccl_error_handling()
    local = local_rank()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def is_nccl(group=None) -> bool:
    """Whether ``group`` (default: the world) communicates through NCCL."""
    return dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower()


def comm_device() -> torch.device:
    """Where this rank computes and communicates: its CUDA device under NCCL, the CPU under gloo.

    Without an initialised process group: the current CUDA device when CUDA is available, else the CPU.
    """
    if dist.is_available() and dist.is_initialized():
        return torch.device("cuda", torch.cuda.current_device()) if is_nccl() else torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_comm_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` on :func:`comm_device` (itself when already there)."""
    dev = comm_device()
    return t if t.device == dev else t.to(dev)


def host_to_device(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``t`` on ``device`` (default :func:`comm_device`) without making the host wait: a CPU tensor goes to a
    GPU from pinned memory with ``non_blocking`` (a copy from pageable memory waits for the GPU to catch up);
    itself when already there."""
    dev = comm_device() if device is None else torch.device(device)
    if t.device == dev or (dev.index is None and t.device.type == dev.type):
        return t
    if dev.type == "cuda" and t.device.type == "cpu":
        return (t if t.is_pinned() else t.pin_memory()).to(dev, non_blocking=True)
    return t.to(dev)


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised receive buffer on :func:`comm_device`."""
    return torch.empty(tuple(shape), dtype=dtype, device=comm_device())


@_named("all_reduce")
def all_reduce(t: torch.Tensor, *, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce of ``t`` (moved to the device for the call and copied back if it was elsewhere)."""
    x = on_comm_device(t)
    dist.all_reduce(x, op=op, group=group)
    if x is not t:
        t.copy_(x)
    return t


@_named("all_reduce_async")
def all_reduce_async(t: torch.Tensor, *, op=ReduceOp.SUM, group=None):
    """``(x, work)``: ``x`` is ``t`` on the device; after ``work.wait()`` it holds the reduced values."""
    x = on_comm_device(t)
    return x, dist.all_reduce(x, op=op, group=group, async_op=True)


@_named("all_gather")
def all_gather(t: torch.Tensor, *, group=None) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape everywhere), in group-rank order, on the device."""
    x = on_comm_device(t).contiguous()
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out


@_named("broadcast")
def broadcast(t: torch.Tensor, *, src: int | None = None, group=None, group_src: int | None = None) -> torch.Tensor:
    """In-place broadcast from global rank ``src`` (or rank ``group_src`` within ``group``), moved to the
    device and back when needed."""
    x = on_comm_device(t)
    if group_src is not None:
        dist.broadcast(x, group=group, group_src=group_src)
    else:
        dist.broadcast(x, src=src, group=group)
    if x is not t:
        t.copy_(x)
    return t


@_named("barrier")
def barrier(group=None) -> None:
    if is_nccl(group):
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


@_named("broadcast_object_list")
def broadcast_object_list(objects: list, *, src: int, group=None) -> list:
    dist.broadcast_object_list(objects, src=src, group=group, device=comm_device())
    return objects


@_named("all_gather_object")
def all_gather_object(obj, *, group=None) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@_named("gather_object")
def gather_object(obj, *, dst: int = 0, group=None) -> list | None:
    """Every rank's ``obj`` on global rank ``dst`` (None elsewhere)."""
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def send_op(t: torch.Tensor, peer: int, *, tag: int = 0, group=None) -> dist.P2POp:
    """An ``isend`` of ``t`` (on the device, contiguous) to global rank ``peer``, for :func:`batch_isend_irecv`."""
    return dist.P2POp(dist.isend, on_comm_device(t).contiguous(), peer, group=group, tag=tag)


def recv_op(buf: torch.Tensor, peer: int, *, tag: int = 0, group=None) -> dist.P2POp:
    """An ``irecv`` into ``buf`` from global rank ``peer``; ``buf`` must live on the device (:func:`empty`)."""
    if buf.device != comm_device():
        raise ValueError(f"receive buffer on {buf.device}, but this rank communicates on {comm_device()}; "
                         f"allocate it with megatron_spindle.comm.empty")
    return dist.P2POp(dist.irecv, buf, peer, group=group, tag=tag)


@_named("batch_isend_irecv")
def batch_isend_irecv(ops: Sequence[dist.P2POp]) -> list:
    """Post every operation at once; returns the works (empty for no operations): one per operation (gloo)
    or one for the whole batch (NCCL). :func:`works_per_op` maps them to the operations."""
    return list(dist.batch_isend_irecv(list(ops))) if ops else []


def works_per_op(works: Sequence, n_ops: int) -> list:
    """The work that completes each of ``n_ops`` operations of one :func:`batch_isend_irecv` call: its own
    (one work per operation, gloo) or the batch's single coalesced work (NCCL) for every one."""
    if len(works) == n_ops:
        return list(works)
    if len(works) == 1:
        return list(works) * n_ops
    raise RuntimeError(f"batch_isend_irecv of {n_ops} operations returned {len(works)} works: neither one per "
                       f"operation nor one for the batch")


def wait_all(works: Iterable, what: Iterable[str], timeout: datetime.timedelta) -> None:
    """Wait for each work; ``TimeoutError`` names the message that failed or hung.

    gloo: each wait blocks the host up to ``timeout``. NCCL: ``work.wait()`` without a timeout, which makes
    the current CUDA stream wait and returns at once; a peer that never answers is caught by the process
    group's timeout (NCCL's watchdog aborts the communicator, :data:`NCCL_ASYNC_ERROR_HANDLING`, and the next
    call raises)."""
    host = not is_nccl()
    for work, desc in zip(works, what):
        try:
            ok = work.wait(timeout) if host else work.wait()
        except RuntimeError as e:
            raise TimeoutError(f"{desc} failed: {first_line(e)}") from e
        if ok is False:
            raise TimeoutError(f"{desc} timed out after {timeout.total_seconds():g} s")
