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
