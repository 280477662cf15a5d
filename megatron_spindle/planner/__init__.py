"""The planner: pure Python + numpy (HiGHS optional), by the paper's stages.

* :mod:`.workload`: the task graph and model specs, operator costs and memory, the cluster, the contraction
  into MetaOps and their scaling curves;
* :mod:`.level`: one MetaLevel's schedule (allocation, Algorithm 1, the searches and the bounds);
* :mod:`.step`: the whole step (assembly, whole-step choice, placement, data flow, the plan, validation,
  rendering);
* :mod:`.simulation`: the step simulator (per-device timeline, link costs, gradient buckets);
* :mod:`.systems`: the baselines' schedules (static grids, module blocks, device shares) and the tuners that
  set every system, Spindle included, to its own best configuration;
* :mod:`.exact` (machine-independent arithmetic), :mod:`.limits` (input caps), :mod:`.jsonfile`.

The public names below are importable from ``megatron_spindle.planner`` itself; each is loaded on first use
(so importing one stage does not import the others).
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    "workload.graph": ("TaskGraph", "Operator", "LayerConfig", "data_input"),
    "workload.spec": ("load_spec", "parse_spec", "shipped_models", "SpecError"),
    "workload.workloads": ("build_graph", "resolve_passes", "WORKLOADS"),
    "workload.layer_types": ("register_layer_type", "custom_layer_type", "LayerCost"),
    "workload.metaops": ("MetaOp", "contract", "levels"),
    "workload.curves": ("ScalingCurve", "Segment", "fit_piecewise"),
    "workload.analytic": ("CurvesFile", "DeviceModel", "build_curves"),
    "workload.cluster": ("Cluster", "load_cluster", "PRESETS", "DEFAULT_PRESET"),
    "level.allocate": ("allocate_level", "bipoint", "AllocTuple", "LevelAllocation"),
    "level.waves": ("Wave", "WaveSlice", "schedule_level"),
    "level.scheduler": ("plan_level", "LevelSchedule"),
    "step.build": ("make_plan", "make_metaops", "schedule", "plan_system"),
    "step.plan": ("Plan", "Slice", "SliceRef", "Transfer", "Message"),
    "step.validate": ("check_plan", "PlanError"),
    "simulation.simulate": ("simulate", "StepSimulation", "SimulationError"),
    "systems.baselines": ("SYSTEMS", "BASELINES", "lower_bound_ms"),
    "step.placement": ("PlacementError",),
    "step.render": ("grid", "gantt", "summary", "metaop_table"),
}
_WHERE = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
