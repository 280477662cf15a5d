"""The communication check (``runtime/comm_check.py``) on hand-made event streams, then on the executor's own
calls at scale (``runtime/comm_dryrun.py``: every rank of a plan run once on torch's fake process group)."""
from megatron_spindle.runtime.comm_check import check, summary

W2 = (0, 1)
A, B = (0, 1), (0, 1, 2)


def coll(ranks, shape=(4,), op="all_reduce", dtype="torch.float32"):
    return ("coll", op, tuple(ranks), tuple(shape), dtype)


def p2p(*ops):
    return ("p2p", tuple((k, peer, tuple(shape), "torch.float32", tag) for k, peer, shape, tag in ops))


def test_a_consistent_stream_passes():
    ev = [[("new_group", A), coll(A), p2p(("send", 1, (2, 3), 1), ("recv", 1, (2, 3), 2)), coll(W2, (1,))],
          [("new_group", A), coll(A), p2p(("recv", 0, (2, 3), 1), ("send", 0, (2, 3), 2)), coll(W2, (1,))]]
    assert check(ev) == []
    s = summary(ev)
    assert s["groups"]["max"] == 1 and s["peers"]["per_rank"] == [1, 1] and s["ops"]["per_rank"] == [4, 4]


def test_two_groups_in_opposite_orders_deadlock():
    ev = [[("new_group", A), ("new_group", B), coll(A), coll(B)],
          [("new_group", A), ("new_group", B), coll(B), coll(A)],
          [("new_group", A), ("new_group", B), coll(B)]]
    # each communicator alone is issued in one order by all its members: only the cycle of waits across the
    # two communicators is wrong (rank 0 waits in A for rank 1, which waits in B for rank 0)
    errors = check(ev)
    assert errors[0] == "deadlock under NCCL's in-order model: 3 of 3 ranks cannot finish", errors
    assert errors[1].startswith("rank 0 stuck at event #2 of 4: all_reduce over ranks [0, 1] [4]"), errors
    assert errors[2].startswith("rank 1 stuck at event #2 of 4: all_reduce over ranks [0, 1, 2] [4]"), errors


def test_a_cycle_of_sends_posted_one_by_one_deadlocks_but_one_batch_does_not():
    # each rank sends to the next then receives from the previous, in separate calls: NCCL's in-order
    # model waits forever; the same operations in one batch per rank are a group call and complete
    one_by_one = [[p2p(("send", (r + 1) % 3, (2,), 0)), p2p(("recv", (r - 1) % 3, (2,), 0))] for r in range(3)]
    assert any("deadlock" in e for e in check(one_by_one))
    batched = [[p2p(("send", (r + 1) % 3, (2,), 0), ("recv", (r - 1) % 3, (2,), 0))] for r in range(3)]
    assert check(batched) == []


def test_a_mismatched_send_and_receive_is_reported():
    ev = [[p2p(("send", 1, (2, 3), 0))], [p2p(("recv", 0, (3, 2), 0))]]
    errors = check(ev)
    assert any(e.startswith("0->1 message #0: rank 0 sends [2, 3]") for e in errors), errors
    lost = [[p2p(("send", 1, (2,), 0)), p2p(("send", 1, (2,), 1))], [p2p(("recv", 0, (2,), 0))]]
    errors = check(lost)
    assert "0->1: rank 0 posts 2 sends, rank 1 posts 1 receives" in errors
    assert any("rank 0 stuck at event #1" in e for e in errors), errors


def test_tags_out_of_posting_order_are_reported():
    ev = [[p2p(("send", 1, (2,), 1), ("send", 1, (2,), 2))], [p2p(("recv", 0, (2,), 2), ("recv", 0, (2,), 1))]]
    errors = check(ev)
    assert len(errors) == 1 and "gloo matches by tag, NCCL by posting order" in errors[0], errors


def test_groups_created_in_another_order_and_foreign_collectives():
    ev = [[("new_group", A), ("new_group", B)], [("new_group", B), ("new_group", A)], [("new_group", A)]]
    errors = check(ev)
    assert errors[0].startswith("new_group #0: rank 1 creates ranks [0, 1, 2], rank 0 creates ranks [0, 1]")
    assert any("rank 2 creates nothing" in e for e in errors)
    assert any("rank 2 stuck" in e for e in check([[coll(A)], [coll(A)], [coll(A)]]))


def test_local_groups_need_only_their_members():
    ok = [[("new_group", (0,), "local"), ("new_group", A), ("new_group", (0, 1), "local")],
          [("new_group", (1,), "local"), ("new_group", A), ("new_group", (0, 1), "local")]]
    assert check(ok) == []
    assert summary(ok)["new_groups"]["per_rank"] == [1, 1]
    missing = [[("new_group", (0, 1), "local")], [("new_group", A)]]
    errors = check(missing)
    assert any(e.startswith("local groups of ranks 0 and 1") for e in errors), errors
    assert any("rank 0 stuck" in e for e in errors), errors
