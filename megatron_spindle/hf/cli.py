"""``spindle hf spec DIR`` and ``spindle hf check DIR``: a local Hugging Face model directory, no hub.

``spec`` prints the spec modules that match the checkpoint (``--model-spec``: a whole spec with one task and
``init`` set, which trains as is); ``check`` loads the model into Spindle's layers (``--tp N``: on N local
processes, tensor-parallel) and into ``transformers``, and prints ``max relative difference X``; exit status
1 above ``--tolerance``. Both only read the directory; torch and transformers load only for ``check``.
"""
from __future__ import annotations

import argparse
import math
import os

from ..argtypes import positive_int
from ..models.hf_config import model_spec_toml, modules_toml, read_config, temperature, towers
from ..models.hf_files import check_weight_files


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``spindle hf`` on the ``spindle`` command's subparsers."""
    p = subparsers.add_parser("hf", help="pretrained Hugging Face models: matching spec modules, forward check")
    sub = p.add_subparsers(dest="hf_command", required=True)
    s = sub.add_parser("spec", help="print the spec modules matching a Hugging Face model directory")
    s.add_argument("dir", help="a local model directory (config.json and *.safetensors, from save_pretrained)")
    s.add_argument("--module", default=None, metavar="NAME",
                   help="only this tower: vision or text (CLIP), llm (Llama, Qwen2)")
    s.add_argument("--model-spec", action="store_true",
                   help="print a whole spec (one task, [model] init set to DIR) that trains as is")
    s.add_argument("--batch", type=positive_int, default=8, help="global batch of the --model-spec task")
    s.add_argument("--seq-length", type=positive_int, default=64,
                   help="text tokens of the --model-spec task (CLIP text: at most its positions)")
    s.set_defaults(func=cmd_spec)
    c = sub.add_parser("check", help="the same random input through our layers and transformers")
    c.add_argument("dir", help="a local model directory (config.json and *.safetensors)")
    c.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree: local processes (default 1)")
    c.add_argument("--batch", type=positive_int, default=2, help="samples of the random input")
    c.add_argument("--seed", type=int, default=0, help="seed of the random input")
    c.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest relative difference accepted (default 1e-5, fp32); exit status 1 above it")
    c.set_defaults(func=cmd_check)
    return p


def _towers(args):
    ts = towers(args.dir)
    if args.module is not None:
        chosen = [t for t in ts if t.name == args.module]
        if not chosen:
            raise ValueError(f"--module {args.module!r}: {args.dir} has towers {', '.join(t.name for t in ts)}")
        ts = chosen
    return ts


def _logit_scale(path: str) -> float | None:
    """CLIP's trained ``logit_scale`` from the checkpoint (None without torch/safetensors or the tensor)."""
    try:
        from ..models.pretrained import Checkpoint  # optional: torch + safetensors only to read one scalar
        ckpt = Checkpoint(path)
        return float(ckpt.read("logit_scale", ())) if ckpt.shape("logit_scale") is not None else None
    except (ImportError, ValueError):
        return None


def cmd_spec(args) -> int:
    ts = _towers(args)
    cfg = read_config(args.dir)
    if args.model_spec:
        temp = temperature(args.dir, _logit_scale(args.dir)) if cfg["model_type"] == "clip" else 0.07
        name = os.path.basename(os.path.normpath(args.dir)) or "pretrained"
        print(model_spec_toml(args.dir, ts, name=name, batch=args.batch, seq_length=args.seq_length,
                              temp=round(temp, 6)), end="")
        return 0
    print(f"# modules matching {args.dir} ({cfg['model_type']}); load them with "
          + " ".join(f"--spindle-init {t.name}={args.dir}" for t in ts))
    if any(t.name in ("vision", "text") and not t.projection for t in ts):
        print("# the checkpoint has no projection: the pool head's proj keeps its initialisation")
    print(modules_toml(ts), end="")
    return 0


def cmd_check(args) -> int:
    from .check import compare  # optional: torch, megatron.core and transformers, only for the check
    from ..profiler.launch import spawn  # optional: torch (local processes for --tp)

    if not (math.isfinite(args.tolerance) and args.tolerance > 0):
        raise ValueError(f"--tolerance {args.tolerance}: must be a positive number")
    read_config(args.dir)
    check_weight_files(args.dir)  # a truncated file or a missing shard: one line before torch loads
    if args.tp == 1:
        rows = compare(0, 1, args.dir, args.batch, args.seed)
    else:
        rows = spawn(compare, args.tp, args.dir, args.batch, args.seed)[0]
    for name, shape, diff in rows:
        print(f"  {name} {shape}: {diff:.3e}")
    worst = max(d for _, _, d in rows)
    print(f"max relative difference {worst:.3e} (tp {args.tp}, fp32, batch {args.batch})")
    if worst > args.tolerance:
        print(f"above the tolerance {args.tolerance:g}")
        return 1
    return 0
