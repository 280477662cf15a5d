"""Start-of-run checks that need the process group, and one line for a rendezvous that fails.

:func:`.args.check_args` runs every check that needs no peer on every rank before ``torch.distributed``
starts. What is left needs the job: the rendezvous itself (:func:`explain_init_error`) and the save
directory's free space against the size of this model's checkpoint (:func:`check_save_space`), which every
rank checks and all ranks agree on before any of them goes on.
"""
from __future__ import annotations

import os

from .. import comm
from .checkpoint import CheckpointError, checkpoint_bytes
from .ckpt_dir import check_save_dir


def explain_init_error(e: BaseException, timeout_s: float) -> ValueError | None:
    """A one-line ``ValueError`` for a failed ``init_process_group`` (busy port, unreachable rank 0), or
    ``None`` when the failure is something else."""
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    text = str(e).lower()
    if "address already in use" in text or "eaddrinuse" in text:
        return ValueError(f"MASTER_PORT {port} on {addr} is already in use (another job?): set MASTER_PORT to a "
                          f"free port")
    if "timed out" in text or "timeout" in text or "connection refused" in text:
        return ValueError(f"rank {os.environ.get('RANK', '?')} could not join the job at {addr}:{port} within "
                          f"{timeout_s:g} s (--spindle-timeout): is rank 0 running, and MASTER_ADDR right?")
    return None


def check_save_space(root: str, model, optimizer) -> int:
    """Refuse ``--save root`` on every rank alike unless its file system has room for two checkpoints of this
    model (the new one is written beside the last); collective. Returns the checkpoint's size in bytes."""
    need = checkpoint_bytes(model, optimizer)
    try:
        check_save_dir(root, need)
        error = None
    except ValueError as e:
        error = str(e)
    first = next((x for x in comm.all_gather_object(error) if x), None)
    if first:
        raise CheckpointError(first)
    return need
