"""The NCCL communicators a plan's run holds per device, counted from the plan's rank sets and charged in its
memory check (``planner/assembly/communicators.py``). Pure planner tests; that the runtime creates exactly
the groups counted is checked on its own calls at 64 ranks in ``test_comm_check.py``."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_spindle.planner.assembly.communicators import communicators_per_device, peak_memory_bytes, plan_rank_sets
from megatron_spindle.planner.assembly.assemble import fits_memory
from megatron_spindle.planner.assembly.manual import plan_from_waves
from megatron_spindle.planner.assembly.validate import PlanError, check_plan
from megatron_spindle.planner.assembly.plan import Plan
from megatron_spindle.planner.workload.cluster import NCCL_COMMUNICATOR_MIB, load_cluster
from megatron_spindle.planner.workload.metaops import contract
from megatron_spindle.planner.workload.workloads import build_graph


def _sequential(g, n, tp=None, on=None):
    """Every MetaOp alone in level order, on all ``n`` devices (``on``: MetaOp -> its devices)."""
    waves = []
    for m in sorted(contract(g), key=lambda m: m.level):
        ranks = (on or {}).get(m.name) or tuple(range(n if m.batch_splittable else 1))
        waves.append([(m.name, 0, m.num_layers, ranks)])
    return plan_from_waves(g, n, waves, tp=tp)


def test_communicators_are_the_world_and_each_distinct_rank_set():
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=8)
    # every weight on all 4 devices: one rank set (0..3) besides the world; a head on device 0 only: none
    plan = _sequential(g, 4)
    assert set(plan_rank_sets(plan).values()) == {(0, 1, 2, 3)}
    assert communicators_per_device(plan) == [2, 2, 2, 2]
    # the text encoder with tensor parallelism 2: its two tp groups (0, 1), (2, 3) and its two shards' gradient
    # groups (0, 2), (1, 3) on top
    t, at = "vision-text.text.layers", "audio-text.text.layers"
    tp = _sequential(g, 4, tp={t: 2, at: 2})
    assert set(plan_rank_sets(tp).values()) == {(0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3)}
    assert communicators_per_device(tp) == [4, 4, 4, 4]
    assert tp.communicator_bytes == NCCL_COMMUNICATOR_MIB * 2**20  # the default cluster: NCCL's buffers
    assert peak_memory_bytes(tp) == [b + 4 * tp.communicator_bytes for b in tp.device_memory_bytes]
    # one device alone holds no communicator with peers
    one = _sequential(g, 1)
    assert communicators_per_device(one) == [0] and peak_memory_bytes(one) == list(one.device_memory_bytes)


def test_the_charge_counts_where_memory_binds():
    """A plan whose states and activations fit but not with its communicators' buffers is refused by rule 7,
    naming them; with the memory to spare, the same plan passes."""
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=8)
    plan = _sequential(g, 4)
    need, peak = max(plan.device_memory_bytes), max(peak_memory_bytes(plan))
    tight = dataclasses.replace(plan, memory_limit_bytes=(need + peak) / 2)
    with pytest.raises(PlanError) as e:
        check_plan(tight)
    assert "rule 7" in str(e.value) and "2 communicators at 128 MiB included" in str(e.value)
    check_plan(dataclasses.replace(plan, memory_limit_bytes=peak))
    cl = load_cluster(None, num_devices=4, gpus_per_node=4)
    roomy = dataclasses.replace(cl, memory_gib=peak / 2**30 / cl.usable_memory_fraction)
    short = dataclasses.replace(cl, memory_gib=(need + peak) / 2 / 2**30 / cl.usable_memory_fraction)
    assert fits_memory(plan, roomy) and not fits_memory(plan, short)


def test_gloo_ranks_hold_no_communicator_buffers_and_the_plan_says_so_only_then():
    """A cluster of gloo ranks charges nothing (its buffers are host memory); the plan carries the charge, in
    its JSON only when it is not NCCL's default, so a default plan's bytes are what they were."""
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=8)
    nccl = _sequential(g, 4)
    assert "communicator_bytes" not in nccl.to_json()
    cl = dataclasses.replace(load_cluster(None, num_devices=4, gpus_per_node=4), communicator_mib=0.0)
    gloo = plan_from_waves(g, 4, [[(m.name, 0, m.num_layers, tuple(range(4 if m.batch_splittable else 1)))]
                                  for m in sorted(contract(g), key=lambda m: m.level)], cluster=cl)
    assert gloo.communicator_bytes == 0 and peak_memory_bytes(gloo) == list(gloo.device_memory_bytes)
    assert gloo.to_json()["communicator_bytes"] == 0 and Plan.from_json(gloo.to_json()) == gloo
    with pytest.raises(ValueError, match="communicator_mib"):
        dataclasses.replace(cl, communicator_mib=-1.0)
