"""A checkpoint directory's torch-free parts: the tracker, the save directory's checks, a failed save in words.

:func:`.flags.check_args` uses these on every rank before torch is imported (a bad ``--save`` or ``--load`` is
refused at start, not at the first save); :mod:`.ckpt_files` re-exports them beside the manifest and the
restricted loader.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil

from ..atomic import describe_os_error

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
# Save directory: checked at start, failures named
# ---------------------------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_save_dir(root: str, need_bytes: int | None = None) -> None:
    """Refuse ``--save root`` unless this process can create files in it and (with ``need_bytes``) the file
    system has room for two checkpoints (the new one is written beside the last)."""
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
