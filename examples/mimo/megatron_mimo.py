#!/usr/bin/env python3
"""Train your MIMO model with Megatron-LM's own loop and no Spindle (what ``scripts/run_mimo.sh`` runs with
``SPINDLE=0``): the user's provider, Megatron's DDP, optimizer and checkpoints, every module on every rank. The
same flags as ``pretrain_mimo.py``; needs ``megatron.training`` (megatron-core >= 0.17). docs/mimo.md.
"""
import sys

if __name__ == "__main__":
    from megatron_spindle.megatron.job.lifeline import LIFE  # standard library only: bound before torch loads

    LIFE.start()
    from megatron_spindle.log import setup_logging

    setup_logging()
    from megatron_spindle.megatron.adapter.mimo_megatron import main
    sys.exit(main(sys.argv[1:]))
