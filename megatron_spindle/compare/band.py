"""What ``spindle compare`` adds beside each step: MFU, and the band the analytic curves leave open.

**MFU.** Model FLOPs per step (:func:`..planner.workload.flops.step_model_flops`, at the system's own passes;
recompute is not model FLOPs) over the step time, the devices and the cluster's peak per device
(:attr:`..planner.workload.cluster.Cluster.peak_tflops`). Readers' anchors: DistTrain 54.7 % MFU (72B multimodal,
1,172 GPUs), OrchMLLM 41.6 % (84B, 2,560 H100s).

**The band.** Until a profile measures the layers, the analytic device model decides the race, and two of its
constants are not pinned by any training measurement of these layers at small per-device batches: the per-layer
floor and the large-batch efficiency level. The default ("fitted") model runs eagerly, as megatron-core does by
default (no CUDA graphs): the eager floor, FlashAttention's training level.
:func:`..planner.workload.analytic.fast_edge` is the other execution mode (fused kernels / CUDA graphs: the fused
floor); :func:`..planner.workload.analytic.slow_edge` is the eager column's batch-1 latency as floor with Megatron-LM
2021's level. Each system is planned again at its own chosen configuration at both edges (re-tuning would only make
each faster), and the comparison says whether the winner or the ranking differs between the edges. A ``--curves``
file replaces the analytic model: then there is no band, one number per system.
"""
from __future__ import annotations

from typing import Mapping

from ..planner.systems.baselines import BASELINES
from ..planner.step.build import make_plan
from ..planner.simulation.simulate import simulate
from ..planner.tuning.tune_spindle import tune_spindle
from ..planner.tuning.tune import Tuned, Workload, tune_baseline, tune_static_grids
from ..planner.workload.analytic import DeviceModel, fast_edge, slow_edge
from ..planner.workload.flops import mfu, step_model_flops, tflops_per_device

EDGES = ("fast", "fitted", "slow")


def fill_mfu(results: Mapping, workload: Workload, gpus: int, peak_tflops: float) -> None:
    """Set ``model_flops``, ``tflops_per_gpu`` and ``mfu`` on every result that has a step."""
    for r in results.values():
        if not r.ok:
            continue
        passes = r.execution.passes if r.execution is not None else 1
        r.model_flops = step_model_flops(workload.graph(passes), passes)
        r.tflops_per_gpu = tflops_per_device(r.model_flops, r.sim.step_ms, gpus)
        r.mfu = mfu(r.model_flops, r.sim.step_ms, gpus, peak_tflops)


def _edge_step(system: str, r, workload: Workload, cl, device: DeviceModel, hints) -> float | None:
    ex = r.execution
    if ex is None:
        return None
    if system == "spindle-naive-placement":
        try:
            plan = make_plan(workload.graph(ex.passes), cl, device=device, validate=False, placement="sequential",
                             execution=ex)
        except (ValueError, KeyError):
            return None
        return simulate(plan, cl, check_memory=False).step_ms
    if system in BASELINES:
        t: Tuned = tune_baseline(system, workload, cl, device=device, fixed=ex)
    elif system == "static-grids":
        t = tune_static_grids(workload, cl, device=device, fixed=ex)
    elif system == "spindle":
        t = tune_spindle(workload, cl, device=device, fixed=ex, hints=hints)
    else:
        return None
    if t.sim is not None:
        return t.sim.step_ms
    over = t.extra.get("over_sim")  # the same configuration, timed even where it is over memory
    return over.step_ms if over is not None else t.step_ms


def fill_band(results: Mapping, workload: Workload, cl, device: DeviceModel) -> dict:
    """Every system's step at the fast and the slow edge (its own configuration re-planned; the slow one is also
    ``r.slow_ms``), and what moves between the edges."""
    models = {"fast": fast_edge(device), "fitted": device, "slow": slow_edge(device)}
    hints = [r.execution for s, r in results.items() if s in BASELINES and r.execution is not None]
    steps: dict[str, dict[str, float]] = {e: {} for e in EDGES}
    for s, r in results.items():
        if not r.ok:
            r.slow_ms = None
            continue
        for edge in EDGES:
            ms = r.sim.step_ms if edge == "fitted" else _edge_step(s, r, workload, cl, models[edge], hints)
            if ms is not None:
                steps[edge][s] = ms
        r.slow_ms = steps["slow"].get(s)
    ranked = {e: {s: v for s, v in steps[e].items() if s != "spindle-naive-placement"} for e in EDGES}
    ranks = {e: _groups(ranked[e]) for e in EDGES}
    winners = {e: ranks[e][0] if ranks[e] else [] for e in EDGES}
    common = [s for s in ranked["fitted"] if all(s in ranked[e] for e in EDGES)]
    swapped = sorted({(a, c) for a in common for c in common for e1 in EDGES for e2 in EDGES
                      if _less(ranked[e1], a, c) and _less(ranked[e2], c, a)})
    firsts = [set(w) for w in winners.values() if w]
    return {"edges": {e: m.to_json() for e, m in models.items()}, "steps_ms": steps, "ranking": ranks,
            "winner": winners, "winner_changes": bool(firsts) and not set.intersection(*firsts),
            "ranking_changes": bool(swapped), "swapped": [list(p) for p in swapped]}


#: Steps within this relative difference tie (Spindle's plan can be a baseline's schedule, the same step).
TIE = 1e-9


def _less(steps: Mapping[str, float], a: str, b: str) -> bool:
    return steps[a] < steps[b] * (1 - TIE)


def _groups(steps: Mapping[str, float]) -> list[list[str]]:
    """Systems from fastest to slowest, tied ones in one group."""
    out: list[list[str]] = []
    for s, v in sorted(steps.items(), key=lambda kv: (kv[1], kv[0])):
        if out and not _less(steps, out[-1][0], s):
            out[-1].append(s)
        else:
            out.append([s])
    return out


def band_lines(band: dict | None, results: Mapping) -> list[str]:
    """The table's lines about the band."""
    if band is None:
        return ["band: none (measured curves from --curves: one number per system)"]
    steps = band.get("steps_ms", {})
    lead = []
    for b in BASELINES + ("static-grids",):
        ratios = [steps[e][b] / steps[e]["spindle"] for e in EDGES
                  if b in steps.get(e, {}) and steps[e].get("spindle")]
        if len(ratios) == len(EDGES):
            lead.append(f"{b} " + " / ".join(f"{x:.2f}x" for x in ratios))
    out = [f"band (analytic curves, fast edge: fused / CUDA-graph floor / fitted: eager floor, megatron-core's "
           f"default / slow edge: eager batch-1 floor, Megatron-LM 2021 level): Spindle over "
           f"{', '.join(lead) if lead else '-'}"]
    def order(edge):
        return " < ".join(" = ".join(g) for g in band["ranking"][edge])
    w = {e: " = ".join(v) for e, v in band["winner"].items()}
    if band["winner_changes"]:
        out.append("the winner changes inside the band: " + ", ".join(f"{w[e]} at the {e} edge" for e in EDGES)
                   + "; a profile of your own devices (spindle profile, --curves) settles it")
    else:
        common = set.intersection(*([set(v) for v in band["winner"].values() if v] or [set()]))
        out.append(f"{' = '.join(sorted(common))} fastest at every edge")
    if band["ranking_changes"]:
        out.append("the ranking changes inside the band: " + " -> ".join(f"{order(e)} ({e})" for e in EDGES))
    else:
        out.append(f"the ranking holds: {order('fitted')}")
    return out
