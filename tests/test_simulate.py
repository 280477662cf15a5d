"""The step simulator on hand-computed cases, and the cluster model it reads."""
import json
import math

import dataclasses

import pytest

from megatron_spindle.planner.assembly.assemble import assemble_plan
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.workload.cluster import PRESETS, Cluster, load_cluster
from megatron_spindle.planner.workload.curves import ScalingCurve, Segment
from megatron_spindle.planner.workload.graph import LayerConfig, Operator, TaskGraph
from megatron_spindle.planner.workload.metaops import contract
from megatron_spindle.planner.workload.recompute import FORWARD_SHARE
from megatron_spindle.planner.simulation.simulate import GRAD_BYTES_PER_PARAM, SimulationError, simulate, step_time_ms
from megatron_spindle.planner.simulation.link_costs import allreduce_time_ms, boundary_time_ms, sync_time_ms
from megatron_spindle.planner.simulation.link_costs import schedule_collectives, sync_floor
from megatron_spindle.planner.assembly.validate import check_plan
from megatron_spindle.planner.level.waves import Wave, WaveSlice
from megatron_spindle.planner.workload.workloads import build_graph

# Round numbers so every expectation below is mental arithmetic: 100 GB/s and 10 µs inside an island,
# 10 GB/s per node and 50 µs between islands.
INTRA_GBPS, INTRA_US, INTER_GBPS, INTER_US = 100.0, 10.0, 10.0, 50.0


def toy_cluster(n=16, **kw):
    return Cluster(name="toy", num_devices=n, gpus_per_node=8, intra_bandwidth_gbps=INTRA_GBPS,
                   intra_latency_us=INTRA_US, inter_bandwidth_gbps=INTER_GBPS, inter_latency_us=INTER_US, **kw)


# -- cost primitives ----------------------------------------------------------------------------------
def test_transfer_inside_an_island():
    c = toy_cluster()
    # 1 GB at 100 GB/s = 10 ms, plus one latency
    assert boundary_time_ms([(0, 1, 1e9)], c) == pytest.approx(10.0 + 0.010)
    # two disjoint pairs run at once; two senders into one receiver share its link
    assert boundary_time_ms([(0, 1, 1e9), (2, 3, 1e9)], c) == pytest.approx(10.010)
    assert boundary_time_ms([(0, 1, 1e9), (2, 1, 1e9)], c) == pytest.approx(20.010)
    # one sender to two receivers shares the sender's link the same way
    assert boundary_time_ms([(0, 1, 1e9), (0, 2, 1e9)], c) == pytest.approx(20.010)


def test_transfer_across_islands_and_local_copies():
    c = toy_cluster()
    assert boundary_time_ms([(0, 8, 1e9)], c) == pytest.approx(100.0 + 0.050)
    # two devices of one node share the node's NIC
    assert boundary_time_ms([(0, 8, 1e9), (1, 9, 1e9)], c) == pytest.approx(200.050)
    # different nodes do not
    c32 = toy_cluster(32)
    assert boundary_time_ms([(0, 8, 1e9), (16, 24, 1e9)], c32) == pytest.approx(100.050)
    # data that stays on its device is free; a boundary with an intra and a cross flow takes the slower
    assert boundary_time_ms([(3, 3, 1e12)], c) == 0.0
    assert boundary_time_ms([(0, 1, 1e9), (2, 9, 1e9)], c) == pytest.approx(100.050)


def test_allreduce_ring_inside_and_across_islands():
    c = toy_cluster()
    # two devices: 2(n-1) = 2 latencies, 2(n-1)/n = 1 × the bytes
    assert allreduce_time_ms((0, 1), 1e9, c) == pytest.approx(2 * 0.010 + 10.0)
    # four devices in one island: 6 latencies, 1.5 × the bytes
    assert allreduce_time_ms((0, 1, 2, 3), 1e9, c) == pytest.approx(6 * 0.010 + 15.0)
    # the same four spread over two islands: the NIC is the bottleneck; of the 6 steps 2 cross islands
    # (NCCL's 2(nodes-1)) and 4 stay inside one
    assert allreduce_time_ms((0, 1, 8, 9), 1e9, c) == pytest.approx(2 * 0.050 + 4 * 0.010 + 150.0)
    # one device on each of four islands: every step crosses
    c32 = toy_cluster(32)
    assert allreduce_time_ms((0, 8, 16, 24), 1e9, c32) == pytest.approx(6 * 0.050 + 150.0)
    assert allreduce_time_ms((5,), 1e9, c) == 0.0


def test_sync_serializes_on_shared_devices_and_nics():
    c = toy_cluster()
    a, b = ((0, 1), 1e9), ((2, 3), 1e9)
    assert sync_time_ms([a, b], c) == pytest.approx(10.020)                 # disjoint: concurrent
    assert sync_time_ms([a, ((1, 2), 1e9)], c) == pytest.approx(20.040)     # device 1 in both: serial
    # two cross-island groups on different devices of the same two nodes share both NICs
    x, y = ((0, 8), 1e9), ((1, 9), 1e9)
    assert sync_time_ms([x], c) == pytest.approx(100.100)
    # y waits for x's bytes to leave the NICs (100 ms), then takes its own 100.1 ms
    assert sync_time_ms([x, y], c) == pytest.approx(200.100)


def test_sync_floor_names_the_busiest_device_or_nic_and_no_schedule_ends_before_it():
    c = toy_cluster()
    # device 1 holds two 10 ms all-reduces, ready at 0 and 5: it is busy until 20.040 at least
    f = sync_floor([((0, 1), 1e9, 0.0), ((1, 2), 1e9, 5.0)], c)
    assert (f.resource, f.from_ms) == ("device 1", 0.0) and f.busy_ms == pytest.approx(20.040)
    # a late bucket alone can set the floor: ready at 50, 10 ms -> 60.02 beats the pair from 0
    f = sync_floor([((0, 1), 1e9, 0.0), ((1, 2), 1e9, 5.0), ((4, 5), 1e9, 50.0)], c)
    assert (f.resource, f.from_ms) == ("device 4", 50.0) and f.end_ms == pytest.approx(60.020)
    # two cross-island groups on disjoint devices of the same nodes: the NICs carry both (100 ms each)
    f = sync_floor([((0, 8), 1e9, 0.0), ((1, 9), 1e9, 0.0)], c)
    assert f.resource == "node 0 NIC" and f.end_ms == pytest.approx(200.0)
    assert sync_floor([((3,), 1e9, 0.0)], c) is None
    # on mixed groups and ready times the floor never exceeds what the simulator's schedule takes
    groups = [((0, 1), 4e8), ((1, 8, 9), 2e8), ((8, 9), 6e8), ((2, 10), 1e8), ((0, 8), 3e8), ((3, 4, 5), 5e8)]
    for shift in range(6):
        colls = [(r, b, 7.0 * ((i + shift) % 6)) for i, (r, b) in enumerate(groups)]
        colls.sort(key=lambda x: x[2])
        end = max(e for _, e in schedule_collectives(colls, c))
        assert sync_floor(colls, c).end_ms <= end + 1e-9


# -- plans built by hand --------------------------------------------------------------------------------
BATCH, HIDDEN, SEQ, PARAMS = 8, 64, 16, 1000


def toy_graph(layers=2, params=PARAMS, unweighted=()):
    """``layers`` transformer layers of ``params`` parameters each, but those in ``unweighted`` (no weight)."""
    cfg = LayerConfig(hidden=HIDDEN, num_heads=4, ffn_hidden=4 * HIDDEN, seq_len=SEQ)
    ops, prev = [], ("data:t:x",)
    for i in range(layers):
        bare = i in unweighted
        ops.append(Operator(name=f"t.enc.{i}", task="t", module="enc", op_type="transformer_layer",
                            batch=BATCH, layer=cfg, param_key="" if bare else f"enc.layers.{i}", inputs=prev,
                            fwd_flops=1e9, param_count=0 if bare else params, out_elems_per_sample=SEQ * HIDDEN,
                            act_bytes_per_sample=1000.0))
        prev = (ops[-1].name,)
    return TaskGraph(model="toy", tasks=("t",), operators=tuple(ops))


def hand_plan(cluster, slices, params=PARAMS, unweighted=()):
    """``slices``: per wave one ``(layer_start, layers, ranks)``; one layer takes T(n) = 8/n ms."""
    graph = toy_graph(sum(s[1] for s in slices), params, unweighted)
    (m,) = contract(graph, memory_bytes=cluster.memory_gib * 2**30, max_tp=8)
    curve = ScalingCurve(batch=BATCH, segments=(Segment(0.0, 1e-9, 1.0),), counts=m.valid_counts(cluster.num_devices))
    waves, ranks, clock = [], {}, 0.0
    for wi, (start, layers, r) in enumerate(slices):
        t = layers * curve.time(len(r))
        waves.append(Wave(level=1, start_ms=clock, duration_ms=t,
                          slices=[WaveSlice(metaop=m.name, layer_start=start, layers=layers, devices=len(r), time_ms=t)]))
        ranks[(wi, 0)] = tuple(r)
        clock += t
    plan = assemble_plan(graph, cluster, [m], {m.name: curve}, [], waves, ranks, system="hand")
    check_plan(plan)
    return plan


def test_one_wave():
    c = toy_cluster(8)
    sim = simulate(hand_plan(c, [(0, 1, (0, 1, 2, 3))]), c)
    # one layer on 4 devices: 8/4 = 2 ms; the other 4 devices idle; no transfer; one all-reduce over 0-3
    sync = 6 * 0.010 + 1.5 * PARAMS * GRAD_BYTES_PER_PARAM / (INTRA_GBPS * 1e9) * 1e3
    assert sim.makespan_ms == pytest.approx(2.0)
    assert sim.breakdown.compute_ms == pytest.approx(1.0)
    assert sim.breakdown.idle_ms == pytest.approx(1.0)
    assert sim.breakdown.transfer_ms == 0.0
    assert sim.breakdown.sync_ms == pytest.approx(sync)
    assert sim.step_ms == pytest.approx(2.0 + sync)
    assert sim.breakdown.total_ms == pytest.approx(sim.step_ms)
    assert FORWARD_SHARE == pytest.approx(1 / 3)


def test_transfer_between_waves_inside_and_across_islands():
    per_device = (BATCH // 2) * SEQ * HIDDEN * 2  # bf16 activations of one replica (4 samples)
    # layer 0 on devices 0,1 then layer 1 on 2,3: each destination receives one replica over NVLink
    c = toy_cluster(16)
    sim = simulate(hand_plan(c, [(0, 1, (0, 1)), (1, 1, (2, 3))]), c)
    hop = per_device / (INTRA_GBPS * 1e9) * 1e3 + INTRA_US * 1e-3
    assert sim.waves[1].transfer_fwd_ms == pytest.approx(hop)
    assert sim.waves[1].transfer_bwd_ms == pytest.approx(hop)
    assert sim.breakdown.transfer_ms == pytest.approx(2 * hop)
    assert sim.waves[1].moved_bytes == pytest.approx(2 * per_device)
    # the same move onto devices 8,9 crosses islands: both replicas share node 0's NIC
    sim = simulate(hand_plan(c, [(0, 1, (0, 1)), (1, 1, (8, 9))]), c)
    cross = 2 * per_device / (INTER_GBPS * 1e9) * 1e3 + INTER_US * 1e-3
    assert sim.waves[1].transfer_fwd_ms == pytest.approx(cross)
    assert sim.waves[1].cross_island_bytes == pytest.approx(2 * per_device)
    # gradients of layer 0 on 0,1 and layer 1 on 8,9: two groups, each inside its island, concurrent
    ar = 2 * 0.010 + PARAMS * GRAD_BYTES_PER_PARAM / (INTRA_GBPS * 1e9) * 1e3
    assert sim.breakdown.sync_ms == pytest.approx(ar)
    # staying on the same devices is a local copy: free; one rank set, and megatron.core DDP packs both
    # layers' 1000 parameters into one bucket (at least 40 M parameters each), complete after wave 0's backward
    sim = simulate(hand_plan(c, [(0, 1, (0, 1)), (1, 1, (0, 1))]), c)
    assert sim.breakdown.transfer_ms == 0.0
    assert [(col.wave, col.bytes) for col in sim.collectives] == [(0, 2 * PARAMS * GRAD_BYTES_PER_PARAM)]
    # with buckets of 1000 parameters, one bucket per layer, in the order the backward completes them
    sim = simulate(hand_plan(c, [(0, 1, (0, 1)), (1, 1, (0, 1))]), c, bucket_size=PARAMS)
    assert [(col.wave, col.bytes) for col in sim.collectives] == [(1, PARAMS * GRAD_BYTES_PER_PARAM),
                                                                  (0, PARAMS * GRAD_BYTES_PER_PARAM)]


# -- overlapped sync and accumulation: the module docstring's worked example ------------------------------
BIG = 100_000_000  # parameters per layer: 400 MB of fp32 gradients, one all-reduce over 2 devices = 4.02 ms


def test_sync_overlaps_the_remaining_backward():
    c = toy_cluster(16)
    plan = hand_plan(c, [(0, 1, (0, 1)), (1, 1, (0, 1))], params=BIG)
    sim = simulate(plan, c, check_memory=False)
    # one layer on 2 devices: 4 ms; forward 0 -> 8/3, backward of wave 1 8/3 -> 16/3, of wave 0 16/3 -> 8
    assert sim.pass_ms == pytest.approx(8.0)
    l1, l0 = sim.collectives
    assert (l1.wave, l1.ready_ms, l1.start_ms, l1.end_ms) == (1, pytest.approx(16 / 3), pytest.approx(16 / 3),
                                                              pytest.approx(16 / 3 + 4.02))
    # layer 0's bucket is ready at 8 but devices 0-1 are busy with layer 1's until 9.353
    assert (l0.wave, l0.ready_ms, l0.start_ms, l0.end_ms) == (0, pytest.approx(8.0), pytest.approx(16 / 3 + 4.02),
                                                              pytest.approx(16 / 3 + 8.04))
    assert sim.breakdown.sync_ms == pytest.approx(16 / 3 + 8.04 - 8.0)           # 5.373 exposed
    assert sim.sync_standalone_ms == pytest.approx(8.04)
    assert sim.step_ms == pytest.approx(8.0 + 16 / 3 + 8.04 - 8.0)
    assert sim.breakdown.total_ms == pytest.approx(sim.step_ms)
    # posted after the backward (the old hand-written sync): both buckets after t = 8
    old = simulate(plan, c, check_memory=False, overlap_sync=False)
    assert old.breakdown.sync_ms == pytest.approx(8.04)
    assert old.step_ms == pytest.approx(16.04)
    # bf16 gradients: 2.02 ms each; layer 1's is done (7.353) before layer 0's is ready (8)
    bf16 = simulate(plan, c, check_memory=False, grad_bytes=2)
    assert [col.end_ms for col in bf16.collectives] == [pytest.approx(16 / 3 + 2.02), pytest.approx(10.02)]
    assert bf16.breakdown.sync_ms == pytest.approx(2.02)


def test_a_slices_layers_complete_one_by_one_in_its_backward():
    c = toy_cluster(16)
    plan = hand_plan(c, [(0, 2, (0, 1))], params=BIG)  # one slice of two layers on 2 devices: 8 ms
    sim = simulate(plan, c, check_memory=False)
    # forward 0 -> 8/3; backward 8/3 -> 8, layer 1 first (done at 8/3 + 8/3 = 16/3), then layer 0 (at 8)
    assert sim.pass_ms == pytest.approx(8.0)
    l1, l0 = sim.collectives
    assert (l1.ready_ms, l1.start_ms, l1.end_ms) == (pytest.approx(16 / 3), pytest.approx(16 / 3),
                                                     pytest.approx(16 / 3 + 4.02))
    assert (l0.ready_ms, l0.start_ms) == (pytest.approx(8.0), pytest.approx(16 / 3 + 4.02))
    assert sim.breakdown.sync_ms == pytest.approx(16 / 3 + 8.04 - 8.0)  # as with the layers in two waves


def test_a_slices_last_layer_completes_first_and_its_first_layer_last():
    # the bare layers (no weight) leave one all-reduce per weighted layer, which says when that layer completed
    c = toy_cluster(16)

    def ready(slices):
        plan = hand_plan(c, slices, params=BIG, unweighted=(1,))
        return [x.ready_ms for x in simulate(plan, c, check_memory=False).collectives]

    # layers 0-1 on 2 devices, backward 8/3 -> 8: layer 1's backward first, layer 0's last (done at 8)
    assert ready([(0, 2, (0, 1))]) == [pytest.approx(8.0)]
    # layer 0, then layers 1-2 in a second wave: backward of layers 2, 1 from 4 to 28/3 (layer 2 done at 20/3),
    # then layer 0's to 12
    assert ready([(0, 1, (0, 1)), (1, 2, (0, 1))]) == [pytest.approx(20 / 3), pytest.approx(12.0)]


def test_sync_on_disjoint_devices_runs_side_by_side():
    c = toy_cluster(16)
    sim = simulate(hand_plan(c, [(0, 1, (0, 1)), (1, 1, (2, 3))], params=BIG), c, check_memory=False)
    hop = sim.waves[1].transfer_fwd_ms
    assert hop > 0
    assert sim.pass_ms == pytest.approx(8.0 + 2 * hop)
    l1, l0 = sim.collectives
    assert l1.ranks == (2, 3) and l1.end_ms == pytest.approx(hop + 16 / 3 + 4.02)
    assert l0.ranks == (0, 1) and l0.start_ms == pytest.approx(8.0 + 2 * hop)
    assert sim.breakdown.sync_ms == pytest.approx(4.02)


def test_phases_run_forward_then_backward_each():
    """Two independent slices on one device in two phases: forward A, backward A, forward B, backward B (A's
    gradients are complete after A's own forward and backward instead of at the end of the pass); the pass is
    as long, and the device holds one phase's activations at a time."""
    from megatron_spindle.planner.assembly.manual import plan_from_waves
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=8)
    waves = [[("vision-text.vision.embed", 0, 1, (0,))], [("audio-text.audio.embed", 0, 1, (0,))]]
    c = load_cluster(None, num_devices=2, gpus_per_node=2)
    together = plan_from_waves(g, 2, waves, partial=True, cluster=c)
    apart = plan_from_waves(g, 2, waves, partial=True, phases=[0, 1], cluster=c)
    a, b = (simulate(p, c, check_memory=False, bucket_size=1) for p in (together, apart))  # a bucket per weight
    t0, t1 = (s.time_ms for w in together.waves for s in w.slices)
    assert a.pass_ms == pytest.approx(b.pass_ms) == pytest.approx(t0 + t1)
    ready = {col.wave: col.ready_ms for col in b.collectives}
    assert ready[0] == pytest.approx(t0) and ready[1] == pytest.approx(t0 + t1)
    assert {col.wave: col.ready_ms for col in a.collectives}[0] == pytest.approx(t0 + t1)
    assert apart.device_memory_bytes[0] < together.device_memory_bytes[0]


def test_lanes_on_disjoint_devices_run_at_their_own_pace():
    """No barrier at a wave's end: a chain of short slices on devices 0-1 and one long slice on 2-3 share the
    waves' timeline only where data moves, so the pass is the longer lane, not the sum of wave maxima."""
    c = toy_cluster(16)
    plan = hand_plan(c, [(0, 1, (0, 1)), (1, 1, (0, 1))])
    sim = simulate(plan, c, check_memory=False)
    assert sim.pass_ms == pytest.approx(sim.makespan_ms)  # one lane: the wave sum


def test_gradient_accumulation_syncs_once():
    c = toy_cluster(16)
    plan = hand_plan(c, [(0, 1, (0, 1)), (1, 1, (0, 1))], params=BIG)
    one = simulate(plan, c, check_memory=False)
    four = simulate(plan, c, check_memory=False, passes=4)
    assert four.step_ms == pytest.approx(4 * 8.0 + 16 / 3 + 8.04 - 8.0)      # 37.373
    assert four.breakdown.sync_ms == pytest.approx(one.breakdown.sync_ms)
    assert four.breakdown.compute_ms == pytest.approx(4 * one.breakdown.compute_ms)
    assert four.breakdown.idle_ms == pytest.approx(4 * one.breakdown.idle_ms)
    assert four.breakdown.total_ms == pytest.approx(four.step_ms)
    assert four.to_json()["passes"] == 4
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="passes"):
            simulate(plan, c, check_memory=False, passes=bad)
    with pytest.raises(ValueError, match="grad_bytes"):
        simulate(plan, c, check_memory=False, grad_bytes=3)
    assert step_time_ms(plan, c, passes=4) == four.step_ms
    with pytest.raises(ValueError, match="passes"):
        step_time_ms(plan, c, passes=0)


def test_step_time_is_the_simulated_step():
    """The whole-step choice's shortcut (no breakdown) gives the simulator's step, bit for bit, on every
    system's plan at two sizes and with gradient accumulation."""
    from megatron_spindle.planner.step.build import plan_system
    for gpus in (8, 64):
        c = load_cluster(None, num_devices=gpus)
        g = build_graph("multitask-clip", tasks=4)
        for system in ("spindle", "sequential", "task-level", "intra-task"):
            plan = plan_system(system, g, c, validate=False)
            for passes in (1, 3):
                assert step_time_ms(plan, c, passes=passes) == simulate(plan, c, check_memory=False,
                                                                         passes=passes).step_ms


def test_step_adds_up_on_a_real_plan():
    c = load_cluster(None, num_devices=8)
    sim = simulate(make_plan(build_graph("multitask-clip", tasks=4, size="tiny"), c), c)
    b = sim.breakdown
    assert sim.step_ms == pytest.approx(sim.makespan_ms + b.transfer_ms + b.sync_ms)
    assert b.sync_ms <= sim.sync_standalone_ms + 1e-9
    assert all(col.start_ms >= col.ready_ms - 1e-9 for col in sim.collectives)
    assert b.total_ms == pytest.approx(sim.step_ms)
    assert sum(b.shares().values()) == pytest.approx(1.0)
    assert min(b.compute_ms, b.idle_ms, b.transfer_ms, b.sync_ms) >= 0
    assert sim.makespan_ms >= sim.lower_bound_ms * (1 - 1e-9)
    assert len(sim.peak_memory_bytes) == 8
    json.dumps(sim.to_json())


# -- bad input ----------------------------------------------------------------------------------------
def test_plan_that_does_not_fit_the_cluster():
    plan = hand_plan(toy_cluster(16), [(0, 1, (0, 1, 2, 3, 8, 9, 10, 11))])
    with pytest.raises(SimulationError, match="uses 16 devices but cluster 'toy' has 8"):
        simulate(plan, toy_cluster(8))
    other = Cluster(name="fours", num_devices=16, gpus_per_node=4)
    with pytest.raises(SimulationError, match="islands of 8 devices but cluster 'fours' has 4 per island"):
        simulate(plan, other)


def test_memory_over_the_limit():
    plan = hand_plan(toy_cluster(8), [(0, 1, (0, 1))])
    tiny = toy_cluster(8, memory_gib=1e-6)
    # the two devices the plan uses, and the six idle ones: every rank holds the world's NCCL communicator
    with pytest.raises(SimulationError, match="out of memory on 8 device"):
        simulate(plan, tiny)
    assert simulate(plan, tiny, check_memory=False).step_ms > 0


def test_presets_and_cluster_files(tmp_path):
    a800 = load_cluster("a800-8x8", num_devices=16)
    assert (a800.island(a800.num_devices - 1) + 1, a800.intra_bandwidth_gbps,
            a800.inter_bandwidth_gbps) == (2, 160.0, 40.0)
    assert load_cluster("h200", num_devices=32).memory_gib == 141.0
    assert set(PRESETS) == {"a800-8x8", "a100", "h100", "h200"}
    a100, h100 = load_cluster("a100", num_devices=8), load_cluster("h100", num_devices=8)
    assert (a100.intra_bandwidth_gbps, a100.peak_tflops, a100.memory_gib) == (240.0, 312.0, 80.0)
    assert (h100.intra_bandwidth_gbps, h100.peak_tflops, h100.memory_gib) == (360.0, 989.0, 80.0)
    with pytest.raises(ValueError, match="unknown cluster preset 'b200'"):
        load_cluster("b200", num_devices=8)
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"preset": "h200", "inter_bandwidth_gbps": 100}))
    c = load_cluster(str(f), num_devices=16)
    assert (c.inter_bandwidth_gbps, c.peak_tflops, c.name) == (100, 989.0, str(f))
    f.write_text(json.dumps({"nvlink": 1}))
    with pytest.raises(ValueError, match=r"unknown cluster field\(s\) \['nvlink'\]"):
        load_cluster(str(f), num_devices=8)
    f.write_text(json.dumps({"intra_bandwidth_gbps": -1}))
    with pytest.raises(ValueError, match="intra_bandwidth_gbps=-1 must be a positive number"):
        load_cluster(str(f), num_devices=8)
    with pytest.raises(ValueError, match="does not exist"):
        load_cluster(str(tmp_path / "missing.json"), num_devices=8)
    assert math.isinf(a800.link(3, 3)[0]) and a800.link(0, 9) == (40.0, 20.0)


#: Two devices on a slow link (transfers take milliseconds), for the posting tests below.
SLOW = dict(name="slow", num_devices=2, gpus_per_node=2, intra_bandwidth_gbps=0.01, intra_latency_us=10.0,
            inter_bandwidth_gbps=0.01, inter_latency_us=10.0)
V, T = "vision-text.vision", "vision-text.text"


def _two_rank_plan(waves):
    """Tiny one-task Multitask-CLIP on 2 ranks, ``waves`` as :func:`plan_from_waves` takes them, embeddings first."""
    from megatron_spindle.planner.assembly.manual import plan_from_waves
    g = build_graph("multitask-clip", tasks=1, size="tiny")
    return plan_from_waves(g, 2, [[(f"{V}.embed", 0, 1, (0,)), (f"{T}.embed", 0, 1, (1,))]] + waves)


def _swapped_heads():
    """``(plan, slow cluster, slice ms, (vision layers, text layers, vision head, text head))``: the vision
    layers on rank 0 (1 ms), the text layers on rank 1 (100 ms), then each head on the other rank."""
    plan = _two_rank_plan([
        [(f"{V}.layers", 0, 4, (0,)), (f"{T}.layers", 0, 4, (1,))],
        [(f"{V}.head", 0, 1, (1,)), (f"{T}.head", 0, 1, (0,))],
        [("vision-text.loss", 0, 1, (0,))]])
    ms = {s.name: 1.0 for s in plan.slices()}
    names = tuple(next(s.name for s in plan.slices() if s.metaop == m)
                  for m in (f"{V}.layers", f"{T}.layers", f"{V}.head", f"{T}.head"))
    ms[names[1]] = 100.0
    return plan, Cluster(**SLOW), ms, names


def test_producer_posted_transfers_travel_while_the_receiver_computes():
    """Rank 0 runs the vision encoder's layers (short), rank 1 the text encoder's (long), in one wave; the next
    wave swaps them (vision's head on rank 1, text's on rank 0). Posted at the producer's end (the default), the
    vision activations travel while rank 1 still computes text: its head starts when rank 1 is free, nothing
    exposed. Posted at the consumer's wave boundary, they leave only once rank 1 has reached the boundary, and
    the whole transfer is exposed. Text's head waits for its input in both (its producer ends last)."""
    from megatron_spindle.planner.simulation.timeline import dataflow_pass

    plan, cluster, ms, (vl, tl, vh, th) = _swapped_heads()
    moved = lambda src: [(m.src, m.dst, m.bytes) for t in plan.transfers if t.src == src  # noqa: E731
                         for m in t.forward if not m.local]
    cost_v, cost_t = boundary_time_ms(moved(vl), cluster), boundary_time_ms(moved(tl), cluster)
    assert 1.0 < cost_v < 100 * FORWARD_SHARE - 1.0 and cost_t > 1.0
    spans = {}
    dataflow_pass(plan, cluster, ms, spans=spans)
    assert spans[(vh, "fwd")][0] == pytest.approx(spans[(tl, "fwd")][1])  # arrived during text's layers
    assert spans[(th, "fwd")][0] == pytest.approx(spans[(tl, "fwd")][1] + cost_t)
    boundary = dataclasses.replace(plan, transfer_posting="boundary")
    late = {}
    pass_late, _ = dataflow_pass(boundary, cluster, ms, spans=late)
    both = boundary_time_ms(moved(vl) + moved(tl), cluster)
    assert late[(vh, "fwd")][0] == pytest.approx(late[(tl, "fwd")][1] + both)
    assert dataflow_pass(plan, cluster, ms)[0] <= pass_late


def test_best_posting_keeps_the_shorter_step_and_the_summary_names_it():
    """Every candidate is timed under both transfer postings, producer posting also in sending order, and keeps
    the shortest (the plan's own on a tie); the plan's summary says which posting the runtime will run."""
    from megatron_spindle.planner.assembly.dataflow import sending_order
    from megatron_spindle.planner.assembly.render import summary
    from megatron_spindle.planner.simulation.simulate import best_posting, step_time_ms
    from megatron_spindle.planner.tuning.tune import Workload
    cluster = load_cluster(None, num_devices=8)
    plan = make_plan(Workload(model="multitask-clip", tasks=4, size="tiny").graph(1), cluster, placement="sequential")
    assert plan.transfers and any(not m.local for t in plan.transfers for m in t.forward)
    steps = {p: step_time_ms(dataclasses.replace(plan, transfer_posting=p), cluster) for p in ("producer", "boundary")}
    steps["sending order"] = step_time_ms(sending_order(dataclasses.replace(plan, transfer_posting="producer")),
                                          cluster)
    for start in ("producer", "boundary"):
        got, ms = best_posting(dataclasses.replace(plan, transfer_posting=start), cluster)
        assert ms == min(steps.values()) and step_time_ms(got, cluster) == ms
        if len(set(steps.values())) == 1:
            assert got.transfer_posting == start
    assert "posted as each producer ends" in summary(dataclasses.replace(plan, transfer_posting="producer"))
    assert "posted at each consumer's wave" in summary(dataclasses.replace(plan, transfer_posting="boundary"))


def test_make_plan_takes_only_the_postings_it_is_given():
    """``postings=("boundary",)`` is the paper's runtime: every candidate is timed with transfers posted at the
    consumer's wave, and the plan says so (the naive placement too); the default, the shorter of both per
    candidate, is not slower here."""
    from megatron_spindle.planner.simulation.simulate import step_time_ms
    from megatron_spindle.planner.tuning.tune import Workload
    cluster = load_cluster(None, num_devices=8)
    graph = Workload(model="multitask-clip", tasks=4, size="tiny").graph(1)
    wave = make_plan(graph, cluster, postings=("boundary",))
    naive = make_plan(graph, cluster, placement="sequential", postings=("boundary",))
    assert wave.transfer_posting == naive.transfer_posting == "boundary"
    both = make_plan(graph, cluster)
    assert step_time_ms(both, cluster) <= step_time_ms(wave, cluster) * (1 + 1e-9)


def test_a_receiver_posts_before_its_own_work_when_the_sender_comes_first_in_the_wave():
    """Every rank walks a wave's posting points in slice order. Rank 1 runs the text encoder (long) in the wave
    where rank 0 runs the vision encoder's first half, whose continuation runs next on rank 1. Text listed
    first, rank 1 reaches the vision point only after its own slice, so the activations leave then and the
    transfer is exposed; in sending order (the slice sending the most bytes away first) rank 1 posts its
    receive first and the activations travel while it computes."""
    from megatron_spindle.planner.assembly.dataflow import sending_order
    from megatron_spindle.planner.simulation.simulate import best_posting
    from megatron_spindle.planner.simulation.timeline import dataflow_pass

    plan = _two_rank_plan([
        [(f"{T}.layers", 0, 4, (1,)), (f"{V}.layers", 0, 2, (0,))],
        [(f"{V}.layers", 2, 2, (1,)), (f"{T}.head", 0, 1, (0,))],
        [(f"{V}.head", 0, 1, (1,))],
        [("vision-text.loss", 0, 1, (0,))]])
    cluster = Cluster(**SLOW)
    tl, vl, vc = (next(s.name for s in plan.slices() if s.metaop == m and s.layer_start == a)
                  for m, a in ((f"{T}.layers", 0), (f"{V}.layers", 0), (f"{V}.layers", 2)))
    ms = {s.name: 1.0 for s in plan.slices()}
    ms[tl] = 100.0
    cost = boundary_time_ms([(m.src, m.dst, m.bytes) for t in plan.transfers if t.src == vl
                             for m in t.forward if not m.local], cluster)
    assert 1.0 < cost < 100 * FORWARD_SHARE - 1.0
    late, early = {}, {}
    pass_late, _ = dataflow_pass(plan, cluster, ms, spans=late)
    assert late[(vc, "fwd")][0] == pytest.approx(late[(tl, "fwd")][1] + cost)  # sent once rank 1 got there
    ordered = sending_order(plan)
    assert [s.name for s in ordered.waves[1].slices] == [vl, tl] and ordered.waves[2] == plan.waves[2]
    assert sorted(ordered.transfers, key=str) == sorted(plan.transfers, key=str)
    pass_early, _ = dataflow_pass(ordered, cluster, ms, spans=early)
    assert early[(vc, "fwd")][0] == pytest.approx(early[(tl, "fwd")][1])  # arrived while rank 1 computed
    assert pass_early < pass_late
    assert sending_order(ordered) is ordered  # nothing left to move
    got, _ = best_posting(plan, cluster)
    assert [s.name for s in got.waves[1].slices] == [vl, tl]


def test_a_ranks_waits_split_where_the_sender_posted():
    """The runtime's trace splits a rank's blocked time where its sender posted the message; the timeline does
    the same. Rank 0 runs the vision layers (short) and then the text head, whose input the text layers on rank
    1 (long) send: rank 0 waits for its peer until they end, then for the message (its link time). Without
    transfers the same wait is all peer; with the runtime's costs each rank also posts its batches, local
    copies included, and the posting is what those costs charge."""
    from megatron_spindle.planner.assembly.dataflow import posting_key
    from megatron_spindle.planner.simulation.runtime_costs import RuntimeCosts
    from megatron_spindle.planner.simulation.timeline import dataflow_pass, new_waits

    plan, cluster, ms, (vl, tl, _, th) = _swapped_heads()
    cost_t = boundary_time_ms([(m.src, m.dst, m.bytes) for t in plan.transfers if t.src == tl
                               for m in t.forward if not m.local], cluster)
    spans, waits = {}, new_waits(2)
    dataflow_pass(plan, cluster, ms, spans=spans, waits=waits)
    assert spans[(th, "fwd")][0] == pytest.approx(spans[(tl, "fwd")][1] + cost_t)
    assert waits[0]["posting"] == waits[1]["posting"] == 0.0  # no runtime costs: nothing to post
    # rank 0, forward alone: idle from its vision layers' end to the text layers' end, then the message
    assert waits[0]["peer"] >= spans[(tl, "fwd")][1] - spans[(vl, "fwd")][1] - 1e-9
    assert waits[0]["message"] >= cost_t - 1e-9
    free = new_waits(2)
    dataflow_pass(plan, cluster, ms, transfers=False, waits=free)
    assert free[0]["message"] == free[1]["message"] == 0.0 and free[0]["peer"] > 0
    rt = RuntimeCosts(post_fixed_ms=0.5, post_per_op_ms=0.25, collective_first_ms=0.0, collective_ms=0.0,
                      post_local_fixed_ms=0.125, post_local_per_op_ms=0.0625)
    charged = new_waits(2)
    dataflow_pass(plan, cluster, ms, runtime=rt, waits=charged)
    want = [0.0, 0.0]
    for backward in (False, True):
        ops, local = {}, {}
        for t in plan.transfers:
            k = posting_key(plan, t, backward=backward)
            for m in (t.backward if backward else t.forward):
                if m.local:
                    local[(k, m.src)] = local.get((k, m.src), 0) + 1
                else:
                    for r in (m.src, m.dst):
                        ops[(k, r)] = ops.get((k, r), 0) + 1
        for k, r in {*ops, *local}:
            want[r] += rt.post_ms(ops.get((k, r), 0), local.get((k, r), 0))
    assert any(m.local for t in plan.transfers for m in t.forward)  # the embeddings feed their own rank
    assert [w["posting"] for w in charged] == pytest.approx(want) and min(want) > 0


def test_a_local_copy_costs_its_own_post():
    """A batch of local copies alone pays the copies' fixed cost; beside point-to-point operations only their
    per-copy cost; nothing to post costs nothing (profiles without the local costs charge none)."""
    from megatron_spindle.planner.simulation.runtime_costs import RuntimeCosts
    rt = RuntimeCosts(post_fixed_ms=0.5, post_per_op_ms=0.25, collective_first_ms=0.0, collective_ms=0.0,
                      post_local_fixed_ms=0.125, post_local_per_op_ms=0.0625)
    assert rt.post_ms(0) == 0.0 and rt.post_ms(0, 0) == 0.0
    assert rt.post_ms(0, 2) == 0.125 + 2 * 0.0625
    assert rt.post_ms(2, 2) == 0.5 + 2 * 0.25 + 2 * 0.0625
    old = RuntimeCosts.from_measured({"post": {"fixed_ms": 0.5, "per_op_ms": 0.25},
                                      "delivery": {"fixed_ms": 0.0, "per_op_ms": 0.0},
                                      "collective": {"first_ms": 0.0, "per_collective_ms": 0.0}})
    assert old.post_ms(0, 3) == 0.0 and old.post_ms(1, 3) == 0.75
