#!/usr/bin/env python3
"""Pretrain Qwen-VAL (a ViT-bigG-style vision encoder with a cross-attention adapter, a Whisper-style
audio encoder and a Qwen-7B-style LLM; tasks vision-language, audio-language, language) with Spindle,
in the shape of Megatron-LM's pretrain scripts.

Run it under torchrun (see scripts/run_qwen_val.sh). With Megatron-LM installed and a GPU, the hooks
of megatron_spindle.megatron.adapter plug into Megatron's ``pretrain``; otherwise the same hooks drive
megatron_spindle's own loop on megatron.core (CPU with gloo included). All flags: --help.
"""
import sys

DEFAULTS = ["--spindle-model", "qwen-val"]


def main() -> int:
    argv = sys.argv[1:]
    if not any(a.startswith("--spindle-model") for a in argv):
        argv = DEFAULTS + argv
    try:
        from megatron_spindle.megatron.adapter import pretrain_spindle
    except ImportError:  # the adapter needs nothing beyond megatron.core; this guards partial installs
        from megatron_spindle.megatron.loop import main as loop_main
        return loop_main(argv, description=__doc__.splitlines()[0])
    return pretrain_spindle(argv=argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
