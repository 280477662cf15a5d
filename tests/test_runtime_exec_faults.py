"""The wave executor's failures (split from ``test_runtime_exec.py``, whose plans and model it uses): a hung or
dead peer fails the other ranks within their timeout, naming the wave, the slice and the peer; a plan for
another world or model is refused; a receive buffer off the communication device is refused."""
import os
import re
import time

import pytest

from mp_harness import RanksFailed, run_ranks
from test_runtime_exec import WORLD, graph, plans

from megatron_spindle.planner.workload.workloads import build_graph

# -- faults ------------------------------------------------------------------------------------------------
HANG_S = 120.0  # the hung rank would come back after this; the others must have failed long before


def _hang_or_die(rank, world, plan, g, mode, fault_file):
    import torch.distributed as dist
    from megatron_spindle.compat.cpu import apply_cpu_patches
    apply_cpu_patches()
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.runtime.executor import SpindleModel

    dist.barrier()  # start together: on a loaded machine process starts differ by more than the 3 s timeout
    model = SpindleModel(plan, g, seed=0, timeout_s=3)
    if rank == world - 1:
        with open(fault_file, "w") as f:  # the moment of the fault, for the test to measure from
            f.write(repr(time.time()))
        if mode == "die":
            os._exit(17)  # a crashed rank: the harness reports its exit code
        time.sleep(HANG_S)  # a hung rank: the others must give up after their 3 s timeout
        return "slept"
    st = model(SyntheticData(g, seed=0).batch(0))
    model.backward(st)
    return "finished"


def test_a_hung_peer_fails_the_others_with_wave_slice_and_peer(tmp_path):
    g = graph()
    plan = plans()["a-sequential"]
    fault_file = tmp_path / "fault"
    # process start is not timed: it is slow on a loaded machine. Each boundary is one batch, and under NCCL's
    # rules one work: a failed wait names the message it waited for and the ranks of its batch, the hung one
    # among them; the other ranks' failures (one hop further) are collected too
    with pytest.raises(RanksFailed) as e:
        run_ranks(_hang_or_die, WORLD, plan, g, "hang", str(fault_file), timeout_s=HANG_S + 60, grace_s=15.0)
    msg = str(e.value)
    assert fault_file.exists(), f"the ranks failed before the fault: {msg[-3000:]}"
    failed_after_s = time.time() - float(fault_file.read_text())
    assert failed_after_s < HANG_S / 2, failed_after_s
    # e.g. "SpindleTimeout: rank 0: wave 24 forward: receive for w24:vision-text.loss[0-0]x1 from
    #       w16:vision-text.vision.head[0-0]x4 samples [2, 4) from rank 1 (one work for the boundary's batch with
    #       ranks [1, 2, 3]) failed: ... Timed out waiting 3000ms"
    lines = re.findall(r"SpindleTimeout: .*", msg)
    assert any(re.search(r"from rank 3 failed|with ranks \[[\d, ]*\b3\] *\) failed", line) for line in lines), lines
    assert any("Timed out" in line for line in lines), lines  # nobody heard from the hung rank: a timeout
    for line in lines:  # every rank that failed names its wave, the message and its peer; one hop further the
        # peer may have timed out first and closed its connection (seen once on a loaded machine)
        assert re.match(r"SpindleTimeout: rank \d: wave \d+ (forward|backward): (receive for|send of) w\d+:\S+ "
                        r"(from|->) w\d+:\S+ samples \[\d+, \d+\) (from|to) rank \d[ (].*failed: "
                        r".*(Timed out|Connection closed by peer)", line), line


def test_plan_for_another_world_or_model_is_refused():
    from megatron_spindle.planner.assembly.validate import PlanError, check_plan
    g = graph()
    plan = plans()["a-sequential"]
    with pytest.raises(PlanError, match="plan is for 4 devices but the job has 2"):
        check_plan(plan, graph_fingerprint=g.fingerprint(), world_size=2)
    other = build_graph("multitask-clip", tasks=4, size="tiny", batch=16)
    with pytest.raises(PlanError, match="not for this model"):
        check_plan(plan, graph_fingerprint=other.fingerprint(), world_size=4)


def test_post_p2p_refuses_a_receive_buffer_off_the_communication_device():
    import torch
    from megatron_spindle.runtime.p2p import post_p2p
    with pytest.raises(ValueError, match="receive buffer on meta, but this rank communicates on"):
        post_p2p([("recv", torch.empty(2, device="meta"), 1, 1)])
    with pytest.raises(ValueError, match="'bcast' is neither"):
        post_p2p([("bcast", torch.empty(2), 1, 1)])
