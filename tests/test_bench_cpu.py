"""``scripts/bench_cpu.py`` end to end on a small configuration: profile, plan, predict, train both systems.

The Megatron-style baseline (megatron.core ``DistributedDataParallel`` + ``forward_backward_no_pipelining`` +
``finalize_model_grads`` on gloo) must train exactly the model the Spindle runtime trains: same losses at
every step (after SGD updates, so its gradients are checked too). Timing is reported, never asserted: the
sequential sweep over pass counts must name every valid count and pick the fastest measured one. The
activation memory (measured and planned, each recompute mode) must shrink with recompute and stay within a
factor 3 of the planner's estimate.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"measured_ratio", "predicted_ratio", "measured_step_s", "predicted_step_s", "prediction_error"}


def test_bench_cpu_json_last_line_and_both_systems_train_the_same_model(tmp_path):
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_cpu.py"), "--tasks", "4", "--batch", "8",
         "--nproc", "2", "--steps", "3", "--warmup", "1", "--lr", "0.05", "--repeats", "2", "--min-time", "0",
         "--cache", str(tmp_path / "cache.json"), "--curves-out", str(tmp_path / "curves.json"), "--waves",
         "--placement", "naive", "--json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
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
    # --waves: the same waves with boundary-posted transfers, trained in the same run on the same data; placed
    # naively (--placement naive), so activations move between the two processes and the losses still agree
    o = s["overlap"]
    assert o["max_loss_rel_diff"] < 1e-5
    for name in ("spindle", "spindle-boundary"):
        assert o[name]["measured_step_s"] > 0 and o[name]["measured_exposed_transfer_s"] >= 0, o
        assert o[name]["predicted_exposed_transfer_s"] >= 0, o
    assert o["spindle"]["measured_step_s"] == s["measured_step_s"]
    assert "at the consumer's wave" in out
    # the sequential baseline at every pass count whose micro-batch splits over 2 processes (batch 8: 1, 2, 4)
    sweep = {int(p): t for p, t in s["sequential_sweep_step_s"].items()}
    assert sorted(sweep) == [1, 2, 4] and all(t > 0 for t in sweep.values())
    assert s["sequential_best_passes"] == min(sweep, key=sweep.get)
    assert s["sequential_best_measured_step_s"] == sweep[s["sequential_best_passes"]]
    assert s["measured_ratio_vs_best_sequential"] == s["measured_step_s"] / s["sequential_best_measured_step_s"]
    assert "Spindle / best sequential" in out
    mem = s["activation_memory"]
    assert mem["sequential"]["passes"] == s["sequential_best_passes"]
    for system in ("sequential", "spindle"):
        m = {mode: mem[system][mode] for mode in ("none", "selective", "full")}
        assert m["full"]["measured_bytes"] < m["selective"]["measured_bytes"] < m["none"]["measured_bytes"]
        assert m["full"]["planned_bytes"] < m["selective"]["planned_bytes"] < m["none"]["planned_bytes"]
        assert all(1 / 3 < v["measured_over_planned"] < 3 for v in m.values()), (system, m)
    assert "activation memory, largest rank" in out
    assert json.load(open(tmp_path / "curves.json"))["cluster"]["intra_latency_us"] > 0


def test_exposed_transfer_splits_each_wait_where_its_sender_posted():
    """Two ranks, one step, clocks of one host: rank 1 blocks on message ``#3 0->1`` from 10.0 to 14.0 s while
    rank 0 posted it at 13.0 (3 s waiting for the peer, 1 s for the message), and on its own send at the
    pass's end for 0.5 s; its per-wave spans (posting + blocked) sum to 6.0, so 1.5 s went to posting. Rank 0
    blocks on ``#4 1->0``, posted before it waited: all message, and posted for 0.5 s."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_cpu_report import exposed_parts

    ranks = [
        {"waves": [{"w1 fwd transfer": 1.5, "w1 fwd a fwd": 9.0}],
         "messages": [[("w1 fwd #3 0->1 posted", 12.9, 13.0), ("w2 bwd #4 1->0 awaited", 20.0, 21.0)]]},
        {"waves": [{"w1 fwd transfer": 4.5, "w2 bwd transfer": 1.5}],
         "messages": [[("w1 fwd #3 0->1 awaited", 10.0, 14.0), ("w2 bwd #4 1->0 posted", 19.0, 19.5),
                       ("w2 bwd #9 1->0 send awaited", 30.0, 30.5)]]},
    ]
    got = exposed_parts(ranks)
    assert got["peer"] == pytest.approx(1.5)  # rank 1's 3 s, rank 0's none: the mean over ranks
    assert got["message"] == pytest.approx(1.0) and got["send"] == pytest.approx(0.25)
    assert got["posting"] == pytest.approx((0.5 + 1.5) / 2)  # rank 0: 1.5 - 1.0; rank 1: 6.0 - 3.0 - 1.0 - 0.5
    assert got["exposed"] == pytest.approx((1.5 + 3.0) / 2)
    lost = [dict(ranks[0], messages=[[m for m in ranks[0]["messages"][0] if "posted" not in m[0]]]), ranks[1]]
    with pytest.raises(ValueError, match="#3 0->1 that no rank posted"):
        exposed_parts(lost)
