"""Stand-ins for building and running a user's ``MimoModel`` (``megatron.core.models.mimo``) where megatron.core
assumes CUDA, and for building one on the meta device (a plan on a machine without a GPU).

Seen on megatron-core 0.16.1 and 0.19.2 alike (the vision model's code is the same file in both):

7. (without CUDA) ``megatron.core.models.vision.clip_vit_model.CLIPViTModel.__init__`` moves its position ids with
   ``torch.arange(...).cuda()`` ("Torch not compiled with CUDA enabled" on a CPU build): :func:`apply_cpu_patches`
   wraps that ``__init__`` so that ``Tensor.cuda`` inside it keeps the tensor where it is. Applied by
   :func:`megatron_spindle.compat.cpu.apply_cpu_patches` (the seventh of its patches), only without CUDA.

Not seen: the submodules' ``encode`` asking ``torch.cuda.current_device()`` (0.16.1 and 0.19.2 allocate nothing
there; 0.19.2's ``MimoModel._empty_encoder_output``, which does, runs only for non-colocated grids, which Spindle
never builds); where megatron.core does allocate on ``torch.cuda.current_device()`` (its layers without
``use_cpu_initialization``), :mod:`.cpu` patch 3 answers the CPU.

Without CUDA, for a MIMO model trained by Megatron-LM's own loop (``SPINDLE=0``, :func:`apply_megatron_ddp_standins`;
Spindle's runs never wrap a model in Megatron's DDP):

8. ``megatron.training.training.get_model`` (0.19.2) wraps the model chunks in megatron.core's
   ``DistributedDataParallel`` inside a dedicated stream, ``torch.cuda.Stream()`` and ``torch.cuda.stream(s)``,
   which fail without a CUDA driver: a stream whose waits are no-ops and a null context (a CPU-only process runs
   every operation in order).
9. ``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (both lines; Megatron's optimizer imports
   it by name) asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``: inside it a CPU float32 tensor's
   ``type()`` answers that name (its ``device="cuda"`` buffer is the CPU's under Megatron-LM's stand-in 7,
   :func:`.megatron_lm.cuda_on_cpu`).

On every machine, for planning (:func:`meta_device`): a provider is called under ``torch.device("meta")`` so that no
weight is allocated; megatron.core's explicit devices (``device=torch.cuda.current_device()``) would still allocate,
and ``.cuda()`` cannot copy a meta tensor, so inside the context ``torch.cuda.current_device()`` answers the meta
device and ``Tensor.cuda`` keeps a meta tensor on the meta device.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from megatron.core.models.vision import clip_vit_model
from megatron.core.optimizer import clip_grads, optimizer
from torch.overrides import TorchFunctionMode

_PATCHED = False


def apply_cpu_patches() -> bool:
    """Stand-in 7 (module docstring); idempotent; nothing when CUDA is available. Returns whether it is in place."""
    global _PATCHED
    if torch.cuda.is_available():
        return False
    if _PATCHED:
        return True
    original = clip_vit_model.CLIPViTModel.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        with _cuda_keeps_tensors():
            original(self, *args, **kwargs)

    clip_vit_model.CLIPViTModel.__init__ = __init__
    _PATCHED = True
    return True


@contextlib.contextmanager
def _cuda_keeps_tensors():
    """``Tensor.cuda`` returns the tensor itself (CPU-only process: there is no GPU to move it to)."""
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


@contextlib.contextmanager
def meta_device():
    """Build modules without allocating their weights (see the module docstring); restores everything on exit."""
    cuda, current = torch.Tensor.cuda, torch.cuda.current_device

    def keep_meta(self, *args, **kwargs):
        return self if self.is_meta else cuda(self, *args, **kwargs)

    torch.Tensor.cuda = keep_meta
    torch.cuda.current_device = lambda: torch.device("meta")
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.Tensor.cuda, torch.cuda.current_device = cuda, current


class _CpuStream:
    """``torch.cuda.Stream`` without CUDA: every operation of a CPU-only process is already in order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream=None) -> None:
        """Nothing to wait for."""

    def wait_event(self, event=None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


def _cpu_stream_context(stream=None):
    """``torch.cuda.stream(s)`` without CUDA: nothing to switch to."""
    return contextlib.nullcontext()


class _CudaFloatName(TorchFunctionMode):
    """``Tensor.type()`` of a CPU float32 tensor answers ``torch.cuda.FloatTensor`` (stand-in 9)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].dtype == torch.float32 \
                and args[0].device.type == "cpu":
            return "torch.cuda.FloatTensor"
        return func(*args, **(kwargs or {}))


_DDP_PATCHED = False


def apply_megatron_ddp_standins() -> bool:
    """Stand-ins 8 and 9 (module docstring); idempotent; nothing when CUDA is available."""
    global _DDP_PATCHED
    if torch.cuda.is_available():
        return False
    if not _DDP_PATCHED:
        torch.cuda.Stream = _CpuStream
        torch.cuda.stream = _cpu_stream_context
        original = clip_grads.clip_grad_by_total_norm_fp32

        @functools.wraps(original)
        def clip_grad_by_total_norm_fp32(*args, **kwargs):
            with _CudaFloatName():
                return original(*args, **kwargs)

        clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
        optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
        _DDP_PATCHED = True
    return True
