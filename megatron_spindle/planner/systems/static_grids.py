"""The module-level static-grid baseline: what a Megatron user can do today with megatron.core's MIMO.

megatron.core 0.17+ (``megatron/core/models/mimo``) runs each module of a multi-modal model (a modality
encoder, the language model) on its own rank set, a non-colocated ``HyperCommGrid``, for the whole step, and
pipelines micro-batches from the encoders' grids into the consuming module's grid. Here:

1. **Grids.** One grid per module of the spec (``MetaOp.module``: ``vision``, ``text``, ``llm``, ``loss`` ...);
   a module shared by several tasks is one grid that runs every task's MetaOps of it. Shares are sized to
   balance the modules' work per micro-batch (:func:`.shares.finish_together_shares`: the slowest grid as
   fast as it can be with the devices there are, then the fewest devices), contiguous blocks from device 0.
   Inside its grid a MetaOp runs on its best valid count (as the sequential baseline does on the cluster).
2. **Pipeline.** A grid's stage is its depth in the module graph (encoders 0, the module consuming them 1,
   ...). Per micro-batch a grid computes ``t_g = Σ_m L_m · T_m(n_m)`` (forward + backward, every task's
   MetaOps of the module, on the micro-batch's curves) and a stage lasts ``t_s = max_g t_g`` plus the
   transfer of its inputs from the grids before it (:func:`..simulation.link_costs.boundary_time_ms` of the activations
   of one micro-batch, each source device sending its samples to the consuming grid's devices, and back
   for the gradients). With 1F1B over ``M`` micro-batches and ``S`` stages the pass takes
   ``Σ_s t_s + (M - 1) · max_s t_s`` (fill and drain, then the bottleneck stage's pace).
3. **Sync.** Each grid all-reduces its module's gradients over its devices in megatron.core DDP buckets
   (:mod:`..simulation.grad_buckets`' sizes and rule): in the grid's last backward its MetaOps run in reverse order, a
   weight's gradient is complete after the last backward that uses it (a module shared by several tasks:
   after the task that ran first), a bucket when its last weight is; in the drain the last stage finishes
   first, stage ``s`` ``s`` stage paces before the pass ends. Scheduled by
   :func:`..simulation.link_costs.schedule_collectives`; what runs past the pass is exposed.
4. **Memory.** A device holds its module's states (sharded by the distributed optimizer over the grid when it
   is on) and, in 1F1B, the activations of up to ``S - s`` micro-batches in flight at stage ``s``.

This schedule interleaves micro-batches across grids, which a wave plan cannot express, so it is timed here
with the simulator's own cost primitives (curves, :mod:`..simulation.link_costs`, the memory model) instead of
as a plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..workload.cluster import Cluster
from ..workload.curves import ScalingCurve
from ..workload.memory import layer_state_bytes, slice_activation_bytes
from ..workload.metaops import MetaOp, edge_elems_per_sample
from ..workload.recompute import FORWARD_SHARE
from .shares import best_count, finish_together_shares, min_share
from ..simulation.grad_buckets import bucket_params
from ..simulation.link_costs import boundary_time_ms, schedule_collectives
from ..simulation.simulate import GRAD_BYTES_PER_PARAM, Breakdown, StepSimulation

ACTIVATION_BYTES = 2  # bf16 activations cross grids (as :mod:`..assembly.dataflow` counts them)


@dataclass(frozen=True)
class Grid:
    module: str
    ranks: tuple[int, ...]
    stage: int
    metaops: tuple[MetaOp, ...]
    time_ms: float
    """Forward + backward of one micro-batch on this grid."""


def module_stages(metaops: Sequence[MetaOp]) -> dict[str, int]:
    """Each module's depth in the module graph (a module's stage is one more than any producer module's)."""
    by_name = {m.name: m for m in metaops}
    stage: dict[str, int] = {}
    for m in sorted(metaops, key=lambda m: m.level):  # producers come first by level
        s = stage.get(m.module, 0)
        for p in m.producers:
            pm = by_name[p]
            if pm.module != m.module:
                s = max(s, stage.get(pm.module, 0) + 1)
        stage[m.module] = max(stage.get(m.module, 0), s)
    return stage


def build_grids(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], cluster: Cluster) -> list[Grid]:
    """The grids (module docstring, item 1), in stage order then module name."""
    N = cluster.num_devices
    modules = sorted({m.module for m in metaops})
    groups = [[m for m in metaops if m.module == mod] for mod in modules]
    if sum(min_share(g, N) for g in groups) > N:
        raise ValueError(f"the {len(modules)} modules need at least {sum(min_share(g, N) for g in groups)} "
                         f"devices on grids of their own; the cluster has {N}")
    shares = finish_together_shares(groups, curves, N)
    stages = module_stages(metaops)
    order = sorted(range(len(modules)), key=lambda i: (-shares[i], modules[i]))
    out, nxt = {}, 0
    for i in order:
        ranks = tuple(range(nxt, nxt + shares[i]))
        nxt += shares[i]
        t = sum(m.num_layers * curves[m.name].time(best_count(m, curves[m.name], shares[i], N))
                for m in groups[i])
        out[modules[i]] = Grid(modules[i], ranks, stages[modules[i]], tuple(groups[i]), t)
    return sorted(out.values(), key=lambda g: (g.stage, g.module))


def _flows(src: Sequence[int], dst: Sequence[int], nbytes: float) -> list[tuple[int, int, float]]:
    """Each source device sends its share of the micro-batch to the destination devices in turn."""
    per = nbytes / len(src)
    return [(s, dst[i % len(dst)], per) for i, s in enumerate(src)]


def simulate_grids(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], cluster: Cluster, *,
                   micro_batches: int, distributed_optimizer: bool = False,
                   grad_bytes: int = GRAD_BYTES_PER_PARAM) -> tuple[StepSimulation, list[Grid]]:
    """One step of ``micro_batches`` micro-batches (``metaops`` and ``curves`` are one micro-batch's)."""
    N = cluster.num_devices
    grids = build_grids(metaops, curves, cluster)
    grid_of = {m.name: g for g in grids for m in g.metaops}
    by_name = {m.name: m for m in metaops}
    S = 1 + max(g.stage for g in grids)
    stage_ms = [0.0] * S
    transfer = [0.0] * S
    for s in range(S):
        here = [g for g in grids if g.stage == s]
        stage_ms[s] = max(g.time_ms for g in here)
        flows = []
        for g in here:  # activations of one micro-batch into this stage's grids (and gradients back)
            for m in g.metaops:
                for p in m.producers:
                    pg = grid_of[p]
                    if pg is not g:
                        pm = by_name[p]
                        flows += _flows(pg.ranks, g.ranks, pm.batch * edge_elems_per_sample(pm, m) * ACTIVATION_BYTES)
        transfer[s] = 2 * boundary_time_ms(flows, cluster)  # forward, and the gradients back
    pace = max(t + x for t, x in zip(stage_ms, transfer))
    pass_ms = sum(t + x for t, x in zip(stage_ms, transfer)) + (micro_batches - 1) * pace
    # gradient sync: in a grid's last backward its MetaOps run in reverse order, each layer's backward in turn;
    # a weight's gradient is complete after the last of them that uses it (a module shared by several tasks:
    # after the backward of the task that ran first). In 1F1B's drain the last stage finishes first, stage s
    # s paces before the pass's end (the first stage's at the end).
    posted = []
    for g in grids:
        end = pass_ms - g.stage * pace
        done: dict[str, float] = {}
        clock = end - (1 - FORWARD_SHARE) * g.time_ms
        n_of = {m.name: best_count(m, curves[m.name], len(g.ranks), N) for m in g.metaops}
        for m in reversed(g.metaops):
            layer_ms = (1 - FORWARD_SHARE) * curves[m.name].time(n_of[m.name])
            for j in range(m.num_layers - 1, -1, -1):
                clock += layer_ms
                k = m.param_keys[j]
                if k and m.trainable:
                    done[k] = max(done.get(k, 0.0), clock)
        if len(g.ranks) < 2 or not done:
            continue
        size = bucket_params(len(g.ranks))
        owner = {k: m for m in g.metaops for k in m.param_keys if k}
        n, ready = 0, 0.0
        for k, t in sorted(done.items(), key=lambda kv: (kv[1], kv[0])):
            n += owner[k].params_per_layer // owner[k].tp
            ready = t
            if n >= size:
                posted.append((ready, g.ranks, n * grad_bytes))
                n = 0
        if n:
            posted.append((ready, g.ranks, n * grad_bytes))
    posted.sort(key=lambda x: (x[0], x[1]))
    spans = schedule_collectives(((r, nbytes, t) for t, r, nbytes in posted), cluster)
    sync = max([e for _, e in spans] + [pass_ms]) - pass_ms
    # memory: states of the module on every grid device, and up to S - s micro-batches in flight
    mem = [0.0] * N
    for g in grids:
        keys: dict[str, MetaOp] = {}
        act = 0.0
        for m in g.metaops:
            for k in m.param_keys:
                if k:
                    keys.setdefault(k, m)
            n = best_count(m, curves[m.name], len(g.ranks), N)
            act += slice_activation_bytes(m, m.num_layers, n)
        states = sum(layer_state_bytes(m, holders=len(g.ranks) // m.tp, distributed_optimizer=distributed_optimizer)
                     for m in keys.values())
        for r in g.ranks:
            mem[r] = states + (S - g.stage) * act
    busy = sum(len(g.ranks) * g.time_ms for g in grids) * micro_batches / N
    xfer = sum(transfer) * micro_batches
    step = pass_ms + sync
    bd = Breakdown(compute_ms=busy, transfer_ms=xfer, sync_ms=sync, idle_ms=max(0.0, step - busy - xfer - sync))
    sim = StepSimulation(system="static-grids", cluster=cluster.name, world_size=N, step_ms=step, breakdown=bd,
                         waves=(), collectives=(), peak_memory_bytes=tuple(mem),
                         makespan_ms=sum(stage_ms) + (micro_batches - 1) * max(stage_ms), lower_bound_ms=0.0,
                         passes=micro_batches, grad_bytes_per_param=grad_bytes, pass_ms=pass_ms,
                         sync_standalone_ms=0.0)
    return sim, grids
