"""Plans written by hand: a list of waves of ``(MetaOp, first layer, layers, ranks)``.

For tests, ablations and users who want to pin a schedule. The result is a normal :class:`~.plan.Plan`
(times from the scaling curves, transfers, parameter groups, memory) and is validated like any other.

>>> from megatron_spindle.planner.workload.workloads import build_graph
>>> g = build_graph("multitask-clip", tasks=4, size="tiny", batch=8)
>>> p = plan_from_waves(g, 2, [[("vision-text.vision.embed", 0, 1, (0, 1))]], partial=True)
>>> p.waves[0].slices[0].name
'w0:vision-text.vision.embed[0-0]x2'
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from ..workload.analytic import build_curves
from .assemble import assemble_plan, make_metaops
from ..workload.cluster import Cluster, load_cluster
from ..workload.graph import TaskGraph
from .plan import LevelInfo, Plan
from .validate import check_plan
from ..level.waves import Wave, WaveSlice

SliceSpec = tuple[str, int, int, Sequence[int]]


def plan_from_waves(graph: TaskGraph, num_devices: int, waves: Sequence[Sequence[SliceSpec]], *,
                    tp: Mapping[str, int] | None = None, recompute: Mapping[str, str] | None = None,
                    phases: Sequence[int] | None = None, passes: int = 1, distributed_optimizer: bool = False,
                    cluster: Cluster | None = None, partial: bool = False, system: str = "manual") -> Plan:
    """Build (and validate, unless ``partial``) a plan from explicit waves.

    ``tp`` maps a MetaOp name to its tensor-parallel degree (MetaOps sharing weights must agree);
    ``recompute`` a MetaOp name to its recompute mode (:mod:`..workload.recompute`); ``phases`` gives each
    wave's phase (default all 0); ``passes`` and ``distributed_optimizer`` are stored in the plan as given.
    """
    cluster = cluster or load_cluster(None, num_devices=num_devices, gpus_per_node=min(8, num_devices))
    metaops = list(make_metaops(graph, cluster))
    for what, given in (("tp", tp), ("recompute", recompute)):
        unknown = set(given or ()) - {m.name for m in metaops}
        if unknown:
            raise ValueError(f"{what} given for unknown MetaOps {sorted(unknown)}")
    if tp or recompute:
        metaops = [dataclasses.replace(m, tp=(tp or {}).get(m.name, m.tp),
                                       recompute=(recompute or {}).get(m.name, m.recompute)) for m in metaops]
    if phases is not None and len(phases) != len(waves):
        raise ValueError(f"{len(phases)} phases for {len(waves)} waves")
    by_name = {m.name: m for m in metaops}
    curves = build_curves(metaops, num_devices)
    out_waves, ranks, clock = [], {}, 0.0
    for wi, wave in enumerate(waves):
        w = Wave(level=0, start_ms=clock, duration_ms=0.0, phase=phases[wi] if phases is not None else 0)
        for si, (name, start, layers, rk) in enumerate(wave):
            if name not in by_name:
                raise ValueError(f"wave {wi}: unknown MetaOp {name!r}")
            t = layers * curves[name].count_time(len(rk))
            w.slices.append(WaveSlice(metaop=name, layer_start=start, layers=layers, devices=len(rk), time_ms=t))
            w.duration_ms = max(w.duration_ms, t)
            w.level = max(w.level, by_name[name].level)
            ranks[(wi, si)] = tuple(rk)
        clock += w.duration_ms
        out_waves.append(w)
    for i in range(1, len(out_waves)):  # keep levels monotone for validation rule 6
        out_waves[i].level = max(out_waves[i].level, out_waves[i - 1].level)
    levels = [LevelInfo(index=lv, c_star_ms=0.0, n_star=(), variant=system)
              for lv in sorted({m.level for m in metaops})]
    plan = assemble_plan(graph, cluster, metaops, curves, levels, out_waves, ranks, system=system, passes=passes,
                         distributed_optimizer=distributed_optimizer)
    if not partial:
        check_plan(plan)
    return plan
