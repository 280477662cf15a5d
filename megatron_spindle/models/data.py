"""Training data for a task graph: the stream shapes it implies, learnable synthetic batches, real iterators.

Every ``data:<task>:<stream>`` input of the graph is one *stream*. Its per-sample shape and dtype follow from
the consuming operator (:func:`stream_specs`):

* ``patch_embed``: float ``[seq_len - 1, input_dim]`` (pre-cut patches or frames; the class token is added
  by the layer);
* ``token_embed``: int64 ``[seq_len]`` token ids ``< vocab_size``;
* ``lm_head`` (its ``labels`` input): int64 ``[loss_tokens]`` ids ``< vocab_size``; ``labels[:, i]`` is the
  token that should follow loss position ``i``.

A *batch* is ``{task: {stream: tensor [global_batch, ...]}}``: one step's global batch of every task. The
runtime slices it to each rank's local batch.

Real data plugs in as one iterator per task (:func:`batches_from_iterators`): ``{task: iterator}``, each
iterator yielding ``{stream: tensor [global_batch_of_task, ...]}`` per step; batches are checked against
the specs (:func:`check_batch`).

:class:`SyntheticData` makes batches that are deterministic in ``(seed, step)`` and learnable, so a loss
curve visibly goes down:

* each sample of a task has a latent vector ``z`` (``LATENT_DIM`` normal values);
* a patch stream is a fixed random linear image of ``z`` (one map per stream name, so "vision" looks the same
  in every task) plus a little noise: paired modalities share ``z`` and a contrastive loss can match them;
* a token stream without labels reads ``z`` through a fixed random map per position (argmax over the
  vocabulary), so text also identifies its sample;
* a token stream with labels (the ``token_embed`` of the same task and module as an ``lm_head``, e.g.
  ``llm.embed`` / ``llm.head``) follows a fixed affine recurrence ``t' = (a t + c) mod V`` from a start
  token read off ``z``; its labels are the true next tokens, so next-token prediction is learnable.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from ..planner.workload.graph import DATA_PREFIX, Operator, TaskGraph
from .custom import torch_layer

LATENT_DIM = 8
PATCH_NOISE = 0.1


@dataclass(frozen=True, kw_only=True)
class StreamSpec:
    """What one data stream of one task looks like."""

    task: str
    stream: str
    shape: tuple[int, ...]
    """Per-sample shape (the batch dimension comes first in a batch)."""
    dtype: torch.dtype
    vocab_size: int = 0
    """Exclusive upper bound of token ids (0 for float streams)."""
    consumer: str = ""
    """Name of the operator that reads the stream."""


def parse_data_input(name: str) -> tuple[str, str]:
    """``data:<task>:<stream>`` -> ``(task, stream)``."""
    if not name.startswith(DATA_PREFIX) or name.count(":") < 2:
        raise ValueError(f"{name!r} is not a data stream name 'data:<task>:<stream>'")
    task, stream = name[len(DATA_PREFIX):].rsplit(":", 1)
    return task, stream


def stream_spec_for(op: Operator, position: int, task: str = "", stream: str = "") -> StreamSpec:
    """Spec of the data stream that ``op`` reads at input ``position``."""
    own = torch_layer(op.op_type)
    if own is not None and own.stream_spec is not None:
        return own.stream_spec(op, position, task, stream)
    c = op.layer
    if op.op_type == "patch_embed":
        return StreamSpec(task=task, stream=stream, shape=(c.seq_len - 1, c.input_dim),
                          dtype=torch.float32, consumer=op.name)
    if op.op_type == "token_embed":
        return StreamSpec(task=task, stream=stream, shape=(c.seq_len,), dtype=torch.int64,
                          vocab_size=c.vocab_size, consumer=op.name)
    if op.op_type == "lm_head" and position == 1:
        return StreamSpec(task=task, stream=stream, shape=(c.loss_tokens,), dtype=torch.int64,
                          vocab_size=c.vocab_size, consumer=op.name)
    raise ValueError(f"operator {op.name!r} ({op.op_type}) reads data stream {stream!r} at input "
                     f"{position}; only patch_embed, token_embed and lm_head labels read data")


def stream_specs(graph: TaskGraph) -> dict[str, dict[str, StreamSpec]]:
    """``{task: {stream: StreamSpec}}`` for every data stream of the graph."""
    out: dict[str, dict[str, StreamSpec]] = {t: {} for t in graph.tasks}
    for op in graph.operators:
        for i, name in enumerate(op.inputs):
            if not name.startswith(DATA_PREFIX):
                continue
            task, stream = parse_data_input(name)
            if task not in out:
                raise ValueError(f"operator {op.name!r} reads {name!r} of unknown task {task!r}")
            spec = stream_spec_for(op, i, task, stream)
            old = out[task].get(stream)
            if old is not None and (old.shape, old.dtype, old.vocab_size) != (spec.shape, spec.dtype,
                                                                              spec.vocab_size):
                raise ValueError(f"stream {name!r} is read by {old.consumer!r} as {old.shape} and by "
                                 f"{op.name!r} as {spec.shape}")
            out[task].setdefault(stream, spec)
    return out


def task_batch_sizes(graph: TaskGraph) -> dict[str, int]:
    """Global batch of every task (the ``batch`` of its operators)."""
    sizes: dict[str, int] = {}
    for op in graph.operators:
        if sizes.setdefault(op.task, op.batch) != op.batch:
            raise ValueError(f"task {op.task!r} has operators with batches {sizes[op.task]} and {op.batch}")
    return sizes


def check_batch(graph: TaskGraph, batch: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Raise ValueError unless every task in ``batch`` has all its streams with the right shape, dtype and
    token range. Tasks may be missing (a step that trains a subset)."""
    specs, sizes = stream_specs(graph), task_batch_sizes(graph)
    for task, streams in batch.items():
        if task not in specs:
            raise ValueError(f"batch has unknown task {task!r}; tasks: {list(graph.tasks)}")
        if set(streams) != set(specs[task]):
            raise ValueError(f"task {task!r}: batch streams {sorted(streams)}, expected {sorted(specs[task])}")
        for name, spec in specs[task].items():
            t = streams[name]
            want = (sizes[task], *spec.shape)
            if tuple(t.shape) != want or t.dtype != spec.dtype:
                raise ValueError(f"task {task!r} stream {name!r}: got {t.dtype} {list(t.shape)}, "
                                 f"expected {spec.dtype} {list(want)}")
            if spec.vocab_size and t.numel() and (int(t.min()) < 0 or int(t.max()) >= spec.vocab_size):
                raise ValueError(f"task {task!r} stream {name!r}: token ids must lie in "
                                 f"[0, {spec.vocab_size}), got [{int(t.min())}, {int(t.max())}]")


def batches_from_iterators(graph: TaskGraph,
                           iterators: Mapping[str, Iterator[Mapping[str, torch.Tensor]]]
                           ) -> Iterator[dict[str, dict[str, torch.Tensor]]]:
    """Zip per-task iterators into per-step batches, checking each; stops when any iterator stops."""
    while True:
        batch = {}
        for task, it in iterators.items():
            try:
                batch[task] = dict(next(it))
            except StopIteration:
                return
        check_batch(graph, batch)
        yield batch


def _seed(*parts) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*parts))


class SyntheticData:
    """Learnable synthetic batches for every task of a graph, deterministic in ``(seed, step)``.

    ``data.batch(step)`` is one step's global batch ``{task: {stream: tensor}}``; iterating yields steps
    0, 1, 2, ...; :meth:`task_iterators` gives the per-task iterator form that real data uses.
    """

    def __init__(self, graph: TaskGraph, *, seed: int = 0) -> None:
        self.graph = graph
        self.seed = seed
        self.specs = stream_specs(graph)
        self.sizes = task_batch_sizes(graph)
        self._labelled = self._labelled_streams(graph)
        self._own = [op for op in graph.operators if getattr(torch_layer(op.op_type), "synthesize", None)]

    @staticmethod
    def _labelled_streams(graph: TaskGraph) -> dict[str, tuple[str, str]]:
        """``{task: (token stream, labels stream)}`` for next-token tasks (see the module docstring)."""
        out = {}
        for head in graph.operators:
            if head.op_type != "lm_head":
                continue
            _, labels = parse_data_input(head.inputs[1])
            for op in graph.operators:
                if (op.task == head.task and op.module == head.module and op.op_type == "token_embed"
                        and op.layer.seq_len == head.layer.loss_tokens):
                    out[head.task] = (parse_data_input(op.inputs[0])[1], labels)
        return out

    def _recurrence(self, stream: str, vocab: int) -> tuple[int, int]:
        g = _gen(self.seed, "recurrence", stream)
        a = int(torch.randint(1, max(2, vocab), (1,), generator=g))
        c = int(torch.randint(0, vocab, (1,), generator=g))
        return a, c

    def _patches(self, spec: StreamSpec, z: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        n = math.prod(spec.shape)
        proj = torch.randn(LATENT_DIM, n, generator=_gen(self.seed, "patches", spec.stream))
        x = z @ proj / LATENT_DIM ** 0.5
        x = x + PATCH_NOISE * torch.randn(x.shape, generator=g)
        return x.reshape(z.shape[0], *spec.shape)

    def _latent_tokens(self, spec: StreamSpec, z: torch.Tensor) -> torch.Tensor:
        (length,) = spec.shape
        proj = torch.randn(length, LATENT_DIM, spec.vocab_size,
                           generator=_gen(self.seed, "tokens", spec.stream))
        return torch.einsum("bd,ldv->blv", z, proj).argmax(dim=-1)

    def _sequence(self, spec: StreamSpec, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (length,) = spec.shape
        vocab = spec.vocab_size
        a, c = self._recurrence(spec.stream, vocab)
        start = self._latent_tokens(StreamSpec(task=spec.task, stream=spec.stream + "/start", shape=(1,),
                                               dtype=torch.int64, vocab_size=vocab), z)[:, 0]
        toks = [start]
        for _ in range(length):
            toks.append((a * toks[-1] + c) % vocab)
        seq = torch.stack(toks, dim=1)
        return seq[:, :length], seq[:, 1:length + 1]

    def task_batch(self, task: str, step: int) -> dict[str, torch.Tensor]:
        """One step's global batch of one task."""
        if task not in self.specs:
            raise ValueError(f"unknown task {task!r}; tasks: {list(self.graph.tasks)}")
        g = _gen(self.seed, "step", step, task)
        z = torch.randn(self.sizes[task], LATENT_DIM, generator=g)
        out: dict[str, torch.Tensor] = {}
        for op in self._own:  # layer types that make their own streams (registered synthesize)
            if op.task == task:
                out.update(torch_layer(op.op_type).synthesize(op, self.specs[task], z, self.seed))
        seq_stream, label_stream = self._labelled.get(task, ("", ""))
        for name, spec in self.specs[task].items():
            if name == label_stream or name in out:
                continue
            if spec.dtype.is_floating_point:
                out[name] = self._patches(spec, z, g)
            elif name == seq_stream:
                out[name], out[label_stream] = self._sequence(spec, z)
            else:
                out[name] = self._latent_tokens(spec, z)
        for name, spec in self.specs[task].items():  # labels without a matching token stream
            if name not in out:
                out[name] = self._latent_tokens(spec, z)
        return out

    def batch(self, step: int) -> dict[str, dict[str, torch.Tensor]]:
        return {task: self.task_batch(task, step) for task in self.graph.tasks}

    def __iter__(self) -> Iterator[dict[str, dict[str, torch.Tensor]]]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1

    def task_iterators(self, start_step: int = 0) -> dict[str, Iterator[dict[str, torch.Tensor]]]:
        """The per-task iterator interface (what a real data loader provides)."""
        def it(task: str):
            step = start_step
            while True:
                yield self.task_batch(task, step)
                step += 1
        return {task: it(task) for task in self.graph.tasks}
