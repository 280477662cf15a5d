"""Model FLOPs and MFU (hand-computable cases), and the band ``spindle compare`` reports."""
import json

import pytest

from megatron_spindle.cli import main
from megatron_spindle.compare.band import _groups
from megatron_spindle.planner.workload.analytic import (DeviceModel, FUSED_TRANSFORMER_LATENCY_MS,
                                                        LOW_MAX_EFFICIENCY, SLOW_TRANSFORMER_LATENCY_MS,
                                                        TRANSFORMER_LATENCY_MS, fast_edge, slow_edge)
from megatron_spindle.planner.workload.flops import metaop_model_flops, mfu, step_model_flops, tflops_per_device
from megatron_spindle.planner.workload.graph import LayerConfig
from megatron_spindle.planner.workload.metaops import MetaOp, contract
from megatron_spindle.planner.workload.workloads import build_graph

TINY = ["compare", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4"]


def metaop(layers: int, *, trainable=True, input_grad=True) -> MetaOp:
    return MetaOp(name="m", op_type="transformer_layer", task="t", module="x", batch=4,
                  layer=LayerConfig(hidden=64, num_heads=1, ffn_hidden=256, seq_len=8),
                  operators=tuple(f"m.{i}" for i in range(layers)), param_keys=("",) * layers, inputs=(), level=0,
                  fwd_flops_per_layer=1e12, params_per_layer=1, out_elems_per_sample=1, act_bytes_per_sample=1.0,
                  trainable=trainable, input_grad=input_grad)


def test_model_flops_of_a_hand_computable_case():
    # 4 layers of 1 TFLOP forward each: trained 3x (backward twice the forward), frozen with a trained layer
    # before it 2x (only the input's gradient), frozen at the front 1x (forward only)
    assert metaop_model_flops([metaop(4)]) == 12e12
    assert metaop_model_flops([metaop(4, trainable=False)]) == 8e12
    assert metaop_model_flops([metaop(4, trainable=False, input_grad=False)]) == 4e12
    # 2 passes of 12 TFLOP in 100 ms on 2 devices: 120 TFLOP/s per device, 120 / 312 of an A800's peak
    assert tflops_per_device(24e12, 100.0, 2) == pytest.approx(120.0)
    assert mfu(24e12, 100.0, 2, 312.0) == pytest.approx(120.0 / 312.0)
    with pytest.raises(ValueError, match="peak_tflops=0"):
        mfu(1.0, 1.0, 1, 0)


def test_step_model_flops_are_three_forwards_and_do_not_depend_on_the_passes():
    g1 = build_graph("ofasys", tasks=4, size="tiny", batch=64, passes=1)
    g4 = build_graph("ofasys", tasks=4, size="tiny", batch=64, passes=4)
    fwd = sum(o.fwd_flops for o in g1.operators)
    assert step_model_flops(g1, 1) == pytest.approx(3 * fwd)
    assert step_model_flops(g4, 4) == pytest.approx(step_model_flops(g1, 1))
    # recompute is not model FLOPs: a MetaOp recomputed in full counts the same
    ms = contract(g1)
    full = [m.__class__(**{**m.__dict__, "recompute": "full"}) if m.op_type == "transformer_layer" else m for m in ms]
    assert metaop_model_flops(full) == pytest.approx(metaop_model_flops(ms))


def test_edges_scale_every_floor_and_the_slow_one_lowers_the_level():
    dev = DeviceModel()
    slow, fast = slow_edge(dev), fast_edge(dev)
    for edge, floor in ((slow, SLOW_TRANSFORMER_LATENCY_MS), (fast, FUSED_TRANSFORMER_LATENCY_MS)):
        ratio = floor / TRANSFORMER_LATENCY_MS
        assert edge.latency_ms("transformer_layer") == pytest.approx(dev.latency_ms("transformer_layer") * ratio)
        assert edge.latency_ms("lm_head") == pytest.approx(dev.latency_ms("lm_head") * ratio, abs=1e-4)
        assert edge.peak_tflops == dev.peak_tflops and edge.memory_gib == dev.memory_gib
    assert fast.latency_ms("transformer_layer") < dev.latency_ms("transformer_layer") < slow.latency_ms("transformer_layer")
    assert slow.max_efficiency == LOW_MAX_EFFICIENCY < dev.max_efficiency == fast.max_efficiency
    # a device already beyond an edge is not pulled back to it
    own = DeviceModel.from_json({"layer_latency_ms": {"transformer_layer": 5.0}})
    assert slow_edge(own).latency_ms("transformer_layer") == 5.0


def test_ties_rank_together():
    assert _groups({"a": 2.0, "spindle": 1.0, "sequential": 1.0}) == [["sequential", "spindle"], ["a"]]


def test_compare_json_carries_mfu_and_the_band(capsys):
    assert main(TINY + ["--gpus", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["results"][0]
    assert r["peak_tflops"] == 312.0 and r["curves"] == "analytic"
    band = r["band"]
    assert set(band["edges"]) == {"fast", "fitted", "slow"} and band["edges"]["fitted"] == DeviceModel().to_json()
    for name, s in r["systems"].items():
        if "error" in s:
            continue
        assert s["mfu"] == pytest.approx(s["model_flops"] / (s["step_ms"] * 1e-3 * 8 * 312e12))
        assert s["tflops_per_gpu"] == pytest.approx(s["mfu"] * 312.0)
        assert s["band_ms"]["fitted"] == s["step_ms"] and s["band_ms"]["slow"] > 0, name
        assert band["steps_ms"]["slow"][name] == s["band_ms"]["slow"]
        assert band["steps_ms"]["fast"][name] <= s["step_ms"] <= band["steps_ms"]["slow"][name], name
    steps = band["steps_ms"]
    fastest = {e: min(v for n, v in steps[e].items() if n != "spindle-naive-placement") for e in steps}
    for e in ("fast", "fitted", "slow"):
        assert steps[e][band["winner"][e][0]] == fastest[e]
    assert band["winner_changes"] == (not set.intersection(*(set(w) for w in band["winner"].values())))


def test_measured_curves_have_no_band_and_the_table_says_so(capsys, tmp_path):
    f = tmp_path / "curves.json"
    f.write_text(json.dumps({"schema_version": 1, "device": {"peak_tflops": 31.2}}))
    assert main(TINY + ["--gpus", "8", "--json", "--curves", str(f)]) == 0
    r = json.loads(capsys.readouterr().out)["results"][0]
    assert r["band"] is None and r["curves"] == "file"
    assert all(s.get("band_ms") is None for s in r["systems"].values())
    assert main(TINY + ["--gpus", "8", "--curves", str(f)]) == 0
    out = capsys.readouterr().out
    assert "band: none (measured curves" in out and "MFU: model FLOPs per step" in out
    assert "TFLOP/s/GPU" in out
