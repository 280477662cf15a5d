"""What ``spindle plan`` prints about a plan's step: the configuration it runs at, the simulated whole step with
its bound, and the JSON object of ``--json``.

Each figure names what it measures. The **step** (the simulator's whole step: every pass, transfers, the
gradient sync) and the **step bound** (no wave plan of the same configuration is faster,
:mod:`.planner.simulation.step_bound`) are printed for every plan. The per-pass compute **makespan** (the waves
one after another) is printed, with Σ C* and the levels' certified bounds beside it, only for a plan whose
waves run level by level (:attr:`.planner.assembly.plan.Plan.level_by_level`): those bounds bound nothing
else. No ratio mixes the two families (a step over a per-pass compute bound).
"""
from __future__ import annotations

from dataclasses import dataclass

from .planner.assembly.execution import Execution
from .planner.assembly.plan import Plan
from .planner.assembly.render import certified_bound_ms, idle_devices
from .planner.simulation.simulate import StepSimulation, step_sync_floor
from .planner.simulation.step_bound import StepBound
from .planner.simulation.timeline import dataflow_pass
from .planner.workload.cluster import Cluster

#: Said once on stderr when HiGHS is missing: the plan is then not the planner's best.
HIGHS_NOTE = ("note: highspy (HiGHS) is not installed, so this plan is made without the planner's LP searches "
              "and bounds and may be slower than its best: pip install highspy (part of `pip install -e .`)")


@dataclass(frozen=True)
class Configured:
    """The configuration a plan runs at, and how it was chosen."""

    execution: Execution
    given: bool
    """``--passes`` given by the user (else: tuned as ``spindle compare`` tunes Spindle)."""
    schedule: str = "spindle"
    """The whole-step candidate that won (:mod:`.planner.step.choose`; ``spindle``: its own level-by-level waves)."""
    tried: int = 0
    """Configurations the tuner tried (0 when given)."""

    def line(self) -> str:
        how = ("given: --passes; nothing recomputed, one phase, replicated optimizer state" if self.given else
               f"Spindle's tuned configuration, as spindle compare picks it: best of {self.tried} tried")
        return f"{self.execution.label()} ({how})"

    def to_json(self) -> dict:
        return {**self.execution.to_json(), "label": self.execution.label(), "given": self.given,
                "tried": self.tried}


def pass_timeline(plan: Plan, cluster: Cluster) -> dict:
    """Every slice's ``(start, end)`` of one pass as the simulator runs it, forward and backward
    (:func:`.planner.simulation.timeline.dataflow_pass`, keys ``(slice name, "fwd" | "bwd")``): the Gantt."""
    curves = dict(plan.curves)
    slice_ms = {s.name: s.num_layers * curves[s.metaop].time(len(s.ranks)) for s in plan.slices()}
    spans: dict = {}
    dataflow_pass(plan, cluster, slice_ms, spans=spans)
    return spans


def step_title(sim: StepSimulation) -> str:
    """The step in words, for the Gantt's title: ``step 1396.7 ms = 2 passes of 695.8 ms + 5.1 ms sync``."""
    sync = sim.step_ms - sim.passes * sim.pass_ms
    return (f"step {sim.step_ms:.1f} ms = {sim.passes} pass{'es' if sim.passes != 1 else ''} of {sim.pass_ms:.1f} "
            f"ms + {sync:.1f} ms exposed gradient sync")


def step_lines(sim: StepSimulation, whole: StepBound, cluster: Cluster) -> str:
    """The whole step, its bound and the plan's sync floor (printed for every plan)."""
    floor = step_sync_floor(sim, cluster)
    sync = sim.step_ms - sim.passes * sim.pass_ms
    lines = [f"step          {sim.step_ms:10.2f} ms   (simulated whole step: {sim.passes} "
             f"pass{'es' if sim.passes != 1 else ''} of {sim.pass_ms:.2f} ms with their transfers, then "
             f"{sync:.2f} ms of exposed gradient sync)",
             f"step bound    {whole.bound_ms:10.2f} ms   (no wave plan of this configuration has a shorter step: "
             f"compute and paths {whole.compute_ms:.2f} ms, the cheapest sync adds {whole.sync_ms:.2f}); "
             f"step / step bound {sim.step_ms / whole.bound_ms:.3f}"]
    if floor is not None:
        lines.append(f"sync floor    {floor[1]:10.2f} ms   (this plan's {floor[0].resource}: {floor[0].busy_ms:.2f} ms "
                     f"of gradient all-reduces once a bucket of it is ready at {floor[0].from_ms:.2f} ms)")
    return "\n".join(lines)


def plan_json(plan: Plan, sim: StepSimulation, whole: StepBound, cluster: Cluster, configured: Configured, *,
              planning_s: float, files: dict) -> dict:
    """``spindle plan --json``: the step and its bound for every plan; ``makespan_ms`` with ``lower_bound_ms``
    (Σ C*), ``certified_bound_ms``, ``ratio`` and ``gap`` only for a plan built level by level (else ``null``)."""
    floor = step_sync_floor(sim, cluster)
    lbl = plan.level_by_level
    bound = certified_bound_ms(plan)
    return {
        "model": plan.model, "tasks": len(plan.tasks), "gpus": plan.world_size,
        "configuration": configured.to_json(), "passes": plan.passes, "schedule": configured.schedule,
        "step_ms": sim.step_ms, "pass_ms": sim.pass_ms, "step_bound_ms": whole.bound_ms,
        "step_bound": whole.to_json(), "sync_floor": None if floor is None else floor[0].to_json(floor[1]),
        "level_by_level": lbl,
        "makespan_ms": plan.makespan_ms if lbl else None,
        "lower_bound_ms": plan.lower_bound_ms if lbl else None,
        "certified_bound_ms": bound if lbl else None,
        "ratio": plan.makespan_ms / plan.lower_bound_ms if lbl and plan.lower_bound_ms else None,
        "gap": plan.makespan_ms / bound - 1 if lbl and bound else None,
        "planning_s": planning_s, "num_waves": len(plan.waves), "num_metaops": len(plan.metaops),
        "num_levels": plan.num_levels, "max_memory_gib": max(plan.device_memory_bytes) / 2**30,
        "min_memory_gib": min(plan.device_memory_bytes) / 2**30, "idle_devices": len(idle_devices(plan)),
        **files}
