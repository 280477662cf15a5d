"""The built-in trainer's TensorBoard events and W&B log, on rank 0, with Megatron-LM's flags and tag names.

``--tensorboard-dir DIR`` writes events through torch's ``SummaryWriter`` (the ``tensorboard`` package);
``--wandb-project NAME`` (optional ``wandb`` package) logs the same scalars in offline mode, never over the
network (``wandb sync`` uploads a run later). Tags, per iteration (Megatron-LM's ``training_log`` names where
it has one):

* ``<task>``: each task's loss (Megatron logs every key of the loss dict under its own name, and our
  ``forward_step`` reports one key per task, so its own writer gets the same tags), ``learning-rate``,
  ``batch-size`` (samples of all tasks per step), ``grad-norm``, ``iteration-time`` (seconds);
* ``samples-per-second`` (Megatron logs FLOP/s as ``throughput`` instead);
* ``spindle/predicted-step-ms`` and ``spindle/measured-step-ms`` at every prediction line
  (``--spindle-predict-interval``).

A logger that fails (a full disk, a directory gone read-only, a W&B error) is dropped with one warning line
naming the flag and the cause; training goes on. TensorBoard's writer thread keeps its exception for the next
write (where it becomes that warning) and would also print it as a traceback: that printout is left out.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import threading

from ...atomic import describe_os_error
from ...log import get_logger

log = get_logger(__name__)

_PACKAGES = {"--tensorboard-dir": ("tensorboard_dir", "tensorboard", "pip install .[logs]"),
             "--wandb-project": ("wandb_project", "wandb", "pip install wandb (logged offline: no network)")}


def check_log_args(args) -> None:
    """Every rank, before anything starts: the packages the logging flags need are importable."""
    for flag, (attr, package, how) in _PACKAGES.items():
        value = getattr(args, attr, None)
        if value and importlib.util.find_spec(package) is None:
            raise ValueError(f"{flag} {value}: needs the {package} package: {how}")


class TrainLogs:
    """Scalars of a run on rank 0 (a no-op elsewhere and without the flags)."""

    def __init__(self, args, rank: int, *, config: dict | None = None) -> None:
        self.tb = self.wandb = None
        self.interval = max(1, getattr(args, "tensorboard_log_interval", 1) or 1)
        if rank != 0:
            return
        self.what = {"tb": f"--tensorboard-dir {getattr(args, 'tensorboard_dir', None)}",
                     "wandb": f"--wandb-project {getattr(args, 'wandb_project', None)}"}
        if getattr(args, "tensorboard_dir", None):
            from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard (--tensorboard-dir)
            _quiet_writer_threads()
            self.tb = SummaryWriter(log_dir=args.tensorboard_dir,
                                    max_queue=getattr(args, "tensorboard_queue_size", 1000) or 1000)
        if getattr(args, "wandb_project", None):
            import wandb  # optional: wandb (--wandb-project)
            save = args.wandb_save_dir or os.path.join(args.tensorboard_dir or ".", "wandb")
            os.makedirs(save, exist_ok=True)
            self.wandb = wandb.init(project=args.wandb_project, name=args.wandb_exp_name or None, dir=save,
                                    mode="offline", config=config or {})

    def _scalars(self, it: int, values: dict[str, float]) -> None:
        if self.tb is not None:
            with self._guard("tb"):
                for tag, v in values.items():
                    self.tb.add_scalar(tag, v, it)
        if self.wandb is not None:
            with self._guard("wandb"):
                self.wandb.log(values, step=it)

    @contextlib.contextmanager
    def _guard(self, which: str):
        """A failing logger is dropped with one warning; training goes on."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any failure of a logger: it is dropped, the run goes on
            cause = describe_os_error(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            log.warning(f"warning: {self.what[which]}: cannot write ({' '.join(str(cause).split())[:200]}); "
                        f"{'TensorBoard' if which == 'tb' else 'W&B'} logging stopped, training goes on")
            writer, _ = getattr(self, which), setattr(self, which, None)
            with contextlib.suppress(Exception):
                writer.close() if which == "tb" else writer.finish()

    def step(self, it: int, *, losses: dict[str, float], grad_norm: float, lr: float, batch_size: int,
             step_s: float) -> None:
        """One training iteration (``it`` counted from 1, as Megatron's)."""
        if (self.tb is None and self.wandb is None) or it % self.interval:
            return
        self._scalars(it, {**losses, "learning-rate": lr, "batch-size": batch_size, "grad-norm": grad_norm,
                           "iteration-time": step_s, "samples-per-second": batch_size / step_s if step_s > 0 else 0.0})

    def prediction(self, it: int, predicted_ms: float, measured_ms: float) -> None:
        self._scalars(it, {"spindle/predicted-step-ms": predicted_ms, "spindle/measured-step-ms": measured_ms})

    def close(self) -> None:
        if self.tb is not None:
            with self._guard("tb"):
                self.tb.close()
        if self.wandb is not None:
            with self._guard("wandb"):
                self.wandb.finish()
        self.tb = self.wandb = None


def _quiet_writer_threads() -> None:
    """Leave out the traceback TensorBoard's writer thread prints when a write fails (it keeps the exception
    and raises it at the next write in the main thread, where :meth:`TrainLogs._guard` names it)."""
    previous = threading.excepthook
    if getattr(previous, "_spindle", False):
        return

    def hook(a):
        if type(a.thread).__name__ == "_AsyncWriterThread" and "tensorboard" in type(a.thread).__module__:
            return
        previous(a)

    hook._spindle = True
    threading.excepthook = hook
