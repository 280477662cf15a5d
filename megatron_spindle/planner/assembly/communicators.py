"""The process groups a plan needs, and the device memory their NCCL communicators hold. Pure Python.

:func:`plan_rank_sets` maps a plan to ``{group name: ranks}``; the runtime's group registry
(``runtime/groups.py``) creates exactly these, in sorted order:

* ``tp/<slice>/<replica>``: the tensor-parallel group of each data-parallel replica of a slice with tp > 1
  (ranks ascending: a device's position is its tensor-parallel rank);
* ``param/<param_key>/<shard>``: each parameter device group with more than one device; its gradient is
  all-reduced over exactly these ranks after backward (none for a frozen weight: no gradient).

Nothing else: the loss and gradient-norm reductions and the point-to-point messages use the default group,
and a weight held by one rank is reduced over nobody, so no group is created unused.

**Memory.** Under NCCL every distinct rank set a device belongs to is one communicator on that device (names
with the same ranks share one group), and so is the world's default group; a one-rank group connects to no
peer and holds no channel buffers. :func:`communicators_per_device` counts them; each is charged the plan's
``communicator_bytes`` (the cluster's ``communicator_mib``: NCCL's buffers,
:data:`..workload.cluster.NCCL_COMMUNICATOR_MIB`; none for gloo ranks), and :func:`peak_memory_bytes` is a
device's memory estimate
(``plan.device_memory_bytes``: weights, gradients, optimizer state, activations) plus that charge, which is
what the memory checks compare with the limit (validation's rule 7, the searches, the simulator, the start-up
check on GPUs). The stored estimate is unchanged, so a plan changes only where the charge makes memory bind.
"""
from __future__ import annotations

from .dataflow import frozen_param_keys
from .plan import Plan

def tp_group_name(slice_name: str, replica: int) -> str:
    return f"tp/{slice_name}/{replica}"


def param_group_name(param_key: str, shard: int) -> str:
    return f"param/{param_key}/{shard}"


def plan_rank_sets(plan: Plan) -> dict[str, tuple[int, ...]]:
    """``{group name: ranks}`` of every group the plan's run creates (see the module docstring)."""
    out: dict[str, tuple[int, ...]] = {}
    for s in plan.slices():
        if s.tp > 1:
            for i in range(s.dp):
                out[tp_group_name(s.name, i)] = tuple(s.ranks[i * s.tp:(i + 1) * s.tp])
    frozen = frozen_param_keys(plan.metaops)
    for g in plan.param_groups:
        if len(g.ranks) > 1 and g.param_key not in frozen:
            out[param_group_name(g.param_key, g.tp_rank)] = tuple(g.ranks)
    return out


def communicators_per_device(plan: Plan) -> list[int]:
    """NCCL communicators with peers on each device: the world's (more than one device) and one per distinct
    rank set of :func:`plan_rank_sets` it belongs to."""
    counts = [1 if plan.world_size > 1 else 0] * plan.world_size
    for ranks in {tuple(sorted(r)) for r in plan_rank_sets(plan).values()}:
        for d in ranks:
            if 0 <= d < len(counts):  # a rank outside the world is validation's rule 1, not counted here
                counts[d] += 1
    return counts


def peak_memory_bytes(plan: Plan) -> list[float]:
    """Each device's memory estimate plus its communicators' (``plan.communicator_bytes`` each)."""
    per = plan.communicator_bytes
    return [b + n * per for b, n in zip(plan.device_memory_bytes, communicators_per_device(plan))]
