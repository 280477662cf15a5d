#!/usr/bin/env python3
"""Pretrain Multitask-CLIP (ImageBind structure: vision, text, audio, depth, thermal and IMU encoders; one
contrastive task per modality pair) with Spindle, in the shape of Megatron-LM's pretrain scripts.

Run it under torchrun (see scripts/run_multitask_clip.sh); all flags: --help.
"""
import sys

from _launch import launch

if __name__ == "__main__":
    sys.exit(launch("multitask-clip"))
