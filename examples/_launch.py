"""Shared entry of the example pretrain scripts: default the model, then run the Spindle pretraining.

With Megatron-LM installed and a GPU, megatron_spindle.megatron.adapter.hooks installs its hooks into Megatron's
``pretrain``; otherwise the same hooks drive megatron_spindle's own trainer on megatron.core (CPU with gloo
included). ``SPINDLE_BACKEND=megatron`` runs Megatron-LM's loop even without a GPU (its CUDA-only start-up
stood in for by megatron_spindle.compat.megatron_lm); ``=loop`` forces the built-in trainer.

How it ends (megatron_spindle.megatron.job.lifeline): bad input prints one line and exits with status 2, a failed
peer 3, a signal 128 + N. ``SPINDLE_PREFLIGHT=1`` only checks the flags and input files in this one process
(no torch, no worker) and exits 0 or 2: the launch scripts run it before torchrun starts any worker.
"""
import os
import sys


def launch(model: str) -> int:
    from megatron_spindle.megatron.job.lifeline import LIFE  # standard library only: bound before torch loads

    LIFE.start()
    argv = sys.argv[1:]
    if not any(a.startswith("--spindle-model") for a in argv):
        argv = ["--spindle-model", model] + argv
    if os.environ.get("SPINDLE_PREFLIGHT") == "1":
        from megatron_spindle.megatron.adapter.flags import preflight_main
        return preflight_main(argv)
    from megatron_spindle.log import setup_logging

    setup_logging()  # before megatron.core is imported: its optional-package warnings become one line
    from megatron_spindle.megatron.adapter.hooks import main
    return main(argv)
