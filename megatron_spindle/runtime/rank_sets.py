"""Rank sets of a plan, computed purely (no torch): the input of :class:`~.groups.ProcessGroupRegistry`.

* ``tp/<slice>/<replica>``: the tensor-parallel group of each data-parallel replica of a slice with tp > 1
  (ranks ascending: a device's position is its tensor-parallel rank);
* ``param/<param_key>/<shard>``: each parameter device group with more than one device; its gradient is
  all-reduced over exactly these ranks after backward (none for a frozen weight: no gradient).

Nothing else: the loss and gradient-norm reductions and the point-to-point messages use the default group,
and a weight held by one rank is reduced over nobody (:mod:`.grad_sync`), so no group is created unused.
"""
from __future__ import annotations

from ..planner.assembly.dataflow import frozen_param_keys
from ..planner.assembly.plan import Plan


def tp_group_name(slice_name: str, replica: int) -> str:
    return f"tp/{slice_name}/{replica}"


def param_group_name(param_key: str, shard: int) -> str:
    return f"param/{param_key}/{shard}"


def plan_rank_sets(plan: Plan) -> dict[str, tuple[int, ...]]:
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
