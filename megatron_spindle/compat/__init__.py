"""Compatibility stand-ins, applied explicitly at entry points and never on import.

* :mod:`.cpu`: megatron.core's CUDA assumptions on a CPU-only machine (:func:`apply_cpu_patches`).

Each stand-in names what it replaces and is applied only where it is needed (no CUDA).
"""
from .cpu import apply_cpu_patches, patches_applied

__all__ = ["apply_cpu_patches", "patches_applied"]
