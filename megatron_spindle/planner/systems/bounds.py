"""The whole-step bound (:mod:`..simulation.step_bound`) of a workload at one configuration, without planning.

Every system at an :class:`..assembly.execution.Execution` runs the same MetaOps and curves
(:func:`..step.build.plan_system` and :func:`..tuning.tune.tune_static_grids` build them this way), so the bound at
a system's configuration bounds that system's step (every plan of it that fits the cluster's memory), and the
smallest over the configurations compared bounds every plan any of them could run.
"""
from __future__ import annotations

from ..simulation.step_bound import StepBound, step_bound
from ..assembly.assemble import make_metaops
from ..assembly.execution import Execution, configure
from ..workload.analytic import CurvesFile, DeviceModel, build_curves
from ..workload.cluster import Cluster
from ..workload.graph import TaskGraph


def configured_step_bound(graph: TaskGraph, cluster: Cluster, execution: Execution, *,
                          curves_file: CurvesFile | None = None, device: DeviceModel | None = None) -> StepBound:
    """The bound for ``graph`` (one pass's, at ``execution.passes``) on ``cluster`` under ``execution``."""
    metaops = configure(make_metaops(graph, cluster), execution, cluster)
    curves = build_curves(metaops, cluster.num_devices, curves_file=curves_file, device=device)
    return step_bound(metaops, curves, cluster, execution.passes)
