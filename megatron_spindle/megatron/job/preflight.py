"""Start-of-run checks that need the process group, and one line for a rendezvous that fails.

:func:`..adapter.flags.check_args` runs every check that needs no peer on every rank before ``torch.distributed``
starts. What is left needs the job: the rendezvous itself (:func:`explain_init_error`); the ranks' agreement
on their flags and input files (:func:`agree_on_inputs`: a node started with other flags fails every rank at
once, naming the flag, instead of a peer waiting out ``--spindle-timeout``); the save directory's lock
(:func:`hold_save_lock`); and its free space against the size of this model's checkpoint
(:func:`check_save_space`). Each is collective: every rank gets the same answer before any goes on.
"""
from __future__ import annotations

import hashlib
import os
import socket

import torch.distributed as dist

from ... import comm
from ...log import get_logger
from ...planner.assembly.communicators import peak_memory_bytes
from ...planner.workload.spec import resolve
from ..checkpoint.save_load import CheckpointError, checkpoint_bytes
from ..checkpoint.directory import SaveLock, check_save_dir
from .lifeline import LIFE

log = get_logger(__name__)

#: Flags whose files are compared by content as well as by name.
_FILE_FLAGS = ("spindle_plan", "spindle_curves", "spindle_tasks_file")
#: Outputs only rank 0 writes: the ranks agree on whether each is given, not on its path (a node's default
#: ``OUT`` is under its own checkout, which another host may keep elsewhere).
RANK0_OUTPUTS = ("spindle_trace", "spindle_gantt", "tensorboard_dir", "wandb_save_dir")


def _digest(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        return f"unreadable ({type(e).__name__})"
    return h.hexdigest()[:16]


def input_fingerprint(args, names=None) -> dict[str, str]:
    """``{what: value}`` that every rank of a job must share: the flags (``names``, default all of ``args``; of
    :data:`RANK0_OUTPUTS` only whether each is given), the content of the model spec, plan and curves files, and
    each energon dataset's prepared metadata."""
    flags = vars(args)
    out = {f"--{k.replace('_', '-')}": ("(a path on rank 0's host)" if k in RANK0_OUTPUTS and flags[k] else repr(flags[k]))
           for k in sorted(names or flags) if k in flags}
    model = flags.get("spindle_model")
    if model:
        try:
            out["the model spec file"] = _digest(resolve(model))
        except ValueError:
            pass
    for k in _FILE_FLAGS:
        if flags.get(k):
            out[f"the file of --{k.replace('_', '-')}"] = _digest(flags[k])
    data = flags.get("spindle_data")
    if data and os.path.isdir(data):
        for task in sorted(os.listdir(data)):
            meta = os.path.join(data, task, ".nv-meta")
            if os.path.isdir(meta):
                out[f"the dataset of task {task!r} in --spindle-data"] = _digest_dir(meta)
    return out


def _digest_dir(path: str) -> str:
    h = hashlib.sha256()
    for f in sorted(os.listdir(path)):
        h.update(f.encode() + b"\0" + _digest(os.path.join(path, f)).encode())
    return h.hexdigest()[:16]


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def agree_on_inputs(args, names=None) -> None:
    """Collective: raise the same ``ValueError`` on every rank, naming the first flag or file that differs
    between ranks, with the value each group of ranks has (and its host)."""
    mine = (socket.gethostname(), input_fingerprint(args, names))
    every = comm.all_gather_object(mine)
    for key in sorted({k for _, fp in every for k in fp}):
        values: dict[str, list[int]] = {}
        for r, (_, fp) in enumerate(every):
            values.setdefault(fp.get(key, "(not given)"), []).append(r)
        if len(values) > 1:
            parts = [f"{v} on {_ranks_text(rs)} (host {every[rs[0]][0]})" for v, rs in values.items()]
            what = "differs" if key.startswith("the ") else "has different values"
            raise ValueError(f"the ranks disagree: {key} {what}: {'; '.join(parts)}; start every rank with the "
                             f"same flags and files")


def hold_save_lock(root: str | None) -> SaveLock | None:
    """Collective: rank 0 takes ``root``'s lock for the run (:class:`..checkpoint.directory.SaveLock`); every rank raises
    the same line when another run holds it. Returns the lock on rank 0 (release it at the end)."""
    if not root:
        return None
    lock, error, warning = None, None, None
    if dist.get_rank() == 0:
        lock = SaveLock(root)
        try:
            warning = lock.acquire()
        except ValueError as e:
            lock, error = None, str(e)
    error = comm.all_gather_object(error)[0]
    if error:
        raise CheckpointError(error)
    if warning:
        log.warning(warning)
    if lock is not None:
        LIFE.cleanups.append(lock.release)  # a run that ends early leaves the lock free, not stale
    return lock



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


def _host_available_bytes() -> int | None:
    """Memory this machine can still give: ``MemAvailable``, less where a cgroup limit leaves less."""
    have = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
        with open("/sys/fs/cgroup/memory.current") as fh:
            used = int(fh.read().strip())
        if limit != "max" and have is not None:
            have = min(have, int(limit) - used)
    except (OSError, ValueError):
        pass
    return have


def check_machine_memory(plan, device) -> None:
    """Collective: :func:`machine_memory_error` on every rank, raised on every rank at once (a rank that
    raised alone would be ended by torchrun while the others still print)."""
    error = None
    try:
        machine_memory_error(plan, device)
    except ValueError as e:
        error = str(e)
    first = next((x for x in comm.all_gather_object(error) if x), None)
    if first:
        raise ValueError(first)


def machine_memory_error(plan, device) -> None:
    """Refuse a plan that cannot fit this machine before any layer is built, the same line on every rank:
    on a GPU, the device memory the plan fills on its fullest rank against the device's; on CPU ranks, which
    share the host's memory, the sum over the ranks of this node against what the host has available. The
    amounts are the planner's estimate (weights, gradients, optimizer state, activations; on GPUs the NCCL
    communicators' buffers too)."""
    need = list(plan.device_memory_bytes)
    gib = 2.0 ** 30
    if device.type == "cuda":
        need = peak_memory_bytes(plan)
        import torch  # optional here: only a CUDA run gets this far with a cuda device
        have = torch.cuda.get_device_properties(device).total_memory
        worst = max(range(len(need)), key=need.__getitem__)
        if need[worst] > have:
            raise ValueError(f"the plan fills {need[worst] / gib:.1f} GiB on rank {worst}'s device, this GPU has "
                             f"{have / gib:.1f} GiB: pass --spindle-memory-gib {have / gib * 0.9:.0f} (the planner "
                             f"fits the plan to it), or use more GPUs or a smaller --micro-batch-size")
        return
    have = _host_available_bytes()
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", len(need)) or len(need)))
    rank = dist.get_rank()
    here = [r for r in range(len(need)) if r // local == rank // local]
    total = sum(need[r] for r in here)
    if have is not None and total > have:
        raise ValueError(f"the plan needs about {total / gib:.1f} GiB of host memory for the {len(here)} rank(s) "
                         f"on this machine (the planner's estimate of weights, gradients, optimizer state and "
                         f"activations), {have / gib:.1f} GiB are available: use a smaller model (--spindle-size, "
                         f"MODEL_SIZE=tiny), fewer ranks per machine or a smaller --micro-batch-size")
