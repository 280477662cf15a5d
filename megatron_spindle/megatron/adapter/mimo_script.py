"""Megatron-LM's own MIMO script, ``examples/mimo/train.py``, with ``--spindle``: its provider, trained by Spindle.

The patch in ``patches/`` makes the script call :func:`main` with its table of model providers (``_MODEL_PROVIDERS``)
and its own flags (``add_mimo_args``) when ``--spindle`` is on its command line. ``--model-provider NAME`` (the
script's flag, ``mock`` by default) picks the function, which Spindle then takes as ``--spindle-model-provider
MODULE:FUNCTION`` (the function's own module and name, imported as the script imports it); ``--spindle-tasks-file``
names the tasks, as for any MIMO provider (docs/mimo.md). The script's other flags parse and keep their defaults.
Spindle's data are its own (synthetic, or ``--spindle-data``): a ``--dataset-provider`` other than ``mock`` (the
script's synthetic batches) is refused in one line, as is a provider that is not a plain function (the script's
``video_llava_vlm`` is a ``functools.partial``).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Mapping

from ...log import setup_logging
from ..job.lifeline import LIFE
from ..trainer.session import run_entry
from .flags import preflight_main
from .hooks import pretrain_spindle


def provider_ref(providers: Mapping[str, Callable], argv: list[str]) -> str:
    """``MODULE:FUNCTION`` of the provider ``--model-provider`` names in ``argv``; ``ValueError`` (one line) else."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--model-provider", default="mock")
    p.add_argument("--dataset-provider", default="mock")
    known = p.parse_known_args(argv)[0]
    if known.dataset_provider != "mock":
        raise ValueError(f"--dataset-provider {known.dataset_provider}: under --spindle each task's data come from "
                         f"--spindle-data (per-task megatron-energon datasets) or are synthetic; drop the flag")
    fn = providers.get(known.model_provider)
    if fn is None:
        raise ValueError(f"--model-provider {known.model_provider}: not one of this script's providers "
                         f"({', '.join(providers)})")
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not name or "<" in name or "." in name:
        raise ValueError(f"--model-provider {known.model_provider}: {fn!r} is not a module-level function, which "
                         f"Spindle imports by name on every rank; use --spindle-model-provider MODULE:FUNCTION")
    return f"{module}:{name}"


def spindle_argv(providers: Mapping[str, Callable], argv: list[str]) -> list[str]:
    """``argv`` with ``--spindle-model-provider`` set from the script's ``--model-provider``."""
    if any(a.startswith("--spindle-model-provider") for a in argv):
        raise ValueError("--spindle-model-provider: this script's providers are picked with --model-provider NAME")
    return [*argv, "--spindle-model-provider", provider_ref(providers, argv)]


def main(providers: Mapping[str, Callable], extra_args_provider: Callable | None = None, argv=None,
         backend: str | None = None) -> int:
    """``examples/mimo/train.py --spindle``: :func:`.hooks.pretrain_spindle` on the script's provider, with its flags;
    ends as every entry does (one line and exit status 2 on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("SPINDLE_PREFLIGHT") == "1":  # the launch scripts' check in one process, before any worker
        try:
            argv = spindle_argv(providers, argv)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return preflight_main(argv, extra_args_provider=extra_args_provider)
    LIFE.start()
    setup_logging()
    status = run_entry(lambda: pretrain_spindle(extra_args_provider, argv=spindle_argv(providers, argv),
                                                backend=backend))
    if status or LIFE.signal:
        LIFE.exit(status)
    return status
