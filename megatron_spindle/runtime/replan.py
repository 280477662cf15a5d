"""Changing the task mix during training: replan, rebuild only what changed, keep every weight and its state.

When tasks join or leave, the planner makes a new plan for the new task set (``graph.subset``); then
:func:`replan` turns the running model into the new one without restarting the job:

1. a layer whose parameters this rank already holds with the same tensor-parallel group is *reused*: the
   new model takes over the very same ``Parameter`` objects, so their optimizer state carries over as is;
2. every other layer the new plan puts on this rank is built fresh and filled from a copy that some rank
   holds (point-to-point, parameters and optimizer state together, one message per dtype; from this rank
   itself when it parks a copy under another tensor-parallel group); every state tensor keeps its dtype and
   its device (AdamW's ``step`` is a float32 tensor on the CPU unless the optimizer is fused or capturable:
   it goes through the communication device and back, and is never cast to a bf16 parameter's dtype, which
   holds integers exactly only up to 256). A weight nobody holds yet (a task joining for the first time)
   keeps its fresh initialisation, which depends only on (seed, param_key);
3. layers of the old model that the new one does not use are *parked* on their rank, with their optimizer
   state: a task that leaves keeps its weights, and gets them back when it rejoins. A parked copy is
   dropped as soon as a plan trains that weight anywhere (it would go stale), so every copy that exists
   is current and any of them may serve a transfer.

Every rank computes the same transfer list from an all-gather of who holds what, so sends and receives match.
The new model takes over the old one's process groups (:class:`~.groups.ProcessGroupRegistry`): the rank sets
both plans use keep their communicators, new ones are created and warmed, and the groups that neither the new
plan nor a parked layer (which keeps its tensor-parallel group for when it comes back) needs are destroyed.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .. import comm

from ..planner.workload.graph import TaskGraph
from ..planner.assembly.plan import Plan
from .executor import SpindleModel


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _state_tensors(optimizer, p) -> dict[str, torch.Tensor]:
    """The optimizer's tensors for ``p``: ``optimizer.param_state(p)`` where it has one (fp32 master weights,
    :mod:`.mixed_precision`), else ``optimizer.state[p]``."""
    if optimizer is None:
        return {}
    get = getattr(optimizer, "param_state", None)
    st = get(p) if get is not None else optimizer.state.get(p, {})
    return {k: v for k, v in sorted(st.items()) if torch.is_tensor(v)}


def _load_state(optimizer, p, st: dict) -> None:
    load = getattr(optimizer, "load_param_state", None)
    if load is not None:
        load(p, st)
    else:
        optimizer.state[p] = st


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.split(".")[-1])


def describe(layer, states) -> dict[str, tuple]:
    """What a copy of a layer sends, known to every rank: ``{parameter name: (shape, dtype, [(state key, shape,
    dtype, whether it lives on the parameter's device)])}``. Each state tensor keeps its dtype and device
    class: AdamW keeps ``step`` as a float32 tensor on the CPU (unless fused or capturable), fp32 moments of a
    bf16 parameter stay fp32."""
    out = {}
    for n, p in sorted(layer.core.named_parameters()):
        st = states.get(n, {})
        out[n] = (tuple(p.shape), str(p.dtype), [(sk, tuple(t.shape), str(t.dtype), t.device == p.device)
                                                 for sk, t in sorted(st.items())])
    return out


def _pieces(spec) -> list[tuple]:
    """The tensors of one copy in wire order: ``(parameter, state key or None, shape, dtype, on its device)``,
    each parameter (by name) followed by its state."""
    out = []
    for n, (shape, dtype, states) in sorted(spec.items()):
        out.append((n, None, shape, dtype, True))
        out += [(n, sk, sshape, sdtype, on) for sk, sshape, sdtype, on in states]
    return out


def _by_dtype(spec) -> list[tuple[str, list[int]]]:
    """``[(dtype, indices into the wire order)]``, dtypes sorted: one message each (a dtype is never cast)."""
    groups: dict[str, list[int]] = {}
    for i, piece in enumerate(_pieces(spec)):
        groups.setdefault(piece[3], []).append(i)
    return sorted(groups.items())


def _tensors(layer, states) -> list[torch.Tensor]:
    """A local copy's tensors in wire order (:func:`_pieces` of its :func:`describe`)."""
    params = dict(layer.core.named_parameters())
    return [params[n] if sk is None else states[n][sk] for n, sk, *_ in _pieces(describe(layer, states))]


def messages(layer, states) -> list[torch.Tensor]:
    """A copy's messages: per dtype (:func:`_by_dtype` order) its tensors flat, on the communication device."""
    tensors = _tensors(layer, states)
    return [torch.cat([comm.on_comm_device(tensors[i].detach().reshape(-1)) for i in index])
            for _, index in _by_dtype(describe(layer, states))]


def buffers(spec) -> list[torch.Tensor]:
    """Receive buffers for the messages of a copy described by ``spec``."""
    pieces = _pieces(spec)
    return [comm.empty((sum(_numel(pieces[i][2]) for i in index),), _dtype(dtype)) for dtype, index in _by_dtype(spec)]


def unflatten(spec, flats) -> list[torch.Tensor]:
    """The copy's tensors in wire order, views of its received messages."""
    pieces = _pieces(spec)
    out: list = [None] * len(pieces)
    for (_, index), flat in zip(_by_dtype(spec), flats):
        off = 0
        for i in index:
            n = _numel(pieces[i][2])
            out[i] = flat[off:off + n]
            off += n
    return out


def load_copy(target, tensors, spec, optimizer) -> None:
    """Fill ``target``'s parameters from a copy's tensors (wire order) and give ``optimizer`` their state, each
    state tensor in its own dtype, on the parameter's device or the CPU as on the copy's holder."""
    params = dict(target.core.named_parameters())
    states: dict[str, dict] = {}
    with torch.no_grad():
        for (name, sk, shape, _, on_param), t in zip(_pieces(spec), tensors):
            p = params[name]
            if sk is None:
                p.copy_(t.reshape(p.shape))
            else:  # its own dtype, and its own device: the parameter's, or the CPU (AdamW's step)
                where = p.device if on_param else torch.device("cpu")
                states.setdefault(name, {})[sk] = t.reshape(shape).to(device=where, copy=True)
    for name, st in states.items():
        _load_state(optimizer, params[name], st)


def replan(model, optimizer, plan: Plan, graph: TaskGraph, *, layer_graph: TaskGraph | None = None,
           make_optimizer: Callable, seed: int = 0):
    """The model and optimizer for ``plan``; parameters and optimizer state of every weight are kept.

    ``make_optimizer(params)`` builds an optimizer of the same kind and hyper-parameters over new params.
    Returns ``(new_model, new_optimizer)``; the old model's layers not reused stay parked in
    ``new_model.parked``.
    """
    rank = dist.get_rank()
    parked: dict = dict(getattr(model, "parked", {}))  # (key, tp ranks) -> (layer, {param name: state})
    live = dict(model.cores_by_group)
    # state of parked layers lives beside them; state of live layers in the old optimizer
    available: dict = {}
    for (key, tp_ranks), layer in live.items():
        states = {n: _state_tensors(optimizer, p) for n, p in layer.core.named_parameters()}
        available[(key, tp_ranks)] = (layer, states)
    for k, v in parked.items():
        available.setdefault(k, v)

    # a weight nobody holds yet starts from its checkpoint (init), as at start-up; the same layers and sync
    new = SpindleModel(plan, graph, seed=seed, timeout_s=model.timeout_s, dtype=model.dtype, device=model.device,
                       layer_graph=layer_graph, reuse={k: v[0] for k, v in available.items()},
                       init=model.init, registry=model.registry, **model.options)
    reused = {k for k, layer in new.cores_by_group.items() if k in available and layer.core is available[k][0].core}
    need = [k for k in sorted(new.cores_by_group) if k not in reused]

    # who can serve (key, shard, tp): every rank's available copies, and what each copy consists of
    mine = {(key, tp_ranks.index(rank), len(tp_ranks)): describe(layer, states)
            for (key, tp_ranks), (layer, states) in available.items()}
    everyone = comm.all_gather_object((mine, [(k[0], k[1].index(rank), len(k[1])) for k in need]))
    transfers = []  # (src, dst, (key, shard, tp), what it consists of)
    for dst, (_, wants) in enumerate(everyone):
        for want in wants:
            holders = [r for r, (have, _) in enumerate(everyone) if want in have]
            if not holders:  # never trained (a task joining for the first time): the fresh layer is
                continue     # initialised from (seed, param_key) exactly as it would have been at start
            src = dst if dst in holders else holders[0]
            transfers.append((src, dst, want, everyone[src][0][want]))

    def local_copy(want):
        key, shard, tp = want
        for (k, tp_ranks), v in available.items():
            if k == key and len(tp_ranks) == tp and tp_ranks.index(rank) == shard:
                return v
        raise KeyError(want)

    received: dict = {}  # want -> (target layer, its tensors in wire order, spec)
    ops, bufs, tag = [], [], 0
    for src, dst, want, spec in transfers:
        n_msgs = len(_by_dtype(spec))  # one message per dtype: every tensor keeps its own
        if rank not in (src, dst):
            tag += n_msgs
            continue
        target = next(layer for k, layer in new.cores_by_group.items()
                      if (k[0], k[1].index(rank) if rank in k[1] else -1, len(k[1])) == want) if dst == rank else None
        if src == dst:  # this rank parks a copy under another tensor-parallel group: no message
            received[want] = (target, _tensors(*local_copy(want)), spec)
        elif src == rank:
            ops += [comm.send_op(flat, dst, tag=tag + i) for i, flat in enumerate(messages(*local_copy(want)))]
        else:
            got = buffers(spec)
            ops += [comm.recv_op(buf, src, tag=tag + i) for i, buf in enumerate(got)]
            bufs.append((want, target, spec, got))
        tag += n_msgs
    if ops:
        works = comm.works_per_op(comm.batch_isend_irecv(ops), len(ops))  # one per message, or one for all
        comm.wait_all(list({id(w): w for w in works}.values()), ["replan's weight transfers"] * len(works),
                      new.timeout)
    for want, target, spec, got in bufs:  # each dtype's message back into its tensors
        received[want] = (target, unflatten(spec, got), spec)

    new_opt = make_optimizer(new.trainable_parameters())
    old_params = {id(p) for layer, _ in available.values() for p in layer.core.parameters()}
    for p in new.trainable_parameters():  # reused parameters: same objects, same state
        if id(p) in old_params:
            for layer, states in available.values():
                for n, q in layer.core.named_parameters():
                    if q is p and states.get(n):
                        _load_state(new_opt, p, dict(states[n]))
    for want, (target, tensors, spec) in received.items():
        load_copy(target, tensors, spec, new_opt)
    # park what the new model does not use (with its optimizer state). A parked copy is only kept while
    # its weight is trained nowhere: once a plan uses the weight again, other copies would go stale.
    used = {id(layer.core) for layer in new.cores_by_group.values()}
    live = {g.param_key for g in plan.param_groups}
    new.parked = {k: v for k, v in available.items() if id(v[0].core) not in used and k[0] not in live}
    # a parked layer keeps its tensor-parallel group: every rank keeps the groups any rank's parked layers use
    parked_tp = sorted({k[1] for k in new.parked if len(k[1]) > 1})
    new.registry.retain(r for ranks in comm.all_gather_object(parked_tp) for r in ranks)
    return new, new_opt
