"""``scripts/bench_cpu.py`` end to end on a small configuration: profile, plan, predict, train both systems.

The Megatron-style baseline (megatron.core ``DistributedDataParallel`` + ``forward_backward_no_pipelining`` +
``finalize_model_grads`` on gloo) must train exactly the model the Spindle runtime trains: same losses at
every step (after SGD updates, so its gradients are checked too). Timing is reported, never asserted.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"measured_ratio", "predicted_ratio", "measured_step_s", "predicted_step_s", "prediction_error"}


def test_bench_cpu_json_last_line_and_both_systems_train_the_same_model(tmp_path):
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_cpu.py"), "--tasks", "4", "--batch", "8",
         "--nproc", "2", "--steps", "3", "--warmup", "1", "--lr", "0.05", "--repeats", "2", "--min-time", "0",
         "--cache", str(tmp_path / "cache.json"), "--curves-out", str(tmp_path / "curves.json"), "--waves",
         "--json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    s = json.loads(lines[-1])
    assert KEYS <= set(s)
    assert s["measured_ratio"] == s["measured_step_s"] / s["sequential_measured_step_s"]
    assert s["prediction_error"] == s["predicted_step_s"] / s["measured_step_s"] - 1
    assert all(s[k] > 0 for k in ("measured_step_s", "predicted_step_s", "sequential_measured_step_s"))
    assert s["max_loss_rel_diff"] < 1e-5  # 4 steps of SGD: Megatron DDP's gradients equal Spindle's
    out = r.stdout
    assert "sequential (Megatron DDP, task by task)" in out and "Spindle / sequential step time: measured" in out
    assert "w0 " in out  # the per-wave table
    assert json.load(open(tmp_path / "curves.json"))["cluster"]["intra_latency_us"] > 0
