#!/usr/bin/env python3
"""Train your own Megatron MIMO model with Spindle: ``--spindle-model-provider MODULE:FUNCTION`` (a model provider
returning a ``MimoModel``, importable from PYTHONPATH) and ``--spindle-tasks-file TASKS.toml``, plus Megatron-LM's
training flags and ``--spindle``; Megatron-LM's ``pretrain`` where it runs, else the built-in megatron.core loop
(as every pretrain script here, see examples/_launch.py). docs/mimo.md.

    PYTHONPATH=. torchrun --nproc-per-node 4 examples/mimo/pretrain_mimo.py --spindle \\
        --spindle-model-provider examples.mimo.tiny_avlm:tiny_avlm --spindle-tasks-file examples/mimo/tiny_tasks.toml \\
        --train-iters 3 --spindle-check-equivalence
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/: the shared entry
from _launch import launch  # noqa: E402

if __name__ == "__main__":
    if not any(a.startswith("--spindle-model-provider") for a in sys.argv[1:]) and not {"-h", "--help"} & set(sys.argv):
        print("error: --spindle-model-provider MODULE:FUNCTION is required (and --spindle-tasks-file)", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch("multitask-clip"))  # the name is never used: --spindle-model-provider names the model
