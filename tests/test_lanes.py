"""Spindle's waves inside task lanes: the packing, and plans the whole-step choice can run."""
import pytest

from megatron_spindle.planner.simulation.simulate import simulate
from megatron_spindle.planner.assembly.assemble import make_metaops
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.step.lanes import lane_plans, lane_sizes, lane_waves, pack
from megatron_spindle.planner.assembly.validate import check_plan
from megatron_spindle.planner.workload.analytic import build_curves
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.workload.workloads import build_graph


def test_pack_starts_a_task_on_the_devices_of_one_that_finished():
    # two 4-wide tasks of 10 ms side by side; an 8-wide task of 3 ms must wait for both: 13 ms
    span, where = pack([4, 4, 8], [10.0, 10.0, 3.0], 8, 8)
    assert span == pytest.approx(13.0)
    assert where[:2] == [(0, 0.0), (4, 0.0)] and where[2] == (0, 10.0)
    # a 2-wide task of 9 ms fits beside them on 10 devices, in the first free block
    span, where = pack([4, 4, 2], [10.0, 10.0, 9.0], 10, 8)
    assert span == pytest.approx(10.0) and where[2] == (8, 0.0)


@pytest.mark.parametrize("packed", [False, True])
def test_lane_plans_are_valid_plans_on_disjoint_blocks(packed):
    cluster = load_cluster(None, num_devices=8, gpus_per_node=4)
    graph = build_graph("multitask-clip", tasks=4, size="tiny", batch=8)
    metaops = make_metaops(graph, cluster)
    curves = build_curves(metaops, 8)
    sizes = lane_sizes([[m for m in metaops if m.task == t] for t in graph.tasks], curves, 8)
    assert sum(sizes) == 8 and min(sizes) >= 1
    waves, ranks = lane_waves(metaops, curves, 8, packed=packed, island=4)
    blocks = {}  # every task stays on one block of devices
    for (wi, si), r in ranks.items():
        task = waves[wi].slices[si].metaop.split(".")[0]
        blocks.setdefault(task, set()).update(r)
    if not packed:
        assert sum(len(b) for b in blocks.values()) == 8  # disjoint blocks side by side
    own = make_plan(graph, cluster)
    (name, plan), *_ = [p for p in lane_plans(own, graph, cluster, metaops, curves)
                        if p[0].endswith("packed") == packed]
    check_plan(plan)
    assert simulate(plan, cluster).step_ms > 0


def test_no_lanes_on_large_clusters():
    cluster = load_cluster(None, num_devices=1024)
    graph = build_graph("multitask-clip", tasks=4, size="tiny", batch=8)
    assert lane_plans(None, graph, cluster, (), {}) == []


def _lanes(model, tasks, gpus):
    from megatron_spindle.planner.tuning.tune import Workload
    cluster = load_cluster(None, num_devices=gpus)
    graph = Workload(model=model, tasks=tasks).graph(1)
    metaops = make_metaops(graph, cluster)
    curves = build_curves(metaops, gpus)
    return cluster, graph, metaops, curves, [[m for m in metaops if m.task == t] for t in graph.tasks]


def test_island_sizes_keep_every_lane_off_the_others_islands():
    from megatron_spindle.planner.step.lanes import island_order, island_sizes
    cluster, _, _, curves, lanes = _lanes("multitask-clip", 10, 256)
    sizes = island_sizes(lanes, curves, 256, 8)
    assert sum(sizes) <= 256 and all(n % 8 == 0 or 8 % n == 0 for n in sizes)
    at = 0
    for i in island_order(sizes, 8):  # side by side in that order: no lane crosses an island it shares
        first, last = at, at + sizes[i] - 1
        assert sizes[i] % 8 == 0 and first % 8 == 0 or first // 8 == last // 8, (i, first, sizes[i])
        at += sizes[i]


def test_the_size_search_keeps_only_shorter_steps_and_the_lanes_least_shares():
    from megatron_spindle.planner.simulation.simulate import step_time_ms
    from megatron_spindle.planner.step.lanes import size_search
    from megatron_spindle.planner.assembly.assemble import assemble_plan
    from megatron_spindle.planner.systems.shares import min_share
    cluster, graph, metaops, curves, lanes = _lanes("multitask-clip", 10, 64)
    own = make_plan(graph, cluster, search=False)
    sizes = [lane_sizes(lanes, curves, 64, 8)]
    mins = [[min_share(ms, 64) for ms in lanes]]
    timed = []

    def build(sz):
        got = lane_waves(metaops, curves, 64, (), 8, packed=False, sizes=sz)
        timed.append(sz)
        return assemble_plan(graph, cluster, metaops, curves, own.levels, got[0], got[1], system="spindle")

    start = step_time_ms(build(sizes), cluster)
    timed.clear()
    step, best, plan = size_search(build, sizes, mins, [list(graph.tasks)], cluster, trials=12)
    assert len(timed) <= 1 + 12  # the start and at most the trials
    assert step < start and step == pytest.approx(step_time_ms(plan, cluster), rel=1e-12)
    assert sum(best[0]) <= 64 and all(n >= m for n, m in zip(best[0], mins[0]))
    check_plan(plan)


def test_the_searched_lanes_win_a_row_from_the_best_baseline():
    # Multitask-CLIP-10 on 256 devices: task-level's schedule (power-of-two lanes, a quarter of the devices idle)
    # was the best candidate; the lanes on whole islands, sizes searched by the step, beat it with Spindle's own
    # waves
    from megatron_spindle.planner.tuning.tune import Workload
    cluster = load_cluster(None, num_devices=256)
    report: dict = {}
    make_plan(Workload(model="multitask-clip", tasks=10).graph(1), cluster, report=report)
    steps = {c["name"]: c["step_ms"] for c in report["candidates"]}
    assert "sized by step" in report["winner"] and report["own_name"] == report["winner"]
    sized = next(v for k, v in steps.items() if k.endswith("sized by step"))
    assert sized < steps["task-level"] * (1 - 1e-9)
