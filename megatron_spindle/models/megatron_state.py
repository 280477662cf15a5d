"""megatron.core's process-wide objects, made without ``initialize_model_parallel`` (on GPUs too).

Every Spindle module gets its process groups explicitly, so megatron's global parallel state is never
initialised; the two process-wide objects megatron would have created there are made here, once, before
the first layer is built: the global memory buffer and the RNG tracker's states. :func:`_patch_group_passthrough`
lets an explicit one-rank tp group through in a process without ``torch.distributed`` (reference models).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core import tensor_parallel as mtp
from megatron.core import utils as mutils

from ..compat.cpu import patches_applied
from .blocks import LocalGroup

_MODEL_PARALLEL_RNG = "model-parallel-rng"

_GROUP_PASSTHROUGH = False
#: While true (``models.mimo_build.single_process_groups``: a user's provider run in one process), a module built
#: without a tp group and without megatron's parallel state gets this rank alone.
ONE_RANK_DEFAULT = [False]


def _patch_group_passthrough() -> None:
    """Keep explicit tp groups when torch.distributed is not initialised (any device).

    ``megatron.core.utils.get_tensor_model_parallel_group_if_none(group)`` returns None whenever
    torch.distributed is not initialised, even when a group was passed; Row/ColumnParallelLinear and the
    region mappings then assert on the None group. A single-process model (the reference model, unit
    tests) passes a one-rank stand-in group, which this patch lets through; while :data:`ONE_RANK_DEFAULT` is set,
    a missing group is this rank alone. Every megatron module that imported the function by name gets the
    patched one.
    """
    global _GROUP_PASSTHROUGH
    if _GROUP_PASSTHROUGH:
        return

    orig = mutils.get_tensor_model_parallel_group_if_none

    def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
        if tp_group is not None and not dist.is_initialized():
            return tp_group
        if tp_group is None and ONE_RANK_DEFAULT[0] and not parallel_state.is_initialized():
            return LocalGroup()
        return orig(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, orig.__name__, None) is orig:
            setattr(module, orig.__name__, get_tensor_model_parallel_group_if_none)
    _GROUP_PASSTHROUGH = True


def ensure_megatron_globals(*, seed: int = 1234, tp_rank: int = 0, memory_buffer: bool = True) -> None:
    """Create megatron's process-wide objects that ``initialize_model_parallel`` would have made.

    * the global memory buffer (``parallel_state._set_global_memory_buffer()``): the local
      ``DotProductAttention`` takes its score buffer from it;
    * the RNG tracker states (``model_parallel_cuda_manual_seed``): attention forks ``model-parallel-rng``.
      Attention dropout (``--attention-dropout``) draws from it; ``tp_rank`` follows megatron's offsets.

    ``memory_buffer=False``: not the buffer (a process whose ``initialize_model_parallel`` comes later, and
    refuses a buffer made before it). Idempotent. Without CUDA, :func:`megatron_spindle.compat.apply_cpu_patches` must have run first (entry
    points call it): seeding megatron's RNG tracker would otherwise call ``torch.cuda``.
    """
    if not torch.cuda.is_available() and not patches_applied():
        raise RuntimeError("megatron.core needs CUDA stand-ins on this CPU-only machine: call "
                           "megatron_spindle.compat.apply_cpu_patches() once at start (the launchers, the "
                           "profiler and the tests do)")
    _patch_group_passthrough()
    if memory_buffer and parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    tracker = mtp.get_cuda_rng_tracker()
    if _MODEL_PARALLEL_RNG not in tracker.get_states():
        mtp.random.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)


def seed_rng(seed: int) -> None:
    """``--seed`` for a run, as Megatron-LM's ``_set_random_seed``: torch's generator (hidden dropout) and
    megatron's RNG tracker (attention dropout), reset, at the global tensor-parallel rank 0 (Spindle's global
    TP is 1), so a run's dropout masks depend on the seed alone. Needs :func:`ensure_megatron_globals`'s
    conditions (CUDA, or the CPU stand-ins)."""
    torch.manual_seed(seed)
    mtp.random.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)
