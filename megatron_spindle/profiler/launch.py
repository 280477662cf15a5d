"""Start ``nproc`` local processes joined by one process group and collect what each returns.

:func:`spawn` is what ``spindle profile`` and ``scripts/bench_cpu.py`` use when they are not run under
``torchrun``: ``spawn`` start method, a free local port, NCCL with one GPU per process when CUDA is available,
else gloo; ``OMP_NUM_THREADS`` defaults to cores / processes (``torchrun`` would set 1). If a process raises or
dies, the others are killed at once and the first error is raised here (a ``ValueError`` as itself, so bad
input stays one line; anything else as ``RuntimeError`` with the process's traceback).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import comm
from ..log import setup_logging


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def threads_per_process(nproc: int) -> int:
    """``OMP_NUM_THREADS`` if set, else the cores shared evenly (at least 1)."""
    return int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, (os.cpu_count() or 1) // nproc)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, nproc: int, port: int, args: tuple, results) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc)})
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    setup_logging(announce=False)  # a worker is an entry point: rank-0 progress lines, quiet optional packages
    try:
        torch.set_num_threads(threads_per_process(nproc))
        dist.init_process_group(backend(), rank=rank, world_size=nproc, device_id=comm.device_id(backend()))
        try:
            value = fn(rank, nproc, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        results.put((rank, False, f"ValueError: {e}" if isinstance(e, ValueError) else traceback.format_exc()))


def spawn(fn: Callable, nproc: int, *args: Any, timeout_s: float | None = None) -> list[Any]:
    """``[fn(0, nproc, *args), …, fn(nproc - 1, nproc, *args)]``, each in its own process (``fn`` importable)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, nproc, port, args, results), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while len(values) < nproc and not errors:
            try:
                rank, ok, value = results.get(timeout=0.5)
                (values if ok else errors)[rank] = value
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
            if dead:
                time.sleep(0.5)  # a traceback may be on its way
                while True:
                    try:
                        rank, ok, value = results.get_nowait()
                    except queue.Empty:
                        break
                    (values if ok else errors)[rank] = value
                for r in dead:
                    errors.setdefault(r, f"process exited with code {procs[r].exitcode}")
            elif deadline is not None and time.monotonic() > deadline:
                errors[min(set(range(nproc)) - set(values))] = f"no result within {timeout_s:.0f} s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    if errors:
        first = min(errors)
        msg = errors[first]
        if msg.startswith("ValueError: "):
            raise ValueError(msg[len("ValueError: "):])
        raise RuntimeError(f"process {first} of {nproc} failed:\n{msg}")
    return [values[r] for r in range(nproc)]
