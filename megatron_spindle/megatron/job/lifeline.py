"""How a training process ends: a known exit status and one line; never an orphan, never a hang at start-up.

Exit statuses, the same in both loops and every entry point:

* ``0``: finished, or stopped by ``--exit-signal-handler`` after finishing the step and saving;
* ``2``: bad input, one line naming the value (under torchrun once: the first rank that fails says it);
* ``3``: a peer failed (died, stopped, never joined, or the start-up ran out of time), one line on every
  surviving rank naming the operation and the peer;
* ``128 + N``: stopped by signal N (``130`` SIGINT, ``143`` SIGTERM, ``129`` SIGHUP: a closed terminal, handled
  as SIGTERM is), one line naming the iteration and the last checkpoint.

The mechanisms, each what the kernel or torchrun already offers where one exists:

1. **No orphan** (:func:`bind_to_launcher`): under torchrun a worker asks the kernel to SIGKILL it when its
   launcher dies (``prctl(PR_SET_PDEATHSIG)``, what ``torch.multiprocessing.spawn`` arranges for its
   children through a private torch helper). Called at entry through ``ctypes``, not torch's helper: importing
   torch first takes seconds, a window in which a killed launcher would leave the worker running. A launcher
   that died even before that is seen as a parent that changed.
2. **Signals seen while blocked** (:class:`Lifeline`): Python runs a signal handler only when the main thread
   returns to Python, which a rank blocked in a rendezvous or a collective does not do for minutes. So the
   handlers do nothing themselves; ``signal.set_wakeup_fd`` hands every SIGINT, SIGTERM and SIGHUP to a watchdog
   thread, which decides: during start-up the process stops at once (one line on rank 0); during training
   the signal is recorded and the loop, after the step, agrees with every rank on stopping
   (:meth:`Lifeline.pending`, an all-reduce in the trainer, as Megatron-LM's ``DistributedSignalHandler``
   all-gathers its flag); a repeat of the signal two seconds or more after the first stops at once (torchrun
   forwards the terminal's Ctrl-C within milliseconds: that copy is not a repeat).
3. **A start-up deadline** (:meth:`Lifeline.arm`): the same thread ends a rank whose start-up (rendezvous,
   the ranks' agreement on flags and files) outlasts ``--spindle-startup-timeout``, with one line saying what
   it waited for, instead of waiting out ``--spindle-timeout`` in ``init_process_group``.
4. **One line under torchrun** (:func:`report_once`): every rank of a bad launch finds the same bad value;
   the first to claim a key in torchrun's own store (the agent's ``TCPStore`` its workers rendezvous through)
   prints it, the others stay silent.

Pure standard library (torch only inside :func:`report_once`, where a worker has it loaded already).
"""
from __future__ import annotations

import ctypes
import datetime
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

EXIT_BAD_INPUT = 2
EXIT_PEER = 3
REPEAT_S = 2.0
"""A signal repeated at least this long after the first stops at once (torchrun's forwarded copy is faster)."""
_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a run after the step (SIGHUP: the terminal closed; torchrun forwards it as it does SIGTERM)."""
SAVE_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals on which ``--exit-signal-handler`` finishes the step, saves and exits 0."""


def under_torchrun() -> bool:
    """Whether this process is a worker that torchrun (torch.distributed.elastic) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def bind_to_launcher() -> bool:
    """Under torchrun: SIGKILL this process when its launcher dies (Linux). Returns whether it is bound."""
    if not under_torchrun() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the launcher died before we asked: nobody will reap or signal us
        os._exit(EXIT_PEER)
    return True


def _write_line(line: str) -> None:
    try:
        os.write(2, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def report_once(line: str, key: str = "error") -> None:
    """Print ``line`` on stderr once per node and torchrun attempt: the first worker of this node to claim
    ``key`` in torchrun's agent store prints, the others stay silent (every node's launcher still shows it:
    each node's output may be read alone). Outside torchrun (ranks started by hand, one process) every caller
    prints: each is its own process that someone is watching."""
    if under_torchrun() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        try:
            import torch.distributed as dist  # optional: torch (a worker has it loaded; the preflight has not)
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=3), wait_for_workers=False)
            env = os.environ
            claim = (f"spindle/once/{env.get('TORCHELASTIC_RUN_ID')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                     f"{env.get('GROUP_RANK', '0')}/{key}")
            if store.add(claim, 1) != 1:
                return
        except Exception:  # noqa: BLE001 - no store to ask: better the line twice than never
            pass
    _write_line(line)


def say_per_node(line: str) -> None:
    """``line`` on stderr by local rank 0 under torchrun (once per node: each node's output may be read alone),
    else by rank 0: a line every rank of a job would print alike, such as a stop that all agreed on."""
    local = os.environ.get("LOCAL_RANK", "0") if under_torchrun() else str(env_rank())
    if local.strip() == "0":
        _write_line(line)


class Lifeline:
    """The process's watchdog: signals, the start-up deadline, and (without ``prctl``) the launcher's death.

    ``describe``: a callable returning how far the run got, for the stop line (the loops set it). One per
    process (:data:`LIFE`); :meth:`start` installs it from the main thread.
    """

    def __init__(self) -> None:
        self.signal = 0                 # the first stop signal received, 0: none
        self._first_at = 0.0
        self.phase = "start-up"         # "start-up" | "training" | "finishing"
        self.owned: set[int] = set()    # signals another handler acts on (Megatron's --exit-signal-handler)
        self.describe: Callable[[], str] = lambda: ""
        self.stop_now: Callable[[int], None] | None = None  # Megatron's loop: what an immediate stop says
        self._deadline: float | None = None
        self._limit = (0.0, "")
        self.stage = "starting"         # what start-up is doing, named if the deadline passes
        self._thread: threading.Thread | None = None
        self._ppid = os.getppid()
        self._bound = False
        self.cleanups: list[Callable[[], None]] = []  # run before any exit of this process (a save lock)

    # -- set-up -------------------------------------------------------------------------------------------
    def start(self) -> "Lifeline":
        """Bind to the launcher, install the signal handlers and the thread. Idempotent; from the main thread
        only (Python's rule for signal handlers)."""
        if self._thread is not None or threading.current_thread() is not threading.main_thread():
            return self
        self._bound = bind_to_launcher()
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, _note)
        self._thread = threading.Thread(target=self._watch, args=(r,), name="spindle-lifeline", daemon=True)
        self._thread.start()
        return self

    def arm(self, seconds: float, flag: str = "--spindle-startup-timeout") -> None:
        """End this rank with one line (naming :attr:`stage`, what it waited for) unless :meth:`disarm` comes
        within ``seconds`` (``flag`` sets them)."""
        self._deadline = time.monotonic() + seconds
        self._limit = (seconds, flag)

    def disarm(self) -> None:
        self._deadline = None

    def training(self) -> None:
        """From now on a signal is recorded and acted on after the step (see :meth:`pending`)."""
        self.disarm()
        self.phase = "training"

    def pending(self) -> int:
        """The stop signal this rank received (0: none); the trainer all-reduces it after each step."""
        return self.signal

    # -- the thread -----------------------------------------------------------------------------------------
    def _watch(self, fd: int) -> None:
        while True:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                for sig in os.read(fd, 64):
                    self._on_signal(sig)
            if not self._bound and under_torchrun() and os.getppid() != self._ppid:
                self._die(f"error: rank {env_rank()}: the launcher (pid {self._ppid}) is gone; stopping",
                          EXIT_PEER, everyone=True)
            if self._deadline is not None and time.monotonic() > self._deadline:
                seconds, flag = self._limit
                self._die(f"error: rank {env_rank()}: start-up did not finish within {seconds:g} s ({flag}): "
                          f"{self.stage}", EXIT_PEER, once=True)

    def _on_signal(self, sig: int) -> None:
        if sig not in STOP_SIGNALS or (sig in self.owned and self.phase == "training"):
            return
        now = time.monotonic()
        if self.phase == "finishing":
            return  # saving on the way out: torchrun's grace period bounds it
        if self.phase == "start-up":
            self._die(f"stopped by {signal_name(sig)} during start-up; nothing was trained", 128 + sig)
        if self.signal == 0:
            self.signal, self._first_at = sig, now
            if self.stop_now is not None:
                self.stop_now(sig)
            return
        if now - self._first_at >= REPEAT_S:
            self._die(f"stopped by a second {signal_name(sig)} without finishing the step"
                      + (f"; {self.describe()}" if self.describe() else ""), 128 + sig)

    def exit(self, status: int) -> None:
        """End the process now with ``status`` (the line is printed): skip the interpreter's shutdown, seconds
        of torch teardown during which the default signal handlers are back, so that torchrun's SIGTERM to
        the rest of a failed group would end this rank by signal instead of with its status."""
        for fn in self.cleanups:
            try:
                fn()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)

    def stop_with(self, line: str, status: int) -> None:
        """Stop the process now: ``line`` once per node (:func:`say_per_node`), then :meth:`exit`."""
        say_per_node(line)
        self.exit(status)

    def _die(self, line: str, status: int, *, everyone: bool = False, once: bool = False) -> None:
        if once:
            report_once(line, key="deadline")
        elif everyone or env_rank() == 0:
            _write_line(line)
        self.exit(status)


def _note(signum, frame) -> None:  # noqa: ARG001 - the watchdog thread acts on the signal (set_wakeup_fd)
    return None


LIFE = Lifeline()
