#!/usr/bin/env python3
"""A Megatron-LM user's flags under ``--spindle``, run as the user runs them: each case through the launch script
(``scripts/run_multitask_clip.sh`` or ``run_qwen_val.sh``: its one-process check, then torchrun) on 2 CPU ranks of
the tiny model, in the built-in loop and, where ``megatron.training`` imports (``--mlm-python``, default
``.venv-mlm/bin/python``), in Megatron-LM's loop. Prints one row per case and loop: ``WORKS`` with the last
progress line, ``REFUSED`` with the refusal's line, or ``FAILED`` with the last line of output.

    python scripts/flag_cases.py --list                      # the cases
    python scripts/flag_cases.py --only tp2,pp2 --loops loop  # a few of them

Every case takes about half a minute per loop on 2 shared cores (the whole list: about an hour); run a few.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIP = os.path.join(ROOT, "scripts", "run_multitask_clip.sh")
QWEN = os.path.join(ROOT, "scripts", "run_qwen_val.sh")
#: What Megatron-LM's loop needs beside the script's own flags (it has no default for them).
MEGATRON_NEEDS = ["--lr", "1e-3", "--eval-interval", "1000", "--eval-iters", "0"]

#: (name, script, extra flags, environment); ``{tmp}`` is a scratch directory of the case.
CASES = (
    ("spindle-clip", CLIP, [], {}),
    ("spindle0-clip", CLIP, [], {"SPINDLE": "0"}),
    ("spindle-qwen", QWEN, [], {}),
    ("spindle0-qwen", QWEN, [], {"SPINDLE": "0"}),
    ("tp2", CLIP, ["--tensor-model-parallel-size", "2"], {}),
    ("pp2", CLIP, ["--pipeline-model-parallel-size", "2"], {}),
    ("sp", CLIP, ["--sequence-parallel"], {}),
    ("cp2", CLIP, ["--context-parallel-size", "2"], {}),
    ("distopt", CLIP, ["--use-distributed-optimizer"], {}),
    ("overlap", CLIP, ["--overlap-grad-reduce", "--overlap-param-gather"], {}),
    ("vpp", CLIP, ["--num-layers-per-virtual-pipeline-stage", "1"], {}),
    ("vpp-pp2", CLIP, ["--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-model-parallel-size", "2"], {}),
    ("ep2", CLIP, ["--expert-model-parallel-size", "2", "--num-experts", "2"], {}),
    ("bf16", CLIP, ["--bf16"], {}),
    ("fp16", CLIP, ["--fp16"], {}),
    ("fp32-grads", CLIP, ["--accumulate-allreduce-grads-in-fp32"], {}),
    ("gbs12", CLIP, ["--global-batch-size", "12"], {}),
    ("gbs16", CLIP, ["--global-batch-size", "16"], {}),
    ("rampup", CLIP, ["--rampup-batch-size", "8", "8", "16"], {}),
    ("mbs1", CLIP, [], {"MICRO_BATCH": "1", "CPU_MICRO_BATCH": "1"}),
    ("recompute-full", CLIP, ["--recompute-granularity", "full"], {}),
    ("recompute-selective", CLIP, ["--recompute-granularity", "selective"], {}),
    ("ckpt-torch", CLIP, ["--ckpt-format", "torch", "--save", "{tmp}/ckpt"], {}),
    ("bf16-save", CLIP, ["--bf16", "--save", "{tmp}/ckpt", "--save-interval", "2"], {}),
    ("exit2", CLIP, ["--exit-interval", "2"], {}),
    ("eval", CLIP, ["--eval-interval", "2", "--eval-iters", "1"], {}),
    ("data-path", CLIP, ["--data-path", "/nonexistent/data_text_document", "--split", "949,50,1"], {}),
    ("data-path-tokenizer", CLIP, ["--data-path", "/nonexistent/data_text_document", "--split", "949,50,1",
                                   "--tokenizer-type", "GPT2BPETokenizer"], {}),
    ("init-dropout", CLIP, ["--init-method-std", "0.5", "--hidden-dropout", "0.5", "--attention-dropout", "0.5"], {}),
    ("lr-schedule", CLIP, ["--lr-warmup-fraction", "0.5", "--lr-decay-iters", "100"], {}),
    ("train-samples", CLIP, ["--train-samples", "16"], {"TRAIN_ITERS": ""}),
    ("per-token", CLIP, ["--calculate-per-token-loss"], {}),
    ("te", CLIP, ["--transformer-impl", "transformer_engine"], {}),
    ("cyclic", CLIP, ["--dataloader-type", "cyclic"], {}),
    ("freeze-vit", CLIP, ["--freeze-ViT"], {}),
)


def run_case(name, script, extra, env_extra, loop: str, python: str, port: int) -> tuple[str, str]:
    """``(verdict, evidence)`` of one case in one loop."""
    with tempfile.TemporaryDirectory(prefix=f"flag_case_{name}_") as tmp:
        extra = (MEGATRON_NEEDS if loop == "megatron" else []) + [a.format(tmp=tmp) for a in extra]  # the case's win
        env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "GPUS_PER_NODE": "2",
               "TRAIN_ITERS": "2", "LOG_INTERVAL": "1", "OUT": os.path.join(tmp, "out"), "PYTHON": python,
               "SPINDLE_BACKEND": loop, "MASTER_PORT": str(port),
               "PYTHONPATH": ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
        env.update(env_extra)
        if env.get("TRAIN_ITERS") == "":
            env.pop("TRAIN_ITERS")
        r = subprocess.run(["bash", script, *extra], capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in (r.stderr + "\n" + r.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    progress = [line for line in lines if re.search(r"iteration\s+\d+/", line)]
    if r.returncode == 2 and errors:
        return "REFUSED", errors[0]
    if r.returncode == 0 and progress:
        return "WORKS", progress[-1]
    return "FAILED", f"exit {r.returncode}: " + (errors[0] if errors else lines[-1] if lines else "(no output)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--loops", default="loop,megatron", help="loop, megatron or both (default)")
    p.add_argument("--mlm-python", default=os.path.join(ROOT, ".venv-mlm", "bin", "python"),
                   help="the Python with megatron.training for Megatron-LM's loop")
    p.add_argument("--python", default=sys.executable, help="the Python for the built-in loop")
    p.add_argument("--port", type=int, default=29640, help="first master port (one per case)")
    p.add_argument("--list", action="store_true", help="print the cases and stop")
    a = p.parse_args(argv)
    cases = CASES
    if a.only:
        wanted = set(a.only.split(","))
        unknown = wanted - {c[0] for c in CASES}
        if unknown:
            p.error(f"unknown cases {sorted(unknown)}; --list shows them")
        cases = [c for c in CASES if c[0] in wanted]
    if a.list:
        for name, script, extra, env in cases:
            print(f"{name:22s} {os.path.basename(script)} {' '.join(extra)} {' '.join(f'{k}={v}' for k, v in env.items())}")
        return 0
    loops = a.loops.split(",")
    port = a.port
    for name, script, extra, env in cases:
        for loop in loops:
            python = a.mlm_python if loop == "megatron" else a.python
            verdict, evidence = run_case(name, script, extra, env, loop, python, port)
            port += 1
            print(f"| {name} | {loop} | {verdict} | {evidence[:300]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
