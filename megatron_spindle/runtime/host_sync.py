"""How often the host waits for the device in a training step.

On a GPU the host queues kernels and runs ahead; a call that needs a value computed on the device (a loss read
with ``float(t)``, ``.item()`` or ``.tolist()``, a copy to the host) or a copy from pageable host memory makes
it wait until the GPU has caught up, and the overlap of transfers and compute that the plan assumes goes. The
runtime keeps such waits to a small number per step that does not grow with tasks, passes or slices (the
losses reduced as one tensor and read once, the gradient norm read once, the stop flag read once; each
pass's inputs copied from pinned memory without waiting). :class:`HostSyncCounter` counts them:

* **on a GPU**, torch's own sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``): every CUDA call that
  synchronises the host with the device warns ("called a synchronizing CUDA operation"), whoever makes it
  (this package, megatron.core, torch); the counter captures those warnings while it counts and passes the
  others on;
* **on the CPU**, where there is no device to wait for, the calls that would wait on a GPU: a value read from
  a tensor (``item``, ``tolist``, ``numpy``, ``cpu``, ``float()``, ``int()``, ``bool()``) by this package's
  own code, its data loading excepted (those tensors live on the host anyway). torch's and megatron's own
  reads are not seen here (AdamW reads its ``step``, a CPU tensor, on every device): the GPU count has them.

Counting is on only inside :meth:`HostSyncCounter.counting`; the trainer counts each iteration's step and its
stop agreement, and its final JSON line reports ``host_syncs_per_step``.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter

import torch

#: Tensor methods that read a value on the host (a device-to-host copy and a wait on a GPU).
READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__")
#: torch's warning for a synchronizing CUDA call under ``set_sync_debug_mode("warn")``.
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"

_active: "HostSyncCounter | None" = None
_originals: dict[str, object] = {}


def _counted_frame(depth: int = 2) -> str | None:
    """``module:line`` of the caller when it is this package's own code (its data loading excepted)."""
    frame = sys._getframe(depth)
    name = frame.f_globals.get("__name__", "")
    if not name.startswith("megatron_spindle.") or name == __name__:
        return None
    if name.startswith("megatron_spindle.data.") or name.endswith(".data"):
        return None
    return f"{name}:{frame.f_lineno}"


def _wrap(method: str):
    original = _originals[method]

    def read(self, *args, **kwargs):
        counter = _active
        if counter is not None:
            site = _counted_frame()
            if site is not None:
                counter.sites[f"{method} at {site}"] += 1
                counter.total += 1
        return original(self, *args, **kwargs)

    read.__name__ = getattr(original, "__name__", method)
    read.__doc__ = getattr(original, "__doc__", None)
    return read


def _install() -> None:
    if _originals:
        return
    for method in READS:
        _originals[method] = getattr(torch.Tensor, method)
    for method in READS:
        setattr(torch.Tensor, method, _wrap(method))


def uninstall() -> None:
    """Restore the tensor methods (the CPU counter's patches)."""
    for method, original in _originals.items():
        setattr(torch.Tensor, method, original)
    _originals.clear()


class HostSyncCounter:
    """Host waits for the device on ``device`` (see the module docstring).

    ``total``: waits counted so far; ``sites``: per call site (CPU) or per warning location (GPU);
    ``per_step``: the count of each step closed by :meth:`end_step`.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.total = 0
        self.sites: Counter = Counter()
        self.per_step: list[int] = []
        self._step_start = 0

    @contextlib.contextmanager
    def counting(self):
        """Count the host's waits inside the block."""
        global _active
        if self.cuda:
            previous = torch.cuda.get_sync_debug_mode()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield self
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            for w in caught:
                if CUDA_SYNC_WARNING in str(w.message):
                    self.total += 1
                    self.sites[f"{w.filename}:{w.lineno}"] += 1
                else:  # someone else's warning: pass it on
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
            return
        _install()
        outer, _active = _active, self
        try:
            yield self
        finally:
            _active = outer

    def end_step(self) -> int:
        """Close a step: its count (waits since the previous :meth:`end_step`)."""
        n = self.total - self._step_start
        self._step_start = self.total
        self.per_step.append(n)
        return n

    def most(self) -> int | None:
        """The largest count of a step (None before any step)."""
        return max(self.per_step) if self.per_step else None
