"""The path terms of the whole-step bound: each cost floor at or below what the simulator
charges, every random plan's pass and step at or above them, and a case where every plan must pay the sync
that the bound without them leaves out."""
import random

import numpy as np
import pytest

from megatron_spindle.planner.level.waves import Wave, WaveSlice
from megatron_spindle.planner.simulation.link_costs import allreduce_time_ms, boundary_time_ms
from megatron_spindle.planner.simulation.path_bound import PathTerms, allreduce_floor_ms, edge_ms
from megatron_spindle.planner.simulation.simulate import simulate
from megatron_spindle.planner.simulation.step_bound import plan_step_bound, step_bound
from megatron_spindle.planner.assembly.assemble import assemble_plan, make_metaops
from megatron_spindle.planner.assembly.dataflow import ACTIVATION_BYTES, island_messages, slice_layout
from megatron_spindle.planner.assembly.manual import plan_from_waves
from megatron_spindle.planner.assembly.validate import PlanError, check_plan
from megatron_spindle.planner.workload.cluster import Cluster
from megatron_spindle.planner.workload.curves import ScalingCurve, Segment
from megatron_spindle.planner.workload.graph import LayerConfig, Operator, TaskGraph
from megatron_spindle.planner.workload.metaops import contract
from megatron_spindle.planner.workload.workloads import build_graph
from test_step_bound import N, clusters, random_waves

SLOW = clusters()["slow"]


def test_an_edge_floor_is_at_or_below_its_messages():
    """Random producer and consumer layouts of the tiny workload's MetaOps: the edge's least time never
    exceeds the simulator's time of its forward or backward messages alone."""
    cl = Cluster(name="c", num_devices=8, gpus_per_node=4, intra_bandwidth_gbps=100.0, inter_bandwidth_gbps=10.0,
                 intra_latency_us=5.0, inter_latency_us=20.0)
    metaops = make_metaops(build_graph("multitask-clip", tasks=4, size="tiny", batch=8), cl)
    rng = random.Random(7)
    for _ in range(400):
        a, b = rng.choice(metaops), rng.choice(metaops)
        if a.batch != b.batch:
            continue
        ra = tuple(rng.sample(range(8), rng.choice(a.valid_counts(8))))
        rb = tuple(rng.sample(range(8), rng.choice(b.valid_counts(8))))
        bps = float(ACTIVATION_BYTES * a.out_elems_per_sample)
        la, lb = slice_layout(a, ra), slice_layout(b, rb)
        moved = set(ra) != set(rb)
        for src, s, dst, d, lsrc, ldst in ((a, ra, b, rb, la, lb), (b, rb, a, ra, lb, la)):
            floor = float(edge_ms(src, np.array([len(s)]), dst, np.array([len(d)]), bps, cl, moved=moved)[0])
            msgs = [(m.src, m.dst, m.bytes) for m in island_messages(lsrc, ldst, 4, bps)]
            assert floor <= boundary_time_ms(msgs, cl) * (1 + 1e-9) + 1e-12, (src.name, s, dst.name, d)


def test_an_allreduce_floor_is_at_or_below_every_ring_that_large():
    rng = random.Random(3)
    for cl in (SLOW, Cluster(name="p", num_devices=64, gpus_per_node=8, intra_bandwidth_gbps=160.0,
                             inter_bandwidth_gbps=40.0, intra_latency_us=8.0, inter_latency_us=20.0,
                             allreduce_latency_us=30.0)):
        for _ in range(300):
            h = rng.randint(1, cl.num_devices)
            ranks = rng.sample(range(cl.num_devices), rng.randint(h, cl.num_devices))
            nbytes = rng.choice([1e3, 4e6, 4e8])
            assert allreduce_floor_ms(np.array([h]), nbytes, cl)[0] <= allreduce_time_ms(ranks, nbytes, cl) * (1 + 1e-12)


@pytest.mark.parametrize("passes", [1, 2])
def test_every_random_plan_passes_at_or_above_the_path_terms(passes):
    """The least path (with transfers) under every random plan's pass, the sync-end bound under its step, on
    links slow enough that both bind."""
    graph = build_graph("multitask-clip", tasks=4, size="tiny", batch=8, passes=passes)
    metaops = make_metaops(graph, SLOW)
    rng = random.Random(11 + passes)
    terms = None
    for _ in range(80):
        plan = plan_from_waves(graph, N, random_waves(metaops, rng), cluster=SLOW, passes=passes, partial=True)
        check_plan(plan)
        if terms is None:
            terms = PathTerms(plan.metaops, dict(plan.curves), SLOW, passes)
            assert terms.path_ms > 0 and terms.sync_step_ms > 0
        sim = simulate(plan, SLOW, check_memory=False)
        assert terms.path_ms <= sim.pass_ms * (1 + 1e-9), (terms.path_ms, sim.pass_ms)
        assert terms.sync_step_ms <= sim.step_ms * (1 + 1e-9), (terms.sync_step_ms, sim.step_ms)


# -- a shared encoder that fits no single device: every plan pays its all-reduce --------------------------
def shared_plan(cluster, ranks_a, ranks_b, stash=5e9):
    """Two tasks sharing one encoder layer (``enc.0``, 100 M parameters), ``stash`` bytes a sample stashed
    (16 samples: 80 GB on one device, 40 GB on two); ``ranks_a``/``ranks_b``: each task's slice, one wave
    each."""
    cfg = LayerConfig(hidden=64, num_heads=4, ffn_hidden=256, seq_len=16)
    ops = [Operator(name=f"{t}.enc.0", task=t, module="enc", op_type="transformer_layer", batch=16, layer=cfg,
                    param_key="enc.0", inputs=(f"data:{t}:x",), fwd_flops=1e9, param_count=100_000_000,
                    out_elems_per_sample=1024, act_bytes_per_sample=stash) for t in ("a", "b")]
    graph = TaskGraph(model="toy", tasks=("a", "b"), operators=tuple(ops))
    metaops = contract(graph, memory_bytes=cluster.memory_gib * 2**30, max_tp=8)
    curves = {m.name: ScalingCurve(batch=16, segments=(Segment(0.0, 1e-9, 0.5),),
                                   counts=m.valid_counts(cluster.num_devices)) for m in metaops}
    waves, ranks, clock = [], {}, 0.0
    for wi, (m, r) in enumerate(zip(metaops, (ranks_a, ranks_b))):
        t = curves[m.name].time(len(r))
        waves.append(Wave(level=0, start_ms=clock, duration_ms=t, slices=[
            WaveSlice(metaop=m.name, layer_start=0, layers=1, devices=len(r), time_ms=t)]))
        ranks[(wi, 0)] = tuple(r)
        clock += t
    plan = assemble_plan(graph, cluster, metaops, curves, [], waves, ranks, system="hand")
    check_plan(plan)
    return plan, metaops, curves


def test_a_shared_layer_too_large_for_one_device_pays_its_sync():
    """16 devices, 80 GB each; a layer's stash needs two devices, so its weight's group spans at least two and
    every plan that fits memory all-reduces 400 MB after the layer's backward (the second task's use too). The bound counts it (the bound
    without memory does not: one device, no sync), and every such plan, side by side or one after the
    other, in one island or across, is at or above it."""
    cl = Cluster(name="toy", num_devices=16, gpus_per_node=8, intra_bandwidth_gbps=100.0, intra_latency_us=10.0,
                 inter_bandwidth_gbps=10.0, inter_latency_us=50.0)
    menu = [tuple(range(a, a + n)) for n in (2, 4, 8) for a in (0, 4, 8) if a % 8 + n <= 8]
    menu += [tuple(range(16)), (0, 8), (0, 1, 8, 9)]
    steps = []
    for ra in menu:
        for rb in menu:
            try:
                plan, metaops, curves = shared_plan(cl, ra, rb)
            except PlanError:  # both stashes on the same two devices: out of memory
                assert set(ra) & set(rb)
                continue
            steps.append(simulate(plan, cl).step_ms)  # fits memory: simulate checks it
    assert len(steps) > 60
    with pytest.raises(PlanError, match="rule 7"):
        shared_plan(cl, (0,), (1,))
    b = step_bound(metaops, curves, cl, 1)
    free = step_bound(metaops, curves, cl, 1, memory=False)
    assert b.bound_ms <= min(steps) * (1 + 1e-9), (b, min(steps))
    assert b.allreduce_ms > 0 and b.sync_step_ms == b.bound_ms
    assert b.bound_ms > 1.5 * b.compute_ms and b.bound_ms > free.bound_ms, (b, free)
    assert plan_step_bound(plan, cl) == b
