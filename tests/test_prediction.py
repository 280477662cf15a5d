"""The live prediction line: every part of the step predicted by the simulator against the trace's spans."""
import dataclasses

import pytest

import torch

from megatron_spindle.megatron.trainer.prediction import StepCosts, compute_scale, grad_bytes_of, percent, predict_step
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.simulation.link_costs import allreduce_time_ms
from megatron_spindle.planner.simulation.simulate import simulate
from megatron_spindle.planner.workload.workloads import build_graph
from megatron_spindle.profiler.step_costs import fit_optimizer, measure_optimizer
from megatron_spindle.runtime.trace import Span


class FakeTrace:
    def __init__(self, spans):
        self.spans = spans


def _spans():
    return [Span("data", "next batch", 0.0, 0.001, 3),
            Span("forward", "a fwd", 0.0, 0.010, 3), Span("backward", "a bwd", 0.010, 0.020, 3),
            Span("transfer", "w1 fwd transfer", 0.030, 0.004, 3),
            Span("sync", "reduce [0, 1] bucket 0", 0.020, 0.015, 3),   # overlapped: not exposed
            Span("sync", "gradient sync wait", 0.035, 0.003, 3),
            Span("step end", "gradient norm + loss all-reduce", 0.038, 0.001, 3),
            Span("optimizer", "optimizer step", 0.039, 0.002, 3), Span("step", "step", 0.0, 0.045, 3),
            Span("forward", "a fwd", 1.0, 0.5, 4)]                     # another step: ignored


def test_parts_predicted_against_the_spans_of_that_step():
    cluster = load_cluster(None, num_devices=4, gpus_per_node=4)
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=16), cluster)
    rank, passes = 1, 2
    fit = fit_optimizer([{"tensors": k, "elements": e, "ms": 0.5 + 0.01 * k + 2.0 * e / 1e6}
                         for k, e in ((4, 4096), (64, 1 << 18), (8, 1 << 22))])
    costs = StepCosts(optimizer_fit=fit, tensors=10, elements=1_000_000)
    cluster = dataclasses.replace(cluster, allreduce_latency_us=100.0)  # a profile's own all-reduce latency
    p = predict_step(plan, cluster, FakeTrace(_spans()), 3, rank, passes=passes, grad_bytes=4, costs=costs)
    sim = simulate(plan, cluster, check_memory=False, passes=passes)
    assert sim.collectives and all(c.time_ms == pytest.approx(allreduce_time_ms(c.ranks, c.bytes, cluster))
                                   for c in sim.collectives)
    busy = passes * sum(s.time_ms for s in plan.rank_slices(rank))
    assert p.compute == (pytest.approx(busy), pytest.approx(30.0))
    assert p.transfer == (pytest.approx(passes * sim.pass_ms - busy), pytest.approx(4.0))
    assert p.sync == (pytest.approx(sim.breakdown.sync_ms), pytest.approx(3.0))
    # the norm's and each task's loss all-reduce (1 + 4) over 4 ranks, 2(n-1) latencies each; the optimizer from
    # its fit for 10 tensors, 1M elements
    assert p.step_end == (pytest.approx(5 * (2 * 3 * 0.1 + 12 / (cluster.intra_bandwidth_gbps * 1e9) * 1e3)), pytest.approx(1.0))
    assert p.optimizer == (pytest.approx(0.5 + 0.1 + 2.0), pytest.approx(2.0))
    assert (p.data_ms, p.other_ms, p.step_measured_ms) == (pytest.approx(1.0), pytest.approx(4.0),
                                                           pytest.approx(45.0))
    # the first three parts are the simulated step seen from this rank; the step's end and optimizer follow
    assert p.predicted_ms == pytest.approx(sim.step_ms + p.step_end[0] + 2.6)
    assert p.error == pytest.approx((45.0 - p.predicted_ms) / p.predicted_ms)
    line = p.format()
    assert "exposed sync" in line and "optimizer 2.6/2.0" in line and "2 passes" in line and "data 1.0 ms" in line
    # 4 ranks on 2 cores: the predicted compute (and the waves it sets) take twice as long
    shared = predict_step(plan, cluster, FakeTrace(_spans()), 3, rank, passes=passes, grad_bytes=4,
                          compute_scale=compute_scale(4, 2), costs=costs)
    assert shared.compute[0] == pytest.approx(2 * busy)
    slow = simulate(plan, cluster, check_memory=False, passes=passes, compute_scale=2.0)
    assert slow.makespan_ms == pytest.approx(2 * sim.makespan_ms)  # buckets become ready later too
    assert shared.predicted_ms == pytest.approx(slow.step_ms + p.step_end[0] + 2.6)
    assert "x2 for shared cores" in shared.format()
    assert compute_scale(2, 2) == compute_scale(1, 4) == 1.0


def test_measured_parts_are_medians_over_the_steps_asked_that_were_traced():
    cluster = load_cluster(None, num_devices=4, gpus_per_node=4)
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=16), cluster)
    # steps 3, 5 and 7 at 1x, 3x and 20x step 3's spans (7: a step slowed by another process)
    spans = _spans() + [Span(sp.cat, sp.name, sp.start_s + k, f * sp.dur_s, k) for k, f in ((5, 3), (7, 20))
                        for sp in _spans() if sp.step == 3]
    one = predict_step(plan, cluster, FakeTrace(spans), 3, 1, passes=1, grad_bytes=4)
    three = predict_step(plan, cluster, FakeTrace(spans), range(3, 9), 1, passes=1, grad_bytes=4)  # 4, 6, 8: none
    assert three.steps == 3 and three.step_measured_ms == pytest.approx(3 * one.step_measured_ms)
    assert three.compute[1] == pytest.approx(3 * one.compute[1]) and three.predicted_ms == one.predicted_ms
    # the line compares with the fastest of them (step 3's), which a slowed step cannot move, the median beside
    assert three.fastest_ms == pytest.approx(one.measured_ms) and one.fastest_ms is None
    assert three.compared_ms == pytest.approx(one.measured_ms) and one.compared_ms == one.measured_ms
    line = three.format()
    assert line.startswith(f"step {three.predicted_ms:.1f} ms predicted vs {one.measured_ms:.1f} ms, the fastest of "
                           f"3 steps without the optimizer ({percent(one.error)}; median step {three.measured_ms:.1f} ms, "
                           f"{percent(three.error)}: other load on the machine)"), line
    assert "predicted/measured ms (medians):" in line
    assert (percent(-0.001), percent(0.004), percent(-0.26)) == ("+0%", "+0%", "-26%")
    assert "fastest" not in one.format() and "median" not in one.format()
    assert one.format().startswith(f"step {one.predicted_ms:.1f} ms predicted vs {one.measured_ms:.1f} ms, measured without the optimizer (")
    with pytest.raises(ValueError, match="no traced step among"):
        predict_step(plan, cluster, FakeTrace(spans), [9, 10], 1, passes=1, grad_bytes=4)


def test_without_an_optimizer_measurement_the_line_says_so_and_leaves_it_out():
    cluster = load_cluster(None, num_devices=4, gpus_per_node=4)
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=16), cluster)
    p = predict_step(plan, cluster, FakeTrace(_spans()), 3, 1, passes=1, grad_bytes=4)
    assert p.optimizer == (None, pytest.approx(2.0))
    assert p.measured_ms == pytest.approx(43.0)  # the measured step less the unpredicted optimizer
    assert "optimizer 2.0 ms (not predicted" in p.format() and "without the optimizer" in p.format()
    # without a measured all-reduce latency, the link's latency times each ring step (the norm's and 4 tasks')
    assert p.step_end[0] == pytest.approx(5 * allreduce_time_ms([0, 1, 2, 3], 8.0, cluster))
    assert allreduce_time_ms([0, 1, 2, 3], 8.0, cluster) > 6 * cluster.intra_latency_us * 1e-3


def test_step_costs_from_a_profile():
    measured = {"optimizer": {"fixed_ms": 1.0, "per_tensor_ms": 0.0, "per_melement_ms": 1.0}}
    c = StepCosts.from_measured(measured, tensors=3, elements=2_000_000)
    assert c.optimizer_fit["fixed_ms"] == 1.0 and c.elements == 2_000_000
    assert StepCosts.from_measured(None, tensors=0, elements=0) == StepCosts()


def test_optimizer_fit_recovers_its_coefficients_and_measures_adamw():
    pts = [{"tensors": k, "elements": e, "ms": 0.2 + 0.005 * k + 3.0 * e / 1e6}
           for k, e in ((4, 4096), (64, 4096), (4, 1 << 18), (32, 1 << 21))]
    fit = fit_optimizer(pts)
    assert fit["fixed_ms"] == pytest.approx(0.2) and fit["per_tensor_ms"] == pytest.approx(0.005)
    assert fit["per_melement_ms"] == pytest.approx(3.0) and fit["fit_error"] < 1e-9
    # a negative coefficient is dropped and the rest refitted (times cannot shrink with more work)
    neg = fit_optimizer([{"tensors": k, "elements": e, "ms": 1.0 - 0.001 * k + 2.0 * e / 1e6}
                         for k, e in ((1, 1000), (100, 1000), (1, 10**6), (50, 10**6))])
    assert min(neg["fixed_ms"], neg["per_tensor_ms"], neg["per_melement_ms"]) >= 0.0
    ms = measure_optimizer(torch.device("cpu"), shapes=((2, 1024), (8, 4096)), warmup=1, repeats=3)
    assert [(m["tensors"], m["elements"]) for m in ms] == [(2, 2048), (8, 32768)]
    assert all(m["ms"] > 0 for m in ms)


def test_gradient_bytes_follow_the_reduction_dtype():
    class A:
        bf16 = True
        accumulate_allreduce_grads_in_fp32 = False
    assert grad_bytes_of(A()) == 2
    A.accumulate_allreduce_grads_in_fp32 = True
    assert grad_bytes_of(A()) == 4
    A.bf16 = False
    assert grad_bytes_of(A()) == 4
