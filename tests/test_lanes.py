"""Spindle's waves inside task lanes (issue 32, part 1): the packing, and plans the whole-step choice can run."""
import pytest

from megatron_spindle.planner.simulation.simulate import simulate
from megatron_spindle.planner.step.assemble import make_metaops
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.step.lanes import lane_plans, lane_sizes, lane_waves, pack
from megatron_spindle.planner.step.validate import check_plan
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
