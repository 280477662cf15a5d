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

On every machine, for planning (:func:`meta_device`): a provider is called under ``torch.device("meta")`` so that no
weight is allocated; megatron.core's explicit devices (``device=torch.cuda.current_device()``) would still allocate,
and ``.cuda()`` cannot copy a meta tensor, so inside the context ``torch.cuda.current_device()`` answers the meta
device and ``Tensor.cuda`` keeps a meta tensor on the meta device.
"""
from __future__ import annotations

import contextlib
import functools

import torch

_PATCHED = False


def apply_cpu_patches() -> bool:
    """Stand-in 7 (module docstring); idempotent; nothing when CUDA is available. Returns whether it is in place."""
    global _PATCHED
    if torch.cuda.is_available():
        return False
    if _PATCHED:
        return True
    from megatron.core.models.vision import clip_vit_model

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
