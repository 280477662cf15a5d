"""What the GPU path needs that gloo does not show, checked on the CPU where the property is visible here: the
GPU a rank takes from its launcher's environment, the model's device against where it communicates, NCCL's
error handling under ``--spindle-timeout``, the trace's clock."""
from __future__ import annotations

import pytest

from megatron_spindle import comm


@pytest.mark.parametrize("env,want", [
    ({"LOCAL_RANK": "3", "RANK": "11", "WORLD_SIZE": "16"}, 3),
    ({"SLURM_LOCALID": "2", "RANK": "10", "WORLD_SIZE": "16"}, 2),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "RANK": "9", "WORLD_SIZE": "16"}, 1),
    ({"RANK": "11", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 3),
    ({}, 0),                                           # a plain `python script.py`: one rank
    ({"RANK": "0", "WORLD_SIZE": "1"}, 0),
])
def test_the_local_rank_comes_from_the_launcher(env, want):
    assert comm.local_rank(env) == want


def test_an_unknown_local_rank_is_refused_in_one_line():
    with pytest.raises(ValueError) as e:
        comm.local_rank({"RANK": "5", "WORLD_SIZE": "8"})
    line = str(e.value)
    assert "\n" not in line and line.startswith("LOCAL_RANK is not set (RANK=5 of WORLD_SIZE=8)"), line
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        comm.local_rank({"LOCAL_RANK": "x"})


def test_the_model_lives_where_its_rank_communicates(tmp_path):
    """``SpindleModel(device=None)`` builds on :func:`comm.comm_device` (where receive buffers go); a device
    the rank does not communicate on is refused before any group is created."""
    import torch
    import torch.distributed as dist

    from megatron_spindle.compat.cpu import apply_cpu_patches
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph
    from megatron_spindle.runtime.executor import SpindleModel

    apply_cpu_patches()
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=2)
    plan = make_plan(g, load_cluster(None, num_devices=1))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = SpindleModel(plan, g, seed=0)
        assert model.device == comm.comm_device() == torch.device("cpu")
        assert {p.device for p in model.parameters()} == {torch.device("cpu")}
        model.destroy()
        with pytest.raises(ValueError, match="but this rank communicates on cpu"):
            SpindleModel(plan, g, seed=0, device="cuda")
    finally:
        dist.destroy_process_group()


def test_a_pass_copies_each_input_block_to_the_device_once(tmp_path, monkeypatch):
    """The executor moves each data block its slices read once per pass, through ``comm.host_to_device``
    (pinned and non-blocking on a GPU: a pageable copy per input per slice would make the host wait for the GPU
    each time), not per slice and layer."""
    import torch.distributed as dist

    from megatron_spindle.compat.cpu import apply_cpu_patches
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph
    from megatron_spindle.runtime.executor import SpindleModel

    apply_cpu_patches()
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=2)
    plan = make_plan(g, load_cluster(None, num_devices=1))
    copies = []
    real = comm.host_to_device
    monkeypatch.setattr(comm, "host_to_device", lambda t, device=None: copies.append(t.shape) or real(t, device))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = SpindleModel(plan, g, seed=0)
        data = SyntheticData(g, seed=0)
        for step in range(2):
            model.backward(model(data.batch(step)))
        blocks = model._data_blocks
        model.destroy()
    finally:
        dist.destroy_process_group()
    streams = {(t, s) for t, streams in data.batch(0).items() for s in streams}
    assert {(t, s) for t, s, *_ in blocks} == streams and len(copies) == 2 * len(blocks)


class FakeEvent:
    """A CUDA event's interface on a fake device whose clock the test moves: ``record`` stamps the device time,
    ``query`` is whether the device has got there, ``synchronize`` makes the host wait until it has."""

    device_ms = 0.0   # where the fake stream will be when it reaches the next event
    reached_ms = 0.0  # how far the device has run
    waits = 0

    def record(self):
        self.t = FakeEvent.device_ms

    def query(self):
        return FakeEvent.reached_ms >= self.t

    def elapsed_time(self, other):
        assert self.query() and other.query(), "elapsed_time of an event the device has not reached"
        return other.t - self.t

    def synchronize(self):
        FakeEvent.waits += 1
        FakeEvent.reached_ms = max(FakeEvent.reached_ms, self.t)


def test_the_clock_follows_the_device():
    import torch

    from megatron_spindle.runtime.trace import EventClock, HostClock, clock_for

    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), EventClock)  # no event made until a mark is taken


def test_spans_come_from_events_resolved_after_the_device_passed_them():
    """On a GPU a span is two CUDA events on the stream: its length is the device's (here 5 ms of fake device
    time while the host took none), resolved once the device has passed it, without waiting; reading
    ``spans`` waits for the rest once."""
    from megatron_spindle.runtime.trace import EventClock, StepTrace

    FakeEvent.device_ms = FakeEvent.reached_ms = 100.0
    FakeEvent.waits = 0
    trace = StepTrace(0, clock=EventClock(FakeEvent))
    a = trace.now()
    FakeEvent.device_ms += 5.0           # the kernels queued between the marks take 5 ms on the device
    trace.span("forward", "s fwd", a)
    b0 = trace.now()
    FakeEvent.device_ms += 2.0           # the stream waits 2 ms for a message
    b1 = trace.now()
    FakeEvent.device_ms += 1.0
    trace.exposed("transfer", "w0 fwd transfer", [(b0, b1)], trace.now())
    assert len(trace) == 2 and trace._spans == []
    FakeEvent.reached_ms = 105.0         # the device has passed the forward only
    trace.resolve()
    assert [s.name for s in trace._spans] == ["s fwd"] and FakeEvent.waits == 0
    assert trace._spans[0].dur_s == pytest.approx(0.005)
    spans = trace.spans                  # the rest: one wait for the device
    assert FakeEvent.waits == 1 and [s.name for s in spans] == ["s fwd", "w0 fwd transfer"]
    assert spans[1].dur_s == pytest.approx(0.002)
    assert spans[1].start_s + spans[1].dur_s - spans[0].start_s == pytest.approx(0.008)  # the device's timeline


def _ticking_pass(rank, world):
    """One training pass of a 2-rank plan with the trace on a fake event clock that moves 1 ms per mark."""
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph
    from megatron_spindle.runtime.executor import SpindleModel
    from megatron_spindle.runtime.trace import EventClock

    class Ticking(FakeEvent):
        def record(self):
            FakeEvent.device_ms += 1.0
            super().record()

    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=4)
    model = SpindleModel(make_plan(g, load_cluster(None, num_devices=world, gpus_per_node=world)), g, seed=0,
                         bucket_size=20_000)
    host = model.trace.clock.host
    model.trace.clock = EventClock(Ticking)
    data = SyntheticData(g, seed=0)
    for step in range(2):  # from the second step on, buckets are posted during backward
        model.trace.step = step
        model.backward(model(data.batch(step)))
        model.finalize_grads()
    FakeEvent.reached_ms = FakeEvent.device_ms
    spans = [(s.cat, s.name, s.dur_s) for s in model.trace.spans]
    model.destroy()
    return host, spans


def test_the_executor_and_grad_sync_take_every_mark_from_the_trace_clock():
    """Every span of a training pass (slices, messages, boundaries, buckets, the sync wait) is made of the trace
    clock's marks: with a fake event clock whose device time advances 1 ms per mark, every span's length is a
    whole number of those milliseconds (a host ``perf_counter`` leaking in would not be). The CPU model's own
    clock is the host's."""
    from mp_harness import run_ranks

    for host, spans in run_ranks(_ticking_pass, 2, timeout_s=300):
        assert host
        names = {(c, n) for c, n, _ in spans}
        assert {"forward", "backward", "transfer", "sync"} <= {c for c, _ in names}, names
        assert any(c == "transfer" and " send " in n for c, n in names), names             # a message
        assert any(c == "transfer" and n.endswith(" transfer") for c, n in names), names   # a boundary
        assert any(c == "sync" and n.startswith("reduce ") for c, n in names), names       # a bucket
        assert ("sync", "gradient sync wait") in names, names
        assert all(d * 1e3 == pytest.approx(round(d * 1e3)) and d >= 0 for _, _, d in spans), spans[:5]


def test_nccls_watchdog_aborts_the_communicators_and_leaves_the_exit_to_the_run():
    """Under NCCL, ``--spindle-timeout`` is the process group's timeout, enforced by NCCL's watchdog: set to
    abort the communicators without tearing the process down (torchrun's default, 1, would kill it on an
    abort signal), so the next call raises and the rank ends with the one line and exit 3 of a gloo run. gloo
    needs nothing (its waits raise themselves)."""
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # what torchrun puts in a worker's environment
    comm.nccl_error_handling(env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert comm.device_id("gloo") is None
