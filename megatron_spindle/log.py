"""Logging: one ``megatron_spindle`` logger tree, rank 0 only, configured by the entry points.

Library modules call ``log = get_logger(__name__)`` and ``log.info(...)``; they never set levels or add
handlers. An entry point (the launchers, ``spindle`` subcommands, the profiler) calls :func:`setup_logging`
once: a plain ``%(message)s`` handler on stdout that passes records only on rank 0 (``RANK`` of the
launcher, or of ``torch.distributed`` once it is initialised), and third-party warnings about optional
packages that are missing collapsed into one line (megatron.core warns once per module that TransformerEngine
and Apex are not installed).

Pure standard library, so the planner may use it too.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings

ROOT = "megatron_spindle"

#: Prefixes of third-party warnings that only say an optional package is missing (megatron.core, per module).
OPTIONAL_PACKAGE_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "TransformerEngine not installed",
    "Transformer Engine is not installed",
)


def get_logger(name: str) -> logging.Logger:
    """The logger of a module of this package (``get_logger(__name__)``)."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


def rank() -> int:
    """This process's global rank: ``torch.distributed``'s once initialised, else the launcher's ``RANK``."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


class RankZeroFilter(logging.Filter):
    """Pass records on rank 0 only (a record with ``all_ranks=True`` in ``extra`` passes everywhere)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "all_ranks", False) or rank() == 0


class _OptionalPackageFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(p.lower() in msg.lower() for p in OPTIONAL_PACKAGE_WARNINGS)


_OPTIONAL_FILTER = _OptionalPackageFilter()


def quiet_optional_package_warnings() -> str:
    """Silence the repeated "not installed" warnings of optional packages; returns the one line to show."""
    for prefix in OPTIONAL_PACKAGE_WARNINGS:
        warnings.filterwarnings("ignore", message=prefix)
    # child processes (profiler workers, torchrun ranks) inherit the same filters
    extra = [f"ignore:{p}" for p in OPTIONAL_PACKAGE_WARNINGS]
    have = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join(have + [w for w in extra if w not in have])
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).addFilter(_OPTIONAL_FILTER)  # one instance: adding it again is a no-op
    have_te = importlib.util.find_spec("transformer_engine") is not None
    have_apex = importlib.util.find_spec("apex") is not None
    te = ("TransformerEngine importable: TE layer specs on CUDA" if have_te
          else "TransformerEngine not importable: megatron.core local specs")
    apex = "" if have_apex else "; Apex not importable: torch norms and optimizers"
    return te + apex


_CONFIGURED = False


def setup_logging(level: int = logging.INFO, *, stream=None, announce: bool = True) -> None:
    """Entry points only: rank-0 ``%(message)s`` handler on ``stream`` (stdout) and quiet optional-package
    warnings, announced in one line. Idempotent."""
    global _CONFIGURED
    if _CONFIGURED:
        return
    _CONFIGURED = True
    line = quiet_optional_package_warnings()
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RankZeroFilter())
    root = logging.getLogger(ROOT)
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    if announce:
        root.info(line)
