"""The live prediction of a whole training step, part by part, against what this rank measured.

Predicted: :func:`..planner.simulate.simulate` of the run's plan (its curves) on the run's cluster
(:func:`.model.make_cluster`), with the step's passes (gradient accumulation) and the gradient bytes the
runtime reduces (2 for a bf16 model unless ``--accumulate-allreduce-grads-in-fp32``, else 4). Measured: the
:class:`..runtime.trace.StepTrace` spans of that step on this rank. The parts, seen from one rank:

* **compute**: predicted ``K · Σ`` this rank's slice times (``Slice.time_ms``); measured: its forward and
  backward spans;
* **transfer + wave wait**: predicted ``K ·`` the boundaries' transfer time plus ``K · Σ_w duration_w`` minus
  this rank's compute (a rank whose slice ends before the wave's longest one waits in the next boundary's
  blocking transfer); measured: its transfer spans;
* **exposed sync**: predicted the simulator's exposed sync (buckets reduced during the backward, what runs
  past its end); measured: the ``gradient sync wait`` span (the time :meth:`GradSync.finish` blocks);
* **optimizer**: not predicted (the planner has no cost model of the optimizer step): measured only, and the
  step comparison leaves it out;
* **other**: the rest of the measured step (data, loss reduction, gradient clipping): measured only.

``compute_scale`` (the trainer passes ranks per core when CPU ranks outnumber the cores) stretches the
predicted compute, wave time included: ``n`` ranks time-sharing ``c < n`` cores each compute about ``n / c``
times slower than the profile, which ran with fewer ranks than cores. Load from other processes is not seen.

The step comparison is the predicted total of the first three parts against the measured step minus the
optimizer (so "other" counts against the prediction).
"""
from __future__ import annotations

import re

from dataclasses import dataclass

from ..planner.simulate import simulate


#: The executor's per-boundary span: time this rank spent posting and blocked on transfers (the exposed part).
EXPOSED_TRANSFER = re.compile(r"^w\d+ (fwd|bwd) transfer$")


@dataclass(frozen=True)
class StepPrediction:
    compute: tuple[float, float]
    """(predicted, measured) ms."""
    transfer: tuple[float, float]
    sync: tuple[float, float]
    optimizer_ms: float
    other_ms: float
    step_measured_ms: float
    passes: int
    compute_scale: float = 1.0

    @property
    def predicted_ms(self) -> float:
        return self.compute[0] + self.transfer[0] + self.sync[0]

    @property
    def measured_without_optimizer_ms(self) -> float:
        return self.step_measured_ms - self.optimizer_ms

    @property
    def error(self) -> float:
        """Relative error of the prediction against the measured step without the optimizer."""
        p = self.predicted_ms
        return (self.measured_without_optimizer_ms - p) / p if p > 0 else float("inf")

    def format(self) -> str:
        def part(name, pm):
            return f"{name} {pm[0]:.1f}/{pm[1]:.1f}"
        return (f"step {self.predicted_ms:.1f} ms predicted vs {self.measured_without_optimizer_ms:.1f} ms measured "
                f"without the optimizer ({self.error:+.0%}), {self.passes} pass{'es' if self.passes > 1 else ''}"
                + (f", predicted compute x{self.compute_scale:g} for shared cores" if self.compute_scale != 1 else "")
                + " | "
                f"predicted/measured ms: {part('compute', self.compute)}, "
                f"{part('transfer + wave wait', self.transfer)}, {part('exposed sync', self.sync)} | "
                f"measured only: optimizer {self.optimizer_ms:.1f} ms (not predicted: no optimizer cost model), "
                f"other {self.other_ms:.1f} ms (data, loss, clipping)")


def grad_bytes_of(args) -> int:
    """Bytes per gradient element the runtime all-reduces (see :mod:`..runtime.grad_sync`)."""
    return 2 if getattr(args, "bf16", False) and not getattr(args, "accumulate_allreduce_grads_in_fp32", False) else 4


def predict_step(plan, cluster, trace, step: int, rank: int, *, passes: int, grad_bytes: int,
                 compute_scale: float = 1.0) -> StepPrediction:
    """Predicted against measured parts of step ``step`` on ``rank`` (see the module docstring)."""
    sim = simulate(plan, cluster, check_memory=False, passes=passes, grad_bytes=grad_bytes)
    busy = compute_scale * passes * sum(s.time_ms for s in plan.rank_slices(rank))
    waves = compute_scale * passes * sim.makespan_ms
    transfer = sim.breakdown.transfer_ms + max(0.0, waves - busy)
    meas = {"compute": 0.0, "transfer": 0.0, "sync": 0.0, "optimizer": 0.0, "step": 0.0}
    for s in trace.spans:
        if s.step != step:
            continue
        ms = s.dur_s * 1e3
        if s.cat in ("forward", "backward"):
            meas["compute"] += ms
        elif s.cat == "transfer" and EXPOSED_TRANSFER.match(s.name):
            meas["transfer"] += ms  # the boundary's exposed part; per-message spans overlap compute
        elif s.cat == "sync" and s.name == "gradient sync wait":
            meas["sync"] += ms
        elif s.cat in ("optimizer", "step"):
            meas[s.cat] += ms
    other = meas["step"] - meas["compute"] - meas["transfer"] - meas["sync"] - meas["optimizer"]
    return StepPrediction(compute=(busy, meas["compute"]), transfer=(transfer, meas["transfer"]),
                          sync=(sim.breakdown.sync_ms, meas["sync"]), optimizer_ms=meas["optimizer"],
                          other_ms=max(0.0, other), step_measured_ms=meas["step"], passes=passes,
                          compute_scale=compute_scale)
