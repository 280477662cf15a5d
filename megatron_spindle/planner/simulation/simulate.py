"""Step simulator: predict one training step of any plan (Spindle's or a baseline's) on a cluster.

Pure Python. The same code times every system, so the comparison is only as biased as the plans.

The model is the runtime as it is (``runtime/executor.py`` + ``runtime/grad_sync.py``): every rank runs its
own slices in wave order, each as soon as its devices are free and its inputs have arrived (no barrier at a
wave's end: :mod:`.timeline`), transfers move the plan's stored messages (posted as the plan's
``transfer_posting`` says: by default one batch per slice when it ends, travelling while later slices
compute; :mod:`.timeline` item 2), and the gradient all-reduces, which megatron.core's DDP posts during the
backward, overlap compute:

1. **Compute.** A slice of ``l`` layers of MetaOp ``m`` on ``n`` devices takes ``l · T_m(n)`` (the plan's
   scaling curve: forward + backward of one layer). Of that, :data:`FORWARD_SHARE` is forward (backward
   costs twice the forward FLOPs); the split places the slices on the timeline (so when gradients are
   complete, item 3), the totals do not depend on it. A wave's duration (its longest slice) is reported; the
   pass is timed per device (item 4).
2. **Inter-wave transfers.** Forward, before wave ``w``: every transfer into a slice of ``w`` moves the
   messages the plan stores for it (:mod:`..assembly.dataflow`: copy, shard, concat, send/recv; nothing here derives
   them again). A message that stays on its device is free. Inside an island a message uses the sender's and
   the receiver's NVLink (full duplex); across islands it uses the sending node's and the receiving node's
   NICs (shared by the node's devices). All messages of a boundary go at once (batched point-to-point), so::

       t_boundary = max( max_d max(out_d, in_d) / B_intra + λ_intra,  max_node max(out, in) / B_inter + λ_inter )

   (each latency ``λ`` counted once, only when that kind of link is used); a consumer's input arrives
   ``t_boundary`` after its producer has run and both ends' devices have reached the boundary. Backward:
   the plan's backward messages of the same transfers return the gradients (as many bytes, each piece
   from one holder), timed the same way. That is the ``boundary`` posting; under ``producer`` posting (the
   default) the batch is a slice's outputs, posted when it ends (:mod:`.timeline`, item 2b).

3. **Parameter sync** (overlapped). Gradients are bucketed as megatron.core's DDP does
   (:mod:`.grad_buckets`: per rank set, in order of completion, at least ``bucket_size`` parameters per
   bucket, by default ``max(40 M, 1 M × ranks)``): a parameter group's (:class:`..assembly.plan.ParamGroup`) gradient
   is complete when the last backward, in execution order, of a slice holding it on one of its ranks has
   passed its layer (a slice's layers complete one by one, last layer first, its backward time split evenly);
   a bucket is ready when its last group is; a frozen weight's group is in none (no gradient). Each bucket is one ring all-reduce of
   :data:`GRAD_BYTES_PER_PARAM` (fp32, Megatron's default for bf16 training) or 2 (bf16, ``grad_bytes=2``)
   bytes per parameter. A ring over ``n`` devices sends and receives ``2(n-1)/n · S`` bytes per member::

       T_c = 2(n-1) · λ + 2(n-1)/n · S / B          (B = B_inter per node if the group spans islands, else B_intra)

   (``λ``: the cluster's ``allreduce_latency_us`` inside an island where a profile measured it, else the link's
   latency; a ring over ``k`` islands pays the inter-island latency in ``2(k-1)`` of its steps and ``λ`` in the
   other ``2(n-k)``, as NCCL's own cost model does: :func:`.link_costs.allreduce_time_ms`.)

   Buckets are posted in order of readiness; each starts when ready, when every one of its devices has
   finished the all-reduces posted before it (all-reduces sharing a device run one after another; on
   disjoint devices concurrently, and alongside compute and transfers: the model charges no contention
   with them), and, if it spans islands, when its nodes' NICs have moved the cross-island bytes posted
   before it (``2(n-1)/n · S / B_inter`` each). Only what runs past the end of the backward is exposed::

       t_sync = max(0, max_c end_c − t_pass)

   With ``overlap_sync=False`` every bucket is ready at ``t_pass`` (the hand-written sync of old).
4. **Step.** A pass runs phase by phase (:attr:`..assembly.plan.WavePlan.phase`; one phase unless the plan frees
   activations early): the forwards of the phase's waves, then their backwards in reverse, then the next
   phase, every slice placed on its devices' timeline as item 1-2 say (:func:`.timeline.dataflow_pass`);
   ``t_pass`` ends when the last device does. With gradient accumulation over ``K`` passes (``passes=K``,
   default the plan's, one sync after the last pass): ``step = K · t_pass + t_sync``. The breakdown (the
   paper's Figure 10): *compute* ``= K · Σ_w Σ_d busy_{w,d} / N`` (mean device busy time), *transfer*
   ``= K ·`` (``t_pass`` minus the same pass with free communication: what the transfers expose),
   *idle* the rest of ``K · t_pass`` (devices waiting for inputs, or unused), *sync* (exposed); the four add
   up to the step.
5. **Memory.** The plan's per-device estimate (:func:`..assembly.assemble.device_memory`: model states of every layer
   the device holds plus the activations its largest phase stashes), checked against the cluster's usable
   memory.

Worked example (one island at 100 GB/s and 10 µs; ``tests/test_simulate.py`` checks it): two waves, one
layer each of 4 ms (forward + backward) on devices 0-1, 100 M parameters (400 MB of fp32 gradients) per
layer, nothing to move between the waves. Forward 0 → 8/3 ms; backward of wave 1 8/3 → 16/3 ms, of wave 0
16/3 → 8 ms = ``t_pass``. One all-reduce: ``2·10 µs + 1·400e6/100e9 s = 4.02 ms``. Layer 1's bucket is
ready at 16/3 and ends at 9.353 ms; layer 0's is ready at 8 ms but shares devices 0-1, so it runs 9.353 →
13.373 ms: exposed sync 5.373 ms (8.04 ms if posted after the backward). Layer 1 on devices 2-3 instead:
its reduce runs beside layer 0's and ends before it; exposed 4.02 ms. bf16 gradients (2.02 ms each, on 0-1):
5.333 → 7.353, then 8 → 10.02: exposed 2.02 ms. ``K = 4`` passes: step ``4 · 8 + 5.373 = 37.373`` ms.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Mapping

from ..workload.cluster import Cluster
from ..workload.recompute import FORWARD_SHARE
from .grad_buckets import gradient_buckets
from .link_costs import SyncFloor, allreduce_time_ms, boundary_time_ms, schedule_collectives, sync_floor, sync_time_ms
from ..assembly.plan import TRANSFER_POSTINGS, Plan, Slice
from ..assembly.communicators import peak_memory_bytes
from ..assembly.dataflow import sending_order
from .runtime_costs import RuntimeCosts
from .timeline import dataflow_pass, new_waits
#: Bytes per parameter of the gradient all-reduce: Megatron-LM trains bf16 with gradient accumulation and
#: all-reduce in fp32 (``megatron/training/arguments.py``: "bfloat16 requires gradient accumulation and
#: all-reduce to be done in fp32").
GRAD_BYTES_PER_PARAM = 4


class SimulationError(ValueError):
    """The plan cannot run on the cluster as given (too few devices, other islands, memory)."""


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
    wave: int | None = None
    """The plan wave whose backward completes the bucket (None: no member uses it; ready at the pass end)."""
    ready_ms: float = 0.0
    """When the bucket is complete on every member, from the start of the step's last pass."""
    start_ms: float = 0.0
    end_ms: float = 0.0


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
    passes: int = 1
    """Passes of the plan per optimizer step (gradient accumulation)."""
    grad_bytes_per_param: int = GRAD_BYTES_PER_PARAM
    pass_ms: float = 0.0
    """One pass: Σ wave durations + Σ transfers."""
    sync_standalone_ms: float = 0.0
    """What the sync would cost if every bucket were posted after the backward (no overlap)."""

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
                "num_waves": len(self.waves), "num_collectives": len(self.collectives), "passes": self.passes,
                "grad_bytes_per_param": self.grad_bytes_per_param, "pass_ms": self.pass_ms,
                "sync_standalone_ms": self.sync_standalone_ms}


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
        over = [(b, d) for d, b in enumerate(peak_memory_bytes(plan)) if b > limit * (1 + 1e-9)]
        if over:
            b, d = max(over)
            raise SimulationError(
                f"plan ({plan.system}) is out of memory on {len(over)} device(s): device {d} needs "
                f"{b / 2**30:.2f} GiB (NCCL communicators included), cluster {cluster.name!r} allows "
                f"{limit / 2**30:.2f} GiB "
                f"({cluster.memory_gib:g} GiB × {cluster.usable_memory_fraction:g} usable)")


def _slice_time(s: Slice, curves: Mapping) -> float:
    return s.num_layers * curves[s.metaop].time(len(s.ranks))


def _slice_times(plan: Plan, scale: float = 1.0) -> dict[str, float]:
    """Every slice's curve time (forward + backward), times ``scale``."""
    curves = dict(plan.curves)
    return {s.name: scale * _slice_time(s, curves) for w in plan.waves for s in w.slices}


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


def _check_args(passes, grad_bytes: int) -> int:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be a positive integer, got {passes!r}")
    if grad_bytes not in (2, 4):
        raise ValueError(f"grad_bytes must be 2 (bf16) or 4 (fp32), got {grad_bytes!r}")
    return passes


def _pass_and_sync(plan: Plan, cluster: Cluster, *, grad_bytes: int, overlap_sync: bool, compute_scale: float,
                   bucket_size: int | None,
                   runtime: RuntimeCosts | None = None) -> tuple[dict[str, float], float, list, list]:
    """``(slice ms, pass ms, posted buckets as (post time, bucket), their (start, end))``: items 1-4 of the
    module docstring, what the step's time needs (the breakdown's parts are :func:`simulate`'s)."""
    slice_ms = _slice_times(plan, compute_scale)
    pass_ms, done = dataflow_pass(plan, cluster, slice_ms, runtime=runtime)
    buckets = gradient_buckets(plan, done, pass_ms, grad_bytes=grad_bytes, bucket_size=bucket_size,
                               backward_ms={k: (1 - FORWARD_SHARE) * t for k, t in slice_ms.items()})
    posted = [((b.ready_ms if overlap_sync else pass_ms), b) for b in buckets]
    posted.sort(key=lambda rb: (rb[0], rb[1].ranks))
    spans = schedule_collectives(((b.ranks, b.bytes, r) for r, b in posted), cluster)
    return slice_ms, pass_ms, posted, spans


def step_time_ms(plan: Plan, cluster: Cluster, *, passes: int | None = None,
                 grad_bytes: int = GRAD_BYTES_PER_PARAM) -> float:
    """:func:`simulate`'s ``step_ms`` without the breakdown (the whole-step choice times many candidates;
    memory not checked): the same numbers, half the work."""
    passes = _check_args(passes if passes is not None else plan.passes, grad_bytes)
    check_fits(plan, cluster, check_memory=False)
    _, pass_ms, _, spans = _pass_and_sync(plan, cluster, grad_bytes=grad_bytes, overlap_sync=True,
                                          compute_scale=1.0, bucket_size=None)
    return passes * pass_ms + (max([end for _, end in spans] + [pass_ms]) - pass_ms)


def rank_waits(plan: Plan, cluster: Cluster, *, runtime: RuntimeCosts | None = None) -> list[dict[str, float]]:
    """Each rank's host time beside its slices in one pass, as the runtime's trace splits it
    (:data:`.timeline.WAIT_PARTS`: posting its batches, blocked on messages already posted, blocked on peers
    that had not posted yet), ms. The breakdown's *transfer* is what the transfers add to the pass; this is
    what each rank spends on them, the quantity a trace measures."""
    waits = new_waits(plan.world_size)
    dataflow_pass(plan, cluster, _slice_times(plan), runtime=runtime, waits=waits)
    return waits


def best_posting(plan: Plan, cluster: Cluster, *, passes: int | None = None,
                 postings: tuple[str, ...] = TRANSFER_POSTINGS) -> tuple[Plan, float]:
    """``plan`` under the transfer posting of ``postings`` (default :data:`..assembly.plan.TRANSFER_POSTINGS`)
    whose :func:`step_time_ms` is shortest, with that step; the plan's own posting on a tie (if among them).
    Producer posting moves an edge while both ends compute later slices, but pays each point's batch on its
    own; boundary posting pays one batch per wave, its messages sharing the links
    (:func:`.link_costs.boundary_time_ms`), which is shorter where many small slices feed one wave. Producer
    posting is also timed with each wave's slices in sending order (:func:`..assembly.dataflow.sending_order`:
    receivers post before their own work). The plan says which the runtime runs, so the planner picks per
    plan."""
    if plan.transfer_posting not in postings:
        plan = replace(plan, transfer_posting=postings[0])
    best = (plan, step_time_ms(plan, cluster, passes=passes))
    timed = {id(plan)}
    for posting in postings:
        other = plan if posting == plan.transfer_posting else replace(plan, transfer_posting=posting)
        for q in [other] + ([sending_order(other)] if posting == "producer" else []):
            if id(q) in timed:  # sending_order gives the plan itself when no wave's order changes
                continue
            timed.add(id(q))
            t = step_time_ms(q, cluster, passes=passes)
            if t < best[1] * (1 - 1e-9):
                best = (q, t)
    return best


def step_sync_floor(sim: StepSimulation, cluster: Cluster) -> tuple[SyncFloor, float] | None:
    """The busiest device or NIC of a simulated plan's gradient sync (:func:`.link_costs.sync_floor`) and the
    step it forces (``passes - 1`` passes before the last one, from whose start the buckets' ready times count);
    ``None``: no all-reduce takes time."""
    f = sync_floor(((c.ranks, c.bytes, c.ready_ms) for c in sim.collectives), cluster)
    return None if f is None else (f, (sim.passes - 1) * sim.pass_ms + f.end_ms)


def simulate(plan: Plan, cluster: Cluster, *, check_memory: bool = True, passes: int | None = None,
             grad_bytes: int = GRAD_BYTES_PER_PARAM, overlap_sync: bool = True,
             compute_scale: float = 1.0, bucket_size: int | None = None,
             runtime: RuntimeCosts | None = None) -> StepSimulation:
    """Predict one training step of ``plan`` on ``cluster`` (see the module docstring for the model).

    ``passes``: passes of the plan per optimizer step (gradient accumulation, one sync after the last;
    default the plan's own); ``grad_bytes``: bytes per gradient element of the all-reduce (4: fp32, 2:
    bf16); ``overlap_sync``: post each bucket when its last gradient is complete (the runtime's default)
    rather than after the backward; ``compute_scale``: every slice takes that many times its curve's time
    (CPU ranks sharing cores, as the live prediction of :mod:`megatron_spindle.megatron.trainer.prediction` sees
    them), so buckets become ready later too; ``bucket_size``: parameters per gradient bucket (default
    megatron.core's, :mod:`.grad_buckets`); ``runtime``: the runtime's own measured costs (a profile's
    ``measured.runtime``, :mod:`.runtime_costs`), charged on the pass's timeline (:mod:`.timeline`).
    """
    passes = _check_args(passes if passes is not None else plan.passes, grad_bytes)
    check_fits(plan, cluster, check_memory=check_memory)
    N = plan.world_size
    flows = transfer_flows(plan, cluster)
    back = transfer_flows(plan, cluster, backward=True)
    slice_ms, pass_ms, posted, spans = _pass_and_sync(plan, cluster, grad_bytes=grad_bytes,
                                                      overlap_sync=overlap_sync, compute_scale=compute_scale,
                                                      bucket_size=bucket_size, runtime=runtime)
    waves = []
    for w in plan.waves:
        times = [slice_ms[s.name] for s in w.slices]
        duration = max(times, default=0.0)
        busy = sum(t * len(s.ranks) for t, s in zip(times, w.slices)) / N
        f = flows.get(w.index, [])
        fwd = boundary_time_ms(f, cluster)
        bwd = boundary_time_ms(back.get(w.index, []), cluster)
        g = cluster.gpus_per_node  # cluster.island(d) is d // g
        waves.append(WaveTiming(index=w.index, duration_ms=duration, busy_ms=busy, transfer_fwd_ms=fwd,
                                transfer_bwd_ms=bwd, moved_bytes=sum(x for a, b, x in f if a != b),
                                cross_island_bytes=sum(x for a, b, x in f if a // g != b // g)))
    free_comm_ms, _ = dataflow_pass(plan, cluster, slice_ms, transfers=False, runtime=runtime)  # per-slice costs
    colls = tuple(Collective(ranks=b.ranks, bytes=b.bytes, time_ms=allreduce_time_ms(b.ranks, b.bytes, cluster),
                             wave=b.wave, ready_ms=r, start_ms=start, end_ms=end)
                  for (r, b), (start, end) in zip(posted, spans))
    sync = max([c.end_ms for c in colls] + [pass_ms]) - pass_ms
    standalone = sync_time_ms(((c.ranks, c.bytes) for c in colls), cluster)
    makespan = sum(w.duration_ms for w in waves)
    compute = sum(w.busy_ms for w in waves)
    transfer = max(0.0, pass_ms - free_comm_ms)
    bd = Breakdown(compute_ms=passes * compute, transfer_ms=passes * transfer, sync_ms=sync,
                   idle_ms=passes * max(0.0, pass_ms - transfer - compute))
    return StepSimulation(system=plan.system, cluster=cluster.name, world_size=N, step_ms=passes * pass_ms + sync,
                          breakdown=bd, waves=tuple(waves), collectives=colls,
                          peak_memory_bytes=tuple(plan.device_memory_bytes), makespan_ms=makespan,
                          lower_bound_ms=plan.lower_bound_ms, passes=passes, grad_bytes_per_param=grad_bytes,
                          pass_ms=pass_ms, sync_standalone_ms=standalone)
