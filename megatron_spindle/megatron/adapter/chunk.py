"""The model chunk Megatron-LM's loop sees, and the forward-backward function its ``train_step`` calls.

A Spindle model is a wave plan, not a module Megatron knows: :class:`MegatronModelChunk` dresses this rank's
:class:`~megatron_spindle.runtime.executor.SpindleModel` as the outermost model chunk (where Megatron's DDP
wrapper would stand), and :func:`megatron_forward_backward` is the schedule the hooks return from
``get_forward_backward_func``. megatron.core only: no ``megatron.training`` import here (see :mod:`.hooks`).

Batch sizes keep Megatron's meaning: ``--micro-batch-size`` is per rank, so one pass of the plan carries
``micro_batch_size x world`` samples of every task; ``--global-batch-size`` is samples of every task per
step, and Megatron's ``num_microbatches = global / (micro x world)`` is the number of passes.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.distributed import DistributedDataParallelConfig
from torch.nn.modules.module import _IncompatibleKeys

from ..checkpoint.mimo_keys import is_mimo, is_object
from ..checkpoint.save_load import holder_state, local_holders, sharded_state_dict
from .schedule import spindle_forward_backward


class MegatronModelChunk(torch.nn.Module):
    """A :class:`~megatron_spindle.runtime.executor.SpindleModel` dressed as the model chunk Megatron expects.

    It stands where Megatron's DDP wrapper would stand (outermost), and provides what ``train_step``, the
    optimizer builder and checkpointing read: ``zero_grad_buffer()``, ``force_all_reduce``, ``config``
    (a ``TransformerConfig``: the hook attributes ``train`` sets live there), ``ddp_config`` (a default
    ``DistributedDataParallelConfig``: no distributed optimizer, no FSDP), ``pg_collection``,
    ``sharded_state_dict`` / ``load_state_dict``, ``no_sync`` (the model's), ``finish_grad_sync`` (a no-op).
    Forward, backward, gradient sync and clipping delegate to the Spindle model.

    Args:
        model: this rank's Spindle model.
        config: the ``TransformerConfig`` Megatron's loop reads (from ``core_transformer_config_from_args``).
        pg_collection: the ``ProcessGroupCollection`` ``get_model`` passed (Megatron's global groups).
        clip_grad: global gradient-norm clip applied after each synchronised step (0: off).
    """

    def __init__(self, model, *, config=None, pg_collection=None, clip_grad: float = 0.0) -> None:
        super().__init__()
        self.module = model
        self.config = config
        self.ddp_config = DistributedDataParallelConfig()
        self.pg_collection = pg_collection
        self.force_all_reduce = False
        self.clip_grad = float(clip_grad)
        self.grad_norm: float | None = None
        """Global gradient norm of the last training step (before clipping); what Megatron logs."""
        self.steps = 0

    # -- what the schedule uses -----------------------------------------------------------------------
    @property
    def plan(self):
        return self.module.plan

    @property
    def graph(self):
        return self.module.graph

    def forward(self, batch):
        return self.module(batch)

    def backward(self, state, *, loss_scale: float = 1.0) -> None:
        self.module.backward(state, loss_scale=loss_scale)

    def finalize_grads(self) -> None:
        self.module.finalize_grads()

    def clip_grads(self) -> float:
        """Clip by the global norm (``clip_grad``; 0 only measures); records and returns the norm."""
        self.grad_norm = self.module.clip_grads(self.clip_grad)
        return self.grad_norm

    def report_device(self) -> torch.device:
        """Where loss reports go: Megatron's ``train_step`` all-reduces them with NCCL on GPUs."""
        return self.module.device

    # -- what Megatron's train_step / optimizer read ----------------------------------------------------
    def zero_grad_buffer(self) -> None:
        self.module.zero_grad_buffer()

    def no_sync(self):
        return self.module.no_sync()

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: :func:`megatron_forward_backward` synchronises gradients before returning."""

    # -- checkpointing ----------------------------------------------------------------------------------
    def _entries(self) -> list[tuple[str, torch.nn.Parameter, object]]:
        """``(dict key, parameter, ShardedTensor template)`` for every local parameter, prefix-free.

        The templates are :func:`..checkpoint.save_load.sharded_state_dict`'s (plan-independent keys
        ``model/<param_key>/<name>``, the right offsets and replica ids), so a checkpoint written through
        Megatron holds the model under the same keys as the built-in loop's. A second local copy of a shard
        (one per tensor-parallel group it serves) gets its own entry with the same key and a non-main
        replica id: Megatron's optimizer needs every parameter it steps to appear in the model's dict.
        """
        if is_mimo(self.module):
            return self._mimo_entries()
        base = sharded_state_dict(self.module)
        by_storage = {(p.data_ptr(), p.numel()): p for p in self.module.unique_parameters()}
        out, main_of = [], {}
        for key, sh in base.items():
            p = by_storage[(sh.data.data_ptr(), sh.data.numel())]
            out.append((key, p, sh))
            main_of[id(p)] = sh
        copies: dict[tuple[str, int], int] = {}
        for param_key, shard, mod in self.module.local_cores():
            n = copies[(param_key, shard)] = copies.get((param_key, shard), -1) + 1
            if n == 0:
                continue  # the main copy, already in ``base``
            for name, p in sorted(mod.core.named_parameters()):
                sh = base[f"model/{param_key}/{name}"]
                rid = tuple(sh.replica_id) if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
                out.append((f"model/{param_key}/{name}#copy{n}", p,
                            replace(sh, data=p.data.view(sh.local_shape), replica_id=(*rid, n))))
        return out

    def _mimo_entries(self) -> list[tuple[str, torch.nn.Parameter | None, object]]:
        """Under a MIMO model: megatron.core's own entries of every local holder (:mod:`..checkpoint.mimo_keys`),
        whose data are the parameters themselves; an ``_extra_state`` object has no parameter."""
        out = []
        for key, shard, tp, idx, copy, layer in local_holders(self.module):
            for name, entry in holder_state(layer, key, shard, tp, idx, None, True, copy=copy).items():
                out.append((name + (f"#copy{copy}" if copy else ""), None if is_object(entry) else entry.data, entry))
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's ``MegatronModule.sharded_state_dict`` contract, keys prefixed with ``prefix``.

        Each value's data is the parameter object itself (Megatron's optimizer finds its state by
        ``id(param)``): a ``ShardedTensor`` when the stored layout is the parameter's shape, else a
        ``ShardedTensorFactory`` that views the parameter (or an optimizer state of its shape) as the stored
        block. ``metadata`` (Megatron's global DP group) is not used: replica ids come from the plan.
        """
        if sharded_offsets:
            raise ValueError(f"Spindle chunks take no pipeline offsets, got sharded_offsets={sharded_offsets!r}")
        out = {}
        for key, p, sh in self._entries():
            if p is None or not isinstance(sh, ShardedTensor) or sh.data is p:  # megatron.core's own entry
                out[prefix + key] = replace(sh, key=prefix + sh.key)
                continue
            if tuple(sh.local_shape) == tuple(p.shape):
                out[prefix + key] = replace(sh, key=prefix + sh.key, data=p)
                continue

            def build(k, data, replica_id, flattened_range, _sh=sh):
                return replace(_sh, key=k, data=data.view(_sh.local_shape), replica_id=replica_id,
                               dtype=data.dtype)

            def merge(loaded, _shape=tuple(p.shape)):
                return loaded.reshape(_shape)

            out[prefix + key] = ShardedTensorFactory(prefix + sh.key, p, build, merge, replica_id=sh.replica_id)
        return out

    def load_state_dict(self, state_dict, strict: bool = True):
        """Copy loaded tensors (keys as :meth:`sharded_state_dict` with no prefix) into the parameters."""
        every = self._entries()
        entries = {key: p for key, p, _ in every if p is not None}
        objects = {key for key, p, _ in every if p is None}  # an ``_extra_state``: nothing to copy
        missing = [k for k in entries if k not in state_dict]
        unexpected = [k for k in state_dict if k not in entries and k not in objects]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Spindle chunk state dict: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                               f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        with torch.no_grad():
            for k, p in entries.items():
                v = state_dict.get(k)
                if v is not None and v is not p and v.data_ptr() != p.data_ptr():
                    p.copy_(v.reshape(p.shape))
        return _IncompatibleKeys(missing, unexpected)


def spindle_chunk(model) -> MegatronModelChunk | None:
    """The :class:`MegatronModelChunk` in ``model`` (a list of chunks, or a chunk under wrappers), else None."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            return None
        model = model[0]
    seen = 0
    while not isinstance(model, MegatronModelChunk) and hasattr(model, "module") and seen < 8:
        model, seen = model.module, seen + 1
    return model if isinstance(model, MegatronModelChunk) else None


def megatron_forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int,
                              forward_only: bool = False, **kwargs) -> list[dict]:
    """:func:`.schedule.spindle_forward_backward` for Megatron's loop, plus what the loop expects around it.

    Accepts every keyword ``train_step``/``evaluate`` pass (core_v0.16.1: ``seq_length, micro_batch_size,
    decoder_seq_length, adjust_tensor_shapes_fn, force_all_reduce``; newer: ``p2p_communicator,
    pg_collection``). After a training call the gradients are synchronised and clipped by the global norm;
    the reports are moved to the model's device (NCCL all-reduces them) with every task on every rank.
    """
    chunk = spindle_chunk(model)
    if chunk is None:
        raise TypeError(f"the Spindle schedule needs one MegatronModelChunk per rank, got {type(model).__name__}")
    if not forward_only:
        chunk.module.trace.step = chunk.steps
        chunk.steps += 1
    reports = spindle_forward_backward(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                       model=[chunk], num_microbatches=num_microbatches,
                                       forward_only=forward_only, **kwargs)
    if not forward_only:
        chunk.clip_grads()
    device = chunk.report_device()
    return [{k: v.to(device) for k, v in r.items()} for r in reports]
