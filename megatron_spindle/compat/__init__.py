"""Compatibility stand-ins and version differences, applied explicitly at entry points and never on import.

* :mod:`.cpu`: megatron.core's CUDA assumptions on a CPU-only machine (:func:`apply_cpu_patches`);
* :mod:`.mimo`: a user's MIMO model on a CPU-only machine (applied with :mod:`.cpu`'s), under Megatron-LM's loop
  without Spindle, and built on the meta device for planning (:func:`~.mimo.meta_device`);
* :mod:`.megatron_lm`: Megatron-LM's CUDA-only start-up (``megatron.training``) on CPU ranks
  (:func:`~.megatron_lm.apply_cpu_standins`);
* :mod:`.mcore`: the differences between the supported megatron-core lines (0.16.1 on Python 3.11, 0.19.x on
  Python 3.12), detected by feature, not by version number, and a defect of both that selective activation
  recompute reaches without TransformerEngine.

Each stand-in names what it replaces and is applied only where it is needed (no CUDA).
"""
from .cpu import apply_cpu_patches, patches_applied

__all__ = ["apply_cpu_patches", "patches_applied"]
