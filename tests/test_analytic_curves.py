"""The analytic device model against the published measurements it is anchored on, and its monotonicity.

Sources (docs/results/analytic_curves.md has the tables, the fits and the errors):

* FT: NVIDIA FasterTransformer ``docs/bert_guide.md``, "BERT performance on A100 and TensorFlow", table
  "Performance on FP16", column "FT Latency (ms)": BERT-base (h 768, 12 layers) forward on one A100 (fused).
* FT ViT: FasterTransformer ``docs/vit_guide.md``, "ViT Performance on A100", table "FP16": ViT-B/16-384, columns
  "torch latency(ms)" (eager PyTorch) and "cpp latency(ms)" (fused).
* FA2: Dao-AILab/flash-attention ``training/README.md``, "Training speed" table (tokens/s on 8 x A100 80GB,
  sequence 2048), micro-batches from ``training/configs/experiment/pile/gpt3*-flash*.yaml`` (80 GB).
* timm: huggingface/pytorch-image-models ``results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv`` and
  ``results/benchmark-infer-amp-nchw-pt291-cu128-4090.csv`` (ViT rows; other GPUs, so shape only).
"""
from __future__ import annotations

import pytest

from megatron_spindle.planner.workload.analytic import (
    EAGER_TRANSFORMER_LATENCY_MS, FUSED_TRANSFORMER_LATENCY_MS, FWD_BWD_OPS, FWD_BWD_OPS_TRANSFORMER,
    FWD_OPS_TRANSFORMER, LOW_MAX_EFFICIENCY, SLOW_TRANSFORMER_LATENCY_MS, TRANSFORMER_LATENCY_MS, DeviceModel,
    analytic_curve, fast_edge, slow_edge)
from megatron_spindle.planner.workload.costs import (layer_act_bytes_per_sample, layer_fwd_flops_per_sample,
                                                     layer_params, out_elems_per_sample)
from megatron_spindle.planner.workload.graph import LayerConfig
from megatron_spindle.planner.workload.metaops import MetaOp, contract
from megatron_spindle.planner.workload.workloads import build_graph

DEV = DeviceModel()
PEAK = DEV.peak_tflops * 1e12

# --- anchor data, copied from the sources above --------------------------------------------------------------
#: FT: (batch, sequence) -> latency of 12 layers, ms.
FT_BERT_BASE_A100 = {(1, 32): 0.90, (1, 128): 1.00, (1, 384): 1.33, (8, 32): 1.04, (8, 128): 1.77,
                     (8, 384): 4.39, (32, 32): 1.77, (32, 128): 4.81, (32, 384): 14.67}
#: FT ViT: ViT-B/16 at 384 px (577 tokens, h 768, 12 layers), batch -> (torch latency ms, cpp latency ms), forward.
FT_VIT_B16_384_A100 = {1: (9.58, 2.13), 8: (30.41, 11.23), 16: (60.39, 21.56), 32: (121.17, 43.91)}
#: FA2: (hidden, layers, tokens/s over 8 GPUs, micro-batch sequences per GPU); vocabulary 50257, sequence 2048.
FA2_GPT3_A100 = [(768, 12, 1310e3, 32), (1024, 24, 503e3, 16), (1536, 24, 245e3, 16), (2048, 24, 169e3, 8),
                 (2560, 32, 85e3, 4)]
#: timm ViT training, RTX 3090: hidden -> (layers, tokens, samples/s at the csv's batch): vit_small/base/
#: large_patch16_224, vit_huge_patch14_224.
TIMM_TRAIN_3090 = {384: (12, 197, 1052.92), 768: (12, 197, 390.86), 1024: (24, 197, 117.08),
                   1280: (32, 257, 39.94)}
#: timm ViT inference, RTX 4090, batch 1024: hidden -> (GMACs per sample, samples/s): vit_small/base/
#: large_patch16_224, vit_huge/giant_patch14_224, vit_gigantic_patch14_clip_224.
TIMM_INFER_4090 = {384: (4.61, 8214.74), 768: (17.58, 2992.79), 1024: (61.6, 954.12), 1280: (167.4, 370.78),
                   1408: (267.18, 241.69), 1664: (483.96, 148.12)}

#: Tolerances: the largest relative error the fitted model may show on each family.
TOL_FT, TOL_FA2, TOL_TIMM = 0.12, 0.10, 0.11


def metaop(op_type: str, layer: LayerConfig, batch: int, tp: int = 1) -> MetaOp:
    return MetaOp(name="m", op_type=op_type, task="t", module="x", batch=batch, layer=layer, operators=("m.0",),
                  param_keys=("",), inputs=(), level=0,
                  fwd_flops_per_layer=batch * layer_fwd_flops_per_sample(op_type, layer),
                  params_per_layer=layer_params(op_type, layer),
                  out_elems_per_sample=out_elems_per_sample(op_type, layer),
                  act_bytes_per_sample=layer_act_bytes_per_sample(op_type, layer), tp=tp)


def gpt_layer(h: int, s: int) -> LayerConfig:
    return LayerConfig(hidden=h, num_heads=max(h // 64, 1), ffn_hidden=4 * h, seq_len=s)


def achieved(dev: DeviceModel, m: MetaOp, n: int = 1) -> float:
    """Share of peak one layer of ``m`` achieves on ``n`` devices (latency included)."""
    return 3.0 * m.fwd_flops_per_layer / n / (dev.peak_tflops * 1e12 * dev.layer_time_ms(m, n) * 1e-3)


# --- fits ----------------------------------------------------------------------------------------------------
def fit_line(pts: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares (relative errors) of ``t = a + x·b`` on (x, t): (a, b, largest relative error)."""
    s11 = sum(1 / t ** 2 for _, t in pts)
    s12 = sum(x / t ** 2 for x, t in pts)
    s22 = sum((x / t) ** 2 for x, t in pts)
    b1, b2 = sum(1 / t for _, t in pts), sum(x / t for x, t in pts)
    det = s11 * s22 - s12 ** 2
    a, b = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
    return a, b, max(abs((a + x * b) / t - 1) for x, t in pts)


def fit_floor(pts: list[tuple[float, float]]) -> tuple[float, float, float]:
    """``t = L + F·c`` on per-layer forward (FLOPs, ms): (L ms, efficiency, largest relative error)."""
    lat, c, err = fit_line(pts)
    return lat, 1.0 / (c * 1e-3 * PEAK), err


def ft_bert_points() -> list[tuple[float, float]]:
    return [(b * layer_fwd_flops_per_sample("transformer_layer", gpt_layer(768, s)), ms / 12)
            for (b, s), ms in FT_BERT_BASE_A100.items()]


def ft_vit_points(column: int) -> list[tuple[float, float]]:
    """FT ViT per-layer forward points; ``column`` 0 = torch (eager), 1 = cpp (fused)."""
    return [(b * layer_fwd_flops_per_sample("transformer_layer", gpt_layer(768, 577)), ms[column] / 12)
            for b, ms in FT_VIT_B16_384_A100.items()]


def to_training(fwd_floor_ms: float) -> float:
    """A per-layer forward floor as forward + backward: per operator, 55 operators against 22."""
    return fwd_floor_ms * FWD_BWD_OPS_TRANSFORMER / FWD_OPS_TRANSFORMER


def fa2_errors(dev: DeviceModel) -> list[float]:
    """Predicted / measured time per token per GPU - 1: every layer and the LM head of one micro-batch."""
    out = []
    for h, layers, tps, mb in FA2_GPT3_A100:
        layer = metaop("transformer_layer", gpt_layer(h, 2048), mb)
        head = metaop("lm_head", LayerConfig(hidden=h, seq_len=2048, vocab_size=50257, loss_tokens=2048), mb)
        pred_ms = (layers * dev.layer_time_ms(layer, 1) + dev.layer_time_ms(head, 1)) / (mb * 2048)
        out.append(pred_ms / (8 / tps * 1e3) - 1)
    return out


def timm_measured() -> tuple[dict, dict]:
    train = {h: 3 * l * layer_fwd_flops_per_sample("transformer_layer", gpt_layer(h, s)) * sps
             for h, (l, s, sps) in TIMM_TRAIN_3090.items()}
    infer = {h: 2 * g * 1e9 * sps for h, (g, sps) in TIMM_INFER_4090.items()}
    return train, infer  # FLOP/s; the level of each family is free (other GPUs)


def shape_errors(measured: dict, half: float) -> list[float]:
    """Relative errors of ``A · h/(h + half)`` against ``measured`` with ``A`` the least-squares level."""
    g = {h: h / (h + half) for h in measured}
    a = sum(g[h] / measured[h] for h in measured) / sum((g[h] / measured[h]) ** 2 for h in measured)
    return [a * g[h] / measured[h] - 1 for h in measured]


# --- the anchors ---------------------------------------------------------------------------------------------
def test_fused_floor_is_the_fit_of_ft_fused_columns():
    """The fast edge's floor: FT's fused BERT and ViT columns, each fitted, their mean as forward + backward."""
    lat_bert, eff, err_bert = fit_ft_bert = fit_floor(ft_bert_points())
    lat_vit, _, err_vit = fit_floor(ft_vit_points(1))
    assert 0.5 < eff < 0.6 and err_bert < 0.063 and err_vit < 0.025, (fit_ft_bert, lat_vit, err_vit)
    assert round(to_training((lat_bert + lat_vit) / 2), 2) == FUSED_TRANSFORMER_LATENCY_MS
    assert fast_edge(DEV).latency_ms("transformer_layer") == FUSED_TRANSFORMER_LATENCY_MS


def test_default_floor_is_the_fit_of_the_eager_column():
    """The default floor is eager (megatron-core's default: no CUDA graphs): FT's torch column fitted, all 4
    points within 8.2 %, as forward + backward."""
    lat, _, err = fit_floor(ft_vit_points(0))
    assert err < 0.083, (lat, err)
    assert round(to_training(lat), 2) == EAGER_TRANSFORMER_LATENCY_MS == TRANSFORMER_LATENCY_MS
    assert DEV.latency_ms("transformer_layer") == TRANSFORMER_LATENCY_MS


def test_slow_floor_is_the_eager_batch_one_latency():
    torch1 = FT_VIT_B16_384_A100[1][0]
    assert round(to_training(torch1 / 12), 2) == SLOW_TRANSFORMER_LATENCY_MS
    # the batch-1 point sits above the eager fit: the step is the CPU's there, not floor + GPU work
    lat, _, _ = fit_floor(ft_vit_points(0))
    assert torch1 / 12 > lat
    slow = slow_edge(DEV)
    assert slow.latency_ms("transformer_layer") == SLOW_TRANSFORMER_LATENCY_MS
    assert slow.max_efficiency == LOW_MAX_EFFICIENCY
    for t, n in FWD_BWD_OPS.items():  # every type keeps its share of the transformer layer's floor at each edge
        for dev in (DEV, fast_edge(DEV), slow):
            assert dev.latency_ms(t) == pytest.approx(dev.latency_ms("transformer_layer") * n / 55, rel=1e-3)


def test_operator_counts_of_a_transformer_layer():
    """The forward / forward + backward operator counts that turn forward floors into training floors (22 / 55),
    counted as ``scripts/count_layer_ops.py`` counts them."""
    torch = pytest.importorskip("torch")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from count_layer_ops import NO_KERNEL, count_ops
    from megatron_spindle.compat.cpu import apply_cpu_patches
    from megatron_spindle.models.layers import build_layer
    from megatron_spindle.models.shapes import example_inputs
    from torch.profiler import ProfilerActivity, profile
    apply_cpu_patches()
    g = build_graph("multitask-clip", size="tiny", batch=4)
    op = next(o for o in g.operators if o.op_type == "transformer_layer")
    layer = build_layer(op, seed=0, graph=g, backend="local")
    inputs = example_inputs(op, 4, graph=g, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert count_ops(layer, inputs, False) == FWD_BWD_OPS_TRANSFORMER == FWD_BWD_OPS["transformer_layer"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(inputs)
    fwd = [e for e in prof.events() if e.name.startswith("aten::") and e.name not in NO_KERNEL
           and not any(c.name.startswith("aten::") and c.name not in NO_KERNEL for c in e.cpu_children)]
    assert len(fwd) == FWD_OPS_TRANSFORMER


def test_efficiency_against_tokens_follows_ft():
    """The fast edge's layer run forward only (its floor × 22 / 55, its work / 3): the share of peak against tokens
    per device, relative to 12 288 tokens, as FT's fused kernels measured it."""
    dev = fast_edge(DEV)
    def fwd(b, s):
        return b * layer_fwd_flops_per_sample("transformer_layer", gpt_layer(768, s))
    def model_ms(b, s):
        return (dev.latency_ms("transformer_layer") * FWD_OPS_TRANSFORMER / FWD_BWD_OPS_TRANSFORMER
                + fwd(b, s) / (PEAK * dev.efficiency(768)) * 1e3)
    ref_meas, ref_model = fwd(32, 384) / FT_BERT_BASE_A100[32, 384], fwd(32, 384) / model_ms(32, 384)
    for (b, s), ms in FT_BERT_BASE_A100.items():
        meas = fwd(b, s) / ms / ref_meas
        model = fwd(b, s) / model_ms(b, s) / ref_model
        assert abs(model / meas - 1) < TOL_FT, (b, s, meas, model)


def test_gpt_training_speeds_on_a100():
    errs = fa2_errors(DEV)
    assert max(abs(e) for e in errs) < TOL_FA2, errs


def test_vit_efficiency_against_width():
    train, infer = timm_measured()
    for fam in (train, infer):
        errs = shape_errors(fam, DEV.half_efficiency_hidden)
        assert max(abs(e) for e in errs) < TOL_TIMM, errs


def test_constants_are_the_least_squares_fit_of_the_anchors():
    """Re-fit (max_efficiency, half_efficiency_hidden) over the 15 relative errors: the defaults are the fit
    rounded (0.01 and 10)."""
    train, infer = timm_measured()
    best = None
    for half in range(300, 501, 10):
        shape = sum(e * e for fam in (train, infer) for e in shape_errors(fam, half))
        for k in range(650, 821):
            dev = DeviceModel(max_efficiency=k / 1000, half_efficiency_hidden=half)
            sse = shape + sum(e * e for e in fa2_errors(dev))
            if best is None or sse < best[0]:
                best = (sse, k / 1000, half)
    _, e_max, half = best
    assert round(e_max, 2) == DEV.max_efficiency and half == DEV.half_efficiency_hidden, best


# --- shape properties ----------------------------------------------------------------------------------------
def test_efficiency_grows_with_width_and_work():
    hs = [64, 128, 384, 512, 768, 1024, 1280, 1664, 4096, 16384]
    effs = [DEV.efficiency(h) for h in hs]
    assert all(0 < e < DEV.max_efficiency for e in effs) and effs == sorted(effs)
    for h, s in [(384, 197), (1024, 77), (1280, 257), (4096, 2048)]:
        got = [achieved(DEV, metaop("transformer_layer", gpt_layer(h, s), b)) for b in (1, 2, 4, 16, 64, 256)]
        assert got == sorted(got) and got[-1] < DEV.efficiency(h)


@pytest.mark.parametrize("model,tasks", [("multitask-clip", 10), ("qwen-val", 3), ("ofasys", None)])
def test_layer_time_is_positive_and_non_increasing(model, tasks):
    for m in contract(build_graph(model, tasks=tasks)):
        counts = m.valid_counts(64)
        ts = [DEV.layer_time_ms(m, n) for n in counts]
        assert all(t > 0 for t in ts) and all(a >= b for a, b in zip(ts, ts[1:])), m.name
        curve = analytic_curve(m, DEV, 64)
        ct = [curve.count_time(n) for n in counts]
        assert all(t > 0 for t in ct) and all(a >= b for a, b in zip(ct, ct[1:])), m.name


def test_device_json_round_trip_and_unknown_fields():
    assert DeviceModel.from_json(DEV.to_json()) == DEV
    with pytest.raises(ValueError, match="unknown device constant"):
        DeviceModel.from_json({"saturation_gflop": 400.0})  # the former model's constant
    with pytest.raises(ValueError, match="must be a positive finite number"):
        DeviceModel.from_json({"half_efficiency_hidden": 0})
    dev = DeviceModel.from_json({"layer_latency_ms": {"transformer_layer": 1.0}})
    assert dev.latency_ms("transformer_layer") == 1.0 and dev.latency_ms("lm_head") == DEV.latency_ms("lm_head")


# --- the band's anchors: the level's low edge, and a training anchor at large batch ----------------
#: SC21 Table 1 (Narayanan et al., arXiv 2104.04473), as docs/results/analytic_curves.md source 4 reads it:
#: hidden -> share of peak end to end.
SC21_TABLE1 = {2304: 0.44, 4096: 0.46}
#: DLE BERT: NVIDIA DeepLearningExamples ``PaddlePaddle/LanguageModeling/BERT/README.md``, "Pre-training NVIDIA
#: DGX A100 (8x A100 80GB)": 1 GPU, sequence 128, batch 8192 in 32 accumulation steps (256 per micro-batch),
#: mixed precision: 694 sequences/s. BERT-large: h 1024, 24 layers, 16 heads; MLM on 20 tokens of 30522 words.
DLE_BERT_LARGE_A100 = (1024, 24, 128, 256, 694.0)


def test_low_level_is_sc21_table1_read_as_e_of_h():
    got = [share * (h + DEV.half_efficiency_hidden) / h for h, share in SC21_TABLE1.items()]
    assert round(sum(got) / len(got), 2) == LOW_MAX_EFFICIENCY


def dle_error(dev: DeviceModel) -> float:
    h, layers, s, mb, sps = DLE_BERT_LARGE_A100
    layer = metaop("transformer_layer", gpt_layer(h, s), mb)
    head = metaop("lm_head", LayerConfig(hidden=h, seq_len=s, vocab_size=30522, loss_tokens=20), mb)
    pred_ms = layers * dev.layer_time_ms(layer, 1) + dev.layer_time_ms(head, 1)
    return pred_ms / (mb / sps * 1e3) - 1


def test_bert_large_pretraining_throughput_on_a100():
    """A training anchor at large batch: one micro-batch of BERT-large (every layer and the MLM head) against DLE's
    measured sequences per second. It lies inside the band (fast edge -1.6 %, slow edge +58 %), and the default
    (eager floor) is within 7 % (+5.7 %: slower than measured)."""
    assert dle_error(fast_edge(DEV)) < 0.0 < dle_error(slow_edge(DEV))
    assert abs(dle_error(DEV)) < 0.07


#: The only training measurement at several small per-device batches found in the stored corpus: NVIDIA
#: DeepLearningExamples ``TensorFlow/LanguageModeling/BERT/README.md`` at commit 4b09b347 (2019-03-19), "Training
#: performance results": SQuAD fine-tuning of BERT-large (24 layers, h 1024, sequence 384) on ONE V100, TensorFlow
#: 19.03, FP16, XLA on (``scripts/run_squad.sh`` default), sentences/s: batch -> [measurements] (DGX-1 16G: 2, 3;
#: DGX-1 32G and DGX-2: 4, 10).
TF_BERT_LARGE_SQUAD_V100 = {2: [11.86], 3: [14.86], 4: [18.14, 17.43], 10: [27.69, 28.72]}


def fit_step_intercept(sps: dict) -> tuple[float, float, float]:
    """Relative least squares of ``step = C + B·w`` on (batch, sentences/s): (C ms, w ms, largest error)."""
    return fit_line([(b, b / v * 1e3) for b, vs in sps.items() for v in vs])


def test_training_step_intercept_bounds_every_edge_floor():
    """A training step of BERT-large at 2-10 samples per device costs C = 129 ms + 22.9 ms per sample (6 points
    within 4 %). C holds the 24 layers' floors and the per-step work (optimizer, the framework's step), which
    the data cannot separate: at most C / 24 = 5.4 ms per layer. Every edge's floor fits under that bound."""
    c, w, err = fit_step_intercept(TF_BERT_LARGE_SQUAD_V100)
    assert 120 < c < 140 and 20 < w < 26 and err < 0.04, (c, w, err)
    for dev in (fast_edge(DEV), DEV, slow_edge(DEV)):
        assert 24 * dev.latency_ms("transformer_layer") < c
