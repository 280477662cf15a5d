"""The files of a checkpoint: a checksum manifest, a loader that cannot run code, writes without helpers.

Trust model (README, "Checkpoints"): a checkpoint directory is data, not code.

1. **Corruption is refused.** Every checkpoint directory holds ``manifest.json``: the size and SHA-256 of
   every other file in it, written by rank 0 after every rank finished writing and before the directory is
   renamed into place. Loading verifies every file against it (the ranks split the files between them) and
   refuses, on every rank with the same one line, a checkpoint with a missing, extra, truncated or changed
   file, *before anything in it is unpickled*. A checksum does not stop someone who can write the directory
   (they can rewrite the manifest too); point 2 does.
2. **Loading runs no code from the checkpoint.** torch's distributed-checkpoint metadata (``.metadata``) is a
   pickle; it is read with :class:`MetadataUnpickler`, which admits only the dataclasses and enums of
   ``torch.distributed.checkpoint.metadata`` and ``.planner`` (plus the storage-index record of its
   file-system reader, ``torch.Size``, dtypes, layouts, memory formats and plain containers) and refuses
   anything else by name.
   ``common.pt`` and the shards' byte items go through ``torch.load(weights_only=True)`` (torch's own
   restricted unpickler; the default since torch 2.6), tensors are read as raw bytes.
3. **Writes use no helper processes.** megatron.core's file-system writer forks one writer per file bucket and
   keeps a multiprocessing manager for the results; when a rank is killed those helpers outlive it (orphans
   under init). :func:`in_process_writes` runs the same per-bucket write function in the rank itself, so a
   rank's death leaves nothing behind.
4. **A failed write fails every rank alike.** megatron.core's ``dist_checkpointing.save`` writes ``common.pt``
   on rank 0 before the collective sharded save; an error there (a full disk) left rank 0 outside the
   collectives the other ranks entered, and both waited out the process group's timeout.
   :func:`deferred_common_save_error` keeps rank 0 in step and hands the error to the caller, which raises
   it on every rank after the save.
5. **Save failures are named.** :func:`check_save_dir` (at start: writable, enough free space) and
   :func:`describe_save_error` turn a full disk or a permission error into words instead of torch's
   ``unexpected pos 704 vs 598``.

The torch-free part (the tracker, the save directory's checks, naming a failed save) is :mod:`.directory`, which
:func:`..adapter.flags.check_args` uses before torch is loaded; its names are re-exported here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import io
import json
import os
import importlib
import pickle
import queue

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
try:  # megatron-core 0.16: rank 0 writes common.pt through this strategy, before the sharded save's collectives
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
except ImportError:  # megatron-core 0.19: torch_dist writes the non-tensor state inside DCP's own collective save
    TorchCommonSaveStrategy = None
from torch.distributed.checkpoint import filesystem

from ... import comm
from ...atomic import write_json
from .directory import MANIFEST, MANIFEST_KIND, MANIFEST_VERSION, CheckpointFileError




# ---------------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------------
def _files(directory: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(root, f), directory)
            if rel != MANIFEST:
                out.append(rel)
    return out


def file_digest(path: str) -> dict:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
            n += len(block)
    return {"bytes": n, "sha256": h.hexdigest()}


def _share(names: list[str], rank: int, world: int) -> list[str]:
    return names[rank::world]


def _gather(obj) -> list:
    return comm.all_gather_object(obj) if dist.is_initialized() else [obj]


def write_manifest(directory: str, iteration: int) -> None:
    """Hash every file of ``directory`` (split over the ranks) and write ``manifest.json`` on rank 0; collective."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    names = _files(directory)
    mine = {n: file_digest(os.path.join(directory, n)) for n in _share(names, rank, world)}
    files = {}
    for part in _gather(mine):
        files.update(part)
    if rank == 0:
        write_json(os.path.join(directory, MANIFEST), {
            "kind": MANIFEST_KIND, "schema_version": MANIFEST_VERSION, "iteration": iteration,
            "files": dict(sorted(files.items()))}, "checkpoint manifest")


def _check_share(directory: str, manifest: dict, names: list[str]) -> list[str]:
    bad = []
    for n in names:
        want = manifest["files"].get(n)
        path = os.path.join(directory, n)
        if want is None:
            bad.append(f"{n} is not in the manifest")
            continue
        if not os.path.isfile(path):
            bad.append(f"{n} is missing")
            continue
        got = file_digest(path)
        if got["bytes"] != want["bytes"]:
            bad.append(f"{n} has {got['bytes']} bytes, the manifest says {want['bytes']}")
        elif got["sha256"] != want["sha256"]:
            bad.append(f"{n} does not match its checksum")
    return bad


def verify_checkpoint(directory: str) -> None:
    """Refuse ``directory`` unless every file matches ``manifest.json``; collective when distributed.

    Every rank raises the same :class:`CheckpointFileError`, naming the first bad file and how many are bad.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problem = None
    manifest = None
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as fh:
            manifest = json.load(fh)
        if (not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND
                or not isinstance(manifest.get("files"), dict)):
            problem = f"{MANIFEST} is not a checkpoint manifest"
    except FileNotFoundError:
        problem = f"it has no {MANIFEST} (not written by this version, or not a finished checkpoint)"
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        problem = f"{MANIFEST} is unreadable ({type(e).__name__})"
    bad = []
    if problem is None:
        names = sorted(set(_files(directory)) | set(manifest["files"]))
        bad = _check_share(directory, manifest, _share(names, rank, world))
    every = _gather((problem, bad))
    problems = [p for p, _ in every if p]
    bads = sorted(b for _, bs in every for b in bs)
    if problems:
        raise CheckpointFileError(f"checkpoint {directory} is refused: {problems[0]}")
    if bads:
        more = f" (and {len(bads) - 1} more)" if len(bads) > 1 else ""
        raise CheckpointFileError(f"checkpoint {directory} is corrupt: {bads[0]}{more}")


# ---------------------------------------------------------------------------------------------------
# Restricted unpickling of torch's checkpoint metadata
# ---------------------------------------------------------------------------------------------------
_TORCH_NAMES = {"Size", "device", "memory_format", "layout", "dtype", "contiguous_format",
                "channels_last", "channels_last_3d", "preserve_format", "strided"}
_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "object",
             "slice", "complex", "bytearray"}


def _admitted(module: str, name: str) -> bool:
    """The globals torch's checkpoint ``Metadata`` pickles refer to, found by reading
    ``torch/distributed/checkpoint/metadata.py`` and listing the globals of checkpoints megatron.core wrote:
    the dataclasses and enums of ``torch.distributed.checkpoint.metadata`` and of its ``planner`` (megatron.core
    keeps the save plans in the metadata), the file-system reader's ``_StorageInfo``, ``torch.Size`` shapes,
    dtypes (pickled as ``torch.<dtype>``), layouts (``torch.serialization._get_layout``, a lookup by name),
    memory formats, ``OrderedDict`` and plain builtins. Nothing that executes code."""
    if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner"):
        obj = getattr(importlib.import_module(module), name, None)
        return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    if module == "torch.distributed.checkpoint.filesystem":
        return name == "_StorageInfo"
    if module == "torch.serialization":
        return name == "_get_layout"
    if module == "torch":
        return name in _TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)
    if module == "collections":
        return name == "OrderedDict"
    if module == "builtins":
        return name in _BUILTINS
    return False


class MetadataUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that admits only the classes of torch's checkpoint metadata (see :func:`_admitted`)."""

    def find_class(self, module: str, name: str):
        if not _admitted(module, name):
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a checkpoint "
                                         f"never needs; refusing to load it")
        return super().find_class(module, name)


class _RestrictedPickle:
    """Stands in for the ``pickle`` module inside torch's file-system checkpoint reader: ``load`` is restricted,
    everything else (``dump`` for writing) is the real module's."""

    @staticmethod
    def load(fh, **_kw):
        return MetadataUnpickler(fh).load()

    @staticmethod
    def loads(data: bytes, **_kw):
        return MetadataUnpickler(io.BytesIO(data)).load()

    def __getattr__(self, name):
        return getattr(pickle, name)


def restrict_metadata_unpickling() -> None:
    """Make torch's file-system checkpoint reader unpickle ``.metadata`` with :class:`MetadataUnpickler`
    (idempotent; process-wide, since no checkpoint this package loads needs more)."""
    if not isinstance(filesystem.pickle, _RestrictedPickle):
        filesystem.pickle = _RestrictedPickle()


# ---------------------------------------------------------------------------------------------------
# Writing without helper processes
# ---------------------------------------------------------------------------------------------------
def _write_buckets_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """megatron.core's ``write_preloaded_data_multiproc`` contract, run in this process: each bucket is written
    by the library's own ``write_preloaded_data``; results or the first exception go to the results queue."""
    results: dict | Exception = {}
    for i, bucket in enumerate(write_buckets):
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        kwargs = {"use_msc": use_msc} if use_msc else {}
        fa.FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, **kwargs)
        idx, res = local.get()
        if isinstance(res, Exception):
            results = res
            break
        results[idx] = res
    global_results_queue.put(results)


@contextlib.contextmanager
def in_process_writes():
    """Within the block, megatron.core's checkpoint writer writes in this process: no forked writers and no
    multiprocessing manager that a killed rank would leave behind. megatron-core 0.19 writes with threads
    (``write_preloaded_data_multithread``): nothing to replace there."""
    cls = fa.FileSystemWriterAsync
    if "write_preloaded_data_multiproc" not in cls.__dict__:
        yield
        return
    saved = cls.__dict__["write_preloaded_data_multiproc"], fa._get_write_results_queue
    cls.write_preloaded_data_multiproc = staticmethod(_write_buckets_in_process)
    fa._get_write_results_queue = queue.Queue
    try:
        yield
    finally:
        cls.write_preloaded_data_multiproc, fa._get_write_results_queue = saved


@contextlib.contextmanager
def deferred_common_save_error(errors: list):
    """Within the block, a failure of megatron.core's ``save_common`` (rank 0 writing ``common.pt``) is put in
    ``errors`` instead of raised, so that rank 0 still takes part in the sharded save's collectives (see 4.
    above); the caller raises it on every rank afterwards. Without that strategy (megatron-core 0.19) there is
    no separate common save to defer: a failure is DCP's, raised inside its collective save."""
    cls = TorchCommonSaveStrategy
    if cls is None:
        yield
        return
    original = cls.__dict__["save_common"]

    def save_common(self, common_state_dict, checkpoint_dir):
        try:
            original(self, common_state_dict, checkpoint_dir)
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            errors.append(e)

    cls.save_common = save_common
    try:
        yield
    finally:
        cls.save_common = original
