"""Choose Spindle's plan by the whole step, with the baselines' schedules among the candidates.

The scheduler (:mod:`.scheduler`) picks each level's waves by compute span; a step also pays the
inter-wave transfers and the parameter sync, which depend on how many waves there are and where the
slices sit. So the last choice is made on the step simulator's time (:func:`..simulation.simulate.simulate`: compute,
transfer and sync, as the runtime runs them) over these whole-step candidates:

1. Spindle's wave schedule with island-aware placement, each level's waves the shortest span found; and
   1': the same with some levels' waves replaced by an alternative candidate of that level (the paper's
   pipeline, the best before the local searches, the fewest waves within 3% of the shortest span, the first
   local search's result) where that shortens the whole step (one pass over the
   levels that take at least :data:`MIN_LEVEL_SHARE` of the makespan, each trial timed with the naive
   placement); and 1'': every level's first-search waves (Algorithm 1's, before polishing) together, placed
   both ways (the order and shape of a level's waves move transfers and gradient syncs);
2. the same waves with the naive placement (consecutive devices in slice order);
3. waves across levels, with the paper's readiness rule (a MetaOp may run once its producers have
   finished) instead of a barrier after every level, so a task's next MetaOp need not wait for the slowest
   MetaOp of the whole level: the shorter of *backfilled* waves (1's waves with later levels' ready layers
   moved onto idle devices, :mod:`.backfill`) and *cross-level* waves (Algorithm 1 over all MetaOps at
   once from each level's winning allocation tuples), placed like 1 and 2 when its compute makespan is
   shorter than the level-by-level one;
4. the schedules of the baselines (:mod:`..systems.baselines`): sequential, task-level and intra-task, on the same
   MetaOps, curves and execution; and 5. every module on a fixed block of devices, level after level
   (:mod:`..systems.module_blocks`: its gradients are reduced within the blocks);
6. Spindle's waves inside task lanes (:mod:`.lanes`): each task's MetaOps scheduled by the level
   scheduler on a block of its own (no activations move between device sets), the blocks balanced (on any
   sizes or on whole islands), or packed in time so that a task starts on the devices of one that has
   finished; and the better balanced layout with its sizes searched by the simulated step;
7. the whole-step local search (:mod:`.step_search`) from the best of these, from the best of Spindle's own
   and from the best of Spindle's own whose lane sizes were not searched: devices of a block that finishes
   early lent to the task that finishes last, judged by the simulator.

``Σ C*`` and the certified bounds of :mod:`.solver` are bounds of level-by-level schedules (1 and 2); the
others are not bound by them and may end below ``Σ C*``.

Every candidate is an executable plan that passes the same validation rules, timed under the better of the
two transfer postings (:func:`..simulation.simulate.best_posting`; the plan carries the one it was timed with,
the baselines' schedules too); the one with the shortest simulated step that fits the devices' memory wins
(ties keep the earlier candidate). Hence, under the simulator's model, Spindle's plan is never slower than any baseline's, at any scale; the plan's level
``variant`` names the schedule that won when it is not Spindle's own.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

from ..systems import baselines
from ..assembly.assemble import assemble_plan, fits_memory
from .backfill import backfill
from .lanes import LANES_MAX_DEVICES, SIZED, lane_plans
from .step_search import search as step_search, trial_budget
from ..assembly.validate import violations
from ..assembly.execution import Execution
from ..systems.module_blocks import plan_module_blocks
from ..workload.cluster import Cluster
from ..workload.curves import ScalingCurve
from ..workload.graph import TaskGraph
from ..workload.metaops import MetaOp
from ..assembly.placement import NODE_BUDGET, place, sequential_placement
from ..assembly.plan import TRANSFER_POSTINGS, Plan
from ..simulation.simulate import best_posting, step_time_ms
from ..level.waves import Wave, WaveSlice, schedule_level

#: Levels shorter than this share of the makespan keep their shortest-span waves (candidate 1').
MIN_LEVEL_SHARE = 0.05


def step_ms(plan: Plan, cluster: Cluster, passes: int | None = None) -> float:
    """The simulated step of ``plan`` on ``cluster``, ``passes`` passes per step (default the plan's; memory not
    checked)."""
    return step_time_ms(plan, cluster, passes=passes)


class _Steps:
    """Each plan object timed once under its better transfer posting (:func:`..simulation.simulate.best_posting`;
    the whole-step choice meets some plans twice: the naive layout of Spindle's own waves is the per-level
    search's starting point, and the search's best trial is one of its candidates)."""

    def __init__(self, cluster: Cluster, postings: tuple[str, ...] = TRANSFER_POSTINGS) -> None:
        self.cluster, self.postings = cluster, postings
        self._memo: dict[int, tuple[Plan, Plan, float]] = {}  # id -> (the plan, kept alive so its id stays
        # its own; the plan under its better posting; its step)

    def _got(self, plan: Plan) -> tuple[Plan, Plan, float]:
        got = self._memo.get(id(plan))
        if got is None:
            got = self._memo[id(plan)] = (plan, *best_posting(plan, self.cluster, postings=self.postings))
        return got

    def __call__(self, plan: Plan) -> float:
        return self._got(plan)[2]

    def posted(self, plan: Plan) -> Plan:
        """``plan`` under the posting its step was timed with."""
        return self._got(plan)[1]


def whole_step_candidates(graph: TaskGraph, cluster: Cluster, metaops: Sequence[MetaOp],
                          curves: Mapping[str, ScalingCurve], execution: Execution | None = None
                          ) -> list[tuple[str, Callable[[], Plan]]]:
    """The baselines' schedules as ``(name, build)`` pairs (built lazily; a build may raise ``ValueError``), on
    the same MetaOps, curves, passes and optimizer; each with its own phases (a task's activations freed after
    its backward), which the wave runtime executes as such. Task-level's lanes mix tasks in a wave, so under
    the wave runtime its memory is one phase's (:func:`..assembly.assemble.device_memory`), not its own runtime's."""
    prepared = (tuple(metaops), dict(curves))
    ex = execution or Execution()
    kw = dict(passes=ex.passes, distributed_optimizer=ex.distributed_optimizer)
    out = [(name, lambda f=f: _as_waves(f(graph, cluster, validate=False, prepared=prepared, **kw), graph,
                                        cluster, metaops, curves))
           for name, f in (("sequential", baselines.plan_sequential), ("task-level", baselines.plan_task_level),
                           ("intra-task", baselines.plan_intra_task))]
    out.append(("module-blocks", lambda: plan_module_blocks(graph, cluster, prepared=prepared, groups=ex.groups,
                                                            **kw)))
    return out


def _as_waves(plan: Plan, graph: TaskGraph, cluster: Cluster, metaops, curves) -> Plan:
    """A baseline's plan with the wave runtime's memory (task-level's lanes share one phase)."""
    if plan.system != "task-level":
        return plan
    return assemble_plan(graph, cluster, metaops, curves, plan.levels, _waves_of(plan),
                         {(w.index, i): s.ranks for w in plan.waves for i, s in enumerate(w.slices)},
                         system=plan.system, passes=plan.passes, distributed_optimizer=plan.distributed_optimizer)


def _waves_of(plan: Plan) -> list[Wave]:
    return [Wave(level=w.level, start_ms=w.start_ms, duration_ms=w.duration_ms, phase=w.phase,
                 slices=[WaveSlice(metaop=s.metaop, layer_start=s.layer_start, layers=s.num_layers,
                                   devices=len(s.ranks), time_ms=s.time_ms) for s in w.slices])
            for w in plan.waves]


def cross_level_waves(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int,
                      tuples: Mapping[str, list]) -> list:
    """Candidate 3: the shortest of Algorithm 1's propose/align variants over all MetaOps at once."""
    best = None
    for propose in ("paper", "all"):
        for align in ("shortest", "finisher"):
            waves = schedule_level(0, metaops, tuples, curves, num_devices, propose=propose, align=align,
                                   across_levels=True)
            span = sum(w.duration_ms for w in waves)
            if best is None or span < best[0] * (1 - 1e-12):
                best = (span, waves)
    return best[1]


def _cross_level_plans(own: Plan, graph: TaskGraph, cluster: Cluster, metaops: Sequence[MetaOp],
                       curves: Mapping[str, ScalingCurve], tuples: Mapping[str, list],
                       budget: int = NODE_BUDGET) -> list[tuple[str, Plan]]:
    own_waves = _waves_of(own)
    options = [("cross-level", cross_level_waves(metaops, curves, cluster.num_devices, tuples)),
               ("backfilled", backfill(own_waves, metaops, curves, cluster.num_devices))]
    kind, waves = min(options, key=lambda o: sum(w.duration_ms for w in o[1]))
    if sum(w.duration_ms for w in waves) >= own.makespan_ms * (1 - 1e-9):
        return []
    out = []
    zero1 = own.distributed_optimizer
    for name, placer in ((kind, lambda: place(metaops, waves, cluster, distributed_optimizer=zero1, node_budget=budget)),
                         (f"{kind}, naive placement", lambda: sequential_placement(waves))):
        try:
            ranks = placer()
        except ValueError:  # no placement fits memory
            continue
        out.append((name, assemble_plan(graph, cluster, metaops, curves, own.levels, waves, ranks,
                                        system="cross-level", passes=own.passes, distributed_optimizer=zero1)))
    return out


def first_search_plans(own: Plan, graph: TaskGraph, cluster: Cluster, metaops: Sequence[MetaOp],
                       curves: Mapping[str, ScalingCurve], level_schedules: Sequence,
                       budget: int = NODE_BUDGET, *, picked: Sequence = ()) -> list[tuple[str, Plan]]:
    """Candidate 1'': every level's first-search waves (:attr:`.scheduler.LevelSchedule.first_search`, not
    polished) together, placed both ways; none when no level has them, nor when they are ``picked`` (the
    levels of an earlier candidate placed both ways, :func:`per_level_by_step`'s: the same waves, the same
    placements and steps, and a tie keeps the earlier candidate)."""
    firsts = [ls.first_search or ls for ls in level_schedules]
    if all(f is ls for f, ls in zip(firsts, level_schedules)) or \
            (len(picked) == len(firsts) and all(f is p for f, p in zip(firsts, picked))):
        return []
    waves = _restart([w for f in firsts for w in f.waves])
    levels = tuple(dataclasses.replace(lv, variant=f.variant + ("" if f is ls else " (first search)"))
                   for lv, f, ls in zip(own.levels, firsts, level_schedules))
    out = []
    zero1 = own.distributed_optimizer
    for name, placer in (("spindle, first-search waves", lambda: place(metaops, waves, cluster,
                                                                       distributed_optimizer=zero1,
                                                                       node_budget=budget)),
                         ("spindle, first-search waves, naive placement", lambda: sequential_placement(waves))):
        try:
            ranks = placer()
        except ValueError:  # no placement fits memory
            continue
        out.append((name, assemble_plan(graph, cluster, metaops, curves, levels, waves, ranks, system="spindle",
                                        passes=own.passes, distributed_optimizer=zero1)))
    return out


def _restart(waves: Sequence[Wave]) -> list[Wave]:
    """Copies of ``waves`` laid end to end from time 0."""
    out, clock = [], 0.0
    for w in waves:
        out.append(Wave(level=w.level, start_ms=clock, duration_ms=w.duration_ms, phase=w.phase,
                        slices=[dataclasses.replace(s) for s in w.slices]))
        clock += w.duration_ms
    return out


def per_level_by_step(own: Plan, graph: TaskGraph, cluster: Cluster, metaops: Sequence[MetaOp],
                      curves: Mapping[str, ScalingCurve], level_schedules: Sequence,
                      budget: int = NODE_BUDGET, *, naive: Plan | None = None,
                      steps: Callable[[Plan], float] | None = None) -> tuple[list[tuple[str, Plan]], list]:
    """Candidate 1': each level's alternatives (:attr:`.scheduler.LevelSchedule.alternatives`) tried in turn
    on the whole step (one pass over the levels, each trial timed with the cheap naive placement); when a
    combination beats the levels' shortest spans, it is returned placed both ways, with the level schedules
    it picked (else ``([], [])``). ``naive``: ``own``'s waves with the naive placement when the caller has
    that plan already (the search's start); ``steps``: how a plan is timed (default :func:`step_ms`)."""
    if not any(ls.alternatives for ls in level_schedules):
        return [], []
    steps = steps or (lambda p: step_ms(p, cluster))
    pick = [ls for ls in level_schedules]

    def plan_of(choice, ranks_fn):
        waves = _restart([w for ls in choice for w in ls.waves])
        levels = tuple(dataclasses.replace(lv, variant=ls.variant + ("" if ls is orig else " (by step)"))
                       for lv, ls, orig in zip(own.levels, choice, level_schedules))
        return assemble_plan(graph, cluster, metaops, curves, levels, waves, ranks_fn(waves), system="spindle",
                             passes=own.passes, distributed_optimizer=own.distributed_optimizer)

    best_plan = naive if naive is not None else plan_of(pick, sequential_placement)
    best = steps(best_plan)
    total = sum(ls.span_ms for ls in level_schedules)
    for i, ls in enumerate(level_schedules):
        if ls.span_ms < MIN_LEVEL_SHARE * total:  # a short level moves the step little: not worth a trial
            continue
        for alt in ls.alternatives:
            trial = pick[:i] + [alt] + pick[i + 1:]
            p = plan_of(trial, sequential_placement)
            t = steps(p)
            if t < best * (1 - 1e-9):
                best, pick, best_plan = t, trial, p
    if all(a is b for a, b in zip(pick, level_schedules)):
        return [], []
    out = [("spindle, per-level by step, naive placement", best_plan)]  # plan_of(pick, sequential_placement)
    try:
        out.insert(0, ("spindle, per-level by step", plan_of(pick, lambda w: place(
            metaops, w, cluster, distributed_optimizer=own.distributed_optimizer, node_budget=budget))))
    except ValueError:
        pass
    return out, pick


def _report(report: dict, scored, fitting, winner: str, own, cluster: Cluster) -> None:
    """``winner``: the name of the candidate that won; ``candidates``: every candidate's name, simulated step
    and whether it fits memory, in the order tried; ``own_name`` / ``own_plan``: the best fitting candidate
    built from Spindle's own waves (the indices in ``own``, not a baseline's schedule), if any."""
    fits = {s[1] for s in fitting if fits_memory(s[3], cluster)}
    report["winner"] = winner
    report["candidates"] = [{"name": name, "step_ms": t, "fits": i in fits} for t, i, name, _ in scored]
    mine = [s for s in scored if s[1] in own and s[1] in fits]
    if mine:
        _, _, report["own_name"], report["own_plan"] = min(mine, key=lambda s: (s[0] * (1 + 1e-12), s[1]))


def _lane_search(name: str) -> bool:
    """Whether candidate ``name`` is lanes on whole islands or with sizes searched by the step (:mod:`.lanes`)."""
    return "whole islands" in name or SIZED in name


def _searched(scored, fitting, own: set, cluster: Cluster, postings: tuple[str, ...] = TRANSFER_POSTINGS
              ) -> list[tuple[float, int, str, Plan]]:
    """Candidate 7: the whole-step local search (:mod:`.step_search`) from the best fitting candidate and from
    the best of Spindle's own, other than lanes on whole islands or with searched sizes (sharing one search's
    trials), from the best of all and of Spindle's own where those are such lanes, and from the best baseline
    schedule (a quarter of the trials each), each start searched under both transfer postings, each result kept
    where it shortens the step; none on clusters larger than :data:`.lanes.LANES_MAX_DEVICES`
    (planning time)."""
    if cluster.num_devices > LANES_MAX_DEVICES:
        return []
    ok = sorted((s for s in fitting if fits_memory(s[3], cluster)), key=lambda s: (s[0] * (1 + 1e-12), s[1]))
    budget = trial_budget(cluster.num_devices)

    def firsts(pool):  # the best and the best of Spindle's own, once each
        return list(dict((s[1], s) for s in pool[:1] + [s for s in pool if s[1] in own][:1]).values())

    # the lanes on whole islands or with searched sizes start searches of their own, a quarter of the budget each,
    # so that the other starts keep theirs: a plan at a local optimum of one search may be one the step search
    # cannot leave where another start's moves reach a shorter step (OFASys-7 on 16 devices at 4 passes: 964.8 ms
    # from the lanes on whole islands, 906.8 from task-level's schedule)
    starts = firsts([s for s in ok if not _lane_search(s[2])])
    runs = [(s, budget // max(1, len(starts))) for s in starts] + \
        [(s, budget // 4) for s in firsts(ok) if s[1] not in {t[1] for t in starts}]
    # and from the best baseline schedule, a quarter of the budget: the searches' local optima differ, and
    # which start leads may turn on a fraction of a millisecond (task lanes and task-level's schedule on
    # OFASys-7 / 16 devices with four task groups: `spindle compare --model ofasys --tasks 7 --gpus 16 --json`)
    runs += [(s, budget // 4) for s in [s for s in ok if s[1] not in own][:1]
             if s[1] not in {t[1] for t, _ in runs}]
    out: list[tuple[float, int, str, Plan]] = []
    for (t, i, name, p), trials in runs:
        # one search per transfer posting, each timing its trials under it: a search's path turns on its
        # timings, and either posting's local optimum may be the shorter step
        found = []
        for posting in postings:
            start = p if p.transfer_posting == posting else dataclasses.replace(p, transfer_posting=posting)
            found.append(step_search(start, cluster, t if start is p else None, trials=trials))
        q, ms, kept = min(found, key=lambda f: f[1] * (1 + 1e-12) if f[2] else math.inf)
        if kept:  # timed as every candidate is: in sending order too (best_posting)
            q, ms = best_posting(q, cluster, postings=postings)
        if kept and not violations(q):  # the moves keep the rules; a plan that broke one is not offered
            levels = tuple(dataclasses.replace(lv, variant=(lv.variant if p.system == "spindle" else
                                                            f"{name} schedule") + " + step search")
                           for lv in q.levels)
            out.append((ms, len(scored) + len(out), f"{name}, step search",
                        dataclasses.replace(q, system="spindle", levels=levels)))
    return out


def choose_whole_step(plans: Sequence[tuple[str, Plan]], graph: TaskGraph, cluster: Cluster,
                      metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], *,
                      baselines: bool = True, level_schedules: Sequence | None = None,
                      execution: Execution | None = None, placement_budget: int = NODE_BUDGET,
                      report: dict | None = None, postings: tuple[str, ...] = TRANSFER_POSTINGS) -> Plan:
    """The candidate with the shortest simulated step (see the module docstring), labelled ``spindle``.

    ``plans`` are Spindle's own placed candidates, best first; the baselines' schedules are added here
    unless ``baselines`` is false (``--no-search``: the paper's pipeline only), and, when the levels'
    schedules are given, their alternatives chosen by the step and the waves across levels (one phase
    only: waves across levels would cross phases). The step is the execution's passes of the plan and one
    gradient sync (gradient accumulation). ``report``, when given, receives the scoreboard
    (:func:`_report`). ``postings``: the transfer postings a candidate may take (default both; the paper's
    runtime is ``("boundary",)``).
    """
    one_phase = len({w.phase for w in plans[0][1].waves}) <= 1
    steps = _Steps(cluster, postings)
    if level_schedules is not None and baselines:
        tuples = {m: t for ls in level_schedules for m, t in ls.tuples.items()}
        b = placement_budget
        naive = dict(plans).get("spindle, naive placement")  # own waves, naive placement (from make_plan)
        by_step, picked = per_level_by_step(plans[0][1], graph, cluster, metaops, curves, level_schedules, b,
                                            naive=naive, steps=steps)
        plans = list(plans) + by_step \
            + first_search_plans(plans[0][1], graph, cluster, metaops, curves, level_schedules, b, picked=picked) \
            + lane_plans(plans[0][1], graph, cluster, metaops, curves, (execution or Execution()).groups) \
            + (_cross_level_plans(plans[0][1], graph, cluster, metaops, curves, tuples, b) if one_phase else [])
    scored: list[tuple[float, int, str, Plan]] = []
    for i, (name, p) in enumerate(plans):
        scored.append((steps(p), i, name, steps.posted(p)))
    extra = whole_step_candidates(graph, cluster, metaops, curves, execution) if baselines else []
    for j, (name, build) in enumerate(extra):
        try:
            p = build()
        except ValueError:  # that baseline has no schedule here (too few devices for its shares)
            continue
        scored.append((steps(p), len(plans) + j, name, steps.posted(p)))
    fitting = [s for s in scored if fits_memory(s[3], cluster)] or scored[:1]
    own = set(range(len(plans)))
    if baselines:
        found = _searched(scored, fitting, own, cluster, postings)
        own.update(s[1] for s in found)
        scored += found
        fitting += found
    t, _, name, best = min(fitting, key=lambda s: (s[0] * (1 + 1e-12), s[1]))
    if report is not None:
        _report(report, scored, fitting, name, own, cluster)
    if best.system == "spindle":
        return best  # Spindle's own level-by-level waves (1, 1' or 2)
    own = plans[0][1]
    name = name.split(",")[0]
    levels = tuple(dataclasses.replace(lv, variant=f"{name} schedule (shortest whole step)") for lv in own.levels)
    return dataclasses.replace(best, system="spindle", levels=levels)
