"""Stand-ins that let megatron.core layers run on a machine without CUDA (tests, the CPU demo, CPU training).

Applied once, explicitly, by the entry points (the training launchers, the profiler, ``tests/conftest.py``
and the multi-process test harness): importing or building a model never patches anything.

megatron.core 0.16.1 assumes a GPU in a few places that our layers reach even with
``use_cpu_initialization=True`` and every fusion turned off. :func:`apply_cpu_patches` fixes exactly those,
once per process, and does nothing when ``torch.cuda.is_available()``. Each patch below says what it fixes
and which of our code paths reaches it; each was checked to be needed (megatron-core 0.16.1, torch 2.13 CPU):
without it a forward and backward of the tiny reference models fails ("Torch not compiled with CUDA
enabled" for the first three, and for the sixth once a layer recomputes its activations, "group should not be
None" / "global memory buffer is not initialized" for the two in ``ensure_megatron_globals``). The seventh is a
user's MIMO model's (``CLIPViTModel``'s ``.cuda()``), in the sibling :mod:`.mimo`, applied from here.

Not patched, because no layer built by :mod:`megatron_spindle.models.layers` reaches them: megatron optimizers
(the runtime uses torch optimizers), sequence parallelism. megatron.core's ``DistributedDataParallel``
(:mod:`megatron_spindle.runtime.grad_sync`) needs only patch 3: its gradient and parameter buffers are
allocated on ``torch.cuda.current_device()``.

:func:`megatron_spindle.models.megatron_state.ensure_megatron_globals` is separate and applies on GPUs too
(megatron's process-wide objects that ``initialize_model_parallel`` would make); on a CPU machine it
refuses to run before these stand-ins are applied, rather than applying them as a side effect.
"""
from __future__ import annotations

import contextlib
import functools

import megatron.core.tensor_parallel as tp_pkg
import torch
from megatron.core.fusions import fused_softmax
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer import utils as tutils

from .mimo import apply_cpu_patches as mimo_cpu_patches

_PATCHED = False

_MODEL_PARALLEL_RNG = "model-parallel-rng"


class CpuRNGStatesTracker:
    """megatron's ``CudaRNGStatesTracker`` interface over the CPU default generator.

    megatron forks the ``model-parallel-rng`` state around attention dropout
    (``DotProductAttention.forward``: ``get_cuda_rng_tracker().fork()``), which calls
    ``torch.cuda.get_rng_state``. This tracker keeps named CPU generator states instead; ``fork`` swaps the
    CPU default generator to the named state and back. One tracker per process, shared by every module.
    """

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _cpu_model_parallel_manual_seed(seed: int, *args, tp_rank: int | None = None,
                                    ep_rank: int | None = None, etp_rank: int | None = None,
                                    **kwargs) -> None:
    """CPU twin of megatron's ``model_parallel_cuda_manual_seed``: same seed offsets, CPU generator states.

    The original calls ``torch.cuda.manual_seed``. Ranks default to 0 rather than to the global parallel
    state, which we never initialise.
    """
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + (tp_rank or 0))
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + 1024 + 100 * (ep_rank or 0) + (etp_rank or 0))


@functools.lru_cache(maxsize=64)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """megatron's ``get_default_causal_mask`` builds the mask with ``device="cuda"``."""
    return _cpu_causal_mask(sq)


def _cpu_current_device() -> torch.device:
    """``torch.cuda.current_device()`` used as an allocation device by megatron.

    Reached by ``GlobalMemoryBuffer.get_tensor`` (the attention score buffer of the local
    ``DotProductAttention``) and by ``_gather_along_last_dim`` (``ColumnParallelLinear(gather_output=True)``
    with tp > 1: our adapters). Without CUDA it raises; we return the CPU device instead.
    """
    return torch.device("cpu")


def _cpu_synchronize(device=None) -> None:
    """No CUDA stream to wait for on a CPU-only process."""


class _CpuStream:
    """What megatron.core's gradient buckets ask of ``torch.cuda.current_stream()``: on a CPU-only process every
    operation is already ordered, so waiting on an event or a stream is a no-op."""

    def wait_event(self, event=None) -> None:
        """Nothing to wait for."""

    def wait_stream(self, stream=None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


_CPU_STREAM = _CpuStream()


def _cpu_current_stream(device=None) -> _CpuStream:
    """``torch.cuda.current_stream()`` (megatron-core 0.19's ``start_grad_sync`` waits on CUDA-graph events)."""
    return _CPU_STREAM


def _cpu_get_cuda_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """megatron's ``_get_cuda_rng_state`` without CUDA: no CUDA generator, an empty state."""
    return torch.empty(0, dtype=torch.uint8)


def _cpu_set_cuda_rng_state(new_state=None, device: int = -1, graph_safe: bool = False) -> None:
    """megatron's ``_set_cuda_rng_state`` without CUDA: nothing to restore."""


def apply_cpu_patches() -> bool:
    """Patch megatron.core for a CPU-only process; idempotent. Returns whether patches are in place.

    Does nothing (and returns False) when CUDA is available.
    """
    global _PATCHED
    if torch.cuda.is_available():
        return False
    if _PATCHED:
        return True
    # 1. RNG tracker: DotProductAttention forks "model-parallel-rng" around dropout; the stock tracker
    #    reads and writes CUDA generator states. Install a CPU tracker as the process-wide one and seed
    #    it with the CPU twin of model_parallel_cuda_manual_seed.
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.model_parallel_cuda_manual_seed = _cpu_model_parallel_manual_seed
    tp_pkg.model_parallel_cuda_manual_seed = _cpu_model_parallel_manual_seed

    # 2. Causal mask: FusedScaleMaskSoftmax.forward_torch_softmax builds it with device="cuda" when a
    #    causal self-attention gets attention_mask=None (text encoder, LLM, decoder self-attention).
    tutils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask

    # 3. Allocation device: GlobalMemoryBuffer (local attention) and all-gathers along the last dim
    #    allocate on torch.cuda.current_device().
    torch.cuda.current_device = _cpu_current_device

    # 4. Checkpoints: dist_checkpointing's file writer calls torch.cuda.synchronize() before staging
    #    tensors, unconditionally; without CUDA there is nothing to wait for.
    torch.cuda.synchronize = _cpu_synchronize

    # 5. Gradient buckets: megatron-core 0.19's _ParamAndGradBucketGroup.start_grad_sync takes
    #    torch.cuda.current_stream() to wait for CUDA-graph replay events before reducing (0.16.1 does not);
    #    our DDP instances (runtime/grad_sync.py) reach it on every step.
    torch.cuda.current_stream = _cpu_current_stream

    # 6. Activation recompute: megatron's CheckpointFunction (tensor_parallel.checkpoint: full recompute, the
    #    MLP of selective recompute) and CheckpointWithoutOutput (the layer norms of selective recompute) save
    #    and restore every RNG state around the recomputed forward: the CPU generator's (torch.get_rng_state),
    #    the tracker's named states (our CPU tracker above) and the CUDA generator's, which is what fails here.
    #    Without CUDA there is no CUDA generator to save: an empty state, restored as nothing.
    mrandom._get_cuda_rng_state = _cpu_get_cuda_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_cuda_rng_state

    # 7. MIMO: CLIPViTModel.__init__ moves its position ids with .cuda() (:mod:`.mimo`).
    mimo_cpu_patches()

    _PATCHED = True
    return True


def patches_applied() -> bool:
    """Whether :func:`apply_cpu_patches` has patched this process."""
    return _PATCHED
