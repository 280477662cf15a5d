"""A checkpoint directory's torch-free parts: the tracker, the save directory's checks, a failed save in words.

:func:`..adapter.flags.check_args` uses these on every rank before torch is imported (a bad ``--save`` or ``--load`` is
refused at start, not at the first save); :mod:`.files` re-exports them beside the manifest and the
restricted loader.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time

from ...atomic import describe_os_error

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
    if not os.path.isfile(path):  # a FIFO would block the read forever, a directory would fail it
        raise CheckpointFileError(f"checkpoint tracker {path} is not a regular file; remove it (it should hold "
                                  f"the number of the last saved iteration)")
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


def check_save_reuse(save: str, load: str | None, overwrite: bool) -> None:
    """Refuse ``--save save`` when it already holds a checkpoint this run would not resume: without
    ``--load`` pointing at the same directory (Megatron-LM's way to resume) the run's saves would replace
    that run's iterations and move its tracker back. A torchrun restart (``--max-restarts``) resumes from its
    own ``--save`` and is not refused; ``overwrite`` (``--spindle-overwrite-save``) says to replace them."""
    if overwrite or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return
    if load and os.path.realpath(load) == os.path.realpath(save):
        return
    it = latest_iteration(save) if os.path.isdir(save) else None
    if it is None:
        return
    raise CheckpointFileError(
        f"--save {save!r} already holds the checkpoints of another run (up to iteration {it}); this run would "
        f"replace them: resume that run with --load {save}, give another --save, or pass "
        f"--spindle-overwrite-save to replace them")


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


# ---------------------------------------------------------------------------------------------------
# One writer per save directory
# ---------------------------------------------------------------------------------------------------
LOCK = ".spindle-save.lock"


def _lock_owner(text: str) -> dict:
    try:
        info = json.loads(text) if text.strip() else {}
    except ValueError:
        return {"unreadable": text[:60]}
    return info if isinstance(info, dict) else {}


def describe_owner(info: dict) -> str:
    if not info:
        return "a run that left no details"
    if "unreadable" in info:
        return f"a lock file that is not ours: {info['unreadable']!r}"
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}"
            + (f", torchrun attempt {info['attempt']}" if info.get("attempt") else ""))


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError) as e:
        return isinstance(e, PermissionError)
    return True


def run_identity() -> dict:
    """Who holds a lock: host, pid, start time, and (under torchrun) the job and attempt it belongs to."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime()),
            "job": (f"{os.environ.get('TORCHELASTIC_RUN_ID')}@{os.environ.get('MASTER_ADDR')}:"
                    f"{os.environ.get('MASTER_PORT')}" if "TORCHELASTIC_RUN_ID" in os.environ else None),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}


class SaveLock:
    """The lock of a ``--save`` directory, held by one process (rank 0) for the whole run.

    ``DIR/.spindle-save.lock`` carries an exclusive ``flock`` while the run lives (the kernel drops it when
    the process dies, however it dies) and says who holds it (:func:`run_identity`). A second run is refused
    with one line naming the holder; a lock whose holder is gone (its content left, its ``flock`` free) is
    taken over with a warning, silently when it is an earlier attempt of the same torchrun job (a restart).
    Where the file system has no ``flock``, a lock of a live process on this host refuses and any other is
    taken over. The file is written in place, not through :mod:`megatron_spindle.atomic`: the lock is on its
    inode, which a rename would replace. Releasing removes the file; a taker checks after locking that the
    path still names the inode it locked (else another run removed it meanwhile: it tries again).
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, LOCK)
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock or raise :class:`CheckpointFileError`; returns a warning line for a stale lock taken
        over (``None`` otherwise)."""
        for _ in range(10):
            warning = self._try()
            if self.fd is not None:
                return warning
        raise CheckpointFileError(f"--save {self.root!r}: its lock file keeps being replaced by another run")

    def _try(self) -> str | None:
        try:
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointFileError(f"--save {self.root!r}: cannot create its lock file: "
                                      f"{describe_os_error(e)}") from None
        try:
            old = _lock_owner(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            me = run_identity()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._refusal(old) from None
            except OSError as e:  # no flock on this file system: judge by the pid on this host
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                if old.get("host") == me["host"] and old.get("pid") != me["pid"] and _pid_alive(old.get("pid")):
                    raise self._refusal(old) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released (removed) between our open and our lock: try again
                os.close(fd)
                return None
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        if not old or (old.get("job") and old.get("job") == me["job"] and old.get("attempt", 0) < me["attempt"]):
            return None  # free, or an earlier attempt of this torchrun job
        return (f"warning: --save {self.root!r} was locked by a run that is gone ({describe_owner(old)}); "
                f"taking it over")

    def _refusal(self, old: dict) -> CheckpointFileError:
        return CheckpointFileError(f"--save {self.root!r} is in use by another run ({describe_owner(old)}): two "
                                   f"runs writing one checkpoint directory overwrite each other's checkpoints; give "
                                   f"this run another --save, or stop that run first")

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = None


def probe_save_lock(root: str) -> None:
    """Refuse ``--save root`` if another run holds its lock now (the launcher's check before any worker
    starts); only looks: the lock and its content stay as they were."""
    path = os.path.join(root, LOCK)
    if not os.path.isfile(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        old = _lock_owner(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SaveLock(root)._refusal(old) from None
        except OSError:
            return  # no flock here: the run's own rank 0 judges by the pid
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
