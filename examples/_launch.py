"""Shared entry of the example pretrain scripts: default the model, then run the Spindle pretraining.

With Megatron-LM installed and a GPU, megatron_spindle.megatron.adapter installs its hooks into Megatron's
``pretrain``; otherwise the same hooks drive megatron_spindle's own loop on megatron.core (CPU with gloo
included). Bad input prints one line and exits with status 2.
"""
import sys


def launch(model: str) -> int:
    argv = sys.argv[1:]
    if not any(a.startswith("--spindle-model") for a in argv):
        argv = ["--spindle-model", model] + argv
    from megatron_spindle.megatron.adapter import main
    return main(argv)
