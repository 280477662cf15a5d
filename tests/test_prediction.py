"""The live prediction line: every part of the step predicted by the simulator against the trace's spans."""
import pytest

from megatron_spindle.megatron.prediction import grad_bytes_of, predict_step
from megatron_spindle.planner.build import make_plan
from megatron_spindle.planner.cluster import load_cluster
from megatron_spindle.planner.simulate import simulate
from megatron_spindle.planner.workloads import build_graph
from megatron_spindle.runtime.trace import Span


class FakeTrace:
    def __init__(self, spans):
        self.spans = spans


def test_parts_predicted_against_the_spans_of_that_step():
    cluster = load_cluster(None, num_devices=4, gpus_per_node=4)
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=16), cluster)
    rank, passes = 1, 2
    spans = [Span("forward", "a fwd", 0.0, 0.010, 3), Span("backward", "a bwd", 0.010, 0.020, 3),
             Span("transfer", "w1 fwd transfer", 0.030, 0.004, 3),
             Span("sync", "reduce [0, 1] bucket 0", 0.020, 0.015, 3),   # overlapped: not exposed
             Span("sync", "gradient sync wait", 0.035, 0.003, 3),
             Span("optimizer", "optimizer step", 0.038, 0.002, 3), Span("step", "step", 0.0, 0.045, 3),
             Span("forward", "a fwd", 1.0, 0.5, 4)]                     # another step: ignored
    p = predict_step(plan, cluster, FakeTrace(spans), 3, rank, passes=passes, grad_bytes=4)
    sim = simulate(plan, cluster, check_memory=False, passes=passes)
    busy = passes * sum(s.time_ms for s in plan.rank_slices(rank))
    assert p.compute == (pytest.approx(busy), pytest.approx(30.0))
    assert p.transfer == (pytest.approx(sim.breakdown.transfer_ms + passes * sim.makespan_ms - busy),
                          pytest.approx(4.0))
    assert p.sync == (pytest.approx(sim.breakdown.sync_ms), pytest.approx(3.0))
    assert (p.optimizer_ms, p.other_ms, p.step_measured_ms) == (pytest.approx(2.0), pytest.approx(6.0),
                                                                pytest.approx(45.0))
    # the three predicted parts are the simulated step seen from this rank
    assert p.predicted_ms == pytest.approx(sim.step_ms)
    assert p.error == pytest.approx((43.0 - sim.step_ms) / sim.step_ms)
    line = p.format()
    assert "exposed sync" in line and "optimizer 2.0 ms (not predicted" in line and "2 passes" in line
    # 4 ranks on 2 cores: the predicted compute (and the waves it sets) take twice as long
    shared = predict_step(plan, cluster, FakeTrace(spans), 3, rank, passes=passes, grad_bytes=4, compute_scale=2.0)
    assert shared.compute[0] == pytest.approx(2 * busy)
    assert shared.predicted_ms == pytest.approx(sim.step_ms + passes * sim.makespan_ms)
    assert "x2 for shared cores" in shared.format()


def test_gradient_bytes_follow_the_reduction_dtype():
    class A:
        bf16 = True
        accumulate_allreduce_grads_in_fp32 = False
    assert grad_bytes_of(A()) == 2
    A.accumulate_allreduce_grads_in_fp32 = True
    assert grad_bytes_of(A()) == 4
    A.bf16 = False
    assert grad_bytes_of(A()) == 4
