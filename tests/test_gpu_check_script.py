"""scripts/gpu_check.sh's dry run (``GPU_CHECK_DRY_RUN=1``): every step of the GPU check on the CPU at tiny sizes
(gloo, Megatron-LM's loop with the CPU stand-ins), checking what the lent machine allows: at most 8 files come
back from ``$OUT``, the summary JSON is complete and valid after every step (a run cut off anywhere still
reports), and the steps' time budgets add to under 8 minutes (480 s).

Needs ``megatron.training`` (the Megatron step): runs under ``make test-megatron-lm``; skipped otherwise.
About 100 s on 2 busy cores.
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
STEPS = ["wheels", "nccl", "runtime", "fp32", "bf16", "megatron", "curves", "compare"]
MAX_FILES = 8  # what the device tool brings back from $OUT
LIMIT_S = 480  # one command under 8 minutes


def check_summary(doc: dict) -> None:
    """The summary's shape, whatever the point of the run: every step finished or pending, in order."""
    assert set(doc) == {"gpu_check", "steps", "pending"}
    assert list(doc["steps"]) + doc["pending"] == STEPS
    run = doc["gpu_check"]
    assert run["dry_run"] is True and run["gpu"] is False and run["device"] == "cpu"
    assert list(run["budgets_s"]) == STEPS and run["budget_total_s"] == sum(run["budgets_s"].values()) < LIMIT_S
    assert run["complete"] is (not doc["pending"])
    for name, step in doc["steps"].items():
        assert {"ok", "exit", "seconds", "budget_s"} <= set(step) and step["budget_s"] == run["budgets_s"][name]


def test_gpu_check_dry_run_reports_after_every_step(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "MASTER_PORT": "29741", "GPU_CHECK_DRY_RUN": "1",
           "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, seen = [], []
    try:
        for line in proc.stdout:  # "== STEP: exit ..." is printed once the summary holds STEP
            lines.append(line)
            if line.startswith("== ") and line.split(":")[0][3:] in STEPS:
                name = line.split(":")[0][3:]
                doc = json.loads((out / "gpu_check.json").read_text())  # valid JSON (written atomically)
                check_summary(doc)
                assert all(s in doc["steps"] for s in STEPS[:STEPS.index(name) + 1]), (name, doc["pending"])
                seen.append(name)
        proc.wait(timeout=600)
    finally:
        proc.kill()
    log = "".join(lines)
    assert proc.returncode == 0, log[-3000:]
    assert seen == STEPS, log[-3000:]  # a summary after each step, the first ones with later steps pending
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= MAX_FILES, files
    doc = json.loads((out / "gpu_check.json").read_text())
    check_summary(doc)
    assert doc["gpu_check"]["ok"] is True and doc["pending"] == [], doc
    steps = doc["steps"]
    assert steps["nccl"]["backend"] == "gloo" and [b["ops"] for b in steps["nccl"]["batches"]] == [2, 6]
    checks = steps["runtime"]["checks"]
    assert checks["replan"]["state_kept"] and checks["replan"]["copy"]["kept"], checks["replan"]
    assert checks["replan"]["step"] == [["torch.float32", "cpu"]]  # AdamW's step: a float32 CPU tensor
    assert checks["sync_debug"]["host_syncs_per_step"] == 3 and "skipped" in checks["timeout"], checks
    assert steps["fp32"]["host_syncs_per_step"] == 3, steps["fp32"]
    assert steps["fp32"]["loop"] == steps["bf16"]["loop"] == "built-in"  # never Megatron's loop for these two
    assert float(steps["fp32"]["equivalence"]) < 1e-5 and steps["bf16"]["equivalence"] is not None
    assert steps["megatron"]["last_iteration"] == "5" and steps["megatron"]["validation"]
    assert set(steps["curves"]["models"]) == set(steps["compare"]["models"]) == {"multitask-clip", "ofasys", "qwen-val"}
    for m in steps["curves"]["models"].values():
        assert Path(m["file"]).parent == out and m["metaops"] > 0 and m["not_measured"] == []
    for rows in steps["compare"]["models"].values():
        assert rows["4"]["step_ms"]["spindle"] > 0
    assert {"logs.tar.gz", "gpu_check.json"} <= {p.name for p in files}
