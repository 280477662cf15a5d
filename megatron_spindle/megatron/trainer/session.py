"""A run's start and end around the loop, shared by both loops: joining the job, resuming after a torchrun
restart, and how a run ends (:mod:`..job.lifeline` has the exit statuses).

* :func:`join_job`: ``init_process_group`` and the ranks' agreement on flags and files, both inside the
  start-up deadline;
* :func:`restart_source`: where a run resumes from, ``--load`` or, on a torchrun restart, its own ``--save``;
* :func:`run_entry`: a whole run, its end turned into an exit status and at most one line. With
  ``SPINDLE_NCCL_RULES=DIR`` in the environment the run imitates NCCL on gloo and records every
  ``torch.distributed`` call (:mod:`...runtime.comm_record`), and each rank that finishes writes its calls to
  ``DIR/rank<R>.pkl`` for :func:`...runtime.comm_check.check` (send, receive and collective order, deadlock
  freedom) to read them all.
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys

import torch
import torch.distributed as dist

from ... import comm
from ...atomic import write_file
from ...planner.assembly.validate import PlanError
from ...runtime import comm_record
from ..checkpoint.directory import latest_iteration
from ..job.lifeline import EXIT_BAD_INPUT, EXIT_PEER, LIFE, env_rank, report_once, signal_name
from ..job.preflight import agree_on_inputs, explain_init_error


def init_distributed(timeout_s: float) -> None:
    """``init_process_group`` from the launcher's environment (NCCL with CUDA, gloo without); a plain
    ``python script.py`` is a one-rank job."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    device = comm.device_id(backend)  # NCCL: this rank's GPU, the default communicator created eagerly on it
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, device_id=device)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout, device_id=device)
    except (RuntimeError, OSError) as e:  # torch's DistNetworkError / DistStoreError are RuntimeErrors
        raise (explain_init_error(e, timeout_s) or e) from None


def attempt_store(timeout: datetime.timedelta):
    """Under torchrun, its agent's store with a prefix of this attempt (``None`` otherwise: torch's own
    ``env://`` rendezvous).

    torch's ``env://`` rendezvous hands workers the agent's store without a prefix per attempt ("a new
    TCPStore for every retry"), but the agent keeps one store across ``--max-restarts`` attempts (static and
    c10d rendezvous alike, torch 2.13): process groups made after the default one (``new_group``) then read
    the previous attempt's gloo addresses and fail with ``connectFullMesh ... Connection refused``. The
    prefix keeps each attempt's keys apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        world_size=int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/spindle/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", tcp)


def join_job(args) -> None:
    """Start ``torch.distributed`` and agree with every rank on flags and files, within the start-up
    deadline (:mod:`..job.lifeline`): a rank that never comes, or comes with other flags, fails every rank fast."""
    LIFE.arm(min(args.spindle_startup_timeout, args.spindle_timeout))
    LIFE.stage = (f"waiting in init_process_group to join the job at {os.environ.get('MASTER_ADDR', '127.0.0.1')}:"
                  f"{os.environ.get('MASTER_PORT', '29512')} as rank {env_rank()} of "
                  f"{os.environ.get('WORLD_SIZE', '1')}; is every rank started, with the same MASTER_ADDR, "
                  f"MASTER_PORT and WORLD_SIZE?")
    init_distributed(args.spindle_timeout)
    LIFE.stage = "comparing flags and input files with the other ranks; a rank stopped or is still starting"
    agree_on_inputs(args)


def restart_source(args) -> tuple[str | None, int]:
    """``(checkpoint directory to resume from, torchrun attempt)``: ``--load``; on a torchrun restart
    (``--max-restarts``) without ``--load``, the run's own ``--save`` when it holds a checkpoint."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if args.load or not attempt or not args.save or latest_iteration(args.save) is None:
        return args.load, attempt
    return args.save, attempt


class Stopped(Exception):
    """Training stopped on a signal after a step; the line is printed. ``status``: 128 + the signal."""

    def __init__(self, sig: int) -> None:
        super().__init__(signal_name(sig))
        self.status = 128 + sig


def report_error(e: ValueError, plan_path: str | None = None) -> None:
    """One line on stderr for a configuration error (a plan's violated rules without the grid); under
    torchrun once per job (:func:`..job.lifeline.report_once`): every rank finds the same error."""
    if isinstance(e, PlanError):
        msg = "; ".join(str(v) for v in e.violations[:3])
        report_once(f"error: invalid plan {plan_path or ''}: {msg}".replace("  ", " "))
    else:
        report_once(f"error: {' '.join(str(e).split())}")


def run_entry(fn, plan_path: str | None = None) -> int:
    """Run ``fn`` (a whole training run) and turn how it ends into an exit status and at most one line
    (:mod:`..job.lifeline`): 2 bad input, 3 a failed peer (every surviving rank says which), 128 + N a signal."""
    rules = os.environ.get("SPINDLE_NCCL_RULES")
    recorder = comm_record.install(nccl_rules=True) if rules else None
    try:
        fn()
        if recorder is not None:
            write_file(os.path.join(rules, f"rank{env_rank()}.pkl"), pickle.dumps(recorder.events),
                       "SPINDLE_NCCL_RULES record")
        return 0
    except Stopped as e:
        return e.status
    except ValueError as e:
        report_error(e, plan_path)
        return EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001 - a failed exchange with a peer is a fault, anything else a bug
        if not comm.is_peer_failure(e):
            raise
        line = str(e) if isinstance(e, comm.PeerError) else f"rank {env_rank()}: {comm.first_line(e)}"
        print(f"error: {' '.join(line.split())}", file=sys.stderr, flush=True)
        return EXIT_PEER
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
