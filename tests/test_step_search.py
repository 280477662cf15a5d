"""Whole-step local search: never a longer step than its start, the same plan on every run,
valid plans, and a row where it shortens the step below every other candidate."""
import pytest

from megatron_spindle.planner.simulation.simulate import step_time_ms
from megatron_spindle.planner.assembly.assemble import make_metaops
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.step.lanes import lane_plans
from megatron_spindle.planner.step.step_search import follow_moves, moves, relocate, search
from megatron_spindle.planner.assembly.validate import check_plan
from megatron_spindle.planner.workload.analytic import build_curves
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.workload.workloads import build_graph


def _starts(model, k, n):
    graph, cluster = build_graph(model, tasks=k), load_cluster(None, num_devices=n)
    metaops = make_metaops(graph, cluster)
    curves = build_curves(metaops, n)
    own = make_plan(graph, cluster, search=False)
    return cluster, [p for _, p in lane_plans(own, graph, cluster, metaops, curves)]


@pytest.mark.parametrize("model,k,n", [("ofasys", 4, 16), ("ofasys", 7, 16), ("multitask-clip", 4, 16)])
def test_search_never_lengthens_its_start_and_is_deterministic(model, k, n):
    cluster, starts = _starts(model, k, n)
    assert starts
    for start in starts:
        before = step_time_ms(start, cluster)
        plan, ms, kept = search(start, cluster)
        assert ms <= before
        assert ms == step_time_ms(plan, cluster)  # the step it reports is the plan's
        assert (kept == 0) == (plan is start)
        check_plan(plan)
        again, ms2, kept2 = search(start, cluster)
        assert again.dumps() == plan.dumps() and ms2 == ms and kept2 == kept


def test_moves_keep_every_wave_on_distinct_devices_and_valid_counts():
    cluster, starts = _starts("ofasys", 4, 16)
    for start in starts:
        for change, order in moves(start, cluster):
            for (wi, si), ranks in change.items():
                s = start.waves[wi].slices[si]
                assert order is not None or set(s.ranks) < set(ranks)  # a widening move only adds devices
            check_plan(relocate(start, change, order))  # rules 1-11: distinct devices per wave, counts, data flow


def test_a_follow_move_makes_its_edge_a_local_copy():
    """A slice with one input fed from other devices takes its producer's devices (free in its wave): the edge's
    forward messages all become local copies, and the plan keeps every rule."""
    graph, cluster = build_graph("multitask-clip", tasks=10), load_cluster(None, num_devices=32)
    plan = make_plan(graph, cluster, passes=2, search=False)
    changes = follow_moves(plan)
    assert changes
    slice_at = {(w.index, i): s for w in plan.waves for i, s in enumerate(w.slices)}
    for change in changes:
        moved = relocate(plan, change)
        check_plan(moved)
        for (wi, si), ranks in change.items():
            name = slice_at[(wi, si)].name.replace(f"x{len(slice_at[(wi, si)].ranks)}", f"x{len(ranks)}")
            edge = next(t for t in moved.transfers if t.dst == name)
            assert all(m.local for m in edge.forward), edge


def test_relocate_without_changes_is_the_same_step():
    cluster, (start, *_) = _starts("ofasys", 4, 16)
    same = relocate(start, {})
    assert same.transfers == start.transfers and same.param_groups == start.param_groups
    assert step_time_ms(same, cluster) == pytest.approx(step_time_ms(start, cluster), rel=1e-12)


def test_the_search_wins_a_row_no_other_candidate_could():
    # OFASys-4 on 16 devices: the task lanes leave the lightest task's block idle while the heaviest runs; the
    # search lends it to the heaviest task's later MetaOps and the step drops below every other candidate
    report: dict = {}
    plan = make_plan(build_graph("ofasys", tasks=4), load_cluster(None, num_devices=16), report=report)
    assert report["winner"].endswith("step search") and report["own_name"] == report["winner"]
    best_other = min(c["step_ms"] for c in report["candidates"] if "step search" not in c["name"] and c["fits"])
    assert step_time_ms(plan, load_cluster(None, num_devices=16)) < best_other * (1 - 1e-9)
    assert plan.system == "spindle" and all(lv.variant.endswith("step search") for lv in plan.levels)


def test_gather_moves_put_a_weight_on_one_two_or_four_islands_alike():
    # OFASys-4 on 64 devices under task-level's schedule: every embedding table is held on every node; a gather
    # onto k islands (the same devices in each) splits its outputs' transfer over k NICs
    from megatron_spindle.planner.simulation.simulate import simulate
    from megatron_spindle.planner.step.build import plan_system
    from megatron_spindle.planner.step.step_search import ISLANDS, gather_moves
    cluster = load_cluster(None, num_devices=64)
    start = plan_system("task-level", build_graph("ofasys", tasks=4), cluster)
    g = cluster.gpus_per_node
    seen = set()
    for change, order in gather_moves(start, cluster, simulate(start, cluster).pass_ms):
        for ranks in change.values():
            per = {}
            for r in ranks:
                per[r // g] = per.get(r // g, 0) + 1
            assert len(set(per.values())) == 1  # as many devices in each island
            seen.add(len(per))
        if change:
            check_plan(relocate(start, change, order))
    assert seen == set(ISLANDS) == {1, 2, 4}


def test_the_tasks_whose_buckets_start_the_sync_floor_are_critical():
    # OFASys-4 on 64 devices under task-level's schedule: the shared weights' rings decide the step; the task
    # that completes the bucket starting the busiest device's (or NIC's) all-reduces is widened as well as the
    # one completing the bucket that ends last
    from megatron_spindle.planner.simulation.link_costs import sync_floor
    from megatron_spindle.planner.simulation.simulate import simulate
    from megatron_spindle.planner.step.build import plan_system
    from megatron_spindle.planner.step.step_search import _sync_critical, _uses
    cluster = load_cluster(None, num_devices=64)
    start = plan_system("task-level", build_graph("ofasys", tasks=4), cluster)
    sim = simulate(start, cluster)
    assert sim.breakdown.sync_ms > 0
    floor = sync_floor(((c.ranks, c.bytes, c.ready_ms) for c in sim.collectives), cluster)
    first = [c for c in sim.collectives if c.ready_ms == floor.from_ms and _uses(c, floor.resource, cluster)]
    assert first and all(c.wave is not None for c in first)
    task = {m.name: m.task for m in start.metaops}
    starters = {task[s.metaop] for c in first for s in start.waves[c.wave].slices if set(s.ranks) & set(c.ranks)}
    critical = _sync_critical(start, cluster)
    assert critical and set(critical) & starters and len(critical) == len(set(critical))


def test_without_an_exposed_sync_the_critical_task_is_the_one_that_finishes_last(monkeypatch):
    from megatron_spindle.planner.simulation.timeline import dataflow_pass
    from megatron_spindle.planner.step import step_search
    cluster, (start, *_) = _starts("ofasys", 4, 16)
    monkeypatch.setattr(step_search, "_sync_critical", lambda plan, cluster: [])
    curves = dict(start.curves)
    _, done = dataflow_pass(start, cluster, {s.name: s.num_layers * curves[s.metaop].time(len(s.ranks))
                                             for s in start.slices()})
    last = max(done.values())
    tasks = {m.task for m in start.metaops for s in start.slices() if s.metaop == m.name and done[s.name] == last}
    assert len(tasks) == 1 and step_search.critical_tasks(start, cluster) == sorted(tasks)
