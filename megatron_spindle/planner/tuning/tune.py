"""Every system at its own best configuration: the tuner behind ``spindle compare`` and ``spindle plan``.

A comparison is only as fair as its baselines' tuning. For one workload (model, tasks, global batch per step)
and cluster, each system searches what a good engineer would set by hand, under its own runtime's memory:

* **passes per step** ``P`` (gradient accumulation; a pass carries ``1/P`` of every task's batch): any
  common divisor of the tasks' global batches. Fewer passes mean larger per-device batches (better kernel
  efficiency, fewer per-pass costs) and more activation memory;
* **activation recompute** (:mod:`..workload.recompute`): ``none``, ``selective`` or ``full`` for every
  transformer layer, as Megatron-LM's flags set it for a whole model; Spindle chooses per MetaOp, only
  where memory binds (the MetaOps that save the most bytes per millisecond of recompute first);
* **the distributed optimizer** (ZeRO-1; no time cost in the simulator: reduce-scatter + all-gather move
  what an all-reduce moves) where model state binds;
* **tensor parallelism**: degree ``k`` for every layer that can be split (Megatron-LM's
  ``--tensor-model-parallel-size``) where memory binds;
* **transfer posting**: a transfer's messages posted when its producer ends or at its consumer's wave,
  whichever gives the shorter step (:func:`..simulation.simulate.best_posting`; Spindle's whole-step choice
  picks it per candidate the same way);
* **phases** (Spindle only): tasks split into groups whose forward and backward run one group after another,
  so one group's activations are freed before the next's exist (:attr:`..assembly.plan.WavePlan.phase`).

Memory rules: sequential and intra-task run as Megatron-LM does (states + one task's activations at a time:
one phase per task), task-level per lane (each lane frees a task's activations after its backward), the
module-level static grids as a 1F1B pipeline (:mod:`..systems.static_grids`), Spindle as the wave runtime does (states +
its largest phase's activations).

The search is bounded by counts, never by the clock: per option (recompute, optimizer, TP), the smallest
pass count that fits is found by bisection over the pass options (memory falls as ``P`` grows), and the step is
simulated there and at the next :data:`EXTRA_PASSES` pass counts; options more expensive in time are tried only
while they let a smaller ``P`` fit. Spindle's candidates are ranked by the paper's pipeline alone
(``search=False``, milliseconds per level) and only the best :data:`FULL_SEARCHES` get the full search.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce
from typing import Callable, Mapping, Sequence

from ..limits import divisors
from ..workload.analytic import CurvesFile, DeviceModel
from ..workload.cluster import Cluster
from ..workload.graph import TaskGraph
from ..workload.workloads import build_graph
from ..assembly.assemble import make_metaops
from ..assembly.communicators import peak_memory_bytes
from ..step.build import plan_system
from ..assembly.execution import Execution, configure
from ..assembly.plan import Plan
from ..simulation.simulate import StepSimulation, best_posting, simulate
from ..systems.static_grids import simulate_grids
from ..workload.analytic import build_curves

#: Pass counts simulated above the smallest that fits (the step is not always monotone in ``P``).
EXTRA_PASSES = 1
#: Tensor-parallel degrees the baselines try where memory binds (0: the memory rule's).
TP_OPTIONS = (0, 2, 4, 8)
#: Micro-batch counts the static grids simulate above the smallest that fits (more micro-batches shrink the
#: pipeline's fill and drain, fewer keep kernels efficient).
EXTRA_MICRO_BATCHES = 4


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What is trained: a model (shipped name or spec path), its first ``tasks`` tasks, a size, and the global
    batch per task per optimizer step (``None``: the spec's)."""

    model: str
    tasks: int | None = None
    size: str = "full"
    batch: int | Mapping[str, int] | None = None
    freeze: Sequence[str] = ()
    """Modules frozen at launch (``--spindle-freeze``), besides the spec's ``trainable = false`` ones."""
    _graphs: dict = field(default_factory=dict, compare=False, repr=False)

    def graph(self, passes: int) -> TaskGraph:
        """One pass's graph at ``passes`` passes per step."""
        g = self._graphs.get(passes)
        if g is None:
            g = self._graphs[passes] = build_graph(self.model, tasks=self.tasks, size=self.size, batch=self.batch,
                                                   passes=passes, freeze=tuple(self.freeze))
        return g

    def step_batches(self) -> dict[str, int]:
        """Every task's global batch per optimizer step."""
        return {op.task: op.batch for op in self.graph(1).operators}

    def pass_options(self) -> tuple[int, ...]:
        """Every valid pass count, ascending: the common divisors of the tasks' global batches."""
        return divisors(reduce(math.gcd, self.step_batches().values()))


@dataclass(frozen=True)
class FixedPasses:
    """A workload held to one pass graph (``passes`` passes per step: the run's own, from its flags): the tuner
    then searches only the rest (recompute, phases, the distributed optimizer) at those passes."""

    one_pass: TaskGraph
    passes: int

    def graph(self, passes: int) -> TaskGraph:
        if passes != self.passes:
            raise ValueError(f"this workload is held to {self.passes} passes per step, not {passes}")
        return self.one_pass

    def pass_options(self) -> tuple[int, ...]:
        return (self.passes,)


@dataclass
class Trial:
    execution: Execution
    step_ms: float | None
    """The simulated step (``None``: not simulated, e.g. over memory)."""
    peak_gib: float | None
    fits: bool
    note: str = ""

    def to_json(self) -> dict:
        return {"execution": self.execution.to_json(), "label": self.execution.label(), "step_ms": self.step_ms,
                "peak_memory_gib": self.peak_gib, "fits": self.fits, "note": self.note}


@dataclass
class Tuned:
    """A system at its best configuration found, with everything tried."""

    system: str
    execution: Execution | None = None
    plan: Plan | None = None
    sim: StepSimulation | None = None
    tried: list[Trial] = field(default_factory=list)
    error: str | None = None
    extra: dict = field(default_factory=dict)
    """System-specific facts (the static grids' shares, micro-batches, pipeline timing)."""

    @property
    def step_ms(self) -> float | None:
        return self.sim.step_ms if self.sim is not None else self.extra.get("step_ms")


def plan_peak_bytes(plan: Plan) -> float:
    return max(peak_memory_bytes(plan))  # NCCL communicators included


def plan_fits(plan: Plan, cluster: Cluster) -> bool:
    return plan_peak_bytes(plan) <= cluster.memory_limit_bytes * (1 + 1e-9)


def note_over_memory(out: Tuned, ex: Execution, sim: StepSimulation, peak: float, cluster: Cluster) -> None:
    """Held to one configuration that exceeds memory: keep its simulated step, flagged (``--fixed-passes``)."""
    out.extra.update(over_sim=sim, over_execution=ex,
                     over_memory=f"needs {peak / 2**30:.1f} GiB on a device, {cluster.memory_limit_bytes / 2**30:.1f} "
                                 f"GiB usable (its runtime's memory at {ex.label()})")


def first_fit(opts: Sequence[int], fits: Callable[[int], bool], hi: int | None = None) -> int | None:
    """Index of the smallest pass count in ``opts[:hi]`` that fits, by bisection (memory falls with ``P``)."""
    hi = len(opts) if hi is None else hi
    lo, found = 0, None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(opts[mid]):
            found, hi = mid, mid
        else:
            lo = mid + 1
    return found


# ----------------------------------------------------------------------------------------------------
# Baselines
# ----------------------------------------------------------------------------------------------------
def baseline_options() -> list[tuple[str, bool, int]]:
    """(recompute, distributed optimizer, TP) in order of time cost: nothing, ZeRO-1 (free), recompute
    (selective, then full), then wider tensor parallelism (communication)."""
    out = []
    for tp in TP_OPTIONS:
        for rc in ("none", "selective", "full"):
            for z in (False, True):
                out.append((rc, z, tp))
    return out


def _search(out: Tuned, wl: Workload, cluster: Cluster, fixed: Execution | None, extra: int, run) -> Tuned:
    """The bounded search of the module docstring, shared by the baselines: ``run(ex)`` gives ``(step
    simulation, peak bytes, payload)`` or an error line; the fastest configuration that fits wins (``fixed``:
    only that one, kept and flagged when over memory)."""
    got: dict[Execution, tuple | str] = {}

    def result(ex: Execution):
        if ex not in got:
            try:
                got[ex] = run(ex)
            except (ValueError, KeyError) as e:
                got[ex] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return got[ex]

    def fits(ex: Execution) -> bool:
        r = result(ex)
        return not isinstance(r, str) and r[1] <= cluster.memory_limit_bytes * (1 + 1e-9)

    def evaluate(ex: Execution) -> None:
        r = result(ex)
        if isinstance(r, str):
            out.tried.append(Trial(ex, None, None, False, r))
            return
        sim, peak, payload = r
        ok = fits(ex)
        out.tried.append(Trial(ex, sim.step_ms, peak / 2**30, ok))
        if ok and (out.sim is None or sim.step_ms < out.sim.step_ms * (1 - 1e-9)):
            out.execution, out.sim = ex, sim
            out.plan = payload if isinstance(payload, Plan) else None
            if isinstance(payload, dict):
                out.extra.update(payload)
        elif not ok and fixed is not None:
            note_over_memory(out, ex, sim, peak, cluster)

    if fixed is not None:
        evaluate(fixed)
    else:
        opts = wl.pass_options()
        bound = len(opts)
        for rc, z, tp in baseline_options():
            cheap = rc == "none" and not z and tp == 0
            i = first_fit(opts, lambda P: fits(Execution(passes=P, recompute=rc, distributed_optimizer=z, tp=tp)),
                           None if cheap else bound)
            if i is None:
                continue
            for j in range(i, min(len(opts), i + 1 + extra)):
                evaluate(Execution(passes=opts[j], recompute=rc, distributed_optimizer=z, tp=tp))
            bound = min(bound, i)
            if bound == 0 and not cheap:
                break
    if out.sim is None:
        errors = [r for r in got.values() if isinstance(r, str)]
        reasons = [t.note for t in out.tried if t.note] or errors or ["no configuration fits the devices' memory"]
        out.error = reasons[0]
    return out


def tune_baseline(system: str, wl: Workload, cluster: Cluster, *, curves_file: CurvesFile | None = None,
                  device: DeviceModel | None = None, fixed: Execution | None = None) -> Tuned:
    """``system`` (one of :data:`..systems.baselines.BASELINES`) at its best configuration (module docstring), or at
    ``fixed`` only."""
    def run(ex: Execution):
        p, _ = best_posting(plan_system(system, wl.graph(ex.passes), cluster, curves_file=curves_file,
                                        device=device, validate=False, execution=ex), cluster)
        return simulate(p, cluster, check_memory=False), plan_peak_bytes(p), p

    return _search(Tuned(system), wl, cluster, fixed, EXTRA_PASSES, run)


def tune_static_grids(wl: Workload, cluster: Cluster, *, curves_file: CurvesFile | None = None,
                      device: DeviceModel | None = None, fixed: Execution | None = None) -> Tuned:
    """The module-level static grids (:mod:`..systems.static_grids`) at their best configuration: micro-batches per
    step (the passes), recompute, the distributed optimizer and TP as for the other baselines."""
    def run(ex: Execution):
        metaops = configure(make_metaops(wl.graph(ex.passes), cluster), ex, cluster)
        curves = build_curves(metaops, cluster.num_devices, curves_file=curves_file, device=device)
        sim, grids = simulate_grids(metaops, curves, cluster, micro_batches=ex.passes,
                                    distributed_optimizer=ex.distributed_optimizer)
        return sim, max(sim.peak_memory_bytes), {
            "grids": {g.module: {"ranks": len(g.ranks), "rank_offset": g.ranks[0], "stage": g.stage,
                                 "tp": max(m.tp for m in g.metaops), "micro_batch_ms": g.time_ms}
                      for g in grids}, "micro_batches": ex.passes}

    return _search(Tuned("static-grids"), wl, cluster, fixed, EXTRA_MICRO_BATCHES, run)
