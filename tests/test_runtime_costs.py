"""The runtime's own measured costs: their fit, and the step model charging them (and nothing without them)."""
import dataclasses

import pytest

from megatron_spindle.megatron.trainer.prediction import StepCosts, predict_step, step_end_allreduces
from megatron_spindle.planner.simulation.runtime_costs import RuntimeCosts
from megatron_spindle.planner.simulation.link_costs import allreduce_time_ms
from megatron_spindle.planner.simulation.simulate import simulate
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.workload.workloads import build_graph
from megatron_spindle.profiler.runtime_costs import fit_runtime, nonneg_fit

from test_prediction import FakeTrace, _spans
from test_simulate import BATCH, HIDDEN, INTRA_GBPS, INTRA_US, SEQ, hand_plan, toy_cluster


def _measurements(a=0.3, b=0.05, c=0.8, d=0.4, e=0.02, f=0.006, g=0.9):
    ms = [{"kind": "post", "pattern": p, "ops": k, "ms": a + b * k, "exchange_ms": a + b * k + 0.2 + 0.01 * k}
          for p, k in (("one-way", 1), ("exchange", 2), ("one-way", 8), ("exchange", 16))]
    ms += [{"kind": "collective", "count": j, "ranks": 2, "ms": c + d * j} for j in (1, 2, 4, 8)]
    ms += [{"kind": "grad_norm", "tensors": k, "elements": k * s, "ms": e + f * k + g * k * s / 1e6}
           for k, s in ((4, 4096), (64, 4096), (16, 16384), (128, 1024))]
    return ms


def test_the_fit_recovers_each_forms_coefficients():
    r = fit_runtime(_measurements())
    assert r["post"]["fixed_ms"] == pytest.approx(0.3) and r["post"]["per_op_ms"] == pytest.approx(0.05)
    assert r["delivery"]["fixed_ms"] == pytest.approx(0.2) and r["delivery"]["per_op_ms"] == pytest.approx(0.01)
    assert r["collective"]["first_ms"] == pytest.approx(0.8)
    assert r["collective"]["per_collective_ms"] == pytest.approx(0.4)
    assert (r["grad_norm"]["fixed_ms"], r["grad_norm"]["per_tensor_ms"], r["grad_norm"]["per_melement_ms"]) == \
        (pytest.approx(0.02), pytest.approx(0.006), pytest.approx(0.9))
    assert max(r[k]["fit_error"] for k in ("post", "delivery", "collective", "grad_norm")) < 1e-9
    assert len(r["measurements"]) == 12
    rt = RuntimeCosts.from_measured(r)
    assert rt.post_ms(4) == pytest.approx(0.5) and rt.post_ms(0) == 0.0
    assert rt.collectives_ms(5) == pytest.approx(0.8 + 2.0) and rt.collectives_ms(0) == 0.0
    assert rt.norm_ms(tensors=10, elements=2_000_000) == pytest.approx(0.02 + 0.06 + 1.8)
    # a boundary's 2 ms of link time with 0.5 ms of it latency, 4 operations: 1.5 ms of bytes + 0.24 delivered
    assert rt.transit_ms(2.0, 0.5, 4) == pytest.approx(1.5 + 0.2 + 0.04) and rt.transit_ms(0.0, 0.5, 4) == 0.0


def test_a_cost_never_shrinks_with_more_work():
    # times that fall with the count: the slope would be negative, so it is 0 and the rest refitted
    (a, b), err = nonneg_fit([[1.0, k] for k in (1, 2, 4, 8)], [1.0, 0.9, 0.8, 0.7])
    assert b == 0.0 and 0.7 < a < 1.0 and err > 0
    with pytest.raises(ValueError, match="no 'collective' measurements"):
        fit_runtime([m for m in _measurements() if m["kind"] != "collective"])


def test_a_curves_file_without_the_block_charges_nothing_and_a_malformed_one_names_it():
    assert RuntimeCosts.from_measured(None) is None and RuntimeCosts.from_measured({}) is None
    with pytest.raises(ValueError, match="measured.runtime is malformed"):
        RuntimeCosts.from_measured({"post": {"fixed_ms": 1.0, "per_op_ms": 0.0}, "collective": {}})
    with pytest.raises(ValueError, match="post_fixed_ms=-1.0"):
        RuntimeCosts(post_fixed_ms=-1.0, post_per_op_ms=0.0, collective_first_ms=0.0, collective_ms=0.0)


def test_the_timeline_charges_each_ranks_post_and_the_measured_delivery_for_the_links_latency():
    # layer 0 on devices 0,1 (8/2 = 4 ms: forward 4/3, backward 8/3), layer 1 on 2,3: one message per rank
    # each way (0->2, 1->3 forward; back the other way), as test_simulate's hand plans
    c = toy_cluster(16)
    plan = hand_plan(c, [(0, 1, (0, 1)), (1, 1, (2, 3))])
    wire = (BATCH // 2) * SEQ * HIDDEN * 2 / (INTRA_GBPS * 1e9) * 1e3  # the bytes over the bandwidth
    base = simulate(plan, c)
    assert base.pass_ms == pytest.approx(8.0 + 2 * (wire + INTRA_US * 1e-3))
    # each boundary on the critical path: both ends post 1 operation (0.5 + 0.25 ms), then the bytes and the
    # measured delivery of 1 operation (0.1 + 0.05 ms) instead of the link's latency
    rt = RuntimeCosts(post_fixed_ms=0.5, post_per_op_ms=0.25, delivery_fixed_ms=0.1, delivery_per_op_ms=0.05,
                      collective_first_ms=0.0, collective_ms=0.0)
    sim = simulate(plan, c, runtime=rt)
    assert sim.pass_ms == pytest.approx(8.0 + 2 * (0.75 + wire + 0.15))
    assert sim.step_ms - base.step_ms == pytest.approx(2 * (0.75 + 0.15 - INTRA_US * 1e-3))
    assert sim.breakdown.compute_ms == pytest.approx(base.breakdown.compute_ms)
    # a plan without messages between devices posts nothing: the same step with or without the costs
    local = hand_plan(c, [(0, 1, (0, 1)), (1, 1, (0, 1))])
    assert simulate(local, c, runtime=rt).step_ms == pytest.approx(simulate(local, c).step_ms)
    # zero costs leave the bytes alone: the link's latency is what the delivery replaced
    zero = RuntimeCosts(post_fixed_ms=0.0, post_per_op_ms=0.0, collective_first_ms=0.0, collective_ms=0.0)
    assert simulate(plan, c, runtime=zero).pass_ms == pytest.approx(8.0 + 2 * wire)


def test_the_prediction_charges_the_fitted_amounts_and_is_unchanged_without_them():
    cluster = dataclasses.replace(load_cluster(None, num_devices=4, gpus_per_node=4), allreduce_latency_us=100.0)
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=16), cluster)
    rank, passes = 1, 2
    rt = RuntimeCosts.from_measured(fit_runtime(_measurements()))
    without = predict_step(plan, cluster, FakeTrace(_spans()), 3, rank, passes=passes, grad_bytes=4,
                           costs=StepCosts(tensors=10, elements=1_000_000))
    withrt = predict_step(plan, cluster, FakeTrace(_spans()), 3, rank, passes=passes, grad_bytes=4,
                          costs=StepCosts(tensors=10, elements=1_000_000, runtime=rt))
    busy = passes * sum(s.time_ms for s in plan.rank_slices(rank))
    # without the block: the link-only simulator, and the norm's and each task's loss all-reduce (1 + 4 of them)
    assert step_end_allreduces(plan) == 5
    assert without.step_end[0] == pytest.approx(5 * allreduce_time_ms(range(4), 8.0, cluster))
    assert without.transfer[0] == pytest.approx(passes * simulate(plan, cluster, passes=passes).pass_ms - busy)
    # with it: the norm's host work for this rank's 10 tensors and 1M elements, then 5 small all-reduces
    assert withrt.step_end[0] == pytest.approx((0.02 + 0.06 + 0.9) + (0.8 + 5 * 0.4))
    sim = simulate(plan, cluster, passes=passes, runtime=rt)
    assert withrt.transfer[0] == pytest.approx(passes * sim.pass_ms - busy)
    assert withrt.transfer[0] > without.transfer[0]  # posts of 0.3 ms and more outweigh 10 us of link latency
    assert withrt.compute == without.compute and withrt.sync[1] == without.sync[1]
    # and a profile's block reaches the prediction through StepCosts.from_measured
    got = StepCosts.from_measured({"runtime": fit_runtime(_measurements())}, tensors=10, elements=1_000_000)
    assert got.runtime == rt and StepCosts.from_measured({}, tensors=0, elements=0).runtime is None


def test_fitting_needs_no_torch_and_the_measurement_runs_the_runtimes_code_paths():
    import os
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None; sys.modules['megatron'] = None\n"
            "import megatron_spindle.profiler.runtime_costs, megatron_spindle.planner.simulation.runtime_costs\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert r.returncode == 0, r.stderr
    from megatron_spindle.profiler import launch
    got = launch.spawn(_measure_small, 2, timeout_s=300)
    assert got[0] == got[1]  # every process returns the same list
    kinds = [(m["kind"], m.get("pattern"), m.get("ops", m.get("count", m.get("tensors")))) for m in got[0]]
    assert kinds == [("post", "exchange", 2), ("post", "one-way", 1), ("post", "local", 1),
                     ("post", "exchange", 4), ("post", "one-way", 2), ("post", "local", 2),
                     ("collective", None, 1), ("collective", None, 3), ("grad_norm", None, 2), ("grad_norm", None, 8)]
    assert all(m["ms"] > 0 for m in got[0]) and all(m["processes"] == 2 for m in got[0] if m["kind"] == "post")
    rt = RuntimeCosts.from_measured(fit_runtime(got[0]))
    assert rt is not None and rt.post_ms(0, 2) > 0  # local copies cost host time at their point


def _measure_small(rank, world):
    from megatron_spindle.profiler.runtime_costs import measure_runtime
    return measure_runtime(device="cpu", repeats=2, post_repeats=2, warmup=1, busy_ms=0.1, messages=(1, 2),
                           collectives=(1, 3), shapes=((2, 64), (8, 256)))


def test_the_line_says_when_the_runtime_costs_are_not_charged():
    cluster = load_cluster(None, num_devices=4, gpus_per_node=4)
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=16), cluster)
    rt = RuntimeCosts.from_measured(fit_runtime(_measurements()))
    lines = [predict_step(plan, cluster, FakeTrace(_spans()), 3, 1, passes=1, grad_bytes=4,
                          costs=StepCosts(runtime=r)).format() for r in (None, rt)]
    assert "runtime's own costs not charged" in lines[0] and "runtime's own costs" not in lines[1]


def test_the_per_slice_fit_subtracts_each_slices_point_and_never_goes_negative():
    from megatron_spindle.profiler.slice_costs import fit_slices
    # slices of 3 and 6 ms of layer points; forward a third of the point + 0.5, backward two thirds + 0.25
    ms = [{"fwd_ms": p / 3 + 0.5, "bwd_ms": 2 * p / 3 + 0.25, "point_ms": p} for p in (3.0, 6.0)]
    r = fit_slices(ms, share=1 / 3)
    assert (r["fwd_ms"], r["bwd_ms"], r["slices"]) == (pytest.approx(0.5), pytest.approx(0.25), 2)
    assert r["fit_error"] < 1e-9 and r["rms_ms"] < 1e-9
    # spans shorter than the points: no negative cost, and the fit says how far off it is
    r = fit_slices([{"fwd_ms": 0.5, "bwd_ms": 1.0, "point_ms": 3.0}], share=1 / 3)
    assert (r["fwd_ms"], r["bwd_ms"]) == (0.0, 0.0) and r["fit_error"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no measured slices"):
        fit_slices([])


def test_the_per_slice_fit_separates_a_fixed_part_from_a_scale_on_the_layers():
    from megatron_spindle.profiler.slice_costs import fit_slices
    # the executor: 0.2 ms per slice plus its layers 1.3 times as long as alone; forward its third + 0.2
    ms = [{"fwd_ms": 1.3 * p / 3 + 0.2, "bwd_ms": 2 * 1.3 * p / 3, "point_ms": p} for p in (0.05, 0.1, 1.0, 4.0)]
    r = fit_slices(ms, share=1 / 3)
    assert (r["fwd_ms"], r["bwd_ms"], r["scale"]) == (pytest.approx(0.2), pytest.approx(0.0, abs=1e-9),
                                                      pytest.approx(1.3))
    assert r["rms_ms"] < 1e-9
    # spans a fixed part alone cannot fit: the big slices' excess grows with their layers
    fixed_only = max(abs(m["fwd_ms"] + m["bwd_ms"] - m["point_ms"] - 0.2) for m in ms)
    assert fixed_only > 1.0
    # layers faster than alone (noise): the scale stays 1, the fixed part takes the rest, never negative
    r = fit_slices([{"fwd_ms": 0.3, "bwd_ms": 0.6, "point_ms": p} for p in (1.0, 2.0)], share=1 / 3)
    assert r["scale"] == 1.0 and r["fwd_ms"] >= 0 and r["bwd_ms"] >= 0


def test_the_per_slice_cost_lengthens_each_slice_on_the_timeline_and_the_predicted_compute():
    c = toy_cluster(16)
    plan = hand_plan(c, [(0, 1, (0, 1)), (1, 1, (2, 3))])  # two slices one after the other
    zero = RuntimeCosts(post_fixed_ms=0.0, post_per_op_ms=0.0, collective_first_ms=0.0, collective_ms=0.0)
    per = dataclasses.replace(zero, per_slice_fwd_ms=0.4, per_slice_bwd_ms=0.1)
    base, sim = simulate(plan, c, runtime=zero), simulate(plan, c, runtime=per)
    assert sim.pass_ms - base.pass_ms == pytest.approx(2 * (0.4 + 0.1))  # both slices, forward and backward
    assert sim.breakdown.compute_ms == pytest.approx(base.breakdown.compute_ms)
    # an older profile's block has no per-slice costs: none charged
    old = fit_runtime(_measurements())
    assert RuntimeCosts.from_measured(old).per_slice_fwd_ms == 0.0
    got = RuntimeCosts.from_measured({**old, "slice": {"fwd_ms": 0.4, "bwd_ms": 0.1}})
    assert (got.per_slice_fwd_ms, got.per_slice_bwd_ms) == (0.4, 0.1)
    # the live prediction: this rank's compute grows by passes x its slices x the cost, the same block without
    # it predicts what it did
    cluster = load_cluster(None, num_devices=4, gpus_per_node=4)
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=16), cluster)
    rank, passes = 1, 2

    def predicted(rt):
        return predict_step(plan, cluster, FakeTrace(_spans()), 3, rank, passes=passes, grad_bytes=4,
                            costs=StepCosts(runtime=rt))
    without, withsl = predicted(RuntimeCosts.from_measured(old)), predicted(got)
    slices = len(plan.rank_slices(rank))
    assert slices > 0
    assert withsl.compute[0] - without.compute[0] == pytest.approx(passes * slices * 0.5)
    assert without.compute[0] == pytest.approx(passes * sum(s.time_ms for s in plan.rank_slices(rank)))
    assert withsl.compute[1] == without.compute[1]


def test_the_per_slice_scale_stretches_each_slice_on_the_timeline_and_the_predicted_compute():
    c = toy_cluster(16)
    plan = hand_plan(c, [(0, 1, (0, 1)), (1, 1, (2, 3))])  # two slices one after the other
    zero = RuntimeCosts(post_fixed_ms=0.0, post_per_op_ms=0.0, collective_first_ms=0.0, collective_ms=0.0)
    scaled = dataclasses.replace(zero, per_slice_scale=1.25)
    base, sim = simulate(plan, c, runtime=zero), simulate(plan, c, runtime=scaled)
    chain = sum(s.time_ms for w in plan.waves for s in w.slices)  # one after the other, a transfer between
    assert chain > 0 and sim.pass_ms - base.pass_ms == pytest.approx(0.25 * chain)
    got = RuntimeCosts.from_measured({**fit_runtime(_measurements()), "slice": {"fwd_ms": 0.0, "bwd_ms": 0.0,
                                                                                 "scale": 1.25}})
    assert got.per_slice_scale == 1.25
    assert RuntimeCosts.from_measured(fit_runtime(_measurements())).per_slice_scale == 1.0  # older profiles
    with pytest.raises(ValueError, match="per_slice_scale=0.5"):
        dataclasses.replace(zero, per_slice_scale=0.5)
    cluster = load_cluster(None, num_devices=4, gpus_per_node=4)
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=16), cluster)
    one, stretched = (predict_step(plan, cluster, FakeTrace(_spans()), 3, 1, passes=2, grad_bytes=4,
                                   costs=StepCosts(runtime=rt)) for rt in (zero, got))
    assert stretched.compute[0] == pytest.approx(1.25 * one.compute[0]) and one.compute[0] > 0


def test_the_per_slice_measurement_runs_the_executor_on_the_profiles_processes():
    from megatron_spindle.profiler import launch
    got = launch.spawn(_measure_slices_small, 2, timeout_s=300)
    assert got[0] == got[1] and got[0]  # every process returns the same list
    assert {m["rank"] for m in got[0]} == {0, 1}
    assert all(m["fwd_ms"] > 0 and m["bwd_ms"] > 0 and m["point_ms"] > 0 and m["layers"] >= 1 for m in got[0])


def _measure_slices_small(rank, world):
    from megatron_spindle.compat.cpu import apply_cpu_patches
    from megatron_spindle.planner.workload.cluster import Cluster
    from megatron_spindle.profiler.slice_costs import measure_slices
    apply_cpu_patches()
    graph = build_graph("multitask-clip", tasks=4, size="tiny", batch=4)
    return measure_slices(graph, Cluster(name="profile", num_devices=8, gpus_per_node=8, memory_gib=8.0),
                          device="cpu", passes=2, warmup=1, rounds=2, layer_warmup=0, layer_repeats=1,
                          min_seconds=0.0)
