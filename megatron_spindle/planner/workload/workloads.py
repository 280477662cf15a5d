"""The built-in multi-task models, now spec files shipped in the package, and the task graphs built from them.

The models are described in ``megatron_spindle/specs/<name>.toml`` (schema: ``docs/model_spec.md``, parser:
:mod:`.spec`); this module keeps the entry points the planner, runtime and scripts call:
:func:`build_graph` takes a shipped model's name or the path of a user's spec file.

* ``multitask-clip``: ImageBind structure. One transformer encoder per modality (vision, text, audio, depth,
  thermal, IMU) with a patch/token embedding, a pool head (CLS, or EOS for text) with a projection, and one
  symmetric InfoNCE loss per task pairing two modalities. 4, 7 or 10 tasks.
* ``qwen-val``: ViT-bigG-style vision encoder, one-layer cross-attention adapter (256 queries), Whisper-large
  style audio encoder with a pooling projection, Qwen-7B-style decoder LLM. Tasks vision-language,
  audio-language, language; next-token loss on the text tokens.
* ``ofasys``: light modality adaptors (ViT adaptor 768 × 9 layers for images and video, a 6-layer audio
  adaptor, embeddings for text) feeding a shared 12-layer encoder and a 12-layer decoder, with a
  next-token loss. 4 or 7 tasks.

``size="tiny"`` picks each spec's ``[sizes.tiny]`` overrides (same structure, same task list) for CPU tests
and the demo. ``tests/test_model_spec.py`` proves the graphs equal those the former Python definitions built.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .graph import TaskGraph
from .spec import SIZE_FULL, load_spec, shipped_models


class _Workloads(Mapping):
    """``{model name: (allowed task counts, default global batch per task)}`` of the shipped specs."""

    def __getitem__(self, name: str) -> tuple[tuple[int, ...], int]:
        if name not in shipped_models():
            raise KeyError(name)
        spec = load_spec(name)
        return spec.task_counts, spec.batch

    def __iter__(self):
        return iter(shipped_models())

    def __len__(self) -> int:
        return len(shipped_models())


WORKLOADS: Mapping[str, tuple[tuple[int, ...], int]] = _Workloads()
SIZES = (SIZE_FULL, "tiny")


def task_counts(model: str) -> tuple[int, ...]:
    """Allowed ``--tasks`` values of a shipped model name or a spec file."""
    return load_spec(model).task_counts


def build_graph(model: str, *, tasks: int | None = None, size: str = SIZE_FULL,
                batch: int | Mapping[str, int] | None = None, passes: int | None = None,
                freeze: Sequence[str] = ()) -> TaskGraph:
    """The task graph of one pass of a model: a shipped model's name (``multitask-clip``) or a spec file's path.

    ``tasks`` picks how many tasks (default: the largest allowed; the first K are trained); ``batch`` is the
    global batch per task per optimizer step, one number for all tasks or a mapping task -> batch (default:
    the spec's); a pass holds ``batch / passes`` of it (``passes``: default the spec's when ``batch`` is not
    given, else 1; see :func:`resolve_passes`); ``freeze`` names modules or components whose weights do not
    train (``--spindle-freeze``, :meth:`.spec.ModelSpec.frozen_modules`).
    """
    return load_spec(model).build_graph(tasks=tasks, size=size, batch=batch, passes=passes, freeze=freeze)


def resolve_passes(model: str, *, size: str = SIZE_FULL, batch=None, passes: int | None = None) -> int:
    """Passes per optimizer step that :func:`build_graph` uses for these arguments."""
    return load_spec(model).resolve_passes(size, batch, passes)
