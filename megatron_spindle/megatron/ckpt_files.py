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
4. **Save failures are named.** :func:`check_save_dir` (at start: writable, enough free space) and
   :func:`describe_save_error` turn a full disk or a permission error into words instead of torch's
   ``unexpected pos 704 vs 598``.

torch and megatron.core are imported inside the functions that use them: :func:`.flags.check_args` reads
the tracker and probes the save directory through this module before torch is loaded.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import queue
import shutil

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
MANIFEST_KIND = "spindle-checkpoint-manifest"
MANIFEST_VERSION = 1


class CheckpointFileError(ValueError):
    """A checkpoint file that fails verification, or a save directory that cannot take a checkpoint."""


def latest_iteration(root: str) -> int | None:
    """The iteration ``root``'s tracker names; ``None`` without a tracker. Pure (no torch)."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointFileError(f"checkpoint tracker {path} is unreadable: {type(e).__name__}") from None
    try:
        return int(text)
    except ValueError:
        raise CheckpointFileError(f"checkpoint tracker {path} is corrupt: {text[:40]!r} is not an iteration") from None


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
    import torch.distributed as dist

    from .. import comm
    return comm.all_gather_object(obj) if dist.is_initialized() else [obj]


def write_manifest(directory: str, iteration: int) -> None:
    """Hash every file of ``directory`` (split over the ranks) and write ``manifest.json`` on rank 0; collective."""
    import torch.distributed as dist

    from ..atomic import write_json
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
    import torch.distributed as dist

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
    import dataclasses
    import enum

    import torch
    if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner"):
        import importlib
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
    from torch.distributed.checkpoint import filesystem
    if not isinstance(filesystem.pickle, _RestrictedPickle):
        filesystem.pickle = _RestrictedPickle()


# ---------------------------------------------------------------------------------------------------
# Writing without helper processes
# ---------------------------------------------------------------------------------------------------
def _write_buckets_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """megatron.core's ``write_preloaded_data_multiproc`` contract, run in this process: each bucket is written
    by the library's own ``write_preloaded_data``; results or the first exception go to the results queue."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    results: dict | Exception = {}
    for i, bucket in enumerate(write_buckets):
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        kwargs = {"use_msc": use_msc} if use_msc else {}
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, **kwargs)
        idx, res = local.get()
        if isinstance(res, Exception):
            results = res
            break
        results[idx] = res
    global_results_queue.put(results)


@contextlib.contextmanager
def in_process_writes():
    """Within the block, megatron.core's checkpoint writer writes in this process: no forked writers and no
    multiprocessing manager that a killed rank would leave behind."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    cls = fa.FileSystemWriterAsync
    saved = cls.__dict__["write_preloaded_data_multiproc"], fa._get_write_results_queue
    cls.write_preloaded_data_multiproc = staticmethod(_write_buckets_in_process)
    fa._get_write_results_queue = queue.Queue
    try:
        yield
    finally:
        cls.write_preloaded_data_multiproc, fa._get_write_results_queue = saved


# ---------------------------------------------------------------------------------------------------
# Save directory: checked at start, failures named
# ---------------------------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_save_dir(root: str, need_bytes: int | None = None) -> None:
    """Refuse ``--save root`` unless this process can create files in it and (with ``need_bytes``) the file
    system has room for two checkpoints (the new one is written beside the last)."""
    from ..atomic import describe_os_error
    full = os.path.abspath(root)
    if os.path.exists(full) and not os.path.isdir(full):
        raise CheckpointFileError(f"--save {root!r} is not a directory")
    probe = os.path.join(full, f".spindle-write-test-{os.getpid()}")
    try:
        os.makedirs(full, exist_ok=True)
        with open(probe, "wb") as fh:
            fh.write(b"ok")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as e:
        raise CheckpointFileError(f"--save {root!r} is not writable: {describe_os_error(e)}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    if need_bytes:
        free = shutil.disk_usage(full).free
        if free < 2 * need_bytes:
            raise CheckpointFileError(f"--save {root!r}: {_mib(free)} free, a checkpoint needs about "
                                      f"{_mib(need_bytes)} and the last one is kept while the next is written "
                                      f"(free space for two)")


def _os_errors(e: BaseException):
    """Every OSError in ``e``'s cause/context chain and in torch's CheckpointException failures."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            yield x
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [v for v in failures.values() if isinstance(v, BaseException)]
        todo += [a for a in getattr(x, "args", ()) if isinstance(a, BaseException)]


def describe_save_error(root: str, e: BaseException, need_bytes: int | None = None) -> str:
    """One line for a failed checkpoint write: a full disk and a permission error are named as such."""
    from ..atomic import describe_os_error
    for oe in _os_errors(e):
        if oe.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS):
            return f"cannot write checkpoint to {root!r}: {describe_os_error(oe)}"
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(root).free
        if need_bytes and free < need_bytes or free < 1 << 20:  # torch's writer hides ENOSPC in its message
            return (f"cannot write checkpoint to {root!r}: no space left on device ({_mib(free)} free"
                    + (f", the checkpoint needs about {_mib(need_bytes)})" if need_bytes else ")"))
    first = str(e).strip().splitlines()
    return f"cannot write checkpoint to {root!r}: {type(e).__name__}: {first[0] if first else ''}"
