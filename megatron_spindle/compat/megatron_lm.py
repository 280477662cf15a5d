"""CPU stand-ins for Megatron-LM's CUDA-only start-up, so its own ``pretrain`` runs on gloo CPU ranks.

Megatron-LM's training loop assumes a GPU in a handful of start-up steps; past those, ``train_step``,
``evaluate``, checkpointing and logging run on the CPU with our hooks. :func:`apply_cpu_standins` replaces
exactly those steps, once per process, and **does nothing when CUDA is available**. Each stand-in names
the function it replaces and why. Steps 1-5 fail without their stand-in at Megatron-LM tag ``core_v0.16.1``;
with megatron-core 0.19.2's ``megatron.training`` (and a ``core_v0.19.0`` checkout) 1, 2, 6 and 7 fail
without theirs, and all seven are applied on both lines:

1. ``megatron.training.initialize.initialize_megatron`` asserts ``torch.cuda.is_available()`` unless
   ``allow_no_cuda``: called with ``allow_no_cuda=True``.
2. ``megatron.training.initialize._initialize_distributed`` creates the process group with
   ``--distributed-backend`` (default nccl) and initialises Megatron's parallel state only when
   ``torch.cuda.device_count() > 0`` (``_set_random_seed`` then asserts on the missing pipeline group):
   the backend is set to gloo, and after the original runs, ``initialize_model_parallel`` is called with
   the run's (all 1) parallel sizes.
3. ``megatron.core.datasets.utils.compile_helpers`` runs ``make`` for the C++ dataset index builder
   (needs pybind11 and a compiler with the ``python3`` on PATH); Spindle feeds data through
   ``--dataloader-type external`` and never builds Megatron datasets: a no-op.
4. ``megatron.legacy.fused_kernels.load`` (0.16.1 only) compiles CUDA kernels with nvcc: a no-op.
5. ``megatron.training.training.set_jit_fusion_options`` warms the fused bias-GeLU/-dropout kernels up on
   ``device="cuda"`` tensors: a no-op (nothing to warm up without CUDA).
6. ``torch.cuda.get_rng_state`` / ``torch.cuda.set_rng_state``, called by the rerun state machine
   (``RerunStateMachine._save_state``/``_restore_state``) and by checkpointing (``get_rng_state`` when
   saving, the RNG restore when loading): there is no CUDA generator, so the getter returns the CPU
   generator's state (a valid byte tensor to store) and the setter leaves the CPU generator alone (Megatron
   restores it from ``random_rng_state``/``rng_state`` itself).
7. ``device="cuda"`` allocations and ``.cuda()`` moves in ``megatron.training.training`` itself (0.19:
   start-time tensors in ``pretrain``, the loss dictionaries of ``training_log`` and ``evaluate``, the
   train/valid/test flags, ``get_model``'s ``model_module.cuda(...)``): :func:`cuda_on_cpu`, a
   ``TorchFunctionMode`` around the ``pretrain`` call, turns a CUDA device into the CPU. It cannot reach code
   inside autograd Functions, which is why megatron.core's own allocations keep their patches below.

On every machine, GPU included (:func:`apply_wheel_standins`): megatron-core wheels (0.16.1 to 0.19.2) ship the
C++ dataset helpers prebuilt (``megatron/core/datasets/helpers_cpp*.so``) and no ``Makefile``, but Megatron-LM's
``initialize._compile_dependencies`` still runs ``compile_helpers`` (``make -C .../megatron/core/datasets``) on
rank 0, which fails there ("No targets specified and no makefile found") and exits the run. Where that folder
has no Makefile, ``compile_helpers`` is replaced by an import of the prebuilt module (nothing to compile); a
checkout with its Makefile keeps Megatron's own step.

Also needed, and applied with them: :func:`megatron_spindle.compat.cpu.apply_cpu_patches` (megatron.core's
own CUDA allocations: RNG tracker, causal mask, ``torch.cuda.current_device``, ``torch.cuda.synchronize``).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
from megatron.core import parallel_state as mpu
from megatron.core.datasets import utils as dataset_utils
from torch.overrides import TorchFunctionMode

from .cpu import apply_cpu_patches

_APPLIED = False


def apply_cpu_standins() -> bool:
    """Install the stand-ins above when there is no CUDA; idempotent. Returns whether they are in place."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    apply_cpu_patches()
    import megatron.training.initialize as init  # optional: megatron.training (the stand-ins patch it)
    import megatron.training.training as training  # optional: megatron.training (the stand-ins patch it)

    # 1. initialize_megatron: the CUDA assert (training.py imported the function by name)
    original_init = init.initialize_megatron

    @functools.wraps(original_init)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    init.initialize_megatron = initialize_megatron
    training.initialize_megatron = initialize_megatron

    # 2. _initialize_distributed: gloo, then the parallel state that is made only when CUDA devices exist
    original_dist = init._initialize_distributed

    @functools.wraps(original_dist)
    def _initialize_distributed(*args, **kwargs):
        args_ = init.get_args()
        args_.distributed_backend = "gloo"
        out = original_dist(*args, **kwargs)
        if not mpu.model_parallel_is_initialized():
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=args_.tensor_model_parallel_size,
                pipeline_model_parallel_size=args_.pipeline_model_parallel_size,
                context_parallel_size=args_.context_parallel_size,
                expert_model_parallel_size=args_.expert_model_parallel_size,
                distributed_timeout_minutes=args_.distributed_timeout_minutes)
        return out

    init._initialize_distributed = _initialize_distributed

    # 3. compile_helpers: imported inside _compile_dependencies from the module, so patch the module
    dataset_utils.compile_helpers = _no_compile_helpers

    # 4. fused kernels (0.16.1's initialize imports megatron.legacy.fused_kernels)
    fused = getattr(init, "fused_kernels", None)
    if fused is not None:
        fused.load = _no_fused_kernels

    # 5. JIT fusion warm-up on CUDA tensors
    training.set_jit_fusion_options = _no_jit_warmup

    # 6. CUDA generator state for the rerun state machine and checkpoints
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    _APPLIED = True
    return True


def apply_wheel_standins() -> bool:
    """Stand in for ``compile_helpers`` where the installed megatron-core has no Makefile to run (a wheel), with or
    without CUDA; idempotent. Returns whether the stand-in is in place."""
    if os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")):
        return False
    dataset_utils.compile_helpers = _prebuilt_helpers
    return True


def _prebuilt_helpers() -> None:
    """Stands in for ``megatron.core.datasets.utils.compile_helpers`` where the wheel ships the helpers built and
    no Makefile: imports them (Spindle's data never uses them; a missing build is said, not fatal)."""
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401  # optional: the wheel's prebuilt dataset helpers
    except ImportError as e:
        print(f"note: megatron.core.datasets.helpers_cpp is not built here ({e}) and there is no Makefile to "
              f"build it: Megatron's own datasets would fail; Spindle's data does not use them", flush=True)


def _no_compile_helpers() -> None:
    """Stands in for ``megatron.core.datasets.utils.compile_helpers`` (Megatron datasets are not used)."""


def _no_fused_kernels(args=None) -> None:
    """Stands in for ``megatron.legacy.fused_kernels.load`` (CUDA kernels; nothing to load on a CPU)."""


def _no_jit_warmup(*args, **kwargs) -> None:
    """Stands in for ``megatron.training.training.set_jit_fusion_options`` (warms CUDA kernels up)."""


def _cpu_get_rng_state(device="cuda") -> torch.Tensor:
    """Stands in for ``torch.cuda.get_rng_state`` without CUDA: the CPU generator's state."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device="cuda") -> None:
    """Stands in for ``torch.cuda.set_rng_state`` without CUDA: no CUDA generator to set."""


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaOnCpu(TorchFunctionMode):
    """Maps every ``device=cuda`` keyword, ``.to(cuda)`` and ``.cuda()`` to the CPU (stand-in 7)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            kwargs.pop("device", None), kwargs.pop("non_blocking", None)
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def cuda_on_cpu():
    """Stand-in 7 as a context manager: active only without CUDA (else a null context)."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return _CudaOnCpu()
