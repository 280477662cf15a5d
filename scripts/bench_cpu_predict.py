"""The planner's side of ``scripts/bench_cpu.py``: which pass counts to time, the plans and their simulated steps
(:func:`predict`), and the planner's activation estimates the measured stash is compared with. Pure Python
(the planner); the runtime's side stays in ``bench_cpu.py``."""
from __future__ import annotations

import dataclasses
import statistics

from megatron_spindle.planner.workload.graph import TaskGraph
from bench_cpu_report import BOUNDARY, _step_series, seq_name


def valid_passes(batch: int, world: int) -> list[int]:
    """Pass counts of a step whose per-pass batch still splits over ``world`` ranks."""
    return [p for p in range(1, batch + 1) if batch % p == 0 and (batch // p) % world == 0]


def best_passes(ranks: list[dict], passes: list[int]) -> int:
    """The sequential pass count with the shortest median step (slowest rank per step)."""
    return min(passes, key=lambda p: statistics.median(_step_series(ranks, seq_name(p), "step")))


def recomputed(plan, mode: str):
    """``plan`` with every transformer and decoder MetaOp recomputing ``mode``."""
    from megatron_spindle.planner.workload.recompute import RECOMPUTABLE
    return dataclasses.replace(plan, metaops=tuple(
        dataclasses.replace(m, recompute=mode if m.op_type in RECOMPUTABLE else "none") for m in plan.metaops))


def planned_peak(plan, rank: int) -> float:
    """The planner's activation estimate of ``rank`` (bf16 bytes): its largest phase's slices."""
    from megatron_spindle.planner.workload.memory import slice_activation_bytes
    by_phase: dict[int, float] = {}
    for s in plan.rank_slices(rank):
        phase = plan.waves[s.wave].phase
        by_phase[phase] = by_phase.get(phase, 0.0) + slice_activation_bytes(plan.metaop(s.metaop), s.num_layers,
                                                                              len(s.ranks))
    return max(by_phase.values(), default=0.0)


def planned_task_by_task(graph: TaskGraph, world: int, mode: str) -> float:
    """The planner's estimate (bf16 bytes) for the sequential baseline as it runs: one task's forward and
    backward at a time, every MetaOp over all ranks, the contrastive loss on every rank (all-gathered)."""
    from megatron_spindle.planner.workload.memory import slice_activation_bytes
    from megatron_spindle.planner.workload.metaops import contract
    from megatron_spindle.planner.workload.recompute import RECOMPUTABLE
    per_task: dict[str, float] = {}
    for m in contract(graph):
        m = dataclasses.replace(m, recompute=mode if m.op_type in RECOMPUTABLE else "none")
        n = world if m.batch_splittable else 1
        per_task[m.task] = per_task.get(m.task, 0.0) + slice_activation_bytes(m, m.num_layers, n)
    return max(per_task.values(), default=0.0)


def predict(graph: TaskGraph, doc: dict, world: int, placement: str = "spindle") -> dict:
    """Plans (Spindle, sequential) and their simulated steps on the profiled curves and link; ``placement``:
    ``naive`` places Spindle's waves on consecutive devices in slice order (``make_plan``'s ablation), so that
    activations move between processes even where the planner's own plan keeps them on one. Spindle's plan is
    run with its transfers posted as each producer ends, its twin (``--waves``) at each consumer's wave, so
    the two differ by the posting alone whichever the planner picked (``planned_posting``)."""
    from megatron_spindle.planner.workload.analytic import CurvesFile
    from megatron_spindle.planner.step.build import plan_system
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import Cluster
    from megatron_spindle.planner.assembly.render import grid, metaop_table
    from megatron_spindle.planner.simulation.runtime_costs import RuntimeCosts
    from megatron_spindle.planner.simulation.simulate import rank_waits, simulate

    if "cluster" not in doc:
        raise ValueError("the curves have no measured link ('cluster'): profile with two or more processes")
    cluster = Cluster(**{**doc["cluster"], "num_devices": world})
    cf = CurvesFile.parse(doc)
    made = make_plan(graph, cluster, curves_file=cf, placement="sequential" if placement == "naive" else "spindle")
    plans = {"spindle": dataclasses.replace(made, transfer_posting="producer"),
             "sequential": plan_system("sequential", graph, cluster, curves_file=cf)}
    # the same waves with every transfer posted at its consumer's wave boundary (no overlap across waves)
    plans[BOUNDARY] = dataclasses.replace(made, transfer_posting="boundary")
    # the executor posts each boundary's sends with its receives, on gloo as under NCCL; the runtime's own
    # costs (posting each batch) where the profile measured them
    runtime = RuntimeCosts.from_measured(doc.get("measured", {}).get("runtime"))
    sims = {k: simulate(p, cluster, runtime=runtime) for k, p in plans.items()}
    sp = sims["spindle"]
    wave_pred = [{"index": w.index, "compute_s": w.duration_ms / 1e3,
                  "transfer_s": (t.transfer_fwd_ms + t.transfer_bwd_ms) / 1e3,
                  "slices": [(sl.name, list(sl.ranks)) for sl in w.slices]}
                 for w, t in zip(plans["spindle"].waves, sp.waves)]
    return {"spindle_plan": plans["spindle"], "boundary_plan": plans[BOUNDARY], "planned_posting": made.transfer_posting,
            "cluster": cluster.to_json(), "wave_pred": wave_pred,
            "sims": {k: s.to_json() for k, s in sims.items()},
            "waits": {k: rank_waits(plans[k], cluster, runtime=runtime) for k in ("spindle", BOUNDARY)},
            "waves": {k: len(p.waves) for k, p in plans.items()},
            "plan_summary": metaop_table(plans["spindle"]) + "\n\n" + grid(plans["spindle"])}


def sequential_passes(args) -> list[int]:
    """The pass counts of the sequential sweep: ``--sequential-passes`` (checked) or every valid one."""
    valid = valid_passes(args.batch, args.nproc)
    if args.sequential_passes is None:
        return valid
    try:
        chosen = sorted({int(x) for x in args.sequential_passes.split(",") if x.strip()} | {1})
    except ValueError:
        raise SystemExit(f"bench_cpu: --sequential-passes {args.sequential_passes!r} is not a list of integers")
    bad = [p for p in chosen if p not in valid]
    if bad:
        raise SystemExit(f"bench_cpu: --sequential-passes {bad} do not split batch {args.batch} over {args.nproc} "
                         f"processes; valid: {valid}")
    return chosen
