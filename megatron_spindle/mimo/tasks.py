"""The tasks of a MIMO model: a TOML file (``--tasks-file`` for ``spindle plan|compare|profile``,
``--spindle-tasks-file`` for training), read with the standard library's ``tomllib``.

A ``MimoModel`` says which modules exist; the tasks say what is trained with them::

    [[tasks]]
    name = "image-text"
    modalities = ["images"]   # keys of modality_submodules_spec; the language model is in every task
    batch = 64                # global samples per optimizer step
    # seq_length = 512        # tokens per sample (default: the language model's max_sequence_length)
    # weight = 1.0            # the task loss's weight in the total loss (default 1)

    [inputs.audio.whisper]    # an encoder's forward keywords and their per-sample shapes, where Spindle
    input_features = [80, 3000]   # cannot read them off the model (every encoder but CLIPViTModel)

An empty ``modalities`` is a text-only task; one task is a valid workload. Pure Python: every error is one line
``<file>: <key> = <value>: <problem>`` (:class:`TasksError`, a ``ValueError``); whether a modality exists is
checked against the model when the graph is built (:mod:`.graph`).
"""
from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass
from typing import Any

from ..planner.limits import MAX_TASKS, SPEC_LIMITS
from ..planner.workload.spec_layers import NAME_RE, NO_VALUE, SpecError

_TASK_KEYS = ("name", "modalities", "batch", "seq_length", "weight")


class TasksError(SpecError):
    """A bad tasks file: one line naming the file, the key and the value."""


@dataclass(frozen=True, kw_only=True)
class MimoTask:
    """One training objective over the model: some modalities and the language model."""

    name: str
    modalities: tuple[str, ...]
    """Modalities whose encoders feed the language model, in the order their tokens come in each sample."""
    batch: int
    """Global samples per optimizer step."""
    seq_length: int = 0
    """Tokens per sample in the language model (0: its ``max_sequence_length``)."""
    weight: float = 1.0


@dataclass(frozen=True, kw_only=True)
class MimoTasks:
    """A parsed tasks file."""

    file: str
    tasks: tuple[MimoTask, ...]
    inputs: dict
    """``{modality: {encoder: {keyword: per-sample shape}}}`` from ``[inputs]``."""

    def task(self, name: str) -> MimoTask:
        return next(t for t in self.tasks if t.name == name)


def _need_int(file: str, key: str, v: Any, cap_name: str) -> int:
    cap, what = SPEC_LIMITS.get(cap_name, (None, ""))
    if type(v) is not int or v <= 0 or (cap is not None and v > cap):
        raise TasksError(file, key, v, "must be a positive integer" + (f" (at most {cap} {what})" if cap else ""))
    return v


def parse_tasks(text: str, file: str) -> MimoTasks:
    """Parse and check a tasks file's text (``file`` names it in errors)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TasksError(file, "(syntax)", NO_VALUE, f"invalid TOML: {e}") from None
    for k in doc:
        if k not in ("tasks", "inputs"):
            raise TasksError(file, k, doc[k] if not isinstance(doc[k], dict) else NO_VALUE,
                             "unknown top-level key; keys: tasks (a [[tasks]] list), inputs")
    raw = doc.get("tasks")
    if not isinstance(raw, list) or not raw or not all(isinstance(t, dict) for t in raw):
        raise TasksError(file, "tasks", raw if raw is not None else NO_VALUE,
                         "missing: at least one [[tasks]] table (name, modalities, batch)")
    if len(raw) > MAX_TASKS:
        raise TasksError(file, "tasks", NO_VALUE, f"{len(raw)} tasks: the planner accepts 1 to {MAX_TASKS}")
    tasks, seen = [], set()
    for i, t in enumerate(raw):
        where = f"tasks[{i}]"
        for k, v in t.items():
            if k not in _TASK_KEYS:
                raise TasksError(file, f"{where}.{k}", v, f"unknown key; keys: {', '.join(_TASK_KEYS)}")
        name = t.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name) or len(name) > 64:
            raise TasksError(file, f"{where}.name", name if name is not None else NO_VALUE,
                             "a task name must be ASCII letters, digits, '_' and '-' (starting with a letter or digit, "
                             "at most 64 characters)")
        if name in seen:
            raise TasksError(file, f"{where}.name", name, "another task has this name")
        seen.add(name)
        mods = t.get("modalities")
        if not isinstance(mods, list) or not all(isinstance(m, str) and m for m in mods):
            raise TasksError(file, f"{where}.modalities", mods if mods is not None else NO_VALUE,
                             "must be a list of modality names (keys of modality_submodules_spec; [] for text only)")
        if len(set(mods)) != len(mods):
            raise TasksError(file, f"{where}.modalities", mods, "names a modality twice")
        if "batch" not in t:
            raise TasksError(file, f"{where}.batch", NO_VALUE, "missing: global samples per optimizer step")
        batch = _need_int(file, f"{where}.batch", t["batch"], "batch")
        seq = _need_int(file, f"{where}.seq_length", t["seq_length"], "tokens") if "seq_length" in t else 0
        weight = t.get("weight", 1.0)
        if type(weight) not in (int, float) or not math.isfinite(weight) or weight < 0:
            raise TasksError(file, f"{where}.weight", weight, "must be a finite non-negative number")
        tasks.append(MimoTask(name=name, modalities=tuple(mods), batch=batch, seq_length=seq, weight=float(weight)))
    return MimoTasks(file=file, tasks=tuple(tasks), inputs=_inputs(file, doc.get("inputs", {})))


def _inputs(file: str, table: Any) -> dict:
    if not isinstance(table, dict):
        raise TasksError(file, "inputs", table, "must be a table [inputs.<modality>.<encoder>]")
    out: dict = {}
    for m, encoders in table.items():
        if not isinstance(encoders, dict):
            raise TasksError(file, f"inputs.{m}", encoders, "must be a table [inputs.<modality>.<encoder>]")
        for e, kws in encoders.items():
            if not isinstance(kws, dict) or not kws:
                raise TasksError(file, f"inputs.{m}.{e}", kws, "must be a table keyword = [per-sample shape]")
            for kw, shape in kws.items():
                key = f"inputs.{m}.{e}.{kw}"
                if not kw.isidentifier():
                    raise TasksError(file, key, kw, "a forward keyword must be a Python identifier")
                if not isinstance(shape, list) or not shape:
                    raise TasksError(file, key, shape, "must be a list of positive integers (one sample's shape)")
                for d in shape:
                    _need_int(file, key, d, "tokens")
                out.setdefault(m, {}).setdefault(e, {})[kw] = tuple(shape)
    return out


def load_tasks(path: str) -> MimoTasks:
    """Read and check a tasks file; a missing or unreadable file is one line naming it."""
    if not os.path.isfile(path):
        raise TasksError(path, "(file)", NO_VALUE, "no such file")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TasksError(path, "(file)", NO_VALUE, f"not UTF-8 text: {e}") from None
    return parse_tasks(text, path)
