"""The data flow of a plan (planner/assembly/dataflow.py): layouts, routing, edges, the stored messages. Pure, no torch."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.assembly.dataflow import (Layout, boundaries, messages, plan_transfers, rank_messages,
                                               slice_layout)
from megatron_spindle.planner.assembly.plan import Plan
from megatron_spindle.planner.assembly.validate import PlanError, check_plan
from megatron_spindle.planner.workload.workloads import build_graph

BATCH = 8
# (producer layout, consumer layout): replicas of other sizes, tensor parallelism on either side, a
# reversed rank order, a gather onto one rank and a scatter from one rank
LAYOUT_PAIRS = [
    (Layout((0, 1), 1, BATCH), Layout((2, 3), 2, BATCH)),
    (Layout((0, 1, 2, 3), 1, BATCH), Layout((1,), 1, BATCH)),
    (Layout((0,), 1, BATCH), Layout((0, 1, 2, 3), 1, BATCH)),
    (Layout((0,), 1, BATCH), Layout((0, 1, 2, 3), 2, BATCH)),
    (Layout((0, 1, 2, 3), 2, BATCH), Layout((3, 2, 1, 0), 1, BATCH)),
    (Layout((2, 3), 2, BATCH), Layout((0, 1), 1, BATCH)),
    (Layout((0, 1, 2, 3), 4, BATCH), Layout((1, 3), 1, BATCH)),
]


def _covers_exactly(src: Layout, dst: Layout, msgs) -> None:
    """Every rank of ``dst`` receives each sample of its replica exactly once, from a rank holding it."""
    for d in dst.ranks:
        a, b = dst.rank_samples(d)
        got = sorted((m.start, m.stop) for m in msgs if m.dst == d)
        assert [x for r in got for x in range(*r)] == list(range(a, b)), (src, dst, d, got)
    for m in msgs:
        s0, s1 = src.rank_samples(m.src)
        assert s0 <= m.start < m.stop <= s1, (src, dst, m)


@pytest.mark.parametrize("src,dst", LAYOUT_PAIRS)
def test_forward_and_backward_messages_cover_every_sample_once(src, dst):
    _covers_exactly(src, dst, messages(src, dst))
    _covers_exactly(dst, src, messages(dst, src))  # backward: the gradient of every producer sample
    pairs = [(m.src, m.dst) for m in messages(src, dst)]
    assert len(pairs) == len(set(pairs)), "a pair of ranks exchanges at most one message per edge"


def test_forward_messages_prefer_local_copies_and_spread_over_replicas():
    msgs = messages(Layout((0,), 1, 8), Layout((0, 1, 2, 3), 1, 8), bytes_per_sample=3.0)
    assert [str(m) for m in msgs] == ["0->0[0:2]", "0->1[2:4]", "0->2[4:6]", "0->3[6:8]"]
    assert msgs[0].local and [m.bytes for m in msgs] == [6.0] * 4
    assert [str(m) for m in messages(Layout((2, 3), 2, 8), Layout((0, 1), 1, 8))] == ["2->0[0:4]", "3->1[4:8]"]


def test_backward_messages_take_one_replica_per_sample_range():
    msgs = messages(Layout((2, 3), 2, 8), Layout((0, 1, 2, 3), 1, 8))
    assert [str(m) for m in msgs] == ["2->0[0:2]", "3->1[2:4]", "2->2[4:6]", "3->3[6:8]"]
    msgs = messages(Layout((2, 3), 1, 8), Layout((0, 1), 2, 8))
    assert [str(m) for m in msgs] == ["2->0[0:4]", "3->0[4:8]", "2->1[0:4]", "3->1[4:8]"]


def test_a_sender_in_the_receivers_island_is_preferred():
    island = lambda r: r // 4  # noqa: E731
    msgs = messages(Layout((0, 4), 2, 8), Layout((5, 6), 1, 8), island_of=island)
    assert {m.src for m in msgs} == {4}


def test_layout_validation():
    with pytest.raises(ValueError, match="does not split"):
        Layout((0, 1, 2), 1, 8)
    with pytest.raises(ValueError, match="tp=2"):
        Layout((0, 1, 2), 2, 6)
    with pytest.raises(ValueError, match="distinct"):
        Layout((0, 0), 1, 8)
    with pytest.raises(ValueError, match="global batch differs"):
        messages(Layout((0,), 1, 8), Layout((1,), 1, 4))


@pytest.fixture(scope="module")
def plan() -> Plan:
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=8)
    return make_plan(g, load_cluster(None, num_devices=8, gpus_per_node=4))


def test_plan_stores_every_edge_with_messages_both_ways(plan):
    slices = {s.name: s for s in plan.slices()}
    by_name = {m.name: m for m in plan.metaops}
    assert plan.transfers and list(plan.transfers) == plan_transfers(plan)
    for t in plan.transfers:
        src, dst = slices[t.src], slices[t.dst]
        assert src.wave < dst.wave == t.wave
        a, b = slice_layout(by_name[src.metaop], src.ranks), slice_layout(by_name[dst.metaop], dst.ranks)
        _covers_exactly(a, b, t.forward)
        _covers_exactly(b, a, t.backward)
        assert sum(m.bytes for m in t.backward) == t.bytes > 0
    # consumer waves never go back, so boundaries are contiguous runs of the list
    assert [t.wave for t in plan.transfers] == sorted(t.wave for t in plan.transfers)
    assert sum(len(b) for b in boundaries(plan)) == len(plan.transfers)


def test_rank_messages_number_a_boundary_the_same_on_both_ends(plan):
    for b in boundaries(plan):
        for backward in (False, True):
            mine = {r: rank_messages(b, r, backward=backward) for r in range(plan.world_size)}
            for r, items in mine.items():
                for tag, t, m in items:
                    peer = m.dst if m.src == r else m.src
                    assert (tag, t, m) in mine[peer]
            every = [m for t in b for m in (t.backward if backward else t.forward)]
            tags = {tag for items in mine.values() for tag, _, _ in items}
            assert tags == set(range(1, len(every) + 1))


def test_json_round_trip_keeps_messages_and_old_plans_are_refused(plan):
    back = Plan.from_json(json.loads(plan.dumps()))
    assert back == plan and back.transfers[0].forward == plan.transfers[0].forward
    old = json.loads(plan.dumps())
    old["schema_version"] = 1
    with pytest.raises(ValueError, match=r"schema_version 1 is not supported .*re-plan with `spindle plan "
                                         r"\.\.\. --out PLAN\.json`"):
        Plan.from_json(old)


def test_validation_rule_10_refuses_a_plan_whose_messages_do_not_match_its_slices(plan):
    t = plan.transfers[0]
    m = t.forward[0]
    moved = dataclasses.replace(m, src=(m.src + 1) % plan.world_size)
    bad = dataclasses.replace(plan, transfers=(dataclasses.replace(t, forward=(moved,) + t.forward[1:]),)
                              + plan.transfers[1:])
    with pytest.raises(PlanError, match=r"rule 10 \(wave \d+\): transfer into \S+ input 0 differs"):
        check_plan(bad)
    swapped = dataclasses.replace(plan, transfers=plan.transfers[::-1])
    with pytest.raises(PlanError, match="rule 10: transfers are not in plan order"):
        check_plan(swapped)
    with pytest.raises(PlanError, match="rule 10 .* is missing"):
        check_plan(dataclasses.replace(plan, transfers=plan.transfers[1:]))


def test_an_edge_into_a_cls_or_eos_pool_head_moves_the_one_token_it_reads(plan):
    """A pool head pooling ``cls`` reads its input's first token, ``eos`` its last: the edge into it names that
    token and moves ``hidden`` elements a sample, not ``seq · hidden``; every other edge moves the whole output."""
    slices = {s.name: s for s in plan.slices()}
    by_name = {m.name: m for m in plan.metaops}
    seen = set()
    for t in plan.transfers:
        src, dst = by_name[slices[t.src].metaop], by_name[slices[t.dst].metaop]
        per_sample = t.bytes / dst.batch
        if dst.op_type == "pool_head":
            c = dst.layer
            assert t.token == (0 if c.pooling == "cls" else -1), (t.dst, c.pooling)
            assert per_sample == 2 * c.hidden == 2 * src.out_elems_per_sample / c.seq_len > 0
            seen.add(c.pooling)
        else:
            assert t.token is None and per_sample == 2 * src.out_elems_per_sample, t.dst
    assert seen == {"cls", "eos"}
    back = Plan.from_json(json.loads(plan.dumps()))
    assert [t.token for t in back.transfers] == [t.token for t in plan.transfers]
