"""A MIMO workload from a user's provider and tasks file: the model built on the meta device, described, its graph.

:func:`load_source` is what ``spindle plan|compare|profile --model-provider`` and the training hooks'
``--spindle-model-provider`` call: it imports ``MODULE:FUNCTION``, calls it as Megatron does
(:func:`.mimo_build.call_provider`) under ``torch.device("meta")`` (:func:`..compat.mimo.meta_device`: no weight is
allocated, a 7B model plans on a laptop), with one-rank groups where megatron's parallel state is not initialised,
describes the model for the tasks (:mod:`.mimo_extract`) and makes it this process's MIMO model (the one whose
parts :mod:`.mimo_layers` builds). Loaded once per process and provider, tasks file and its modification time.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.utils import GlobalMemoryBuffer

from ..compat.cpu import apply_cpu_patches
from ..compat.mimo import meta_device
from ..log import get_logger
from ..mimo.describe import MimoDescription
from ..mimo.tasks import MimoTasks, load_tasks
from ..mimo.workload import MimoWorkload
from . import mimo_layers
from .megatron_state import ensure_megatron_globals
from .mimo_build import call_provider, load_provider, quiet, single_process_groups
from .mimo_extract import describe

log = get_logger(__name__)


@dataclass
class MimoSource:
    provider: str
    """``MODULE:FUNCTION``, or the name of a provider function given itself (a script's own provider)."""
    tasks: MimoTasks
    model: object
    """The provider's ``MimoModel`` on the meta device (its specs; no weights)."""
    description: MimoDescription
    function: object = None
    """The provider function."""

    def workload(self, *, task_count: int | None = None, batch: int | Mapping[str, int] | None = None,
                 freeze: Sequence[str] = ()) -> MimoWorkload:
        return MimoWorkload(self.description, self.tasks, task_count=task_count, batch=batch, freeze=tuple(freeze))


_LOADED: dict = {}


@contextlib.contextmanager
def _own_memory_buffer():
    """megatron's global memory buffer (local attention's scores) of its own for the meta forwards, the process's
    put back after: a cached meta tensor must never serve a real forward, and a buffer made here would stop a
    later ``initialize_model_parallel`` (Megatron-LM's own start-up)."""
    saved = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    try:
        yield
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = saved


def load_source(provider, tasks_file: str, *, say: bool = False) -> MimoSource:
    """The provider's model described for the tasks of ``tasks_file`` (module docstring): ``provider`` is
    ``MODULE:FUNCTION`` or the function itself (a training script's own provider, named by its module and name);
    ``say``: log the notes (encoders run whole, and why)."""
    tasks = load_tasks(tasks_file)
    fn = provider if callable(provider) else None
    if fn is not None:
        provider = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
    key = (provider, os.path.abspath(tasks_file), os.path.getmtime(tasks_file))
    src = _LOADED.get(key)
    if src is None:
        if not torch.cuda.is_available():
            apply_cpu_patches()  # megatron.core's CUDA assumptions, as every entry point applies them
        ensure_megatron_globals(memory_buffer=False)
        fn = fn or load_provider(provider)
        with meta_device(), single_process_groups(), quiet(), _own_memory_buffer():
            mimo = call_provider(fn, provider)
            description = describe(mimo, provider, tasks)
        src = MimoSource(provider=provider, tasks=tasks, model=mimo, description=description, function=fn)
        _LOADED.clear()
        _LOADED[key] = src
    mimo_layers.set_model(src.model, src.description, src.function)
    if say:
        for line in src.description.notes():
            log.info(f"note: {line}")
    return src
