"""Run a function on several CPU processes joined by a gloo process group (multi-process tests).

``run_ranks(fn, world_size, *args, timeout_s=...)`` spawns ``world_size`` processes, points them at a free
port (a socket bound to port 0), calls ``init_process_group("gloo")``, runs ``fn(rank, world_size, *args)``
and returns every rank's return value (which must pickle), in rank order. If any rank raises, dies or the
timeout passes, every other rank is killed at once and the error lists each rank's traceback (or exit code).

Process starts cost seconds (importing torch and megatron.core), so a test module should start processes
once and run several cases inside ``fn``. ``fn`` must be importable (a module-level function).

**NCCL's rules** (``nccl_rules=True``, the default): gloo is lenient where NCCL is strict, so every rank runs
under :mod:`megatron_spindle.runtime.comm_record` with ``nccl_rules``: ``batch_isend_irecv`` returns ONE work
for the whole batch (what NCCL returns), a tensor off the communication device is refused, and every
``torch.distributed`` call is recorded. When ``fn`` has returned on every rank, the ranks' records are
gathered and checked (:func:`megatron_spindle.runtime.comm_check.check`): the same groups created in the same
order, every communicator's collectives in one order on all its members, each pair's sends and receives
matched in posting order (NCCL has no tags), and no deadlock when each rank's operations complete in issue
order. A broken rule fails the test with the checker's lines.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import subprocess
import time
import traceback
from typing import Any, Callable

_ENV = {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def communicate_all(procs, timeout_s: float) -> list[tuple[int, str, str]]:
    """``(exit status, stdout, stderr)`` of each started process, in order; past ``timeout_s`` on one of them,
    every process is killed and the timeout raised (no rank is left behind)."""
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, so or "", se or ""))
    return out


def _nccl_rules_check(recorder) -> None:
    """Gather every rank's recorded calls and fail on any broken NCCL rule (all ranks raise the same)."""
    from megatron_spindle import comm
    from megatron_spindle.runtime import comm_check, comm_record

    events = list(recorder.events)
    comm_record.uninstall()  # the gather below is the harness's own, not the code under test
    errors = comm_check.check(comm.all_gather_object(events))
    if errors:
        raise AssertionError("NCCL's rules broken (comm_check):\n" + "\n".join(errors))


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results,
            nccl_rules: bool = True) -> None:
    os.environ.update(_ENV)
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    try:
        import torch.distributed as dist

        from megatron_spindle.compat.cpu import apply_cpu_patches

        apply_cpu_patches()  # the entry point's job, as in the launchers (a no-op with CUDA)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            recorder = None
            if nccl_rules:
                from megatron_spindle.runtime import comm_record

                recorder = comm_record.install(nccl_rules=True)
            value = fn(rank, world_size, *args)
            if recorder is not None:
                _nccl_rules_check(recorder)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        pickle.dumps(value)  # an unpicklable result fails here, with a traceback, not in the queue's thread
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def _drain(results, values: dict, errors: dict, *, grace_s: float) -> None:
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            rank, ok, value = results.get(timeout=max(0.01, end - time.monotonic()))
        except queue.Empty:
            return
        (values if ok else errors)[rank] = value


class RanksFailed(AssertionError):
    """At least one rank failed; the message holds every rank's traceback or exit status."""


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
              nccl_rules: bool = True, grace_s: float = 1.0) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each run in its own process, under NCCL's
    rules unless ``nccl_rules=False`` (see the module docstring). After the first failure the other ranks'
    failures are collected for ``grace_s`` seconds before every rank is killed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # not daemonic: megatron.core's checkpoint writer starts a multiprocessing Manager (a child process);
    # every process is killed in the finally clause below anyway
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, nccl_rules), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) + len(errors) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
                (values if ok else errors)[rank] = value
                if errors:
                    _drain(results, values, errors, grace_s=grace_s)  # tracebacks of ranks failing with it
                    break
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in values and r not in errors]
            if dead:
                _drain(results, values, errors, grace_s=0.5)
                for r in dead:
                    errors.setdefault(r, f"process exited with code {procs[r].exitcode}")
                break
            if time.monotonic() > deadline:
                for r in range(world_size):
                    if r not in values and r not in errors:
                        errors[r] = f"no result within {timeout_s:.0f} s"
                break
    finally:
        if not errors:  # let finished ranks run their exit handlers (checkpoint writers' helper processes)
            for p in procs:
                p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        missing = sorted(set(range(world_size)) - set(values) - set(errors))
        if missing:
            report += f"\n--- ranks {missing}: killed after the first failure ---"
        raise RanksFailed(f"{len(errors)} of {world_size} ranks failed:\n{report}")
    return [values[r] for r in range(world_size)]
