"""What ``spindle compare`` adds beside each step: MFU, and the band the analytic curves leave open (issue 31).

**MFU.** Model FLOPs per step (:func:`.planner.workload.flops.step_model_flops`, at the system's own passes;
recompute is not model FLOPs) over the step time, the devices and the cluster's peak per device
(:attr:`.planner.workload.cluster.Cluster.peak_tflops`). Readers' anchors: DistTrain 54.7 % MFU (72B multimodal,
1,172 GPUs), OrchMLLM 41.6 % (84B, 2,560 H100s).

**The band.** Until a profile measures the layers, the analytic device model decides the race, and two of its
constants are not pinned by any training measurement of these layers: the per-layer floor and the large-batch
efficiency level. The default model is the *fast edge* of the published anchors (fused-kernel floor,
FlashAttention's training level); :func:`.planner.workload.analytic.slow_edge` is the *slow edge* (an eager
framework's dispatch floor, Megatron-LM 2021's level). Each system is planned again at its own chosen
configuration under the slow edge (re-tuning would only make each faster), and the comparison says whether the
winner or the ranking differs between the edges. A ``--curves`` file replaces the analytic model: then there is
no band, one number per system.
"""
from __future__ import annotations

from typing import Mapping

from .planner.systems.baselines import BASELINES
from .planner.step.build import make_plan
from .planner.simulation.simulate import simulate
from .planner.systems.tune_spindle import tune_spindle
from .planner.systems.tuning import Tuned, Workload, tune_baseline, tune_static_grids
from .planner.workload.analytic import DeviceModel, slow_edge
from .planner.workload.flops import mfu, step_model_flops, tflops_per_device

EDGES = ("fitted", "slow")


def fill_mfu(results: Mapping, workload: Workload, gpus: int, peak_tflops: float) -> None:
    """Set ``model_flops``, ``tflops_per_gpu`` and ``mfu`` on every result that has a step."""
    for r in results.values():
        if not r.ok:
            continue
        passes = r.execution.passes if r.execution is not None else 1
        r.model_flops = step_model_flops(workload.graph(passes), passes)
        r.tflops_per_gpu = tflops_per_device(r.model_flops, r.sim.step_ms, gpus)
        r.mfu = mfu(r.model_flops, r.sim.step_ms, gpus, peak_tflops)


def _slow_step(system: str, r, workload: Workload, cl, device: DeviceModel, hints) -> float | None:
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
    """Every system's step at the slow edge (its own configuration re-planned), and what moves between edges."""
    slow = slow_edge(device)
    hints = [r.execution for s, r in results.items() if s in BASELINES and r.execution is not None]
    for s, r in results.items():
        r.slow_ms = _slow_step(s, r, workload, cl, slow, hints) if r.ok else None
    steps = {edge: {s: (r.sim.step_ms if edge == "fitted" else r.slow_ms) for s, r in results.items()
                    if r.ok and s != "spindle-naive-placement" and (edge == "fitted" or r.slow_ms is not None)}
             for edge in EDGES}
    ranks = {edge: _groups(steps[edge]) for edge in EDGES}
    winners = {edge: ranks[edge][0] if ranks[edge] else [] for edge in EDGES}
    common = [s for s in steps["fitted"] if s in steps["slow"]]
    swapped = [(a, c) for a in common for c in common
               if _less(steps["fitted"], a, c) and _less(steps["slow"], c, a)]
    return {"edges": {"fitted": device.to_json(), "slow": slow.to_json()}, "ranking": ranks, "winner": winners,
            "winner_changes": bool(winners["fitted"] and winners["slow"]
                                   and not set(winners["fitted"]) & set(winners["slow"])),
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
    sp = results.get("spindle")
    lead = []
    for b in BASELINES + ("static-grids",):
        r = results.get(b)
        if sp is not None and sp.ok and r is not None and r.ok and sp.slow_ms and r.slow_ms:
            lead.append(f"{b} {r.sim.step_ms / sp.sim.step_ms:.2f}x -> {r.slow_ms / sp.slow_ms:.2f}x")
    out = [f"band (analytic curves' fitted = fast edge -> slow edge: eager floor, Megatron-LM 2021 level): "
           f"Spindle over {', '.join(lead) if lead else '-'}"]
    def order(edge):
        return " < ".join(" = ".join(g) for g in band["ranking"][edge])
    w = {e: " = ".join(v) for e, v in band["winner"].items()}
    if band["winner_changes"]:
        out.append(f"the winner changes inside the band: {w['fitted']} at the fitted model, {w['slow']} at the slow "
                   f"edge; a profile of your own devices (spindle profile, --curves) settles it")
    else:
        common = set(band["winner"]["fitted"]) & set(band["winner"]["slow"])
        out.append(f"{' = '.join(sorted(common))} fastest at both edges")
    if band["ranking_changes"]:
        out.append(f"the ranking changes inside the band: {order('fitted')} (fitted) -> {order('slow')} (slow edge)")
    else:
        out.append(f"the ranking holds: {order('fitted')}")
    return out
