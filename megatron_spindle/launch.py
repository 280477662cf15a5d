"""``python -m megatron_spindle.launch [torchrun flags] SCRIPT [flags]``: torchrun, ending as the workers do.

The launch scripts (``scripts/run_multitask_clip.sh``, ``scripts/run_qwen_val.sh``) start training through
this instead of ``torchrun``. It runs torchrun's own code (:mod:`torch.distributed.run`: the same flags,
rendezvous, ``--max-restarts``, signal forwarding to the workers) and changes only how a failed run ends.
torchrun reports a failed worker group with a traceback of its own (``ChildFailedError``, 20 to 40 lines,
"To enable traceback see ...") under the workers' output, and exits 1 whatever happened; the workers have
already said what happened in one line and chosen an exit status (:mod:`.megatron.job.lifeline`). So:

* every worker that failed with one of those statuses (2 bad input, 3 a failed peer, 128 + N stopped by a
  signal) has printed its line: nothing is added;
* a worker that died otherwise (killed by a signal, or a crash with its own traceback above) gets one line:
  ``error: rank 1 (local rank 1, pid 4242 on node-3) was killed by SIGKILL``;
* the exit status is the workers': 2 if any rank found bad input, else 3 if any saw a peer fail, else the
  signal that stopped them (128 + N), else 128 + N of a killed rank, else 1.

When torchrun itself gets SIGINT or SIGTERM (Ctrl-C, a scheduler), it forwards the signal to the workers,
waits for them and raises its own ``SignalException``; the status is then the workers' (0 when they all
finished, as ``--exit-signal-handler`` does after saving), else 128 + N. torchrun reports no exit status of
workers it shut down, so :func:`_remember_exit_statuses` wraps its agent's ``_shutdown`` to read them.

torchrun's log lines about the same events (``failed (exitcode: 2)``, ``Sending process ... closing signal``,
``Received 2 death signal``) are dropped; its other messages pass.
"""
from __future__ import annotations

import logging
import signal
import socket
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

OURS = (2, 3)
#: torchrun log messages that only repeat what the workers and this launcher say.
_REPEATS = ("failed (exitcode", "closing signal", "death signal, shutting down", "OMP_NUM_THREADS")


class _DropRepeats(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(r in msg for r in _REPEATS)


def _describe(rank: int, f) -> str:
    where = f"rank {rank} (local rank {f.local_rank}, pid {f.pid} on {socket.gethostname()})"
    if f.exitcode < 0:
        try:
            name = signal.Signals(-f.exitcode).name
        except ValueError:
            name = f"signal {-f.exitcode}"
        return f"error: {where} was killed by {name}"
    msg = f.message if isinstance(f.message, str) else (f.message or {}).get("message", "")
    tail = f": {' '.join(str(msg).split())[:300]}" if msg and "To enable traceback" not in str(msg) else ""
    return f"error: {where} exited with status {f.exitcode}{tail}"


def status_of(failures: dict) -> tuple[int, list[str]]:
    """``(exit status, lines to print)`` for torchrun's failures ``{global rank: ProcessFailure}``."""
    codes = {f.exitcode for f in failures.values()}
    # torchrun SIGTERMs the rest of the group once one worker failed: that is its doing, not news
    news = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    lines = [_describe(r, f) for r, f in sorted(news.items()) if not (f.exitcode in OURS or 128 < f.exitcode < 160)]
    for code in OURS:
        if code in codes:
            return code, lines
    stopped = sorted(c for c in codes if 128 < c < 160)
    if stopped:
        return stopped[0], lines
    killed = sorted(-f.exitcode for f in news.values() if f.exitcode < 0)
    return (128 + killed[0] if killed else 1), lines


_SHUTDOWN_CODES: list[int] = []


def _remember_exit_statuses() -> None:
    """Record the workers' exit statuses when torchrun's agent shuts them down (on a signal to torchrun)."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent  # optional: internal
    except ImportError:  # pragma: no cover - another torch layout: fall back to 128 + N
        return
    if getattr(LocalElasticAgent._shutdown, "_spindle", False):
        return
    original = LocalElasticAgent._shutdown

    def _shutdown(self, *a, **kw):
        original(self, *a, **kw)
        handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", None) or {}
        _SHUTDOWN_CODES[:] = [h.proc.returncode for h in handlers.values() if h.proc.returncode is not None]

    _shutdown._spindle = True
    LocalElasticAgent._shutdown = _shutdown


def busy_port(args) -> str | None:
    """The line for a rendezvous port that is taken (torchrun would end in a traceback of its own)."""
    if args.rdzv_backend != "static" or args.node_rank != 0:
        return None
    with socket.socket() as s:
        try:
            s.bind(("", int(args.master_port)))
        except OSError:
            return (f"error: MASTER_PORT {args.master_port} is already in use (another job?): set MASTER_PORT to "
                    f"a free port")
    return None


def main(argv=None) -> int:
    for name in ("torch.distributed.run", "torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.agent.server.local_elastic_agent"):
        logging.getLogger(name).addFilter(_DropRepeats())
    _remember_exit_statuses()
    args = torchrun.parse_args(argv)
    busy = busy_port(args)
    if busy:
        print(busy, file=sys.stderr)
        return 2
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        status, lines = status_of(e.failures)
        for line in lines:
            print(line, file=sys.stderr)
        return status
    except SignalException as e:  # Ctrl-C or a scheduler's SIGTERM: forwarded to the workers, which said so
        codes = list(_SHUTDOWN_CODES)
        if codes and all(c == 0 for c in codes):
            return 0
        for code in (*OURS, *sorted(c for c in codes if 128 < c < 160)):
            if code in codes:
                return code
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
