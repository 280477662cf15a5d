"""The cluster model: devices grouped into islands, link speeds, memory and peak rate.

Pure Python. Used by placement (which devices are close) and by the step simulator (what a transfer or an
all-reduce costs, :mod:`.simulate`). Every constant is named, documented with its source, and overridable
from JSON (:func:`load_cluster`).

Bandwidths are *achieved* bandwidths of one direction (the simulator charges sends and receives separately),
derived as ``line rate × NCCL_EFFICIENCY``:

* NVLink: each device's one-way line rate to the NVSwitch;
* InfiniBand: the node's NICs together, shared by every device of the node (``inter_bandwidth_gbps`` is per
  node, not per device).

A preset describes a node type and its interconnect; ``num_devices`` is set by the caller (``--gpus``), so
``load_cluster("a800-8x8", num_devices=16)`` is two of the paper's nodes.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping

from ..jsonfile import read_json

#: Share of a link's line rate that NCCL reaches for large messages. NVIDIA's NCCL maintainer: "450GB/s is
#: the line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s"
#: (H100, https://github.com/NVIDIA/nccl-tests/issues/212). The same ~80% is seen on InfiniBand: 8×A100 with
#: 4×200 Gb/s HDR per node measured 84.8 GB/s average of 100 GB/s (https://github.com/NVIDIA/nccl-tests/issues/119).
NCCL_EFFICIENCY = 0.8

#: NVIDIA A800 SXM4 80 GB datasheet: NVLink 400 GB/s (bidirectional; 8 third-generation links), i.e. 200 GB/s
#: each way.
A800_NVLINK_ONE_WAY_GBPS = 200.0
#: The paper's cluster (Spindle, ASPLOS 2025, evaluation setup): nodes linked by 400 Gb/s InfiniBand = 50 GB/s per node.
A800_NODE_IB_GBPS = 400 / 8
#: A100/A800 dense bf16 tensor-core peak (NVIDIA A100 datasheet; the A800 has the same SMs and clocks).
A800_PEAK_TFLOPS = 312.0
A800_MEMORY_GIB = 80.0

#: NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), SXM 80 GB column:
#: "NVIDIA NVLink: 600GB/s" (third generation, both directions together), i.e. 300 GB/s each way; the A800 is
#: the A100 with NVLink cut to 400 GB/s (above); peak and memory as the A800's.
A100_NVLINK_ONE_WAY_GBPS = 300.0
#: An HGX A100 node (the DGX A100 reference design): eight 200 Gb/s HDR InfiniBand NICs for compute, 8 x 25 GB/s.
A100_NODE_IB_GBPS = 8 * 200 / 8

#: NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: "BFLOAT16 Tensor Core 1,979 teraFLOPS*" with
#: "* With sparsity" (the dense rate is half: 989.5), "GPU memory 80GB", "Interconnect NVIDIA NVLink: 900GB/s"
#: (fourth generation, both directions together: 450 GB/s each way).
H100_PEAK_TFLOPS = 989.0
H100_MEMORY_GIB = 80.0
H100_NVLINK_ONE_WAY_GBPS = 450.0
#: An HGX H100 node (the DGX H100 reference design): one 400 Gb/s ConnectX-7 NIC per GPU, 8 x 50 GB/s.
H100_NODE_IB_GBPS = 8 * 400 / 8

#: NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: "GPU Memory 141GB", "BFLOAT16 Tensor Core
#: 1,979 TFLOPS" (with sparsity; 989 dense, the H100's GH100 at the same clocks), "NVIDIA NVLink: 900GB/s"
#: (450 GB/s each way).
H200_NVLINK_ONE_WAY_GBPS = 450.0
#: An HGX H200 node with one 400 Gb/s ConnectX-7 NIC per GPU (the DGX H200 reference design): 8 × 50 GB/s.
H200_NODE_IB_GBPS = 8 * 400 / 8
#: H200 dense bf16 peak (datasheet: 1,979 TFLOP/s with sparsity, i.e. 989 dense).
H200_PEAK_TFLOPS = 989.0
#: H200 datasheet: 141 GB HBM3e.
H200_MEMORY_GIB = 141.0

#: Latency of one message or one ring step. nccl-tests report all-reduce times of a few microseconds per
#: ring step inside an NVLink node and 10-20 µs per step across InfiniBand for small messages; we take
#: 8 µs (NVLink) and 20 µs (InfiniBand) as round, slightly pessimistic values for both presets.
NVLINK_LATENCY_US = 8.0
IB_LATENCY_US = 20.0
#: Share of device memory a plan may fill; the rest is CUDA context, NCCL buffers and allocator fragmentation
#: (PyTorch's caching allocator commonly loses 5-10% to fragmentation).
USABLE_MEMORY_FRACTION = 0.9
#: Device memory one NCCL communicator holds on each member, MiB: NCCL's default buffer for the Simple protocol
#: (``NCCL_BUFFSIZE``, 4 MiB, the documented default; ``DEFAULT_BUFFSIZE`` in NCCL's ``src/init.cc``) on each
#: channel's ring connection, on 32 channels (NCCL's ``MAXCHANNELS``; an 8 x H100 node opened all 32 per peer
#: in the allocation log of NVIDIA/nccl#1685). The LL and LL128 protocols' buffers, tree connections and NVLink
#: SHARP add to it where NCCL sets them up; fewer channels take less. The GPU check (``scripts/gpu_check.sh``,
#: step ``runtime``) measures what one ``new_group`` takes on the device.
NCCL_COMMUNICATOR_MIB = 4.0 * 32


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous cluster of ``num_devices`` devices in islands of ``gpus_per_node``."""

    name: str = "custom"
    """Preset name or the JSON file it came from (for messages and tables only)."""
    num_devices: int
    """Devices in the cluster (the last island may be partly filled)."""
    gpus_per_node: int = 8
    """Devices per island (NVLink domain: one node)."""
    intra_bandwidth_gbps: float = A800_NVLINK_ONE_WAY_GBPS * NCCL_EFFICIENCY
    """Achieved one-way bandwidth of one device inside an island, GB/s (point-to-point and ring all-reduce bus
    bandwidth)."""
    inter_bandwidth_gbps: float = A800_NODE_IB_GBPS * NCCL_EFFICIENCY
    """Achieved one-way bandwidth between islands per node, GB/s (shared by the node's devices)."""
    intra_latency_us: float = NVLINK_LATENCY_US
    """Latency of one message (one ring step) inside an island, µs."""
    inter_latency_us: float = IB_LATENCY_US
    """Latency of one message (one ring step) between islands, µs (a ring all-reduce over ``k`` islands pays it in
    the ``2(k-1)`` steps that cross between them: :func:`..simulation.link_costs.allreduce_time_ms`)."""
    allreduce_latency_us: float | None = None
    """Latency of one ring step of an all-reduce inside an island, µs, where it was measured apart from a
    message's (``spindle profile`` fits both: gloo's all-reduce is not a ring of its own point-to-point
    messages); ``None``: ``intra_latency_us``."""
    memory_gib: float = A800_MEMORY_GIB
    """Memory of one device, GiB."""
    usable_memory_fraction: float = USABLE_MEMORY_FRACTION
    """Share of device memory a plan may fill (the rest: CUDA context, allocator fragmentation, buffers)."""
    communicator_mib: float = NCCL_COMMUNICATOR_MIB
    """Device memory of one communicator with peers on each member, MiB, charged on top of the plan's estimate
    (:mod:`..assembly.communicators`); 0 where ranks communicate through gloo on the host (no device buffers)."""
    peak_tflops: float = A800_PEAK_TFLOPS
    """Dense bf16 peak of one device, TFLOP/s (the analytic curves' device model uses it)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "allreduce_latency_us" and v is None:
                continue
            if f.name == "communicator_mib" and isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
                continue
            if f.name != "name" and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"cluster field {f.name}={v!r} must be a positive number")
        for f in ("num_devices", "gpus_per_node"):
            if not isinstance(getattr(self, f), int):
                raise ValueError(f"cluster field {f}={getattr(self, f)!r} must be an integer")
        if self.usable_memory_fraction > 1:
            raise ValueError(f"usable_memory_fraction={self.usable_memory_fraction} must be at most 1")

    def island(self, device: int) -> int:
        return device // self.gpus_per_node

    def spans_islands(self, devices) -> bool:
        """Whether ``devices`` lie in more than one island (islands are ranges: the first and the last tell)."""
        devices = tuple(devices)
        return bool(devices) and min(devices) // self.gpus_per_node != max(devices) // self.gpus_per_node

    @property
    def memory_limit_bytes(self) -> float:
        return self.memory_gib * self.usable_memory_fraction * 2**30

    @property
    def communicator_bytes(self) -> float:
        return self.communicator_mib * 2**20

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bandwidth GB/s, latency µs) between devices ``a`` and ``b``; ``inf`` bandwidth when equal."""
        if a == b:
            return float("inf"), 0.0
        if self.island(a) == self.island(b):
            return self.intra_bandwidth_gbps, self.intra_latency_us
        return self.inter_bandwidth_gbps, self.inter_latency_us

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


#: Presets (values are the achieved bandwidths derived above; see the constants for sources). Each is a node
#: type of 8 GPUs on NVSwitch with InfiniBand between nodes; ``num_devices`` is set by the caller.
#: ``a800-8x8``: the paper's testbed, 8 nodes × 8 NVIDIA A800 80 GB, NVLink, 400 Gb/s InfiniBand per node:
#: 160 GB/s per device inside a node, 40 GB/s per node between nodes.
#: ``a100``: HGX A100 80 GB nodes: 240 GB/s per device inside a node, 160 GB/s per node between nodes.
#: ``h100`` / ``h200``: HGX H100 80 GB / H200 141 GB nodes, NVLink 4, 8 × 400 Gb/s InfiniBand per node: 360 GB/s
#: per device inside a node, 320 GB/s per node between nodes.
def _preset(name: str, nvlink: float, node_ib: float, memory: float, peak: float) -> dict:
    return dict(name=name, num_devices=8, gpus_per_node=8, intra_bandwidth_gbps=nvlink * NCCL_EFFICIENCY,
                inter_bandwidth_gbps=node_ib * NCCL_EFFICIENCY, intra_latency_us=NVLINK_LATENCY_US,
                inter_latency_us=IB_LATENCY_US, memory_gib=memory, peak_tflops=peak)


PRESETS: Mapping[str, dict] = {
    "a800-8x8": {**_preset("a800-8x8", A800_NVLINK_ONE_WAY_GBPS, A800_NODE_IB_GBPS, A800_MEMORY_GIB,
                           A800_PEAK_TFLOPS), "num_devices": 64},
    "a100": _preset("a100", A100_NVLINK_ONE_WAY_GBPS, A100_NODE_IB_GBPS, A800_MEMORY_GIB, A800_PEAK_TFLOPS),
    "h100": _preset("h100", H100_NVLINK_ONE_WAY_GBPS, H100_NODE_IB_GBPS, H100_MEMORY_GIB, H100_PEAK_TFLOPS),
    "h200": _preset("h200", H200_NVLINK_ONE_WAY_GBPS, H200_NODE_IB_GBPS, H200_MEMORY_GIB, H200_PEAK_TFLOPS),
}
DEFAULT_PRESET = "a800-8x8"


def _read_json(path: str) -> dict:
    obj = read_json(path, "cluster file")
    if not isinstance(obj, dict):
        raise ValueError(f"cluster file {path!r}: top level must be an object of cluster fields")
    return obj


def load_cluster(spec: str | None, *, num_devices: int, gpus_per_node: int | None = None,
                 memory_gib: float | None = None) -> Cluster:
    """A preset name, a JSON file path, or ``None`` (the a800 preset), resized to ``num_devices``.

    A JSON file holds :class:`Cluster` fields; its optional ``"preset"`` key names the preset it starts from
    (default ``a800-8x8``), e.g. ``{"preset": "h200", "inter_bandwidth_gbps": 100}``.
    """
    if spec is None:
        base = dict(PRESETS[DEFAULT_PRESET])
    elif spec in PRESETS:
        base = dict(PRESETS[spec])
    elif spec.endswith(".json") or os.path.isfile(spec) or os.path.isdir(spec):
        obj = _read_json(spec)
        start = obj.pop("preset", DEFAULT_PRESET)
        if start not in PRESETS:
            raise ValueError(f"cluster file {spec!r}: unknown preset {start!r}; presets: {', '.join(PRESETS)}")
        base = {**PRESETS[start], "name": spec, **obj}
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
