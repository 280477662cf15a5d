"""Step simulator: predict one training step of any plan (Spindle's or a baseline's) on a cluster.

Pure Python. The same code times every system, so the comparison is only as biased as the plans.

The model (nothing overlaps: every term below is on the critical path, as in the paper's runtime, where a
wave forbids overlapping a MetaOp's compute with the next wave's communication):

1. **Compute.** A slice of ``l`` layers of MetaOp ``m`` on ``n`` devices takes ``l · T_m(n)`` (the plan's
   scaling curve: forward + backward of one layer). A wave lasts as long as its longest slice. Of that,
   :data:`FORWARD_SHARE` is forward (backward costs twice the forward FLOPs); the split only places the
   boundaries on the timeline, the totals do not depend on it.
2. **Inter-wave transfers.** Forward, before wave ``w``: every transfer into a slice of ``w`` moves the
   messages the plan stores for it (:mod:`.dataflow`: copy, shard, concat, send/recv; nothing here derives
   them again). A message that stays on its device is free. Inside an island a message uses the sender's and
   the receiver's NVLink (full duplex); across islands it uses the sending node's and the receiving node's
   NICs (shared by the node's devices). All messages of a boundary go at once (batched point-to-point), so::

       t_boundary = max( max_d max(out_d, in_d) / B_intra + λ_intra,  max_node max(out, in) / B_inter + λ_inter )

   (each latency ``λ`` counted once, only when that kind of link is used). Backward: after wave ``w``'s
   backward pass the plan's backward messages of the same transfers return the gradients (as many bytes,
   each piece from one holder), timed the same way.
3. **Parameter sync.** Parameter groups (:class:`.plan.ParamGroup`) with the same ranks are bucketed into one
   ring all-reduce (Megatron's DDP buckets a process group's gradients) of fp32 gradients,
   :data:`GRAD_BYTES_PER_PARAM` bytes per parameter. A ring over ``n`` devices sends and receives
   ``2(n-1)/n · S`` bytes per member::

       T_c = 2(n-1) · λ + 2(n-1)/n · S / B          (B = B_inter per node if the group spans islands, else B_intra)

   All-reduces that share a device run one after another; those on disjoint devices run concurrently,
   except that cross-island all-reduces touching one node share its NICs::

       t_sync = max( max_d Σ_{c ∋ d} T_c,  max_node Σ_{c spans islands, touches node} 2(n-1)/n · S_c / B_inter )

4. **Step.** ``Σ_w duration_w + Σ_w (forward + backward transfer before/after w) + t_sync``. The breakdown
   (the paper's Figure 10): *compute* ``= Σ_w Σ_d busy_{w,d} / N`` (mean device busy time), *idle*
   ``= Σ_w duration_w − compute`` (devices waiting for the wave's longest slice, or unused), *transfer*,
   *sync*; the four add up to the step.
5. **Memory.** The plan's per-device estimate (:func:`.build.device_memory`: model states of every layer the
   device holds plus every stashed activation, since all forward waves run before any backward wave),
   checked against the cluster's usable memory.

Worked example (one island of 8 devices at 160 GB/s and 8 µs): a 160 MB message between two devices takes
``160e6 / 160e9 s + 8 µs = 1.008 ms``; an all-reduce of 160 MB over those two devices
``2·8 µs + 2·(1/2)·160e6/160e9 s = 1.016 ms``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .cluster import Cluster
from .plan import Plan, Slice

#: Share of a layer's forward + backward time spent in the forward pass (backward ≈ 2 × forward FLOPs).
FORWARD_SHARE = 1.0 / 3.0
#: Bytes per parameter of the gradient all-reduce: Megatron-LM trains bf16 with gradient accumulation and
#: all-reduce in fp32 (``megatron/training/arguments.py``: "bfloat16 requires gradient accumulation and
#: all-reduce to be done in fp32").
GRAD_BYTES_PER_PARAM = 4


class SimulationError(ValueError):
    """The plan cannot run on the cluster as given (too few devices, other islands, memory)."""


# --------------------------------------------------------------------------------------------------
# Cost primitives (hand-checkable; the tests use them directly)
# --------------------------------------------------------------------------------------------------
def boundary_time_ms(flows: Iterable[tuple[int, int, float]], cluster: Cluster) -> float:
    """Time of one wave boundary moving ``(src, dst, bytes)`` flows concurrently (see the module docstring)."""
    dev_out: dict[int, float] = defaultdict(float)
    dev_in: dict[int, float] = defaultdict(float)
    node_out: dict[int, float] = defaultdict(float)
    node_in: dict[int, float] = defaultdict(float)
    for src, dst, nbytes in flows:
        if src == dst or nbytes <= 0:
            continue
        if cluster.island(src) == cluster.island(dst):
            dev_out[src] += nbytes
            dev_in[dst] += nbytes
        else:
            node_out[cluster.island(src)] += nbytes
            node_in[cluster.island(dst)] += nbytes
    t = 0.0
    if dev_out:
        peak = max(max(dev_out.values()), max(dev_in.values()))
        t = max(t, peak / (cluster.intra_bandwidth_gbps * 1e9) * 1e3 + cluster.intra_latency_us * 1e-3)
    if node_out:
        peak = max(max(node_out.values()), max(node_in.values()))
        t = max(t, peak / (cluster.inter_bandwidth_gbps * 1e9) * 1e3 + cluster.inter_latency_us * 1e-3)
    return t


def ring_bytes(n: int, nbytes: float) -> float:
    """Bytes each member of a ring all-reduce over ``n`` devices sends (and receives)."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def allreduce_time_ms(ranks: Sequence[int], nbytes: float, cluster: Cluster) -> float:
    """Standalone time of a ring all-reduce of ``nbytes`` over ``ranks`` (0 for one device)."""
    n = len(set(ranks))
    if n <= 1 or nbytes <= 0:
        return 0.0
    if cluster.spans_islands(ranks):
        bw, lat = cluster.inter_bandwidth_gbps, cluster.inter_latency_us
    else:
        bw, lat = cluster.intra_bandwidth_gbps, cluster.intra_latency_us
    return 2 * (n - 1) * lat * 1e-3 + ring_bytes(n, nbytes) / (bw * 1e9) * 1e3


def sync_time_ms(collectives: Iterable[tuple[Sequence[int], float]], cluster: Cluster) -> float:
    """Time of all gradient all-reduces ``(ranks, bytes)`` (see the module docstring, item 3)."""
    per_device: dict[int, float] = defaultdict(float)
    per_node: dict[int, float] = defaultdict(float)
    for ranks, nbytes in collectives:
        t = allreduce_time_ms(ranks, nbytes, cluster)
        if t == 0.0:
            continue
        for d in set(ranks):
            per_device[d] += t
        if cluster.spans_islands(ranks):
            for node in {cluster.island(d) for d in ranks}:
                per_node[node] += ring_bytes(len(set(ranks)), nbytes) / (cluster.inter_bandwidth_gbps * 1e9) * 1e3
    return max(list(per_device.values()) + list(per_node.values()), default=0.0)


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Breakdown:
    """Where one step's time goes (ms); the four parts add up to the step."""

    compute_ms: float
    """Mean busy time of a device (forward + backward)."""
    transfer_ms: float
    """Inter-wave activation and gradient transfers."""
    sync_ms: float
    """Gradient all-reduces over parameter device groups."""
    idle_ms: float
    """Devices waiting inside waves (for the longest slice, or unused)."""

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.transfer_ms + self.sync_ms + self.idle_ms

    def shares(self) -> dict[str, float]:
        t = self.total_ms or 1.0
        return {"compute": self.compute_ms / t, "transfer": self.transfer_ms / t, "sync": self.sync_ms / t,
                "idle": self.idle_ms / t}

    def to_json(self) -> dict:
        return {"compute_ms": self.compute_ms, "transfer_ms": self.transfer_ms, "sync_ms": self.sync_ms,
                "idle_ms": self.idle_ms}


@dataclass(frozen=True)
class WaveTiming:
    index: int
    duration_ms: float
    """Forward + backward compute of the wave (its longest slice)."""
    busy_ms: float
    """Mean busy time over all devices."""
    transfer_fwd_ms: float
    """Activations moved before the wave (forward)."""
    transfer_bwd_ms: float
    """Gradients moved back after the wave's backward."""
    moved_bytes: float
    """Forward bytes that leave their device before the wave."""
    cross_island_bytes: float


@dataclass(frozen=True)
class Collective:
    """One bucketed gradient all-reduce."""

    ranks: tuple[int, ...]
    bytes: float
    time_ms: float
    """Standalone time (:func:`allreduce_time_ms`)."""


@dataclass(frozen=True)
class StepSimulation:
    """The predicted step of one plan on one cluster."""

    system: str
    cluster: str
    world_size: int
    step_ms: float
    breakdown: Breakdown
    waves: tuple[WaveTiming, ...]
    collectives: tuple[Collective, ...]
    peak_memory_bytes: tuple[float, ...]
    """Estimated peak memory of every device."""
    makespan_ms: float
    """Compute only: Σ wave durations."""
    lower_bound_ms: float
    """Σ over levels of C* (compute only; no schedule of these curves beats it)."""

    @property
    def max_memory_gib(self) -> float:
        return max(self.peak_memory_bytes) / 2**30

    @property
    def memory_spread_gib(self) -> float:
        """Max minus min peak memory over devices."""
        return (max(self.peak_memory_bytes) - min(self.peak_memory_bytes)) / 2**30

    def to_json(self) -> dict:
        return {"system": self.system, "cluster": self.cluster, "gpus": self.world_size, "step_ms": self.step_ms,
                "breakdown": self.breakdown.to_json(), "shares": self.breakdown.shares(),
                "makespan_ms": self.makespan_ms, "lower_bound_ms": self.lower_bound_ms,
                "peak_memory_gib": self.max_memory_gib, "peak_memory_spread_gib": self.memory_spread_gib,
                "num_waves": len(self.waves), "num_collectives": len(self.collectives)}


# --------------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------------
def check_fits(plan: Plan, cluster: Cluster, *, check_memory: bool = True) -> None:
    """Raise :class:`SimulationError` when ``plan`` cannot run on ``cluster``."""
    if plan.world_size > cluster.num_devices:
        raise SimulationError(f"plan ({plan.system}, {plan.model}) uses {plan.world_size} devices but cluster "
                              f"{cluster.name!r} has {cluster.num_devices}")
    if plan.gpus_per_node != cluster.gpus_per_node:
        raise SimulationError(f"plan ({plan.system}) was placed for islands of {plan.gpus_per_node} devices but "
                              f"cluster {cluster.name!r} has {cluster.gpus_per_node} per island: re-plan")
    if check_memory:
        limit = cluster.memory_limit_bytes
        over = [(b, d) for d, b in enumerate(plan.device_memory_bytes) if b > limit * (1 + 1e-9)]
        if over:
            b, d = max(over)
            raise SimulationError(
                f"plan ({plan.system}) is out of memory on {len(over)} device(s): device {d} needs "
                f"{b / 2**30:.2f} GiB, cluster {cluster.name!r} allows {limit / 2**30:.2f} GiB "
                f"({cluster.memory_gib:g} GiB × {cluster.usable_memory_fraction:g} usable)")


def _slice_time(s: Slice, curves: Mapping) -> float:
    return s.num_layers * curves[s.metaop].time(len(s.ranks))


def transfer_flows(plan: Plan, cluster: Cluster, *,
                   backward: bool = False) -> dict[int, list[tuple[int, int, float]]]:
    """``(src, dst, bytes)`` of the plan's stored messages per consumer wave, forward or backward."""
    names = {s.name for s in plan.slices()}
    out: dict[int, list[tuple[int, int, float]]] = defaultdict(list)
    for t in plan.transfers:
        for name in (t.src, t.dst):
            if name not in names:
                raise SimulationError(f"plan ({plan.system}) has a transfer naming unknown slice {name!r}")
        out[t.wave].extend((m.src, m.dst, m.bytes) for m in (t.backward if backward else t.forward))
    return out


def bucketed_collectives(plan: Plan) -> list[tuple[tuple[int, ...], float]]:
    """``(ranks, gradient bytes)`` per distinct parameter device group, in sorted rank order."""
    sizes: dict[tuple[int, ...], float] = defaultdict(float)
    for g in plan.param_groups:
        sizes[tuple(sorted(g.ranks))] += g.params * GRAD_BYTES_PER_PARAM
    return sorted(sizes.items())


def simulate(plan: Plan, cluster: Cluster, *, check_memory: bool = True) -> StepSimulation:
    """Predict one training step of ``plan`` on ``cluster`` (see the module docstring for the model)."""
    check_fits(plan, cluster, check_memory=check_memory)
    N = plan.world_size
    curves = dict(plan.curves)
    flows = transfer_flows(plan, cluster)
    back = transfer_flows(plan, cluster, backward=True)
    waves = []
    for w in plan.waves:
        times = [_slice_time(s, curves) for s in w.slices]
        duration = max(times, default=0.0)
        busy = sum(t * len(s.ranks) for t, s in zip(times, w.slices)) / N
        f = flows.get(w.index, [])
        fwd = boundary_time_ms(f, cluster)
        bwd = boundary_time_ms(back.get(w.index, []), cluster)
        waves.append(WaveTiming(index=w.index, duration_ms=duration, busy_ms=busy, transfer_fwd_ms=fwd,
                                transfer_bwd_ms=bwd, moved_bytes=sum(x for a, b, x in f if a != b),
                                cross_island_bytes=sum(x for a, b, x in f
                                                       if cluster.island(a) != cluster.island(b))))
    colls = tuple(Collective(ranks=r, bytes=b, time_ms=allreduce_time_ms(r, b, cluster))
                  for r, b in bucketed_collectives(plan))
    sync = sync_time_ms(((c.ranks, c.bytes) for c in colls), cluster)
    makespan = sum(w.duration_ms for w in waves)
    compute = sum(w.busy_ms for w in waves)
    transfer = sum(w.transfer_fwd_ms + w.transfer_bwd_ms for w in waves)
    bd = Breakdown(compute_ms=compute, transfer_ms=transfer, sync_ms=sync, idle_ms=makespan - compute)
    return StepSimulation(system=plan.system, cluster=cluster.name, world_size=N, step_ms=makespan + transfer + sync,
                          breakdown=bd, waves=tuple(waves), collectives=colls,
                          peak_memory_bytes=tuple(plan.device_memory_bytes), makespan_ms=makespan,
                          lower_bound_ms=plan.lower_bound_ms)
