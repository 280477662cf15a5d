"""Scaling curves for every MetaOp: from a curves file when it has them, else from an analytic device model.

The analytic default (used until profiling measures real points) derives one layer's time on ``n``
devices from its FLOPs::

    W(n)  = 3 · F_layer · (B/n) / B                      per-device work, FLOPs (backward = 2 × forward)
    e(h)  = max_efficiency · h / (h + half_efficiency_hidden)     efficiency of the layer's kernels, width h
    t(n)  = layer_latency_ms[op_type] + W(n) / (peak_tflops · e(h)) + t_tp(n)

Two effects make small per-device batches slow, and each has its own term. A fixed latency per layer
(kernel launches and kernels too small to fill the device) dominates when little work is left per device;
the achieved share of peak is ``W / (peak · t)``, which falls smoothly towards zero as ``W`` shrinks. A
narrow layer (small ``h``) stays below peak however large its batch, because its memory-bound element-wise
work (norms, activations, residuals: ~ tokens · h bytes) grows like its GEMM work (~ tokens · h²) divided by
``h``. ``t(n)`` is positive and non-increasing in ``n`` (``W`` falls, nothing else grows but ``t_tp``'s
message, which shrinks too). ``t_tp`` adds tensor-parallel all-reduces (4 per layer of the layer's output,
ring algorithm inside an island). Points are generated at the MetaOp's valid device counts, put on the
planner's time grid and fitted with :func:`fit_piecewise`, exactly as measured points would be.

Where the constants come from (docs/results/analytic_curves.md has the numbers, the fits and the errors;
tests/test_analytic_curves.py re-checks every anchor point):

* **The floor: eager by default.** A Megatron-LM user runs eagerly unless they ask for CUDA graphs:
  megatron-core 0.16.1 ``TransformerConfig.cuda_graph_impl = "none"`` (``megatron/core/transformer/
  transformer_config.py``), and docs.nvidia.com/megatron/user-guide/features/cuda-graph: ``--cuda-graph-impl``
  ``none`` / ``local`` / ``transformer_engine`` / ``full_iteration``, ``none`` the default. No published
  *training* measurement of a transformer layer at one to a few samples per device was found in the stored
  corpus (docs/results/analytic_curves.md, "What was searched"), so the floors are fitted on A100 FP16
  *forward* latencies at several batch sizes, each column with ``t = L + F / (312 TFLOP/s · c)`` (relative least
  squares, ``c`` free per column) and turned into forward + backward by the operators counted here: one
  transformer layer launches 22 operators forward and 55 forward + backward (``scripts/count_layer_ops.py``'s
  count; the forward-only count by the same rule), so the training floor is ``L · 55 / 22`` (the floor is per
  operator, the model's premise; it replaces the former factor 3, which had no source).

  - **Eager (the default), 1.26 ms.** github.com/NVIDIA/FasterTransformer ``docs/vit_guide.md``, "ViT
    Performance on A100", table "FP16", column "torch latency(ms)": ViT-B/16-384 (577 tokens, h 768, 12
    layers) at batch 1 / 8 / 16 / 32: 9.58 / 30.41 / 60.39 / 121.17 ms. Fit: ``L = 0.503 ms`` per layer forward
    (all 4 within 8.2 %); ``0.503 · 55 / 22 = 1.26``.
  - **Fused / CUDA-graph (the band's fast edge), 0.17 ms.** FasterTransformer's fused columns on the same A100:
    ``docs/bert_guide.md``, "BERT performance on A100 and TensorFlow", FP16, "FT Latency" (BERT-base, 9 points
    from 32 to 12 288 tokens): ``L = 0.0701 ms`` (within 6.2 %); ``vit_guide.md``'s "cpp latency(ms)" column
    (2.13 / 11.23 / 21.56 / 43.91 ms): ``L = 0.0675 ms`` (within 2.3 %). Mean 0.0688; ``· 55 / 22 = 0.17``.
  - **The band's slow edge, 2.0 ms.** The eager column's batch-1 latency read as floor only (0.798 ms per layer
    forward, ``· 55 / 22``): where dispatch hides the GPU's work, the step is the CPU's, as FasterTransformer's
    TorchScript column shows (4.16-4.47 ms for 12 layers from 32 to 1 024 tokens).
  - Between the edges, not used as constants: the TorchScript column (``L = 0.292``) and the TensorFlow column
    (``L = 0.150`` ms per layer forward) of ``bert_guide.md``'s A100 FP16 tables.
* **Latency of the other layer types (a measurement here).** ``scripts/count_layer_ops.py`` counts the
  compute operators of one forward + backward of each layer type of this project (``models/layers.py``,
  local backend, profiled on CPU): transformer 55, decoder 112, cross-attention adapter 49, LM head 44,
  pool head 28, contrastive loss 28, linear adapter 13-15, patch embedding 12, token embedding 9. Each
  type's latency is the transformer floor × its count / 55, at every edge.
* **Efficiency against width (GPT- and ViT-class measurements).** ``e(h)`` is fitted to (a) github.com/Dao-AILab/
  flash-attention ``training/README.md``, section "Training speed", table of tokens/s: GPT3-125M/355M/760M/1.3B/
  2.7B (h = 768/1024/1536/2048/2560, sequence 2048) trained on 8 × A100 80GB, micro-batches from the
  experiment configs ``training/configs/experiment/pile/gpt3{s,m,l,xl}-flash.yaml`` and
  ``gpt3-2.7B-flash-hdim128.yaml`` (predicted step time per token, latency and LM head included; this family
  sets the level); (b) github.com/huggingface/pytorch-image-models (timm)
  ``results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv`` (ViT-S/B/L/H
  training at their largest batch) and (c) ``results/benchmark-infer-amp-nchw-pt291-cu128-4090.csv``
  (ViT-S/B/L/H/g/G inference at batch 1024): ViT-class shape only, each family with its own level (other
  GPUs). Least squares over the 15 relative errors, with the default (eager) floor in source (a)'s times:
  ``max_efficiency`` 0.76, ``half_efficiency_hidden`` 390; largest errors 9 % (GPT family), 10 % (ViT
  training), 8 % (ViT inference). (FlashAttention's training is eager PyTorch with fused kernels, no CUDA
  graphs: the eager floor belongs in its fit.)
* **Not reproduced.** Narayanan et al. (SC21, arXiv 2104.04473) Figure 7 (GPT, h = 4096, 4 layers, one
  A100): about 67 TFLOP/s at micro-batch 1 and 92 at 16 as read off the figure, a 26 % loss at 2048 tokens;
  the default (eager floor) gives about 9 %. Whole-iteration overheads of that 4-layer model are the likely
  cause, but if not, the model is optimistic for wide layers at small batches.
* **A training bound.** The only training measurement at several small per-device batches found:
  DeepLearningExamples ``TensorFlow/LanguageModeling/BERT/README.md`` at commit 4b09b347 (2019-03-19), SQuAD
  fine-tuning of BERT-large (sequence 384) on one V100, TF 19.03 FP16 + XLA, batch 2 / 3 / 4 / 10: 11.86 /
  14.86 / 18.14 / 27.69 sentences/s: step = 129 ms + 22.9 ms per sample. The 129 ms holds the 24 layers'
  floors and the per-step work together (not separable): at most 5.4 ms per layer, above every edge.

* **The band.** :func:`fast_edge` is the fused / CUDA-graph floor with the default level (the other
  execution mode); :func:`slow_edge` is the eager column's batch-1 latency as floor with Megatron-LM 2021's end-to-end
  level (SC21 Table 1; :data:`LOW_MAX_EFFICIENCY`). ``spindle compare`` re-plans every system under both
  (:mod:`megatron_spindle.compare.band`). At large batch a training anchor checks the default: NVIDIA
  DeepLearningExamples' BERT-large pretraining on one A100 (sequence 128, micro-batch 256, 694 sequences/s) lies
  between the fast edge and the slow edge (tests/test_analytic_curves.py).

Curves file (``--curves FILE``; JSON)::

    {"schema_version": 1,
     "device": {"peak_tflops": 989, ...},                     # optional: overrides DeviceModel fields
     "curves": [{"signature": {"op_type": ..., "batch": ..., "seq_len": ..., "hidden": ..., "tp": ...},
                 "points": [[devices, ms], ...]},            # measured points, fitted here
                {"metaop": "vision-text.vision.layers", "curve": {...ScalingCurve JSON...}}]}

A curve entry matches a MetaOp by its exact name or by its signature; points are refitted, a given curve
is validated and used as is. A file is refused in one line unless it has at least one curve, every number
in it is finite, every point is ``[devices, ms]`` with devices an integer from 1 to
:data:`..limits.MAX_DEVICES` and ms in (0, :data:`..limits.MAX_LAYER_MS`], and a given curve stays within that
time on one device: a bad profile must not plan a step of 10^294 ms.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import math

from ..jsonfile import read_json
from ..limits import MAX_DEVICES, MAX_LAYER_MS
from .curves import ScalingCurve, fit_piecewise
from ..exact import on_grid
from .metaops import MetaOp
from .layer_types import timed_like
from .recompute import time_factor

CURVES_SCHEMA_VERSION = 1

#: Operators one transformer layer launches forward, and forward + backward (``scripts/count_layer_ops.py``'s rule
#: on ``models/layers.py``, local backend): the forward latencies below become training floors by 55 / 22.
FWD_OPS_TRANSFORMER, FWD_BWD_OPS_TRANSFORMER = 22, 55
#: Fused / CUDA-graph floor, forward + backward of one transformer layer, ms (the band's fast edge): the mean of the
#: intercepts fitted to FasterTransformer's fused A100 FP16 columns (BERT-base "FT Latency" 0.0701, ViT-B/16-384
#: "cpp latency" 0.0675 ms per layer forward) × 55 / 22 (module docstring).
FUSED_TRANSFORMER_LATENCY_MS = 0.17
#: Eager floor, forward + backward of one transformer layer, ms: the DEFAULT (megatron-core's default is no CUDA
#: graphs). The intercept fitted to FasterTransformer's eager A100 FP16 column (ViT-B/16-384 "torch latency", batch
#: 1-32: 0.503 ms per layer forward) × 55 / 22 (module docstring).
EAGER_TRANSFORMER_LATENCY_MS = 1.26
#: The default floor of a transformer layer (eager).
TRANSFORMER_LATENCY_MS = EAGER_TRANSFORMER_LATENCY_MS
#: Compute operators in one forward + backward of each layer type, counted by ``scripts/count_layer_ops.py``
#: (``models/layers.py``, local backend; the linear adapter counts 13 or 15 with its input width: 14).
FWD_BWD_OPS = {"transformer_layer": 55, "decoder_layer": 112, "cross_attn_adapter": 49, "lm_head": 44,
               "pool_head": 28, "contrastive_loss": 28, "linear_adapter": 14, "patch_embed": 12,
               "token_embed": 9}
#: Latency of a layer type that has no count (a custom type): half a transformer layer, the middle of the
#: counted range (0.16x-2x). A guess; a profile of the type replaces it.
UNKNOWN_TYPE_LATENCY_MS = 0.5 * TRANSFORMER_LATENCY_MS


def _default_latencies() -> dict[str, float]:
    return {k: round(TRANSFORMER_LATENCY_MS * v / FWD_BWD_OPS["transformer_layer"], 4)
            for k, v in FWD_BWD_OPS.items()}


@dataclass(frozen=True, kw_only=True)
class DeviceModel:
    """Constants of the analytic per-layer time model (defaults: one NVIDIA A800 80 GB, bf16; the module
    docstring names each constant's source)."""

    peak_tflops: float = 312.0
    """Dense bf16 tensor-core peak of one device (A800/A100 datasheet: 312 TFLOP/s)."""
    max_efficiency: float = 0.76
    """Share of peak a layer of unbounded width reaches at large batch (fitted: FlashAttention's A100 GPT
    training speeds, eager floor included, with timm's ViT shape; a 4096-wide layer reaches 0.76 · 4096/4486 =
    0.69)."""
    half_efficiency_hidden: float = 390.0
    """Width at which a layer reaches half of ``max_efficiency`` (fitted with it): a 768-wide layer reaches
    0.50 of peak at large batch, a 384-wide one 0.38."""
    layer_latency_ms: Mapping[str, float] = field(default_factory=_default_latencies)
    """Fixed forward + backward time per layer (kernel launches and small kernels), ms."""
    tp_bandwidth_gbps: float = 150.0
    """Achieved all-reduce bus bandwidth inside an island, GB/s (NVLink 400 GB/s nominal, ~150 measured
    for the message sizes of one layer's activations)."""
    tp_latency_us: float = 15.0
    """Latency of one tensor-parallel all-reduce, µs."""
    memory_gib: float = 80.0
    """Device memory, GiB."""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["layer_latency_ms"] = dict(self.layer_latency_ms)
        return d

    @classmethod
    def from_json(cls, obj: Mapping) -> "DeviceModel":
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(obj) - known)
        if bad:
            raise ValueError(f"unknown device constant(s) {bad}; known: {sorted(known)}")
        d = dict(obj)
        if "layer_latency_ms" in d:
            if not isinstance(d["layer_latency_ms"], Mapping):
                raise ValueError(f"device constant layer_latency_ms={d['layer_latency_ms']!r} must be an object "
                                 f"layer type -> ms")
            for t, v in d["layer_latency_ms"].items():
                if not (_number(v) and 0 <= v <= MAX_LAYER_MS):
                    raise ValueError(f"device constant layer_latency_ms.{t}={v!r} must be a finite number of ms "
                                     f"from 0 to {MAX_LAYER_MS:g}")
            d["layer_latency_ms"] = {**cls().layer_latency_ms, **d["layer_latency_ms"]}
        for k, v in d.items():
            if k != "layer_latency_ms" and not (_number(v) and v > 0):
                raise ValueError(f"device constant {k}={v!r} must be a positive finite number")
        return cls(**d)

    def efficiency(self, hidden: int) -> float:
        """Share of peak the kernels of a layer of width ``hidden`` reach at large batch."""
        h = float(max(hidden, 1))
        return self.max_efficiency * h / (h + self.half_efficiency_hidden)

    def latency_ms(self, op_type: str) -> float:
        """Fixed forward + backward time of one layer of ``op_type`` (a custom type: of the built-in type it is
        registered ``like``), ms."""
        return self.layer_latency_ms.get(timed_like(op_type), UNKNOWN_TYPE_LATENCY_MS)

    def layer_time_ms(self, m: MetaOp, n: int) -> float:
        """Analytic forward+backward time of one layer of ``m`` on ``n`` devices (``n`` valid)."""
        work = 3.0 * m.fwd_flops_per_layer / n
        compute_ms = work / (self.peak_tflops * 1e12 * self.efficiency(m.layer.hidden)) * 1e3
        t = self.latency_ms(m.op_type) + compute_ms
        if m.tp > 1:
            dp = n // m.tp
            msg = 2.0 * m.out_elems_per_sample * m.batch / dp  # bf16 bytes of the local activation
            ring = 2.0 * (m.tp - 1) / m.tp * msg / (self.tp_bandwidth_gbps * 1e9) * 1e3
            t += 4 * (ring + self.tp_latency_us * 1e-3)
        return t


#: The band's slow edge floor, forward + backward of one transformer layer, ms: FasterTransformer ``docs/vit_guide.md``,
#: "ViT Performance on A100", "FP16", "torch latency(ms)" at batch 1 (9.58 ms / 12 layers = 0.798 ms per layer
#: forward) read as floor only (where dispatch hides the GPU's work the step is the CPU's), × 55 / 22 = 2.0.
SLOW_TRANSFORMER_LATENCY_MS = 2.0
#: Large-batch efficiency level at the slow edge: Narayanan et al. (SC21, arXiv 2104.04473) Table 1, 44 % of
#: peak at h = 2304 and 46 % at h = 4096 end to end (docs/results/analytic_curves.md, source 4), read as e(h):
#: 0.44 · (2304 + 390) / 2304 = 0.514 and 0.46 · (4096 + 390) / 4096 = 0.504; their mean, 0.51.
LOW_MAX_EFFICIENCY = 0.51


def _scaled_floor(device: "DeviceModel", floor_ms: float) -> dict[str, float]:
    """``device``'s latencies with the transformer layer's at ``floor_ms``, every other type in proportion."""
    ratio = floor_ms / device.latency_ms("transformer_layer") if device.latency_ms("transformer_layer") > 0 else 1.0
    return {k: round(v * ratio, 4) for k, v in device.layer_latency_ms.items()}


def fast_edge(device: "DeviceModel") -> "DeviceModel":
    """``device`` at the fast edge of the published data: the fused / CUDA-graph floor
    (:data:`FUSED_TRANSFORMER_LATENCY_MS`, every type in proportion), never above ``device``'s own; the level is
    ``device``'s (FlashAttention's training level is already the fastest of the anchors)."""
    lat = device.latency_ms("transformer_layer")
    return dataclasses.replace(device, layer_latency_ms=_scaled_floor(device, min(lat, FUSED_TRANSFORMER_LATENCY_MS)))


def slow_edge(device: "DeviceModel") -> "DeviceModel":
    """``device`` at the slow edge of the published data: the eager column's batch-1 latency as floor
    (:data:`SLOW_TRANSFORMER_LATENCY_MS`, every type in proportion; never below ``device``'s own), the large-batch
    efficiency level at :data:`LOW_MAX_EFFICIENCY` (never above ``device``'s own)."""
    lat = device.latency_ms("transformer_layer")
    return dataclasses.replace(device, layer_latency_ms=_scaled_floor(device, max(lat, SLOW_TRANSFORMER_LATENCY_MS)),
                               max_efficiency=min(device.max_efficiency, LOW_MAX_EFFICIENCY))


#: Analytic curves already fitted, by everything they depend on (MetaOps of several tasks with the same layer,
#: batch and degree share one; the tuner plans the same workload under many configurations). Bounded.
_FITTED: dict[tuple, ScalingCurve] = {}
_FITTED_MAX = 4096


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _nonfinite(obj, path: str):
    """The first ``(path, value)`` in ``obj`` (nested objects and lists) that is a non-finite number."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return path, obj
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        bad = _nonfinite(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]")
        if bad:
            return bad
    return None


def analytic_curve(m: MetaOp, device: DeviceModel, num_devices: int) -> ScalingCurve:
    counts = m.valid_counts(num_devices)
    if not counts:
        raise ValueError(f"MetaOp {m.name!r} needs {m.tp} devices (tensor parallel) but only "
                         f"{num_devices} are available")
    key = (json.dumps(device.to_json(), sort_keys=True), m.op_type, m.layer, m.batch, m.fwd_flops_per_layer,
           m.out_elems_per_sample, m.tp, counts)
    got = _FITTED.get(key)
    if got is None:
        pts = [(float(n), on_grid(device.layer_time_ms(m, n))) for n in counts]  # on the grid: no libm ulp
        got = fit_piecewise(pts, batch=m.batch, counts=counts, source="analytic")
        if len(_FITTED) >= _FITTED_MAX:
            _FITTED.clear()
        _FITTED[key] = got
    return got


@dataclass(frozen=True)
class CurvesFile:
    """A parsed ``--curves`` file."""

    device: DeviceModel
    by_name: Mapping[str, object]
    by_signature: Sequence[tuple[dict, object]]
    measured: Mapping = dataclasses.field(default_factory=dict)
    """How the profile ran (``spindle profile``: backend, device type, processes, the link and optimizer
    measurements); empty for a hand-written file."""
    cluster: Mapping | None = None
    """The measured link as :class:`~.cluster.Cluster` fields (one island), if the profile measured one."""

    @classmethod
    def load(cls, path: str) -> "CurvesFile":
        return cls.parse(read_json(path, "curves file"), origin=path)

    @classmethod
    def parse(cls, obj, *, origin: str = "<curves>") -> "CurvesFile":
        if not isinstance(obj, dict):
            raise ValueError(f"curves file {origin!r}: top level must be an object")
        ver = obj.get("schema_version", CURVES_SCHEMA_VERSION)
        if ver != CURVES_SCHEMA_VERSION:
            raise ValueError(f"curves file {origin!r}: schema_version {ver!r} is not supported "
                             f"(expected {CURVES_SCHEMA_VERSION})")
        bad = _nonfinite(obj, "")
        if bad:
            raise ValueError(f"curves file {origin!r}: {bad[0].lstrip('.')} = {bad[1]!r} is not a finite number")
        try:
            device = DeviceModel.from_json(obj.get("device", {}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"curves file {origin!r}: {e}") from None
        by_name, by_sig = {}, []
        entries = obj.get("curves")
        if entries is None and isinstance(obj.get("device"), dict) and obj["device"]:
            entries = []  # device constants only: the analytic curves on this device, said by the file itself
        elif not isinstance(entries, list) or not entries:
            raise ValueError(f"curves file {origin!r} has no curves ('curves' is {entries!r}): give measured points "
                             f"(spindle profile --out), or only a 'device' table for the analytic model on that "
                             f"device, or leave the file out for the analytic model")
        for i, c in enumerate(entries):
            if not isinstance(c, dict) or not ("points" in c or "curve" in c):
                raise ValueError(f"curves file {origin!r}: entry {i} needs 'points' or 'curve'")
            if "curve" in c:
                curve = ScalingCurve.from_json(c["curve"])  # validate now, with the entry's index in errors
                if not curve.f(float(curve.batch)) <= MAX_LAYER_MS:
                    raise ValueError(f"curves file {origin!r}: entry {i}'s curve gives {curve.f(float(curve.batch)):g} "
                                     f"ms on one device, above the {MAX_LAYER_MS:g} ms the planner accepts per layer")
            elif not isinstance(c["points"], list) or not c["points"]:
                raise ValueError(f"curves file {origin!r}: entry {i} has no points")
            else:
                for p in c["points"]:
                    if not (isinstance(p, list) and len(p) == 2 and type(p[0]) is int and _number(p[1])
                            and 1 <= p[0] <= MAX_DEVICES and 0 < p[1] <= MAX_LAYER_MS):
                        raise ValueError(f"curves file {origin!r}: entry {i} has invalid point {p!r} (want [devices "
                                         f"from 1 to {MAX_DEVICES}, ms above 0 and at most {MAX_LAYER_MS:g}])")
            if "metaop" in c:
                by_name[c["metaop"]] = c
            elif "signature" in c:
                by_sig.append((dict(c["signature"]), c))
            else:
                raise ValueError(f"curves file {origin!r}: entry {i} names neither 'metaop' nor 'signature'")
        measured, cluster = obj.get("measured", {}), obj.get("cluster")
        if not isinstance(measured, dict) or not (cluster is None or isinstance(cluster, dict)):
            raise ValueError(f"curves file {origin!r}: 'measured' and 'cluster' must be objects")
        return cls(device=device, by_name=by_name, by_signature=by_sig, measured=measured, cluster=cluster)


def build_curves(metaops: Sequence[MetaOp], num_devices: int, *, curves_file: CurvesFile | None = None,
                 device: DeviceModel | None = None) -> dict[str, ScalingCurve]:
    """One scaling curve per MetaOp name."""
    device = device or (curves_file.device if curves_file else DeviceModel())
    out: dict[str, ScalingCurve] = {}
    for m in metaops:
        entry = None
        if curves_file is not None:
            entry = curves_file.by_name.get(m.name)
            if entry is None:
                sig = m.signature
                entry = next((e for s, e in curves_file.by_signature if s == sig), None)
        counts = m.valid_counts(num_devices)
        if not counts:
            raise ValueError(f"MetaOp {m.name!r} needs {m.tp} devices (tensor parallel) but only "
                             f"{num_devices} are available")
        if entry is None:
            c = analytic_curve(m, device, num_devices)
        elif "curve" in entry:
            c = dataclasses.replace(ScalingCurve.from_json(entry["curve"]), counts=counts)
        else:
            pts = [(float(a), float(b)) for a, b in entry["points"]]
            c = fit_piecewise(pts, batch=m.batch, counts=counts, source="measured")
        out[m.name] = c.scaled(time_factor(m))  # the profile times forward + backward, nothing recomputed
    return out
