"""Record every ``torch.distributed`` call of this process, in issue order (and optionally apply NCCL's rules).

:func:`install` wraps, by name, the communication functions of ``torch.distributed`` (and of
``torch.distributed.distributed_c10d``, whose functions call each other through that module's globals, and of
every loaded megatron module that keeps its own references taken at import: the gradient buffer's and
tensor parallelism's ``dist_all_gather_func`` / ``dist_reduce_scatter_func``, ``from torch.distributed import
...``). Every call made at the outermost level appends one event to
:attr:`Recorder.events`; calls that torch makes inside another wrapped call (an object collective's
``all_gather``, ``batch_isend_irecv``'s ``isend``) are not recorded again. Events are tuples of plain values
(they pickle, and :mod:`.comm_check` reads them without torch):

* ``("coll", op, ranks, shape, dtype)``: a collective; ``ranks`` the sorted global ranks of its group (the
  default group: every rank), ``shape`` a tuple (the full buffer: the gathered output, the reduce-scatter
  input), ``dtype`` like ``"torch.float32"``; object collectives: shape ``()``, dtype ``"object"``; a barrier:
  shape ``()``, dtype ``"none"``;
* ``("p2p", ops)``: one ``batch_isend_irecv`` (a lone ``isend``/``irecv``/``send``/``recv`` is a batch of
  one); ``ops`` = ``((kind, peer, shape, dtype, tag), ...)``, ``kind`` ``"send"`` or ``"recv"``, ``peer`` a
  global rank;
* ``("new_group", ranks)`` (collective over the world) or ``("new_group", ranks, "local")``
  (``use_local_synchronization=True``: only its members take part), and ``("destroy_group", ranks)``.

A collective issued inside ``_coalescing_manager`` (megatron.core's DDP coalesces a bucket group's reductions)
is recorded once per call, in order: on one communicator that is the same order constraint as the
coalesced kernel.

With ``nccl_rules=True`` the wrappers also make gloo behave as NCCL does where it matters
(``../shared/GPU.md`` beside the development checkout): ``batch_isend_irecv`` returns ONE work for the whole batch (:class:`BatchWork`,
what ``_coalescing_manager`` gives for CUDA tensors), and a tensor handed to a collective or P2P call that is not
on :func:`megatron_spindle.comm.comm_device` raises ``RuntimeError``.

The wrapping goes through ``getattr``/``setattr`` by name: only ``megatron_spindle/comm.py`` may spell a
communication function of ``torch.distributed`` (``tests/test_comm_discipline.py``).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["Recorder", "BatchWork", "install", "uninstall", "recorder"]

_C10D = "torch.distributed.distributed_c10d"
#: megatron.core modules that keep references to torch.distributed functions taken at import
#: (``dist_all_gather_func = torch.distributed.all_gather_into_tensor``); imported at install so they are patched
_MCORE_MODULES = ("megatron.core.distributed.param_and_grad_buffer", "megatron.core.tensor_parallel.mappings",
                  "megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.utils")

#: collective name -> the argument whose shape and dtype are recorded (None: shape ``()``, dtype ``"none"``)
_COLLECTIVES: dict[str, str | None] = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "all_gather": "tensor",
    "all_gather_into_tensor": "output_tensor", "_all_gather_base": "output_tensor",
    "reduce_scatter_tensor": "input", "_reduce_scatter_base": "input", "reduce_scatter": "output",
    "gather": "tensor", "scatter": "tensor", "all_to_all_single": "input", "barrier": None,
    "monitored_barrier": None,
}
_OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
_P2P = {"isend": "send", "irecv": "recv", "send": "send", "recv": "recv"}
_GROUPS = ("new_group", "destroy_process_group")


class BatchWork:
    """One work for a whole ``batch_isend_irecv`` batch, as NCCL returns: waits for every operation's work."""

    def __init__(self, works: list) -> None:
        self.works = list(works)

    def wait(self, timeout=None) -> bool:
        ok = True
        for w in self.works:
            got = w.wait() if timeout is None else w.wait(timeout)
            ok = ok and got is not False
        return ok

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def get_future(self):
        """A future of every operation's future (gloo's P2P works have none: ``RuntimeError``, as theirs)."""
        futs = [w.get_future() for w in self.works]
        return torch.futures.collect_all(futs)


class Recorder:
    """This process's recorded events (see the module docstring)."""

    def __init__(self, nccl_rules: bool) -> None:
        self.nccl_rules = nccl_rules
        self.events: list[tuple] = []

    def clear(self) -> None:
        self.events.clear()


_recorder: Recorder | None = None
_saved: list[tuple[Any, str, Any]] = []      # (module, attribute, original) to restore
_local = threading.local()


def recorder() -> Recorder | None:
    """The installed recorder, or None."""
    return _recorder


def _world_ranks() -> tuple[int, ...]:
    return tuple(range(dist.get_world_size()))


def _group_ranks(group) -> tuple[int, ...]:
    if group is None:
        return _world_ranks()
    return tuple(sorted(int(r) for r in dist.get_process_group_ranks(group)))


def _dtype(t) -> str:
    return str(t.dtype)


def _check_device(op: str, tensors) -> None:
    dev = comm.comm_device()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device != dev:
            raise RuntimeError(f"{op}: tensor on {t.device}, but this rank communicates on {dev} "
                               f"(NCCL takes CUDA tensors only)")


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _outermost(fn: Callable, record: Callable[[inspect.BoundArguments], None]) -> Callable:
    """``fn`` wrapped: at depth 0, ``record(bound arguments)`` runs before the call (it may raise)."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_local, "depth", 0)
        if depth == 0 and _recorder is not None:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            record(bound)
        _local.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.depth = depth
    wrapper.__spindle_original__ = fn
    return wrapper


def _collective(name: str, fn: Callable) -> Callable:
    arg = _COLLECTIVES.get(name)

    def record(b: inspect.BoundArguments) -> None:
        a = b.arguments
        if name in _OBJECT_COLLECTIVES:
            shape, dtype = (), "object"
        elif arg is None:
            shape, dtype = (), "none"
        else:
            if _recorder.nccl_rules:
                _check_device(name, [t for v in a.values() for t in _tensors(v)])
            t = a[arg]
            if isinstance(t, (list, tuple)):  # reduce_scatter's output list etc.: the first
                t = t[0]
            shape, dtype = tuple(int(d) for d in t.shape), _dtype(t)
        _recorder.events.append(("coll", name, _group_ranks(a.get("group")), shape, dtype))
    return _outermost(fn, record)


def _peer(a: dict, key: str, group_key: str) -> int:
    """The global peer rank of a lone send or receive (-1: a receive from any source)."""
    if a.get(key) is None and a.get(group_key) is None:
        return -1
    if a.get(key) is not None:
        return int(a[key])
    return int(dist.get_global_rank(a.get("group"), a[group_key])) if a.get("group") is not None \
        else int(a[group_key])


def _lone_p2p(name: str, fn: Callable) -> Callable:
    kind = _P2P[name]

    def record(b: inspect.BoundArguments) -> None:
        a = b.arguments
        t = a["tensor"]
        if _recorder.nccl_rules:
            _check_device(name, [t])
        peer = _peer(a, "dst", "group_dst") if kind == "send" else _peer(a, "src", "group_src")
        _recorder.events.append(("p2p", ((kind, peer, tuple(int(d) for d in t.shape), _dtype(t),
                                           int(a.get("tag") or 0)),)))
    return _outermost(fn, record)


def _batch(fn: Callable) -> Callable:
    c10d = importlib.import_module(_C10D)

    @functools.wraps(fn)
    def wrapper(p2p_op_list):
        depth = getattr(_local, "depth", 0)
        if depth == 0 and _recorder is not None:
            ops = []
            for p in p2p_op_list:
                name = getattr(getattr(p.op, "__spindle_original__", p.op), "__name__", "")
                if name not in ("isend", "irecv"):
                    raise ValueError(f"batch_isend_irecv: operation {name!r} is neither isend nor irecv")
                p.op = getattr(c10d, name)  # torch tells isend from irecv by identity with its current global
                if _recorder.nccl_rules:
                    _check_device("batch_isend_irecv", [p.tensor])
                ops.append(("send" if name == "isend" else "recv", int(p.peer), tuple(int(d) for d in p.tensor.shape),
                            _dtype(p.tensor), int(p.tag)))
            _recorder.events.append(("p2p", tuple(ops)))
        _local.depth = depth + 1
        try:
            works = fn(p2p_op_list)
        finally:
            _local.depth = depth
        if depth == 0 and _recorder is not None and _recorder.nccl_rules and len(works) != 1:
            return [BatchWork([w for w in works if w is not None])]
        return works
    wrapper.__spindle_original__ = fn
    return wrapper


def _group_fn(name: str, fn: Callable) -> Callable:
    def record(b: inspect.BoundArguments) -> None:
        a = b.arguments
        if name == "new_group":
            ranks = a.get("ranks")
            key = tuple(sorted(int(r) for r in ranks)) if ranks else _world_ranks()
            local = a.get("use_local_synchronization") and key != _world_ranks()
            _recorder.events.append(("new_group", key, "local") if local else ("new_group", key))
        else:
            _recorder.events.append(("destroy_group", _group_ranks(a.get("group"))))
    return _outermost(fn, record)


def _wrap(name: str, fn: Callable) -> Callable:
    if name in _P2P:
        return _lone_p2p(name, fn)
    if name == "batch_isend_irecv":
        return _batch(fn)
    if name in _GROUPS:
        return _group_fn(name, fn)
    return _collective(name, fn)


def install(*, nccl_rules: bool = False) -> Recorder:
    """Wrap the communication functions of this process (once; a later call returns the same recorder, and
    ``nccl_rules=True`` switches the rules on)."""
    global _recorder
    if _recorder is not None:
        _recorder.nccl_rules = _recorder.nccl_rules or nccl_rules
        return _recorder
    for name in _MCORE_MODULES:  # first: they take their references at import
        try:
            importlib.import_module(name)
        except ImportError:  # megatron.core absent: only torch's own references matter
            pass
    c10d = importlib.import_module(_C10D)
    names = [*_COLLECTIVES, *_OBJECT_COLLECTIVES, *_P2P, "batch_isend_irecv", *_GROUPS]
    wrapped: dict[str, Callable] = {}
    for name in names:
        original = getattr(c10d, name, None) or getattr(dist, name, None)
        if original is None:
            continue
        wrapped[name] = _wrap(name, original)
        for mod in (dist, c10d):
            if getattr(mod, name, None) is original:
                _saved.append((mod, name, original))
                setattr(mod, name, wrapped[name])
    by_original = {id(w.__spindle_original__): w for w in wrapped.values()}
    for modname, mod in list(sys.modules.items()):  # every megatron module's own references to the originals
        if mod is None or not modname.startswith("megatron."):
            continue
        for attr, value in list(vars(mod).items()):
            if callable(value) and id(value) in by_original and not attr.startswith("__"):
                _saved.append((mod, attr, value))
                setattr(mod, attr, by_original[id(value)])
    _recorder = Recorder(nccl_rules)
    return _recorder


def uninstall() -> None:
    """Restore the original functions (P2P operations made while installed hold the wrapped ``isend``/``irecv``:
    make them again)."""
    global _recorder
    for mod, name, original in reversed(_saved):
        setattr(mod, name, original)
    _saved.clear()
    _recorder = None
