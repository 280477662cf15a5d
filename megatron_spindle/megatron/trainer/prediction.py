"""The live prediction of a whole training step, part by part, against what this rank measured.

Predicted: :func:`...planner.simulation.simulate.simulate` of the run's plan (its curves) on the run's cluster, with the
step's passes (gradient accumulation) and the gradient bytes the runtime reduces (2 for a bf16 model unless
``--accumulate-allreduce-grads-in-fp32``, else 4), plus the step's end from the profile's measurements
(:class:`StepCosts`). Measured: the :class:`...runtime.trace.StepTrace` spans of that step on this rank. The
parts, seen from one rank:

* **compute**: predicted ``K · Σ`` this rank's slice times (``Slice.time_ms``), plus with the runtime costs
  that sum times ``per_slice_scale`` plus ``K · slices · (per_slice_fwd_ms + per_slice_bwd_ms)`` (the
  executor's own time per slice, :mod:`...profiler.slice_costs`); measured: its forward and backward spans;
* **transfer + wave wait**: predicted ``K`` passes of the simulator's timeline (:mod:`...planner.simulation.timeline`)
  minus this rank's compute (the rank waits for its inputs and its peers); measured: its transfer spans;
* **exposed sync**: predicted the simulator's exposed sync (buckets reduced during the backward, what runs
  past its end); measured: the ``gradient sync wait`` span (the time :meth:`GradSync.finish` blocks);
* **norm + loss all-reduce**: the all-reduces over every rank at the step's end: the gradient norm for
  clipping, and one per task for the log (Megatron's ``train_step`` reduces each loss report on its own,
  :func:`..adapter.schedule.reduce_reports`); predicted with the profile's runtime costs (``measured.runtime``,
  :mod:`...planner.simulation.runtime_costs`): the norm's sum of squares over this rank's gradients plus
  ``1 + tasks`` small all-reduces back to back as measured on the backend; without them, ``1 + tasks``
  all-reduces of a few bytes over all ranks (:func:`...planner.simulation.simulate.allreduce_time_ms`:
  ``2(n-1)·λ`` each); measured: the ``step end`` span;
* **optimizer**: predicted from the profile's optimizer measurement
  (:mod:`megatron_spindle.profiler.step_costs`) for this rank's parameter tensors and elements; measured: the
  ``optimizer`` span;
* **data** (fetching the batch: the ``data`` span) and **other** (the rest: Python between the parts):
  measured only.

With the runtime costs the simulator also charges each rank's host time posting every boundary's batch on the
pass's timeline (:mod:`...planner.simulation.timeline`), which lands in *transfer + wave wait*.

The step comparison is the predicted total of the five parts against the whole measured step (so "other"
counts against the prediction). A part the run cannot predict (a curves file without the optimizer
measurement, analytic curves) is shown as measured only and left out of both sides.

Which measured step: the simulator models an undisturbed step, so over several steps the line's error is
against the **fastest** of them (Python's ``timeit`` rule, :attr:`StepPrediction.fastest_ms`), which other work
on a shared machine cannot make slower than the step itself; the **median** step stands beside it with its
error, saying how far that other work moved the run. The parts are each part's median over the steps. On
an idle machine the two figures agree; on a loaded one the median can read +80% where the fastest reads +5%.

``compute_scale`` stretches the predicted compute, wave time included, when CPU ranks share cores:
``r`` ranks on ``c < r`` cores compute about ``r / c`` times slower than the profile's points say
(:func:`compute_scale`). A point's time is the median of many short repeats, and a repeat of a millisecond
mostly runs within one time slice of the operating system, so even a profile taken with ``r`` processes at
once measures the uncontended speed (seen here: 4 processes on 2 cores give the medians of 2). The link and
the optimizer, timed as means after compute, do see the sharing, so the demo profiles with the rank count
it trains with.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from ...planner.workload.cluster import Cluster
from ...planner.simulation.runtime_costs import RuntimeCosts
from ...planner.simulation.link_costs import allreduce_time_ms
from ...planner.simulation.simulate import simulate
from ...profiler.step_costs import optimizer_ms

#: The executor's per-boundary span: time this rank spent posting and blocked on transfers (the exposed part).
EXPOSED_TRANSFER = re.compile(r"^w\d+ (fwd|bwd) transfer$")


def step_end_allreduces(plan) -> int:
    """All-reduces at the step's end over every rank: the gradient norm, then each task's loss report."""
    return 1 + len(plan.tasks)


@dataclass(frozen=True)
class StepCosts:
    """What the profile measured beyond the curves, for the parts of a step that have no curve."""

    optimizer_fit: Mapping | None = None
    """:func:`...profiler.step_costs.fit_optimizer`'s result, or ``None`` (not measured)."""
    tensors: int = 0
    """This rank's parameter tensors and elements (what its optimizer steps over)."""
    elements: int = 0
    runtime: RuntimeCosts | None = None
    """The runtime's own costs (``measured.runtime``), or ``None`` (not measured: not charged)."""

    @classmethod
    def from_measured(cls, measured: Mapping | None, *, tensors: int, elements: int) -> "StepCosts":
        measured = measured or {}
        return cls(optimizer_fit=measured.get("optimizer"), tensors=tensors, elements=elements,
                   runtime=RuntimeCosts.from_measured(measured.get("runtime")))


def compute_scale(ranks_here: int, cores: int) -> float:
    """How much slower CPU ranks sharing cores compute than the profile's medians (see the module docstring)."""
    return max(1.0, ranks_here / max(1, cores))


@dataclass(frozen=True)
class StepPrediction:
    compute: tuple[float, float]
    """(predicted, measured) ms."""
    transfer: tuple[float, float]
    sync: tuple[float, float]
    step_end: tuple[float, float]
    optimizer: tuple[float | None, float]
    """Predicted ``None`` when the profile did not measure the optimizer."""
    data_ms: float
    other_ms: float
    step_measured_ms: float
    passes: int
    compute_scale: float = 1.0
    steps: int = 1
    """Measured parts are medians over this many steps, each part on its own."""
    fastest_ms: float | None = None
    """The fastest of those steps, less its optimizer when that is not predicted (``None`` for one step).
    Python's ``timeit`` rule, "the lowest value gives a lower bound for how fast your machine can run [it];
    higher values are typically not caused by variability in Python's speed, but by other processes
    interfering", is what a shared machine's undisturbed step is."""
    runtime_costs: bool = False
    """Whether the profile's runtime costs (``measured.runtime``) were charged."""

    @property
    def predicted_ms(self) -> float:
        return (self.compute[0] + self.transfer[0] + self.sync[0] + self.step_end[0]
                + (self.optimizer[0] or 0.0))

    @property
    def measured_ms(self) -> float:
        """The measured step, less the optimizer when it is not predicted."""
        return self.step_measured_ms - (self.optimizer[1] if self.optimizer[0] is None else 0.0)

    @property
    def error(self) -> float:
        """Relative error of the prediction against the measured (median) step."""
        return self._error(self.measured_ms)

    @property
    def compared_ms(self) -> float:
        """The measured step the line compares with: the fastest step of several, the step itself of one."""
        return self.measured_ms if self.fastest_ms is None else self.fastest_ms

    @property
    def compared_error(self) -> float:
        """The line's error: against :attr:`compared_ms`."""
        return self._error(self.compared_ms)

    @property
    def fastest_error(self) -> float | None:
        """Relative error against the fastest step (``None`` for one step)."""
        if self.fastest_ms is None:
            return None
        return self._error(self.fastest_ms)

    def _error(self, measured: float) -> float:
        p = self.predicted_ms
        return (measured - p) / p if p > 0 else float("inf")

    def format(self) -> str:
        def part(name, pm):
            return f"{name} {pm[0]:.1f}/{pm[1]:.1f}"
        opt = self.optimizer[0] is not None
        which = (f"the fastest of {self.steps} steps" if self.fastest_ms is not None else "measured")
        return (f"step {self.predicted_ms:.1f} ms predicted vs {self.compared_ms:.1f} ms, {which}"
                + ("" if opt else " without the optimizer")
                + f" ({percent(self.compared_error)}"
                + (f"; median step {self.measured_ms:.1f} ms, {percent(self.error)}: other load on the machine"
                   if self.fastest_ms is not None else "")
                + f"), {self.passes} pass{'es' if self.passes > 1 else ''}"
                + (f", predicted compute x{self.compute_scale:.3g} for shared cores" if self.compute_scale != 1 else "")
                + " | predicted/measured ms" + (" (medians)" if self.fastest_ms is not None else "") + ": "
                + ", ".join([part("compute", self.compute), part("transfer + wave wait", self.transfer),
                             part("exposed sync", self.sync), part("norm + loss all-reduce", self.step_end)]
                            + ([part("optimizer", self.optimizer)] if opt else []))
                + " | measured only: "
                + ("" if opt else f"optimizer {self.optimizer[1]:.1f} ms (not predicted: the curves file has no "
                                  f"optimizer measurement; run `spindle profile`), ")
                + f"data {self.data_ms:.1f} ms, other {self.other_ms:.1f} ms"
                + ("" if self.runtime_costs else " | the runtime's own costs not charged (the curves file has no "
                                                 "runtime measurement; run `spindle profile` with 2+ processes)"))


def percent(x: float) -> str:
    """``x`` as a signed whole percentage, ``+0%`` (not ``-0%``) for a small negative error."""
    return f"{round(x, 2) + 0.0:+.0%}"


def grad_bytes_of(args) -> int:
    """Bytes per gradient element the runtime all-reduces (see :mod:`...runtime.grad_sync`)."""
    return 2 if getattr(args, "bf16", False) and not getattr(args, "accumulate_allreduce_grads_in_fp32", False) else 4


def predict_step(plan, cluster: Cluster, trace, steps: int | Sequence[int], rank: int, *, passes: int,
                 grad_bytes: int,
                 compute_scale: float = 1.0, costs: StepCosts = StepCosts()) -> StepPrediction:
    """Predicted against measured parts of a step on ``rank`` (see the module docstring): the median of each
    part over ``steps`` (one step number or several: one step of a CPU run is noisy, and the median is the
    undisturbed step the simulator models, where a mean takes in a step slowed by another process or the
    run's first steps warming up)."""
    sim = simulate(plan, cluster, check_memory=False, passes=passes, grad_bytes=grad_bytes,
                   compute_scale=compute_scale, runtime=costs.runtime)
    mine = plan.rank_slices(rank)
    busy = compute_scale * passes * sum(s.time_ms for s in mine)
    if costs.runtime is not None:  # the executor's own time on each slice, forward and backward
        busy = (busy * costs.runtime.per_slice_scale
                + passes * len(mine) * (costs.runtime.per_slice_fwd_ms + costs.runtime.per_slice_bwd_ms))
    transfer = max(0.0, passes * sim.pass_ms - busy)  # this rank's passes less its compute: transfer + wave wait
    n = plan.world_size
    k, rt = step_end_allreduces(plan), costs.runtime
    step_end = (rt.norm_ms(tensors=costs.tensors, elements=costs.elements) + rt.collectives_ms(k) if rt is not None
                else k * allreduce_time_ms(range(n), 8.0, cluster))
    opt = (optimizer_ms(costs.optimizer_fit, tensors=costs.tensors, elements=costs.elements)
           if costs.optimizer_fit else None)
    asked = {steps} if isinstance(steps, int) else set(steps)
    wanted = asked & {s.step for s in trace.spans if s.cat == "step"}  # a replanned model traces anew
    if not wanted:
        few = sorted(asked)
        raise ValueError(f"no traced step among {few if len(few) <= 3 else f'steps {few[0]}-{few[-1]}'} to compare "
                         f"the prediction with")
    parts = ("compute", "transfer", "sync", "step end", "optimizer", "data", "step")
    per_step = {st: dict.fromkeys(parts, 0.0) for st in wanted}
    for s in trace.spans:
        if s.step not in wanted:
            continue
        ms, got = s.dur_s * 1e3, per_step[s.step]
        if s.cat in ("forward", "backward"):
            got["compute"] += ms
        elif s.cat == "transfer" and EXPOSED_TRANSFER.match(s.name):
            got["transfer"] += ms  # the boundary's exposed part; per-message spans overlap compute
        elif s.cat == "sync" and s.name == "gradient sync wait":
            got["sync"] += ms
        elif s.cat in ("step end", "optimizer", "data", "step"):
            got[s.cat] += ms
    meas = {k: statistics.median(got[k] for got in per_step.values()) for k in parts}
    other = meas["step"] - sum(meas[k] for k in ("compute", "transfer", "sync", "step end", "optimizer", "data"))
    return StepPrediction(compute=(busy, meas["compute"]), transfer=(transfer, meas["transfer"]),
                          sync=(sim.breakdown.sync_ms, meas["sync"]), step_end=(step_end, meas["step end"]),
                          optimizer=(opt, meas["optimizer"]), data_ms=meas["data"], other_ms=max(0.0, other),
                          step_measured_ms=meas["step"], passes=passes, compute_scale=compute_scale,
                          steps=len(wanted), runtime_costs=rt is not None,
                          fastest_ms=min(got["step"] - (got["optimizer"] if opt is None else 0.0)
                                         for got in per_step.values()) if len(wanted) > 1 else None)
