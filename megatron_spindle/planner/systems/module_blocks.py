"""A whole-step candidate of Spindle's: every module on a fixed block of devices, level after level.

Gradient sync is a cost of where weights live: a weight held by devices in many nodes is all-reduced across
them. Spindle's level schedules give each MetaOp the devices that finish its level soonest, so a module
shared by several tasks (Multitask-CLIP's vision encoder serves four to seven tasks) ends up on devices of
many slices, and its gradients cross nodes. This candidate keeps every module of the spec (``MetaOp.module``)
on one contiguous block of devices for the whole step, sized like the module-level grids
(:func:`.static_grids.build_grids`: balanced per-module work), and runs the modules stage by stage (a module's
stage is its depth in the module graph, :func:`.static_grids.module_stages`: the encoders, then what consumes
them): the modules of a stage as concurrent lanes, each running all its MetaOps (every task's, in level order)
one after another on its block, with no barrier between levels (:class:`.baselines.Lane`, aligned into waves
as the task-level baseline is). With task groups, each group's stages in turn, one phase per group. Its
parameter device groups are the blocks. The whole-step choice (:mod:`..step.choose`) keeps it only when its
simulated step is the shortest.
"""
from __future__ import annotations

from typing import Sequence

from ..workload.cluster import Cluster
from ..workload.graph import TaskGraph
from ..workload.metaops import levels
from .baselines import Lane, share_blocks, PlanBuilder, finish_plan
from .shares import finish_together_shares, min_share
from ..assembly.plan import Plan
from .static_grids import module_stages


def plan_module_blocks(graph: TaskGraph, cluster: Cluster, *, prepared, passes: int = 1,
                       distributed_optimizer: bool = False, groups: Sequence[Sequence[str]] = (),
                       validate: bool = False) -> Plan:
    """The module-blocks schedule of ``prepared = (metaops, curves)`` (module docstring)."""
    metaops, curves = prepared
    N = cluster.num_devices
    modules = sorted({m.module for m in metaops})
    by_module = [[m for m in metaops if m.module == mod] for mod in modules]
    if sum(min_share(g, N) for g in by_module) > N:
        raise ValueError(f"{len(modules)} modules need more than {N} devices on blocks of their own")
    blocks = dict(zip(modules, share_blocks(finish_together_shares(by_module, curves, N))))
    stages = module_stages(metaops)
    b = PlanBuilder()
    for phase, tasks in enumerate(groups or [graph.tasks]):
        b.phase = phase
        here = [m for lv in levels([m for m in metaops if m.task in tasks]) for m in lv]  # level order
        for stage in sorted({stages[m.module] for m in here}):
            lanes = [Lane.of(blocks[mod], [m for m in here if m.module == mod], curves, N)
                     for mod in modules if stages[mod] == stage and any(m.module == mod for m in here)]
            b.lanes(lanes, N)
    return finish_plan(b, graph, cluster, metaops, curves, "module-blocks", validate, None, passes=passes,
                   distributed_optimizer=distributed_optimizer)
