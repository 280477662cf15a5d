"""Scaling curves for every MetaOp: from a curves file when it has them, else from an analytic device model.

The analytic default (used until profiling measures real points) derives one layer's time on ``n``
devices from its FLOPs::

    w      = 3 · F_layer · (B/n) / B              per-device work (forward + backward = 3× forward), FLOPs
    eff(w) = max_efficiency · min(1, (w / saturation_flops) ** efficiency_exponent)
    t(n)   = layer_latency_ms[op_type] + w / (peak_tflops · eff(w)) + t_tp(n)

so light operators are latency-bound and stop scaling early, heavy ones scale almost linearly: the
workload heterogeneity the paper measures. ``t_tp`` adds tensor-parallel all-reduces (4 per layer of the
layer's output, ring algorithm inside an island). Points are generated at the MetaOp's valid device counts
and fitted with :func:`fit_piecewise`, exactly as measured points would be.

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
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import math

from ..jsonfile import read_json
from ..limits import MAX_DEVICES, MAX_LAYER_MS
from .curves import ScalingCurve, fit_piecewise
from ..exact import on_grid
from .metaops import MetaOp

CURVES_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class DeviceModel:
    """Constants of the analytic per-layer time model (defaults: one NVIDIA A800 80 GB, bf16)."""

    peak_tflops: float = 312.0
    """Dense bf16 tensor-core peak of one device (A800/A100 datasheet: 312 TFLOP/s)."""
    max_efficiency: float = 0.55
    """Share of peak a large transformer layer reaches (Megatron-LM reports 50-60% MFU on A100)."""
    saturation_gflop: float = 400.0
    """Per-device work (forward + backward, one layer) from which kernels run at ``max_efficiency``;
    below it efficiency falls as ``(w/saturation)^efficiency_exponent`` (under-filled GEMMs)."""
    efficiency_exponent: float = 0.6
    """How fast efficiency falls below saturation."""
    layer_latency_ms: Mapping[str, float] = field(default_factory=lambda: {
        "transformer_layer": 0.12, "decoder_layer": 0.18, "cross_attn_adapter": 0.12,
        "linear_adapter": 0.04, "patch_embed": 0.04, "token_embed": 0.03, "pool_head": 0.04,
        "contrastive_loss": 0.06, "lm_head": 0.06})
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

    def layer_time_ms(self, m: MetaOp, n: int) -> float:
        """Analytic forward+backward time of one layer of ``m`` on ``n`` devices (``n`` valid)."""
        work = 3.0 * m.fwd_flops_per_layer / n
        eff = self.max_efficiency * min(1.0, (work / (self.saturation_gflop * 1e9)) ** self.efficiency_exponent)
        compute_ms = work / (self.peak_tflops * 1e12 * max(eff, 1e-6)) * 1e3
        t = self.layer_latency_ms.get(m.op_type, 0.05) + compute_ms
        if m.tp > 1:
            dp = n // m.tp
            msg = 2.0 * m.out_elems_per_sample * m.batch / dp  # bf16 bytes of the local activation
            ring = 2.0 * (m.tp - 1) / m.tp * msg / (self.tp_bandwidth_gbps * 1e9) * 1e3
            t += 4 * (ring + self.tp_latency_us * 1e-3)
        return t


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
    pts = [(float(n), on_grid(device.layer_time_ms(m, n))) for n in counts]  # on the grid: no libm ulp reaches the plan
    return fit_piecewise(pts, batch=m.batch, counts=counts, source="analytic")


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
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"curves file {origin!r} has no curves ('curves' is {entries!r}): give measured points "
                             f"(spindle profile --out), or leave the file out for the analytic model")
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
            out[m.name] = analytic_curve(m, device, num_devices)
        elif "curve" in entry:
            c = ScalingCurve.from_json(entry["curve"])
            out[m.name] = dataclasses.replace(c, counts=counts)
        else:
            pts = [(float(a), float(b)) for a, b in entry["points"]]
            out[m.name] = fit_piecewise(pts, batch=m.batch, counts=counts, source="measured")
    return out
