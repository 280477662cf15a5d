"""Checkpoints through megatron.core's distributed checkpointing, independent of the plan.

A MIMO model's parameters and moments are saved under its ``MimoModel``'s own keys (:mod:`.mimo_keys`), which
Megatron-LM's MIMO training reads; a spec model's as follows.
Every parameter is saved under a plan-independent key, ``model/<param_key>/<name>``, as a
``ShardedTensor`` of its full (unsharded) shape: a tensor-parallel shard declares its offset, and the copies
that data-parallel replicas and other slices hold declare a non-zero ``replica_id`` so exactly one copy is
written. AdamW's moments are saved the same way (``optim/<param_key>/<name>/exp_avg``...; a frozen weight has
none, only ``model/...``). Loading asks for
the keys of the *current* plan, so a checkpoint written under one plan loads under another (another world
size, tensor-parallel degree or task mix): megatron.core reshards. Keys the checkpoint lacks (a task that
joined) keep their fresh initialisation and are reported.

A tensor-parallel weight whose shards interleave (``partition_stride`` 2, a SwiGLU ``linear_fc1``) is
saved as ``[..., stride, n/stride, ...]`` so every rank's piece is one contiguous block.

Atomicity: a checkpoint is written to ``iter_NNNNNNN.tmp``, gets its checksum manifest when every rank has
finished, is renamed, and only then is ``latest_checkpointed_iteration.txt`` replaced atomically. A save that
fails or a rank killed at any point leaves the previous checkpoint and the pointer to it untouched; a save
that fails removes its ``iter_NNNNNNN.tmp`` (one whose rank was killed leaves it, and the next save of that
iteration replaces it). A peer that dies during a save or a load is a :class:`~megatron_spindle.comm.PeerError`
(exit status 3), not a damaged checkpoint.
Loading verifies every file against the manifest before anything is unpickled, and unpickles torch's
metadata with a restricted unpickler (:mod:`.files`: the trust model).
"""
from __future__ import annotations

import os
import shutil
import warnings

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

from ... import comm, faults
from ...atomic import write_file
from ...models.layer_state import shard_spec
from .directory import TRACKER, CheckpointFileError, describe_save_error, latest_iteration
from .files import (deferred_common_save_error, in_process_writes, restrict_metadata_unpickling, verify_checkpoint,
                    write_manifest)
from .mimo_keys import OPTIMIZER_PREFIX, is_mimo, is_object, optimizer_entry, part_state, tensors

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


try:  # torch's checkpoint exception derives from BaseException, not Exception
    from torch.distributed.checkpoint.api import CheckpointException as _DcpError
    _READ_ERRORS = (Exception, _DcpError)
except ImportError:  # pragma: no cover
    _READ_ERRORS = (Exception,)


class CheckpointError(CheckpointFileError):
    """A checkpoint that cannot be used (missing, corrupt, for another model) or cannot be written."""


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _tp_of(plan) -> dict[str, int]:
    out = {}
    for m in plan.metaops:
        for k in m.param_keys:
            if k:
                out[k] = m.tp
    return out


def _sharded(key: str, t: torch.Tensor, p: torch.nn.Parameter | None, shard: int, tp: int, replica: tuple):
    spec = shard_spec(p) if p is not None else None
    if spec is None:
        return ShardedTensor.from_rank_offsets(key, t, replica_id=replica)
    dim, stride = spec
    n = t.shape[dim]
    view = t.view(*t.shape[:dim], stride, n // stride, *t.shape[dim + 1:])
    return ShardedTensor.from_rank_offsets(key, view, (dim + 1, shard, tp), replica_id=replica)


def ensure_adam_state(optimizer) -> None:
    """Create empty AdamW state for parameters that have none yet (so a load has somewhere to go)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def sharded_state_dict(model, optimizer=None) -> dict:
    """This rank's plan-independent sharded state: parameters and (optionally) AdamW state."""
    mimo = is_mimo(model)
    state = (lambda name, p: optimizer.state[p]) if optimizer is not None else None
    out = {}
    for key, shard, tp, idx, copy, layer in local_holders(model):
        if copy == 0:
            out.update(holder_state(layer, key, shard, tp, idx, state, mimo))
    out.update(_parked_state_dict(model, optimizer is not None))
    return out


def local_holders(model):
    """``(key, shard, tensor-parallel size, index in the shard's ranks, copy on this rank, layer)`` of every local
    holder of a parameter key's shard (a shard held for two tensor-parallel groups has copies 0 and 1)."""
    tp_of = _tp_of(model.plan)
    groups = {(g.param_key, g.tp_rank): g.ranks for g in model.plan.param_groups}
    for (key, shard), mods in sorted(model.layer_copies.items()):
        idx = groups[(key, shard)].index(model.rank)
        for copy, layer in enumerate(mods):
            yield key, shard, tp_of[key], idx, copy, layer


def holder_state(layer, key: str, shard: int, tp: int, idx: int, state, mimo: bool, copy: int = 0) -> dict:
    """The entries of one local holder of ``key``'s shard ``shard`` (the ``idx``-th rank of its rank list; the
    ``copy``-th holder on this rank): ``model/<key>/<name>`` for every parameter (and, under a MIMO model, every
    ``_extra_state`` object), and with ``state(name, param)`` (its AdamW state) ``optim/<key>/<name>/<state>``.
    The entries' keys: plan-independent ``model/<key>/<name>``, or the ``MimoModel``'s own (:mod:`.mimo_keys`)."""
    out = {}
    if mimo:
        entries = part_state(layer, key, shard, idx, copy)
    else:
        entries = {}
        for name, p in sorted(layer.core.named_parameters()):
            replica = (0, idx) if shard_spec(p) is not None else (shard, idx)  # a replicated tensor of a TP
            if copy:                                                            # layer: one main copy in all
                replica = (*replica, copy)
            entries[name] = _sharded(f"model/{key}/{name}", p.data, p, shard, tp, replica)
    params = dict(layer.core.named_parameters())
    for name, entry in sorted(entries.items()):
        base = f"{key}/{name}"
        out[f"model/{base}"] = entry
        p = params.get(name)
        if state is None or p is None or not p.requires_grad:  # a frozen weight has no optimizer state
            continue
        st = state(name, p)
        for k in ADAM_KEYS:
            out[f"optim/{base}/{k}"] = optimizer_entry(entry, st[k], k) if mimo else \
                _sharded(f"optim/{base}/{k}", st[k], p, shard, tp, entry.replica_id)
        step_key = f"{OPTIMIZER_PREFIX}.step.{key}.{name}" if mimo else f"optim/{base}/step"
        rid = (shard, idx, copy) if copy else (shard, idx)
        out[f"optim/{base}/step"] = _sharded(step_key, st["step"].view(1), None, 0, 1, rid)
    return out


def _parked(model) -> dict:
    """``{(param_key, shard, tp): [(layer, {param name: optimizer state})]}``: the layers a task-mix change
    parked on this rank (:func:`...runtime.replan.replan`), weights of tasks that left with their state."""
    out: dict = {}
    for (key, tp_ranks), (layer, states) in sorted(getattr(model, "parked", {}).items(),
                                                   key=lambda kv: (kv[0][0], kv[0][1])):
        out.setdefault((key, tp_ranks.index(model.rank), len(tp_ranks)), []).append((layer, states))
    return out


def _parked_state_dict(model, with_optimizer: bool) -> dict:
    """The parked layers' weights and AdamW state under the same keys as live ones, so every checkpoint of a
    run with ``--spindle-task-schedule`` holds every module trained so far. Collective once any task-mix
    change happened (every rank replans together, so every rank has ``parked`` or none has): the ranks that
    park one shard agree on which copy is the main one."""
    if not hasattr(model, "parked"):
        return {}
    mine = _parked(model)
    holders: dict = {}
    for r, have in enumerate(comm.all_gather_object(sorted(mine))):
        for k in have:
            holders.setdefault(k, []).append(r)
    out = {}
    mimo = is_mimo(model)
    for (key, shard, tp), copies in mine.items():
        idx = holders[(key, shard, tp)].index(model.rank)
        layer, states = copies[0]
        out.update(holder_state(layer, key, shard, tp, idx, (lambda name, p, _s=states: _parked_adam(_s, name, p))
                                if with_optimizer else None, mimo))
    return out


def _parked_adam(states: dict, name: str, p) -> dict:
    st = states.setdefault(name, {})
    if not all(k in st for k in ADAM_KEYS + ("step",)):  # parked before its first step: empty state
        st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                  exp_avg_sq=torch.zeros_like(p))
    return st


def _copy_parked_duplicates(model) -> None:
    """A shard parked twice on this rank (two tensor-parallel groups) takes the loaded copy's values."""
    with torch.no_grad():
        for copies in _parked(model).values():
            (first, first_states), rest = copies[0], copies[1:]
            params = dict(first.core.named_parameters())
            for layer, states in rest:
                for name, p in layer.core.named_parameters():
                    p.copy_(params[name])
                    if first_states.get(name):
                        states[name] = {k: v.clone() for k, v in first_states[name].items()}


def checkpoint_bytes(model, optimizer) -> int:
    """Bytes a checkpoint of ``model`` and ``optimizer`` writes (every main copy once); collective."""
    ensure_adam_state(optimizer)
    mine = sum(t.data.numel() * t.data.element_size() for v in sharded_state_dict(model, optimizer).values()
               for t in tensors(v) if is_main_replica(t.replica_id))
    return int(comm.all_reduce(torch.tensor([mine], dtype=torch.float64)).item())


def save_checkpoint(root: str, iteration: int, model, optimizer, extra: dict | None = None) -> str:
    """Write a checkpoint atomically; collective over all ranks. Returns its directory.

    Raises :class:`CheckpointError` (the same line on every rank, a full disk or a permission error named
    as such) when it cannot be written; the last checkpoint and the tracker stay as they were.
    """
    rank = dist.get_rank()
    tmp = _iter_dir(root, iteration) + ".tmp"
    try:
        return _save(root, iteration, model, optimizer, extra)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing half-written behind
        raise


def _save(root: str, iteration: int, model, optimizer, extra: dict | None) -> str:
    rank = dist.get_rank()
    final, tmp = _iter_dir(root, iteration), _iter_dir(root, iteration) + ".tmp"
    faults.point("save-start", iteration, rank)
    error = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = describe_save_error(root, e)
    _raise_any(error)
    ensure_adam_state(optimizer)
    sd = sharded_state_dict(model, optimizer)
    sd["common"] = {"iteration": iteration, "model": model.graph.model, "tasks": list(model.plan.tasks),
                    **(extra or {})}
    common_errors: list = []
    try:
        with in_process_writes(), deferred_common_save_error(common_errors):
            dc.save(sd, tmp)
    except _READ_ERRORS as e:  # torch's CheckpointException is a BaseException
        _raise_peer_failure(e, "writing checkpoint shards")
        error = describe_save_error(root, e)
    if common_errors and error is None:
        error = describe_save_error(root, common_errors[0])
    _raise_any(error)  # every rank agrees before any rank goes on
    faults.point("save-written", iteration, rank)
    try:
        write_manifest(tmp, iteration)
    except (OSError, ValueError) as e:
        error = describe_save_error(root, e)
    _raise_any(error)
    if rank == 0:
        try:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            faults.point("save-renamed", iteration, rank)
            write_file(os.path.join(root, TRACKER), str(iteration), "checkpoint tracker")
        except (OSError, ValueError) as e:
            error = describe_save_error(root, e)
    _raise_any(error)
    faults.point("save-done", iteration, rank)
    return final


def _raise_peer_failure(e: BaseException, what: str) -> None:
    """A failure of megatron.core's own collectives inside ``dc.save``/``dc.load`` is a peer's, not the disk's."""
    if isinstance(e, Exception) and comm.is_peer_failure(e) and not isinstance(e, OSError):
        raise comm.PeerError(f"rank {dist.get_rank()}: {what} failed: {comm.first_line(e)}") from e


def _raise_any(error: str | None) -> None:
    """Collective: raise ``CheckpointError`` on every rank with the first rank's message if any rank failed."""
    first = next((e for e in comm.all_gather_object(error) if e), None)
    if first:
        raise CheckpointError(first)


def load_checkpoint(root: str, model, optimizer) -> tuple[int, dict, list[str]]:
    """Load the latest checkpoint into ``model`` and ``optimizer`` (any plan); collective.

    Returns ``(iteration, common dict, keys the checkpoint lacked)``. Raises :class:`CheckpointError` with
    the path for a missing, corrupt or foreign checkpoint; nothing on disk is modified.
    """
    it = latest_iteration(root)
    if it is None:
        raise CheckpointError(f"no checkpoint in {root!r} (missing {TRACKER})")
    path = _iter_dir(root, it)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint tracker in {root!r} names iteration {it}, but {path} does not exist")
    try:
        verify_checkpoint(path)  # every file against the manifest, before anything is unpickled
    except CheckpointFileError as e:
        raise CheckpointError(str(e)) from None
    restrict_metadata_unpickling()
    try:
        common = dc.load_common_state_dict(path)
        meta = dc.load_tensors_metadata(path)
    except _READ_ERRORS as e:  # any failure to read is a corrupt checkpoint
        raise CheckpointError(f"checkpoint {path} is unreadable or corrupt: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None
    saved_model = (common.get("common") or common).get("model") if isinstance(common, dict) else None
    if saved_model is not None and saved_model != model.graph.model:
        raise CheckpointError(f"checkpoint {path} is for model {saved_model!r}, not {model.graph.model!r}")
    ensure_adam_state(optimizer)
    want = sharded_state_dict(model, optimizer)
    present = {k: v for k, v in want.items() if v.key in meta and not is_object(v)}  # no tensor in an object
    mine = {k.split("/")[1] for k, v in want.items()
            if k not in present and k.startswith("model/") and not is_object(v)}
    found = sum(1 for k in present if k.startswith("model/"))
    every = comm.all_gather_object((mine, found))  # report the weights no rank found, wherever they live
    missing = sorted(set().union(*(m for m, _ in every)))
    if missing and not any(n for _, n in every):  # nothing would load: another model's (renamed) checkpoint
        theirs = sorted({k.split("/")[1] if k.startswith("model/") else k for k in meta
                         if not k.startswith(("optim/", OPTIMIZER_PREFIX))})
        raise CheckpointError(f"checkpoint {path} holds none of this model's weights (it has {len(theirs)} such as "
                              f"{', '.join(theirs[:2])}; this model needs {', '.join(missing[:2])}...): a checkpoint of "
                              f"another model or of renamed modules? --load the checkpoint of this model, or start "
                              f"without --load")
    wrong = sorted(f"{v.key} has shape {list(meta[v.key].global_shape)}, this model needs {list(v.global_shape)}"
                   for u in present.values() for v in tensors(u)
                   if tuple(meta[v.key].global_shape) != tuple(v.global_shape))
    wrong = sorted(w for ws in comm.all_gather_object(wrong) for w in ws)  # the same line on every rank
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise CheckpointError(f"checkpoint {path}: {wrong[0]}{more} (another model size?)")
    try:
        with warnings.catch_warnings():  # megatron.core calls torch's deprecated name; nothing for a user
            warnings.filterwarnings("ignore", message=".*load_state_dict.* is deprecated", category=FutureWarning)
            loaded = dc.load(present, path)
    except _READ_ERRORS as e:
        _raise_peer_failure(e, f"loading checkpoint {path}")
        raise CheckpointError(f"checkpoint {path} is unreadable or corrupt: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None
    with torch.no_grad():
        for k, v in present.items():
            if loaded[k].data_ptr() != v.data.data_ptr():
                v.data.copy_(loaded[k])
        for mods in model.layer_copies.values():  # a shard held twice on this rank (two TP groups): same values
            first = dict(mods[0].core.named_parameters())
            for other in mods[1:]:
                for name, p in other.core.named_parameters():
                    p.copy_(first[name])
                    for key in ADAM_KEYS + ("step",):
                        if p in optimizer.state and first[name] in optimizer.state:
                            optimizer.state[p][key] = optimizer.state[first[name]][key].clone()
    _copy_parked_duplicates(model)
    inner = common.get("common", common) if isinstance(common, dict) else {}
    return it, inner, missing
