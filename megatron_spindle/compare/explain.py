"""Explain one row of ``spindle compare``: where Spindle's step and the best tuned baseline's
differ, which candidate won Spindle's whole-step choice, and how far both are above the whole-step bound.

* **The best baseline** is the tuned baseline (sequential, task-level, intra-task, the static grids) with the
  shortest step. The difference ``Spindle − baseline`` is split into the simulator's four parts (compute,
  idle, transfer, sync: :class:`..planner.simulation.simulate.Breakdown`, which add up to the step), with each
  side's passes per step (a different pass count moves compute: smaller per-pass batches run less
  efficiently).
* **The winner.** Spindle's plan is re-chosen at its tuned configuration with the whole-step choice's
  scoreboard (:func:`..planner.step.choose.choose_whole_step`): the winning candidate's name, every
  candidate's step, and the best candidate built from Spindle's *own* waves (not a baseline's schedule),
  split against the best baseline the same way: what Spindle's own waves gain or lose, part by part.
* **The bound** (:mod:`..planner.simulation.step_bound`) at every system's configuration, split into compute
  (area and paths), what a path's boundary transfers add, and what the gradient sync adds; and the smallest
  of them: no plan at any of the configurations compared that fits memory has a shorter simulated step (a
  wave plan: proved; the static grids' pipelined model: checked by the tests). The gap ``best step / lowest
  bound`` is what no explanation above accounts for: a plan may be that much faster, or the bound that
  loose.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..planner.simulation.link_costs import SyncFloor
from ..planner.simulation.simulate import Breakdown, simulate, step_sync_floor
from ..planner.simulation.step_bound import StepBound
from ..planner.step.build import make_plan
from ..planner.systems.bounds import configured_step_bound
from ..planner.tuning.tune_spindle import FULL_NODES

#: The tuned baselines a row's best baseline is taken from.
TUNED_BASELINES = ("sequential", "task-level", "intra-task", "static-grids")
PARTS = ("compute", "idle", "transfer", "sync")


def _parts(b: Breakdown) -> dict[str, float]:
    return {"compute": b.compute_ms, "idle": b.idle_ms, "transfer": b.transfer_ms, "sync": b.sync_ms}


def _diff(a: Breakdown, b: Breakdown) -> dict[str, float]:
    pa, pb = _parts(a), _parts(b)
    return {k: pa[k] - pb[k] for k in PARTS}


@dataclass
class Explanation:
    baseline: str | None
    """The best tuned baseline (``None``: no baseline has a plan)."""
    baseline_ms: float | None
    spindle_ms: float
    passes: tuple[int, int | None]
    """Spindle's and the best baseline's passes per step."""
    diff: dict[str, float]
    """Spindle minus the best baseline, per part (ms)."""
    winner: str
    """The candidate that won Spindle's whole-step choice."""
    candidates: list[dict]
    own_name: str | None = None
    """The best candidate from Spindle's own waves (fitting memory), and its step and parts."""
    own_ms: float | None = None
    own_parts: dict[str, float] = field(default_factory=dict)
    own_diff: dict[str, float] = field(default_factory=dict)
    bound: StepBound | None = None
    """The whole-step bound at Spindle's configuration."""
    bounds: dict[str, float] = field(default_factory=dict)
    """Every system's bound at its own configuration (ms)."""
    sync_floor: dict[str, tuple[SyncFloor, float]] = field(default_factory=dict)
    """Spindle's plan's and the best baseline's sync floor and the step it forces
    (:func:`..planner.simulation.simulate.step_sync_floor`)."""

    @property
    def best_ms(self) -> float:
        """The shorter of Spindle's and the best baseline's steps."""
        return min(self.spindle_ms, self.baseline_ms if self.baseline_ms is not None else self.spindle_ms)

    @property
    def row_bound_ms(self) -> float | None:
        """The smallest bound over the configurations compared."""
        return min(self.bounds.values()) if self.bounds else None

    def to_json(self) -> dict:
        return {"best_baseline": self.baseline, "best_baseline_ms": self.baseline_ms, "spindle_ms": self.spindle_ms,
                "passes": {"spindle": self.passes[0], "best_baseline": self.passes[1]},
                "spindle_minus_baseline_ms": self.diff, "winner": self.winner, "candidates": self.candidates,
                "own": {"name": self.own_name, "step_ms": self.own_ms, "breakdown": self.own_parts,
                        "minus_baseline_ms": self.own_diff} if self.own_name else None,
                "step_bound": self.bound.to_json() if self.bound else None,
                "step_bounds_ms": self.bounds, "row_step_bound_ms": self.row_bound_ms,
                "sync_floor": {k: f.to_json(t) for k, (f, t) in self.sync_floor.items()}}

    def lines(self) -> list[str]:
        out = []
        if self.bound is not None:
            b = self.bound
            out.append(f"whole-step bound {b.bound_ms:.1f} ms at Spindle's configuration (compute and paths "
                       f"{b.compute_ms:.1f} ms, transfers add {b.transfer_ms:.1f}, gradient sync "
                       f"{b.allreduce_ms:.1f}; no wave plan of that configuration that fits memory is faster); "
                       f"lowest over the systems' configurations {self.row_bound_ms:.1f} ms; Spindle's step is "
                       f"{self.spindle_ms / b.bound_ms:.2f}x its bound, the best step "
                       f"{self.best_ms / self.row_bound_ms:.2f}x the lowest")
        n = len(self.candidates)
        if self.baseline is None:
            out.append(f"Spindle's plan: candidate '{self.winner}' of {n}; no tuned baseline has a plan")
            return out
        fmt = lambda d: ", ".join(f"{k} {d[k]:+.1f}" for k in PARTS)  # noqa: E731
        out.append(f"best baseline {self.baseline} {self.baseline_ms:.1f} ms (P={self.passes[1]}); Spindle "
                   f"{self.spindle_ms:.1f} ms (P={self.passes[0]}) is candidate '{self.winner}' of {n}; "
                   f"difference (ms): {fmt(self.diff)}")
        if self.sync_floor:
            steps = {"spindle": self.spindle_ms, self.baseline: self.baseline_ms}
            out.append("sync floor (the device or NIC busiest with gradient all-reduces once they are ready): "
                       + "; ".join(f"{k}'s {f.resource} {f.busy_ms:.1f} ms from {f.from_ms:.1f} ms, step >= "
                                   f"{t:.1f} (is {steps[k]:.1f})" for k, (f, t) in self.sync_floor.items()))
        if self.own_name is not None:
            out.append(f"Spindle's own waves ('{self.own_name}', {self.own_ms:.1f} ms, "
                       f"{self.baseline_ms / self.own_ms:.2f}x the best baseline): {fmt(self.own_diff)}")
        return out


def explain_row(cmp, workload, cluster, *, curves_file=None, device=None) -> Explanation | None:
    """The explanation of one :class:`.cli.Comparison` (``None`` without a Spindle plan)."""
    sp = cmp.results.get("spindle")
    if sp is None or not sp.ok or sp.execution is None:
        return None
    ex = sp.execution
    report: dict = {}
    make_plan(workload.graph(ex.passes), cluster, execution=ex, placement_budget=FULL_NODES, validate=False,
              curves_file=curves_file, device=device, report=report)
    ok = [(r.sim.step_ms, name) for name, r in cmp.results.items() if name in TUNED_BASELINES and r.ok]
    base = min(ok)[1] if ok else None
    br = cmp.results[base] if base else None
    e = Explanation(baseline=base, baseline_ms=br.sim.step_ms if br else None, spindle_ms=sp.sim.step_ms,
                    passes=(ex.passes, br.execution.passes if br and br.execution else None),
                    diff=_diff(sp.sim.breakdown, br.sim.breakdown) if br else {},
                    winner=report.get("winner", ""), candidates=report.get("candidates", []))
    for name, r in (("spindle", sp), (base, br)):
        f = step_sync_floor(r.sim, cluster) if r is not None else None
        if f is not None:
            e.sync_floor[name] = f
    if report.get("own_plan") is not None:
        own = simulate(report["own_plan"], cluster, check_memory=False)
        e.own_name, e.own_ms, e.own_parts = report["own_name"], own.step_ms, _parts(own.breakdown)
        e.own_diff = _diff(own.breakdown, br.sim.breakdown) if br else {}
    memo: dict = {}
    for name, r in cmp.results.items():
        if r.ok and r.execution is not None and name in TUNED_BASELINES + ("spindle",):
            key = repr(r.execution)
            if key not in memo:
                memo[key] = configured_step_bound(workload.graph(r.execution.passes), cluster, r.execution,
                                                  curves_file=curves_file, device=device)
            e.bounds[name] = memo[key].bound_ms
            if name == "spindle":
                e.bound = memo[key]
    return e
