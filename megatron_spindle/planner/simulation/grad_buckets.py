"""Gradient buckets as megatron.core's ``DistributedDataParallel`` forms them, for the step simulator.

The runtime (``runtime/grad_sync.py``) reduces each parameter shard over its parameter device group with one
megatron.core DDP instance per distinct rank set; Megatron-LM's own training (the baselines) uses one DDP
instance over its data-parallel group. Either way DDP packs the parameters of an instance into buckets of at
least ``bucket_size`` parameters (megatron.core ``distributed_data_parallel.py``: when not given,
``max(40_000_000, 1_000_000 × data-parallel size)``; a parameter is never split), in the order their
gradients are produced by the backward pass, and with ``overlap_grad_reduce`` posts a bucket's all-reduce
as soon as every gradient in it is complete.

Here a parameter group (:class:`..assembly.plan.ParamGroup`) is complete when the last backward, in execution order,
of a slice that holds it on one of its ranks has passed its layer: a slice runs its layers' backward in
reverse, so with ``backward_ms`` (the slice's backward time, split evenly over its layers) layer ``j`` of a
slice of layers ``[a, b)`` ending at ``done`` is complete at ``done - backward · (j - a) / (b - a)`` (the last
layer first, the first at the slice's end), as its gradient hooks fire in megatron.core DDP (the static-grid
baseline counts its layers the same way); without it, at the slice's end (``done_ms`` of that slice). Per rank
set the groups are taken in order of completion and cut into buckets at ``bucket_size`` parameters; a bucket
is ready when its last group is. Groups of frozen MetaOps (``trainable=False``) have no gradient and are skipped.

A pure function of the plan and the slices' backward end times, so every system (Spindle's plan or a
baseline's) is bucketed the same way.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

from ..assembly.plan import Plan

#: megatron.core DDP's default bucket size, parameters (``max(40e6, 1e6 × dp)``).
DEFAULT_BUCKET_PARAMS = 40_000_000
BUCKET_PARAMS_PER_RANK = 1_000_000


def bucket_params(ranks: int) -> int:
    """megatron.core's default bucket size for a data-parallel group of ``ranks`` devices."""
    return max(DEFAULT_BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * ranks)


@dataclass(frozen=True)
class GradBucket:
    """One all-reduce: gradients of one rank set, complete at ``ready_ms``."""

    ranks: tuple[int, ...]
    params: int
    bytes: float
    ready_ms: float
    """When its last gradient is complete on every member, from the start of the step's last pass."""
    wave: int | None
    """The wave whose backward completes it (``None``: held by no slice; ready at the pass end)."""


def gradient_buckets(plan: Plan, done_ms: Mapping[str, float], pass_ms: float, *, grad_bytes: int,
                     bucket_size: int | None = None,
                     backward_ms: Mapping[str, float] | None = None) -> list[GradBucket]:
    """The plan's buckets (see the module docstring), sorted by ready time then ranks.

    ``done_ms``: slice name -> end of its backward in the last pass; ``backward_ms``: slice name -> its
    backward time (layer by layer completion; ``None``: every layer at the slice's end); ``bucket_size``:
    parameters per bucket (default: megatron.core's for each rank set's size)."""
    metaops = {m.name: m for m in plan.metaops}
    frozen = {k for m in plan.metaops if not m.trainable for k in m.param_keys if k}
    # every slice's use (end of its backward, wave, name), ranked; per weight and device the last use's rank
    uses: list[tuple[float, int, str]] = []
    per_key: dict[str, list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
    for w in plan.waves:
        for s in w.slices:
            keys = metaops[s.metaop].param_keys[s.layer_start:s.layer_stop]
            if not any(keys) or not s.ranks:
                continue
            done = done_ms[s.name]
            if backward_ms is None:
                for key in keys:
                    if key:
                        per_key[key].append((len(uses), s.ranks))
                uses.append((done, w.index, s.name))
                continue
            per_layer = backward_ms[s.name] / len(keys)
            for i, key in enumerate(keys):  # the backward runs the layers last to first: layer i's ends i
                if key:                      # layers' backward before the slice's end (the first layer's at it)
                    per_key[key].append((len(uses), s.ranks))
                    uses.append((done - per_layer * i, w.index, s.name))
    order = sorted(range(len(uses)), key=uses.__getitem__)
    rank_of = [0] * len(uses)
    for pos, i in enumerate(order):
        rank_of[i] = pos
    last: dict[str, dict[int, int]] = {}  # weight -> device -> rank of its last use there
    for key, held in per_key.items():
        a = last[key] = {}
        for i, ranks in held:
            r = rank_of[i]
            for d in ranks:
                if a.get(d, -1) < r:
                    a[d] = r
    by_ranks: dict[tuple[int, ...], list[tuple[float, int, int, str]]] = defaultdict(list)
    for g in plan.param_groups:
        if g.param_key in frozen:
            continue
        ranks = tuple(sorted(g.ranks))
        a = last.get(g.param_key)
        best = max([a.get(d, -1) for d in ranks], default=-1) if a is not None else -1
        ready, wave = uses[order[best]][:2] if best >= 0 else (pass_ms, None)
        by_ranks[ranks].append((ready, -1 if wave is None else wave, g.params, g.param_key))
    out = []
    for ranks, groups in by_ranks.items():
        size = bucket_size or bucket_params(len(ranks))
        groups.sort()
        n, last = 0, None
        for ready, wave, params, _ in groups:
            n += params
            last = (ready, wave)
            if n >= size:
                out.append(GradBucket(ranks, n, n * grad_bytes, ready, None if wave < 0 else wave))
                n = 0
        if n:
            out.append(GradBucket(ranks, n, n * grad_bytes, last[0], None if last[1] < 0 else last[1]))
    out.sort(key=lambda b: (b.ready_ms, b.ranks))
    return out
