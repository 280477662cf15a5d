"""What a pass keeps for backward: the activation stash, measured per slice and per phase.

Method: while a slice runs forward, ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd
saves for backward (the operators' own saves, megatron's checkpoint functions' ``save_for_backward``); at the
end of the phase's forward, when the stash is largest (the backward frees it), the meter adds up the bytes of
the distinct storages those tensors still hold. So:

* a tensor saved twice, or two views of one buffer, count once (by storage), in the first slice that saved it;
* parameters (and views of them: a linear layer saves its weight) are model state, not stash: left out;
* megatron's selective recompute frees the layer norms' outputs after use (``CheckpointWithoutOutput``
  resizes their storage to 0): they count 0, as they hold no memory until the backward recomputes them;
* a layer's input counts where it is saved (the layer's first operator, or the checkpoint of a fully
  recomputed layer), as in the planner's accounting
  (:func:`~megatron_spindle.planner.workload.memory.slice_activation_bytes`: a layer's input is part of its
  stash).

Not counted: the transient memory of the recomputation in backward (one layer's stash at a time), the messages
in flight and the gradients. The planner's estimate is of the same stash, in bf16 (2 bytes an element).
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
from torch import Tensor


def _storage(t: Tensor):
    st = t.untyped_storage()
    return st.data_ptr(), st


class StashMeter:
    """Bytes saved for backward, per slice and per phase, of the last pass measured (see the module doc).

    Args:
        params: the model's parameters (their storages are not stash).
    """

    def __init__(self, params: Iterable[Tensor]) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._saved: dict[str, list[Tensor]] = {}
        self.slice_bytes: dict[str, int] = {}
        """Slice name -> bytes it keeps for backward at the end of its phase's forward."""
        self.phase_bytes: dict[int, int] = {}
        """Phase -> bytes this rank keeps for backward at the end of the phase's forward."""

    @contextlib.contextmanager
    def slice(self, name: str):
        """Record what autograd saves while slice ``name`` runs forward."""
        saved = self._saved.setdefault(name, [])

        def pack(t: Tensor) -> Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def phase_done(self, phase: int) -> None:
        """The phase's forward ended: add up what its slices hold now; forget the tensors."""
        seen = set(self._params)
        total = 0
        for name, tensors in self._saved.items():
            n = 0
            for t in tensors:
                ptr, st = _storage(t)
                if ptr in seen or st.nbytes() == 0:
                    continue
                seen.add(ptr)
                n += st.nbytes()
            self.slice_bytes[name] = n
            total += n
        self.phase_bytes[phase] = total
        self._saved.clear()

    @property
    def peak_bytes(self) -> int:
        """The largest phase's stash of the last pass (a phase's is freed before the next one's exists)."""
        return max(self.phase_bytes.values(), default=0)
