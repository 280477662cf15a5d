#!/usr/bin/env python3
"""Measured curves of every distinct MetaOp shape of Multitask-CLIP-10, OFASys-7 and Qwen-VAL on this one
device (a step of scripts/gpu_check.sh).

One process, one process group for all three models (started as the trainer starts it: NCCL on a GPU, in bf16;
gloo and fp32 on a CPU), each model profiled by ``spindle profile``'s own code (:func:`megatron_spindle.profiler.
run.profile`) at per-device batches from the model's whole batch down to 1 sample (``--max-devices`` 64: the
largest batch is 64), tensor parallelism 1. What one device cannot measure is left out and named in the
curves file's ``not_measured`` (``--skip-unmeasurable``): MetaOps planned at tensor parallelism above 1 for
this device's memory, and points that run out of memory. Each model's curves file is written as soon as it is
measured, so a run cut off later keeps the earlier ones. Prints one JSON line per model:
``{"curves": {"model": ..., "file": ..., "curves": N, "metaops": M, "not_measured": [...], "seconds": S}}``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch.distributed as dist

from megatron_spindle.megatron.trainer.session import init_distributed
from megatron_spindle.profiler.run import ProfileConfig, profile

MODELS = (("multitask-clip", 10, "multitask_clip_10"), ("ofasys", 7, "ofasys_7"), ("qwen-val", None, "qwen_val"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="full", help="model size (tiny: the CPU dry run)")
    p.add_argument("--out-dir", required=True, help="where the curves files go")
    p.add_argument("--tag", required=True, help="device tag in the file names, e.g. h200")
    p.add_argument("--max-devices", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="one repeat, no warm-up, up to 4 devices (the dry run)")
    args = p.parse_args(argv)
    timing = dict(warmup=2, repeats=5, min_seconds=0.05, max_devices=args.max_devices)
    if args.quick:
        timing = dict(warmup=0, repeats=1, min_seconds=0.0, max_devices=4)
    os.environ.setdefault("MASTER_PORT", "29656")
    init_distributed(120.0)
    try:
        for model, tasks, name in MODELS:
            t0 = time.perf_counter()
            out = os.path.join(args.out_dir, f"curves_{args.tag}_{name}.json")
            doc = profile(ProfileConfig(model=model, tasks=tasks, size=args.size, nproc=1, out=out, **timing,
                                        cache=None, measure_link=False, skip_unmeasurable=True))
            print(json.dumps({"curves": {
                "model": model, "tasks": tasks, "file": out, "curves": len(doc["curves"]),
                "metaops": sum(len(c["metaops"]) for c in doc["curves"]),
                "local_batches": sorted({d["local_batch"] for c in doc["curves"] for d in c["detail"]}),
                "device": doc["measured"].get("device_type"), "dtype": doc["measured"].get("dtype"),
                "not_measured": [{"metaops": n["metaops"], "reason": n["reason"]} for n in doc["not_measured"]],
                "seconds": round(time.perf_counter() - t0, 1)}}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
