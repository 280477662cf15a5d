"""Whole-step choice: backfilled and cross-level waves are valid plans, never longer than the
waves they start from, and the plan with the shortest simulated step wins."""
import pytest

from megatron_spindle.planner.workload.analytic import build_curves
from megatron_spindle.planner.step.backfill import backfill
from megatron_spindle.planner.assembly.assemble import assemble_plan, make_metaops, schedule
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.step.choose import cross_level_waves, step_ms
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.assembly.placement import sequential_placement
from megatron_spindle.planner.assembly.validate import check_plan
from megatron_spindle.planner.workload.workloads import build_graph


@pytest.mark.parametrize("model,k,n", [("multitask-clip", 10, 8), ("ofasys", 7, 16), ("qwen-val", 3, 64),
                                       ("multitask-clip", 4, 64)])
def test_backfilled_and_cross_level_waves_are_valid_plans(model, k, n):
    graph, cluster = build_graph(model, tasks=k), load_cluster(None, num_devices=n)
    metaops = make_metaops(graph, cluster)
    curves = build_curves(metaops, n)
    sched = schedule(metaops, curves, n)
    waves = [w for ls in sched for w in ls.waves]
    levels = make_plan(graph, cluster).levels
    own = sum(w.duration_ms for w in waves)
    filled = backfill(waves, metaops, curves, n)
    assert sum(w.duration_ms for w in filled) <= own * (1 + 1e-12)
    assert sum(w.duration_ms for w in waves) == pytest.approx(own)   # the input is left alone
    across = cross_level_waves(metaops, curves, n, {m: t for ls in sched for m, t in ls.tuples.items()})
    for ws in (filled, across):
        plan = assemble_plan(graph, cluster, metaops, curves, levels, ws, sequential_placement(ws), system="spindle")
        check_plan(plan)      # every layer once, dependencies, devices per wave, levels never go back


def test_backfill_helps_where_devices_stay_free():
    # 10-task Multitask-CLIP on 8 devices at 128 samples per task per pass, the paper's pipeline per level:
    # some waves leave devices free, and later MetaOps are ready (the searched level schedules fill them)
    graph, cluster = build_graph("multitask-clip", tasks=10, batch=128), load_cluster(None, num_devices=8)
    metaops = make_metaops(graph, cluster)
    curves = build_curves(metaops, 8)
    waves = [w for ls in schedule(metaops, curves, 8, search=False) for w in ls.waves]
    assert sum(w.duration_ms for w in backfill(waves, metaops, curves, 8)) < sum(w.duration_ms for w in waves)


@pytest.mark.parametrize("model,k,n", [("ofasys", 7, 64), ("multitask-clip", 10, 8), ("ofasys", 4, 8)])
def test_the_chosen_plan_has_the_shortest_step(model, k, n):
    from megatron_spindle.planner.systems.baselines import BASELINES
    from megatron_spindle.planner.step.build import plan_system
    graph, cluster = build_graph(model, tasks=k), load_cluster(None, num_devices=n)
    plan = make_plan(graph, cluster)
    assert plan.system == "spindle"
    own = make_plan(graph, cluster, search=False)
    for other in [own] + [plan_system(b, graph, cluster, validate=False) for b in BASELINES]:
        assert step_ms(plan, cluster) <= step_ms(other, cluster) * (1 + 1e-12), other.system
