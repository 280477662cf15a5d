"""scripts/gpu_check.sh's logic, run on the CPU: every step runs (tiny sizes, gloo, Megatron-LM's loop with the
CPU stand-ins) and the script ends with one JSON summary naming each step's result.

Needs ``megatron.training`` (the Megatron step): runs under ``make test-megatron-lm``; skipped otherwise.
About 100 s on 2 cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training.training", reason="the Megatron step needs megatron-core >= 0.17")

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_script_runs_every_step_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "MASTER_PORT": "29741",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = summary["steps"]
    assert summary["gpu_check"] == {"gpu": False, "device": "cpu", "ok": True}, steps
    assert set(steps) == {"fp32", "bf16", "megatron", "profile_clip", "profile_qwen", "te"}
    assert float(steps["fp32"]["equivalence"]) < 1e-5
    assert steps["bf16"]["equivalence"] is not None and steps["megatron"]["last_iteration"] == "5"
    for name in ("profile_clip", "profile_qwen"):
        assert Path(steps[name]["curves_file"]).exists() and steps[name]["metaops"] > 0
    assert steps["te"]["available"] is False and "source build" in steps["te"]["detail"]
