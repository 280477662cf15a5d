#!/usr/bin/env python3
"""Write a tiny multi-modal dataset in megatron-energon's format: one prepared webdataset per task.

    python scripts/make_energon_dataset.py --model multitask-clip --tasks 4 --size tiny --samples 256 \\
        --out out/energon_tiny

For every task of the model (a shipped name or a spec file) it makes ``--samples`` samples on the spot and
writes them as webdataset shards to ``OUT/<task>/``, then runs ``energon prepare OUT/<task>
--non-interactive --split-ratio 1,0,0 --sample-type CrudeWebdataset``. Each sample has one part per data
stream of the task (see ``megatron_spindle/data/energon.py``): patch streams as PNG images (one patch of
``input_dim / 3`` RGB pixels per row; ``.npy`` when ``input_dim`` is not a multiple of 3), token streams and
labels as ``.npy`` token ids. Samples are learnable: each has a class; its images are the class's pattern
plus noise, its text starts with the class's tokens, and labels are the next tokens of the text.
Train on it with ``--spindle-data OUT``.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import sys

import numpy as np

CLASSES = 8


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def _parts(specs: dict, rng: np.random.Generator, patterns: dict, cls: int) -> dict[str, bytes]:
    """One sample's parts ``{"<stream>.<ext>": bytes}``."""
    out = {}
    text = None
    for stream, spec in specs.items():
        shape = tuple(spec.shape)
        if spec.dtype.is_floating_point:
            pattern = patterns.setdefault(stream, rng.uniform(0, 1, size=(CLASSES, *shape)))
            x = np.clip(pattern[cls] + rng.normal(0, 0.1, size=shape), 0, 1)
            if shape[1] % 3 == 0:
                out[f"{stream}.png"] = _png((x.reshape(shape[0], shape[1] // 3, 3) * 255).astype(np.uint8))
            else:
                buf = io.BytesIO()
                np.save(buf, (x * 2 - 1).astype(np.float32))
                out[f"{stream}.npy"] = buf.getvalue()
        elif stream != "labels":
            v = spec.vocab_size
            toks = rng.integers(0, v, size=shape[0] + 1)
            toks[: min(2, shape[0])] = [(cls * 7 + i) % v for i in range(min(2, shape[0]))]
            text = toks
            buf = io.BytesIO()
            np.save(buf, toks[:-1].astype(np.int64))
            out[f"{stream}.npy"] = buf.getvalue()
    if "labels" in specs:
        n, v = specs["labels"].shape[0], specs["labels"].vocab_size
        labels = text[-n:] if text is not None and len(text) > n else rng.integers(0, v, size=n)
        buf = io.BytesIO()
        np.save(buf, np.asarray(labels, dtype=np.int64))
        out["labels.npy"] = buf.getvalue()
    return out


def write_task(path: str, specs: dict, samples: int, seed: int, shard_size: int) -> None:
    import webdataset as wds

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    patterns: dict = {}
    with wds.ShardWriter(os.path.join(path, "part-%04d.tar"), maxcount=shard_size, verbose=0) as sink:
        for i in range(samples):
            sink.write({"__key__": f"{i:06d}", **_parts(specs, rng, patterns, int(rng.integers(CLASSES)))})


def energon_prepare(path: str) -> None:
    """``energon prepare PATH --non-interactive --split-ratio 1,0,0 --sample-type CrudeWebdataset``."""
    import contextlib

    from megatron.energon.tools.prepare import command
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            command.main([path, "--non-interactive", "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset",
                          "--force-overwrite", "--no-progress"], standalone_mode=False)
    except BaseException:
        print(said.getvalue(), file=sys.stderr)
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="multitask-clip", help="a shipped model or a spec file")
    p.add_argument("--tasks", type=int, default=None, help="first K tasks (default: the most)")
    p.add_argument("--size", default="tiny")
    p.add_argument("--samples", type=int, default=256, help="samples per task")
    p.add_argument("--shard-size", type=int, default=64, help="samples per tar shard")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="directory: one dataset per task goes to OUT/<task>")
    args = p.parse_args(argv)
    from megatron_spindle.models.data import stream_specs
    from megatron_spindle.planner.workload.workloads import build_graph
    try:
        graph = build_graph(args.model, tasks=args.tasks, size=args.size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.samples < 1 or args.shard_size < 1:
        print("error: --samples and --shard-size must be positive", file=sys.stderr)
        return 2
    for i, (task, specs) in enumerate(stream_specs(graph).items()):
        path = os.path.join(args.out, task)
        shutil.rmtree(path, ignore_errors=True)
        write_task(path, specs, args.samples, args.seed * 1000 + i, args.shard_size)
        energon_prepare(path)
        parts = sorted(s + (".png" if v.dtype.is_floating_point and v.shape[1] % 3 == 0 else ".npy")
                       for s, v in specs.items())
        print(f"{path}: {args.samples} samples, parts {', '.join(parts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
