#!/usr/bin/env python3
"""Pretrain Qwen-VAL (a ViT-bigG-style vision encoder with a cross-attention adapter, a Whisper-style audio
encoder and a Qwen-7B-style LLM; tasks vision-language, audio-language, language) with Spindle, in the shape
of Megatron-LM's pretrain scripts.

Run it under torchrun (see scripts/run_qwen_val.sh); all flags: --help.
"""
import sys

from _launch import launch

if __name__ == "__main__":
    sys.exit(launch("qwen-val"))
