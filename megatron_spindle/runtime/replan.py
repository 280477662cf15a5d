"""Changing the task mix during training: replan, rebuild only what changed, keep every weight and its state.

When tasks join or leave, the planner makes a new plan for the new task set (``graph.subset``); then
:func:`replan` turns the running model into the new one without restarting the job:

1. a layer whose parameters this rank already holds with the same tensor-parallel group is *reused*: the
   new model takes over the very same ``Parameter`` objects, so their optimizer state carries over as is;
2. every other layer the new plan puts on this rank is built fresh and filled from a copy that some rank
   holds (point-to-point, parameters and optimizer state together; from this rank itself when it parks a
   copy under another tensor-parallel group); a weight nobody holds yet (a task joining for the first
   time) keeps its fresh initialisation, which depends only on (seed, param_key);
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
    st = optimizer.state.get(p, {}) if optimizer is not None else {}
    return {k: v for k, v in sorted(st.items()) if torch.is_tensor(v)}


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

    # who can serve (key, shard, tp): every rank's available copies
    mine = {}
    for (key, tp_ranks), (layer, states) in available.items():
        mine[(key, tp_ranks.index(rank), len(tp_ranks))] = {
            n: [(sk, tuple(t.shape), str(t.dtype)) for sk, t in sorted(st.items())] for n, st in states.items()}
    everyone = comm.all_gather_object((mine, [(k[0], k[1].index(rank), len(k[1])) for k in need]))
    transfers = []  # (src, dst, (key, shard, tp))
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

    def flat(layer, states, spec) -> torch.Tensor:
        parts = []
        for n, p in sorted(layer.core.named_parameters()):
            parts.append(p.detach().reshape(-1))
            parts += [states[n][sk].detach().reshape(-1).to(p.dtype) for sk, _, _ in spec[n]]
        return torch.cat(parts) if parts else torch.zeros(0)

    received: dict = {}
    ops, bufs = [], []
    for tag, (src, dst, want, spec) in enumerate(transfers):
        if rank not in (src, dst):
            continue
        target = next(layer for k, layer in new.cores_by_group.items()
                      if (k[0], k[1].index(rank) if rank in k[1] else -1, len(k[1])) == want) if dst == rank else None
        if src == dst:
            layer, states = local_copy(want)
            received[want] = (target, flat(layer, states, spec), spec)
        elif src == rank:
            layer, states = local_copy(want)
            ops.append(comm.send_op(flat(layer, states, spec), dst, tag=tag))
        else:
            n = sum(p.numel() + sum(_numel(shape) for _, shape, _ in spec[name])
                    for name, p in target.core.named_parameters())
            buf = comm.empty((n,), next(target.core.parameters()).dtype)
            ops.append(comm.recv_op(buf, src, tag=tag))
            bufs.append((want, target, buf, spec))
    if ops:
        works = comm.works_per_op(comm.batch_isend_irecv(ops), len(ops))  # one per message, or one for all
        comm.wait_all(list({id(w): w for w in works}.values()), ["replan's weight transfers"] * len(works),
                      new.timeout)
    for want, target, buf, spec in bufs:
        received[want] = (target, buf, spec)

    new_opt = make_optimizer(new.trainable_parameters())
    old_params = {id(p) for layer, _ in available.values() for p in layer.core.parameters()}
    for p in new.trainable_parameters():  # reused parameters: same objects, same state
        if id(p) in old_params:
            for layer, states in available.values():
                for n, q in layer.core.named_parameters():
                    if q is p and states.get(n):
                        new_opt.state[p] = {k: v for k, v in states[n].items()}
    with torch.no_grad():
        for want, (target, buf, spec) in received.items():
            off = 0
            for n, p in sorted(target.core.named_parameters()):
                k = p.numel()
                p.copy_(buf[off:off + k].view_as(p))
                off += k
                st = {}
                for sk, shape, dtype in spec[n]:
                    m = _numel(shape)
                    st[sk] = buf[off:off + m].clone().view(shape).to(getattr(torch, dtype.split(".")[-1]))
                    off += m
                if st:
                    new_opt.state[p] = st
    # park what the new model does not use (with its optimizer state). A parked copy is only kept while
    # its weight is trained nowhere: once a plan uses the weight again, other copies would go stale.
    used = {id(layer.core) for layer in new.cores_by_group.values()}
    live = {g.param_key for g in plan.param_groups}
    new.parked = {k: v for k, v in available.items() if id(v[0].core) not in used and k[0] not in live}
    # a parked layer keeps its tensor-parallel group: every rank keeps the groups any rank's parked layers use
    parked_tp = sorted({k[1] for k in new.parked if len(k[1]) > 1})
    new.registry.retain(r for ranks in comm.all_gather_object(parked_tp) for r in ranks)
    return new, new_opt
