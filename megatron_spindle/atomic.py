"""The one writer of output files: checked before work, atomic, never anything but a regular file.

Every file the package writes (plans, curves and cluster files, the profile cache, Chrome traces, Gantt and
comparison pictures, the checkpoint tracker and manifest) goes through :func:`write_file`:

1. :func:`check_output` refuses, with one line naming the path, a target that exists but is not a regular
   file (a directory, a device such as ``/dev/full``, a FIFO), a parent path that runs through a regular
   file, and a parent directory this process may not write. Commands call it before long work.
2. The content goes to a temporary file beside the target (``.NAME.XXXX.tmp``), is flushed and fsynced, and
   is renamed over the target: a reader sees the old file or the new one, never half of one.
3. On any failure (a full disk, a permission error, an exception while producing the content, Ctrl-C) the
   temporary file is removed, and an ``OSError`` becomes an :class:`OutputError` (a ``ValueError``) whose
   message names the path and the cause in words (``no space left on device``, ``permission denied``).

Pure standard library: the planner uses it too.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from typing import Callable, IO, Union

Content = Union[bytes, str, Callable[[IO[bytes]], None]]

_CAUSES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
           errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
           errno.EROFS: "read-only file system", errno.ENOTDIR: "a parent is not a directory",
           errno.EISDIR: "is a directory", errno.ENAMETOOLONG: "file name too long",
           errno.EIO: "input/output error"}


class OutputError(ValueError):
    """An output path that cannot be written, or a write that failed; the message names path and cause."""


def describe_os_error(e: OSError) -> str:
    """A short cause in words for an ``OSError`` (``no space left on device``...)."""
    return _CAUSES.get(e.errno, e.strerror or type(e).__name__)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_output(path: str, what: str = "output file") -> str:
    """Refuse ``path`` unless it can become a regular file written by this process; returns the absolute path.

    Nothing is created. ``what`` names the file in the message (``"plan file"``, ``"--out"``...).
    """
    if not path:
        raise OutputError(f"{what}: empty path")
    full = os.path.abspath(path)
    try:
        st = os.stat(full)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        st = None  # found below, with the offending parent named
    except OSError as e:
        raise OutputError(f"{what} {path!r}: {describe_os_error(e)}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{what} {path!r} is {_kind(st.st_mode)}; give the path of a regular file to write")
    parent = os.path.dirname(full)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise OutputError(f"{what} {path!r}: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path!r}: cannot write in {parent!r} (permission denied)")
    return full


def write_file(path: str, content: Content, what: str = "output file") -> str:
    """Write ``content`` (bytes, text, or a function that writes to a binary file object) to ``path``
    atomically; returns the path written. Raises :class:`OutputError` naming the path and the cause."""
    full = check_output(path, what)
    d = os.path.dirname(full)
    tmp = None
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(full)}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            if callable(content):
                content(fh)
            else:
                fh.write(content.encode() if isinstance(content, str) else content)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _mode_for(full))
        os.replace(tmp, full)
        tmp = None
    except OSError as e:
        raise OutputError(f"cannot write {what} {path!r}: {describe_os_error(e)}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return path


def write_json(path: str, obj, what: str = "output file", *, indent: int | None = 1) -> str:
    """:func:`write_file` of ``obj`` as JSON (one trailing newline)."""
    return write_file(path, json.dumps(obj, indent=indent) + "\n", what)


def _mode_for(path: str) -> int:
    """An existing file keeps its mode; a new one gets 0666 less the umask (mkstemp's 0600 would hide it)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask
