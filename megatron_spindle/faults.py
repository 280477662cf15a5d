"""Fault injection for the reliability tests: kill this rank at a named point of a named iteration.

``SPINDLE_FAULT=RANK:ITERATION:POINT`` (e.g. ``1:4:save-written``) makes rank ``RANK`` send itself SIGKILL when
it reaches ``POINT`` while handling iteration ``ITERATION``; unset (always, outside tests), :func:`point` costs
one dictionary lookup. The points are where a real crash hurts most (see ``checkpoint.save_checkpoint``):
``save-start`` (before anything is written), ``save-written`` (this rank's shards written, the checkpoint not
yet complete), ``save-renamed`` (rank 0: the directory is in place, the tracker still names the last one) and
``save-done`` (after the save). A fault fires in the first attempt of a torchrun job only: the attempts that
``--max-restarts`` starts afterwards run clean, as a restarted job would.
"""
from __future__ import annotations

import os
import signal

POINTS = ("save-start", "save-written", "save-renamed", "save-done")


def point(name: str, iteration: int, rank: int) -> None:
    spec = os.environ.get("SPINDLE_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        return
    r, it, where = spec.split(":")
    if int(r) == rank and int(it) == iteration and where == name:
        os.kill(os.getpid(), signal.SIGKILL)
