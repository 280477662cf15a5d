"""Spindle at its own best configuration (:mod:`.tune` says what is searched and why).

For each way of splitting the tasks into phases (one phase; :data:`GROUP_COUNTS` groups balanced by their
activations; one phase per task) and with or without the distributed optimizer:

1. the smallest pass count ``P`` at which the plan fits with every layer recomputed in full (bisection over the
   pass options; a pass count the aggregate bound already rules out — the largest phase's stash plus every
   weight's states once over the whole cluster's memory — costs no plan);
2. at that ``P``, the least recompute that fits: MetaOps escalated (none → selective → full) in order of
   bytes saved per unit of time added (:func:`recompute_order`), each round by a share of the stash that
   doubles (1/16, 1/8, ... of it), at most :data:`RECOMPUTE_ROUNDS` rounds; and the smallest ``P`` that fits
   with nothing recomputed.

A configuration fits when the paper's pipeline's waves under it can be placed within memory (the placement
checks every device, :data:`PROBE_NODES` search nodes at most).

Each candidate is planned with the paper's pipeline alone (``search=False``) and its step simulated; the
:data:`FULL_SEARCHES` fastest, and the tuned baselines' own configurations (``hints``: there the whole-step
choice has the baseline's schedule among its candidates), get the full search; the fastest that fits wins.
"""
from __future__ import annotations

from typing import Sequence

from ..workload.analytic import CurvesFile, DeviceModel, build_curves
from ..workload.cluster import Cluster
from ..workload.memory import layer_state_bytes, tp_activation_factor
from ..workload.metaops import MetaOp
from ..workload.recompute import act_bytes_per_sample, options as recompute_options, time_factor
from ..assembly.assemble import make_metaops
from ..step.build import grouped_schedule, make_plan
from ..assembly.placement import PlacementError, place
from ..assembly.execution import Execution, configure, task_groups
from ..assembly.plan import Plan
from ..simulation.simulate import simulate, step_time_ms
from ..systems.baselines import BASELINES
from .tune import Trial, Tuned, Workload, first_fit, plan_fits, plan_peak_bytes, note_over_memory, tune_baseline

#: Spindle configurations given the full search (the rest are ranked by the paper's pipeline alone).
FULL_SEARCHES = 2
#: Recompute escalations tried at one (passes, phases) before giving up on them.
RECOMPUTE_ROUNDS = 4
#: Task-group counts tried besides one phase and one phase per task.
GROUP_COUNTS = (2, 4)
#: Placement search nodes of a feasibility probe (a full plan keeps the placement's own limit): a failing
#: probe ends quickly, at the price of calling some plans that a longer search would place infeasible.
PROBE_NODES = 300
#: ... and of a full search's placement.
FULL_NODES = 3000
_RANK = {"none": 0, "selective": 1, "full": 2}


def stash_bytes(m: MetaOp, mode: str | None = None) -> float:
    """Bytes ``m`` stashes over all its devices in one pass under ``mode`` (default: its own)."""
    return m.batch * act_bytes_per_sample(m, mode) * m.num_layers * tp_activation_factor(m.tp) * m.tp


def recompute_order(metaops: Sequence[MetaOp]) -> list[tuple[str, str, float]]:
    """``(MetaOp, mode, bytes saved)`` escalations, the most bytes saved per unit of time added first."""
    steps = []
    for m in metaops:
        prev = "none"
        for mode in recompute_options(m)[1:]:
            saved = stash_bytes(m, prev) - stash_bytes(m, mode)
            cost = (time_factor(m, mode) - time_factor(m, prev)) * m.fwd_flops_per_layer * m.num_layers
            if saved > 0:
                steps.append((cost / saved, m.name, mode, saved))
            prev = mode
    steps.sort(key=lambda s: (s[0], s[1], _RANK[s[2]]))
    return [(name, mode, saved) for _, name, mode, saved in steps]


def could_fit(metaops: Sequence[MetaOp], groups, cluster: Cluster, zero1: bool) -> bool:
    """A necessary condition: the largest phase's stash plus every weight's states (once, sharded over the
    most devices a weight can be on when the distributed optimizer is on) within the cluster's memory."""
    phase_of = {t: i for i, g in enumerate(groups) for t in g}
    stash: dict[int, float] = {}
    states = 0.0
    seen: set[str] = set()
    for m in metaops:
        stash[phase_of.get(m.task, 0)] = stash.get(phase_of.get(m.task, 0), 0.0) + stash_bytes(m)
        for k in m.param_keys:
            if k and k not in seen:
                seen.add(k)
                states += layer_state_bytes(m, holders=cluster.num_devices, distributed_optimizer=zero1) * m.tp
    return max(stash.values(), default=0.0) + states <= cluster.num_devices * cluster.memory_limit_bytes


def tune_spindle(wl: Workload, cluster: Cluster, *, curves_file: CurvesFile | None = None,
                 device: DeviceModel | None = None, fixed: Execution | None = None,
                 hints: Sequence[Execution] = ()) -> Tuned:
    """Spindle at its best configuration (module docstring), or at ``fixed`` only."""
    out = Tuned("spindle")
    kw = dict(curves_file=curves_file, device=device, validate=False)
    fast_plans: dict[Execution, Plan | str] = {}

    def fast(ex: Execution) -> Plan | str:
        got = fast_plans.get(ex)
        if got is None:
            try:
                got = make_plan(wl.graph(ex.passes), cluster, search=False, execution=ex,
                                placement_budget=PROBE_NODES, **kw)
            except (ValueError, KeyError) as e:
                got = str(e).splitlines()[0] if str(e) else type(e).__name__
            fast_plans[ex] = got
        return got

    probes: dict[Execution, bool] = {}

    def fits(ex: Execution) -> bool:
        """Whether the paper's pipeline's waves under ``ex`` can be placed within memory (no plan assembled)."""
        got = probes.get(ex)
        if got is None:
            metaops = configure(make_metaops(wl.graph(ex.passes), cluster), ex, cluster)
            got = could_fit(metaops, ex.groups, cluster, ex.distributed_optimizer)
            if got:
                curves = build_curves(metaops, cluster.num_devices, curves_file=curves_file, device=device)
                waves = [w for ls in grouped_schedule(metaops, curves, cluster.num_devices, ex.groups, False)
                         for w in ls.waves]
                try:
                    place(metaops, waves, cluster, distributed_optimizer=ex.distributed_optimizer,
                          node_budget=PROBE_NODES)
                except PlacementError:
                    got = False
            probes[ex] = got
        return got

    def least_recompute(P: int, groups, zero1: bool) -> Execution | None:
        metaops = make_metaops(wl.graph(P), cluster)
        order = recompute_order(metaops)
        total = sum(stash_bytes(m) for m in metaops)
        chosen: dict[str, str] = {}
        k = 0
        for round_ in range(RECOMPUTE_ROUNDS + 1):
            ex = Execution(passes=P, recompute=tuple(sorted(chosen.items())) or "none", groups=groups,
                           distributed_optimizer=zero1)
            if fits(ex):
                return ex
            if round_ == RECOMPUTE_ROUNDS or k >= len(order):
                return None
            need = total / 2 ** (RECOMPUTE_ROUNDS - round_)  # a share of the stash, doubling each round
            saved = 0.0
            while k < len(order) and saved < need:
                name, mode, b = order[k]
                if _RANK[mode] > _RANK[chosen.get(name, "none")]:
                    chosen[name] = mode
                    saved += b
                k += 1
        return None

    candidates: list[Execution] = []
    if fixed is not None:
        candidates.append(fixed)
    else:
        opts = wl.pass_options()
        tasks = wl.graph(opts[0]).tasks
        weights = {t: 0.0 for t in tasks}
        for m in make_metaops(wl.graph(opts[0]), cluster):
            weights[m.task] += stash_bytes(m)
        counts = sorted({k for k in (1, *GROUP_COUNTS, len(tasks)) if k <= len(tasks)})
        for k in counts:
            groups = task_groups(tasks, weights, k) if k > 1 else ()
            for zero1 in (False, True):
                full = first_fit(opts, lambda P: fits(Execution(passes=P, recompute="full", groups=groups,
                                                                 distributed_optimizer=zero1)))
                if full is None:
                    continue
                found = [least_recompute(opts[full], groups, zero1)]
                plain = first_fit(opts, lambda P: fits(Execution(passes=P, groups=groups,
                                                                  distributed_optimizer=zero1)))
                if plain is not None:
                    found.append(Execution(passes=opts[plain], groups=groups, distributed_optimizer=zero1))
                candidates += [ex for ex in found if ex is not None]
                if full == 0 and plain == 0:
                    break  # fits at one pass without the distributed optimizer: it cannot help
    ranked = []
    for ex in dict.fromkeys(candidates):
        p = fast(ex)
        if isinstance(p, Plan):
            t = step_time_ms(p, cluster)
            out.tried.append(Trial(ex, t, plan_peak_bytes(p) / 2**30, plan_fits(p, cluster), "paper's pipeline"))
            ranked.append((t, ex))
    ranked.sort(key=lambda r: r[0])
    finals = list(dict.fromkeys([ex for _, ex in ranked[:FULL_SEARCHES]] + list(hints)))
    for ex in finals:
        report: dict = {}
        try:
            p = make_plan(wl.graph(ex.passes), cluster, execution=ex, placement_budget=FULL_NODES, report=report,
                          **kw)
        except (ValueError, KeyError) as e:
            out.tried.append(Trial(ex, None, None, False, str(e).splitlines()[0]))
            continue
        ok = plan_fits(p, cluster)
        sim = simulate(p, cluster, check_memory=False)
        out.tried.append(Trial(ex, sim.step_ms, plan_peak_bytes(p) / 2**30, ok, "full search"))
        if ok and (out.sim is None or sim.step_ms < out.sim.step_ms * (1 - 1e-9)):
            out.execution, out.plan, out.sim = ex, p, sim
            out.extra["schedule"] = report.get("winner", "spindle")  # the whole-step candidate that won
        elif not ok and fixed is not None:
            note_over_memory(out, ex, sim, plan_peak_bytes(p), cluster)
    if out.sim is None:
        notes = [t.note for t in out.tried if not t.fits and t.note not in ("", "paper's pipeline")]
        out.error = notes[0] if notes else "no configuration fits the devices' memory"
    return out


def tune_with_baselines(wl: Workload, cluster: Cluster, *, curves_file: CurvesFile | None = None,
                        device: DeviceModel | None = None, fixed: Execution | None = None,
                        baselines: Sequence[str] = BASELINES) -> dict[str, Tuned]:
    """Every system of ``baselines`` at its best configuration, then Spindle with theirs as ``hints``: the one
    way both ``spindle compare`` and ``spindle plan`` choose Spindle's configuration, so that the two print
    the same step for the same workload. ``{system: Tuned}``, Spindle's under ``"spindle"``."""
    kw = dict(curves_file=curves_file, device=device, fixed=fixed)
    out = {system: tune_baseline(system, wl, cluster, **kw) for system in baselines}
    hints = [t.execution for t in out.values() if t.execution is not None]
    out["spindle"] = tune_spindle(wl, cluster, hints=hints, **kw)
    return out
