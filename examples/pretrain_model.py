#!/usr/bin/env python3
"""Pretrain any multi-task model given by a spec with Spindle: ``--spindle-model NAME|SPEC.toml`` (a shipped
model's name or a spec file, see docs/model_spec.md), in the shape of Megatron-LM's pretrain scripts.

Run it under torchrun, e.g. the LLaVA-style example on 4 CPU ranks:
    torchrun --nproc-per-node 4 examples/pretrain_model.py --spindle-model examples/models/llava.toml \
        --spindle-size tiny --spindle --train-iters 3 --spindle-check-equivalence
All flags: --help.
"""
import sys

from _launch import launch

if __name__ == "__main__":
    if not any(a.startswith("--spindle-model") for a in sys.argv[1:]) and "--help" not in sys.argv and "-h" not in sys.argv:
        print("error: --spindle-model NAME|SPEC.toml is required", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch("multitask-clip"))
