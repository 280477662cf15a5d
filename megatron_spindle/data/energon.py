"""Per-task training data from megatron-energon datasets, read by each rank only where the plan needs it.

Layout on disk: ``ROOT/<task>/`` is one energon dataset per task: webdataset shards prepared with
``energon prepare ROOT/<task> --non-interactive --split-ratio 1,0,0 --sample-type CrudeWebdataset``
(``scripts/make_energon_dataset.py`` writes a tiny one). A sample has one part per data stream of the task,
named after the stream (``vision.png``, ``text.npy``, ``labels.npy``):

* a token stream (``token_embed`` input, ``lm_head`` labels): ``<stream>.npy``, int, ``[tokens]``;
* a patch stream (``patch_embed`` input, ``[patches, input_dim]`` floats): ``<stream>.npy`` of that shape, or
  an image (``.png``/``.jpg``) of ``patches`` rows and ``input_dim / 3`` RGB columns, one patch per row
  (pixels scaled to ``[-1, 1]``). Cutting real images into patches is the writer's job, as Megatron's
  multi-modal task encoders do it.

Each task reads its own dataset at its own global batch ``B`` (the graph's). :mod:`.sharding` gives every
rank the lanes of each task it must read; lane ``k`` of ``L`` is energon's data-parallel rank ``k`` of ``L``
(``WorkerConfig(rank=k, world_size=L)``), so lanes read disjoint, contiguous parts of the dataset, each at
``B/L`` samples per step, deterministically (the same lane gives the same samples on every rank that
reads it). A step's batch on a rank is ``{task: {stream: LocalRows}}``: the rows it holds, addressed by
global sample position (``rows[a:b]``, what the wave executor asks for); asking for another row raises.

``read_log`` lists ``(step, task, lane, sample keys)`` for every lane read: the test of "every rank reads
only its own samples" checks it against the plan.
"""
from __future__ import annotations

import os
import warnings
from typing import Mapping

import numpy as np
import torch
from torch import Tensor

from ..models.data import StreamSpec, stream_specs
from ..planner.workload.graph import TaskGraph
from ..planner.assembly.plan import Plan
from .sharding import RankReads, rank_reads


class LocalRows:
    """Rows ``[start, start + len(tensor))`` of a stream's global batch, the ones this rank holds."""

    def __init__(self, start: int, tensor: Tensor, *, batch: int, what: str) -> None:
        self.start, self.tensor, self.batch, self.what = start, tensor, batch, what

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the global batch (rows not held included)."""
        return (self.batch, *self.tensor.shape[1:])

    def __getitem__(self, key: slice) -> Tensor:
        a, b, step = key.indices(self.batch)
        stop = self.start + self.tensor.shape[0]
        if step != 1 or a < self.start or b > stop:
            raise IndexError(f"{self.what}: this rank read samples [{self.start}, {stop}), not [{a}, {b})")
        return self.tensor[a - self.start:b - self.start]


def _task_encoder():  # megatron.energon is imported where used: an optional dependency (the "data" extra)
    from megatron.energon import Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, stateless  # optional: megatron-energon (only --spindle-data reads it)
    from megatron.energon.edataclass import edataclass  # optional: megatron-energon (only --spindle-data reads it)

    @edataclass
    class StreamSample(Sample):
        parts: dict

    @stateless
    def cook(raw: dict) -> StreamSample:
        return StreamSample(**basic_sample_keys(raw), parts={k: v for k, v in raw.items() if not k.startswith("__")})

    class StreamTaskEncoder(DefaultTaskEncoder):
        """Crude samples as ``{part name: decoded value}``; a batch stays a list of samples."""

        cookers = [Cooker(cook)]

        def batch(self, samples):
            return samples

    return StreamTaskEncoder()


def _decode(value, spec: StreamSpec, where: str) -> Tensor:
    """One sample's part as the stream's per-sample tensor."""
    if isinstance(value, Tensor) and value.dim() == 3 and value.shape[0] == 3:  # energon's torchrgb image
        t = value.permute(1, 2, 0).reshape(-1) * 2.0 - 1.0
    elif isinstance(value, (np.ndarray, Tensor)):
        t = torch.as_tensor(np.asarray(value)).reshape(-1)
    else:
        raise ValueError(f"{where}: a {type(value).__name__}, not an array or an image")
    n = int(np.prod(spec.shape))
    if t.numel() != n:
        raise ValueError(f"{where}: {t.numel()} values, the stream needs {list(spec.shape)} = {n}")
    if spec.dtype.is_floating_point:
        return t.to(spec.dtype).reshape(spec.shape)
    if t.is_floating_point():
        raise ValueError(f"{where}: token ids must be integers, got {t.dtype}")
    t = t.to(torch.int64).reshape(spec.shape)
    if spec.vocab_size and (int(t.min()) < 0 or int(t.max()) >= spec.vocab_size):
        raise ValueError(f"{where}: token ids must lie in [0, {spec.vocab_size}), got [{int(t.min())}, {int(t.max())}]")
    return t


class EnergonData:
    """The multi-task data iterator of one rank: ``next(data)`` is one pass's ``{task: {stream: LocalRows}}``.

    ``root`` holds one energon dataset per task (``root/<task>``); ``plan`` and ``rank`` say which samples
    this rank reads (:func:`.sharding.rank_reads`); ``seed`` goes to energon (``seed_offset``).
    ``position`` is the pass index: a resumed run skips that many passes of every lane it reads.
    """

    def __init__(self, root: str, graph: TaskGraph, plan: Plan, rank: int, *, seed: int = 0,
                 position: int = 0) -> None:
        self.root, self.graph, self.rank = root, graph, rank
        self.tasks = tuple(plan.tasks)
        self.specs = stream_specs(graph)
        self.reads: dict[str, RankReads] = rank_reads(plan, graph, rank)
        self._position = 0
        self.read_log: list[tuple[int, str, int, tuple[str, ...]]] = []
        missing = [t for t in self.tasks if not os.path.isdir(os.path.join(root, t, ".nv-meta"))]
        if missing:
            raise ValueError(f"--spindle-data {root}: no energon dataset for task(s) {', '.join(missing)} "
                             f"(expected {os.path.join(root, missing[0])} prepared with `energon prepare`)")
        self._loaders: dict[tuple[str, int], object] = {}
        for task, r in self.reads.items():
            for lane in r.lanes:
                self._loaders[(task, lane)] = self._open(task, lane, r, seed)
        self.position = position

    @property
    def position(self) -> int:
        """Index of the next pass."""
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        """Skip forward to pass ``value`` (a resumed run): the skipped passes are read and dropped."""
        if value < self._position:
            raise ValueError(f"energon data is at pass {self._position}; it cannot go back to {value}")
        while self._position < value:
            next(self)

    def peek(self) -> None:
        """No full batch here (each rank holds only its own samples): the equivalence check uses synthetic data."""
        return None

    def _open(self, task: str, lane: int, r: RankReads, seed: int):
        from megatron.energon import WorkerConfig, get_loader, get_train_dataset  # optional: megatron-energon (only --spindle-data reads it)

        path = os.path.join(self.root, task)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = get_train_dataset(path, worker_config=WorkerConfig(rank=lane, world_size=r.lanes_total,
                                                                    num_workers=0, seed_offset=seed),
                                   batch_size=r.batch // r.lanes_total, shuffle_buffer_size=None,
                                   max_samples_per_sequence=None, task_encoder=_task_encoder())
            return iter(get_loader(ds, watchdog_timeout_seconds=None))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, dict[str, LocalRows]]:
        out: dict[str, dict[str, LocalRows]] = {}
        for task in self.tasks:
            r = self.reads[task]
            per = r.batch // r.lanes_total
            rows: dict[int, dict[str, Tensor]] = {}
            for lane in r.lanes:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        samples = next(self._loaders[(task, lane)])
                    except Exception as e:  # noqa: BLE001 - a damaged shard deep in the loader: name the dataset
                        first = (str(e).strip().splitlines() or [""])[0][:300]
                        raise ValueError(f"--spindle-data {self.root}: reading task {task!r} (lane {lane}) failed: "
                                         f"{type(e).__name__}: {first}; a shard of {os.path.join(self.root, task)} "
                                         f"is damaged? restore it or prepare the dataset again") from None
                if len(samples) != per:
                    raise ValueError(f"{self.root}/{task}: lane {lane} gave {len(samples)} samples, wanted {per}")
                self.read_log.append((self._position, task, lane, tuple(s.__key__ for s in samples)))
                for i, s in enumerate(samples):
                    rows[lane * per + i] = self._sample(task, s, r)
            out[task] = {}
            for stream, (a, b) in r.streams.items():
                t = torch.stack([rows[j][stream] for j in range(a, b)])
                out[task][stream] = LocalRows(a, t, batch=r.batch, what=f"task {task!r} stream {stream!r}")
        self._position += 1
        return out

    def _sample(self, task: str, s, r: RankReads) -> dict[str, Tensor]:
        got = {}
        for stream in r.streams:
            parts = [k for k in s.parts if k.rsplit(".", 1)[0] == stream]  # "<stream>.<ext>": a stream may hold dots
            where = f"{self.root}/{task} sample {s.__key__!r} part {stream!r}"
            if len(parts) != 1:
                raise ValueError(f"{where}: found {parts or 'no part'}; a sample needs one '{stream}.<ext>' part "
                                 f"(parts: {sorted(s.parts)})")
            got[stream] = _decode(s.parts[parts[0]], self.specs[task][stream], where)
        return got

    def keys_held(self) -> Mapping[str, Mapping[str, tuple[int, int]]]:
        """``{task: {stream: (start, stop)}}`` this rank holds each step."""
        return {t: dict(r.streams) for t, r in self.reads.items()}
