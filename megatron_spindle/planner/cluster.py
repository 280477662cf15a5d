"""The cluster model: devices grouped into islands, link speeds, memory and peak rate.

Pure Python. Used by placement (which devices are close) and by the step simulator (what a transfer or an
all-reduce costs). Every constant is named, documented with its source, and overridable from JSON.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous cluster of ``num_devices`` devices in islands of ``gpus_per_node``."""

    name: str = "custom"
    num_devices: int
    gpus_per_node: int = 8
    """Devices per island (NVLink domain: one node)."""
    intra_bandwidth_gbps: float = 200.0
    """Achieved point-to-point / all-reduce bus bandwidth inside an island, GB/s."""
    inter_bandwidth_gbps: float = 40.0
    """Achieved bandwidth between islands per node, GB/s (shared by the node's devices)."""
    intra_latency_us: float = 8.0
    """Latency of one message inside an island, µs."""
    inter_latency_us: float = 20.0
    """Latency of one message between islands, µs."""
    memory_gib: float = 80.0
    """Memory of one device, GiB."""
    usable_memory_fraction: float = 0.9
    """Share of device memory a plan may fill (the rest: CUDA context, allocator fragmentation, buffers)."""
    peak_tflops: float = 312.0
    """Dense bf16 peak of one device, TFLOP/s."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"cluster field {f.name}={v!r} must be a positive number")
        if self.usable_memory_fraction > 1:
            raise ValueError(f"usable_memory_fraction={self.usable_memory_fraction} must be at most 1")

    @property
    def num_islands(self) -> int:
        return -(-self.num_devices // self.gpus_per_node)

    def island(self, device: int) -> int:
        return device // self.gpus_per_node

    @property
    def memory_limit_bytes(self) -> float:
        return self.memory_gib * self.usable_memory_fraction * 2**30

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bandwidth GB/s, latency µs) between devices ``a`` and ``b``; ``inf`` bandwidth when equal."""
        if a == b:
            return float("inf"), 0.0
        if self.island(a) == self.island(b):
            return self.intra_bandwidth_gbps, self.intra_latency_us
        return self.inter_bandwidth_gbps, self.inter_latency_us

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


#: Presets.
#: ``a800-8x8``: the paper's testbed, 8 nodes × 8 NVIDIA A800 80 GB. NVLink on A800 is 400 GB/s
#: bidirectional (200 GB/s each way; we take it as achieved for large messages); 400 Gb/s InfiniBand per
#: node is 50 GB/s, ~40 GB/s achieved; 312 TFLOP/s dense bf16 (A100/A800 datasheet).
#: ``h200``: 8 × NVIDIA H200 141 GB per node, NVLink 4 at 900 GB/s bidirectional (~360 GB/s achieved one
#: way), 8 × 400 Gb/s InfiniBand per node (400 GB/s, ~320 GB/s achieved), 989 TFLOP/s dense bf16.
PRESETS: Mapping[str, dict] = {
    "a800-8x8": dict(name="a800-8x8", num_devices=64, gpus_per_node=8, intra_bandwidth_gbps=200.0,
                     inter_bandwidth_gbps=40.0, intra_latency_us=8.0, inter_latency_us=20.0,
                     memory_gib=80.0, peak_tflops=312.0),
    "h200": dict(name="h200", num_devices=8, gpus_per_node=8, intra_bandwidth_gbps=360.0,
                 inter_bandwidth_gbps=320.0, intra_latency_us=6.0, inter_latency_us=15.0,
                 memory_gib=141.0, peak_tflops=989.0),
}


def load_cluster(spec: str | None, *, num_devices: int, gpus_per_node: int | None = None,
                 memory_gib: float | None = None) -> Cluster:
    """A preset name, a JSON file path, or ``None`` (the a800 preset), resized to ``num_devices``."""
    if spec is None:
        base = dict(PRESETS["a800-8x8"])
    elif spec in PRESETS:
        base = dict(PRESETS[spec])
    elif spec.endswith(".json"):
        try:
            with open(spec) as fh:
                base = {**PRESETS["a800-8x8"], "name": spec, **json.load(fh)}
        except FileNotFoundError:
            raise ValueError(f"cluster file {spec!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"cluster file {spec!r} is not valid JSON: {e}") from None
    else:
        raise ValueError(f"unknown cluster preset {spec!r}; presets: {', '.join(PRESETS)}, or a .json file")
    base["num_devices"] = num_devices
    if gpus_per_node is not None:
        base["gpus_per_node"] = gpus_per_node
    if memory_gib is not None:
        base["memory_gib"] = memory_gib
    known = {f.name for f in dataclasses.fields(Cluster)}
    bad = sorted(set(base) - known)
    if bad:
        raise ValueError(f"unknown cluster field(s) {bad}; known: {sorted(known)}")
    return Cluster(**base)
