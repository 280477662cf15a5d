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


def test_a_local_group_is_a_split_every_rank_joins():
    """Under eager NCCL initialisation a ``use_local_synchronization`` group is still split from the world
    communicator: every rank must make one at the same position (each rank its own one-rank group, say)."""
    ok = [[("new_group", (0,), "local"), ("new_group", A), ("new_group", (0, 1), "local")],
          [("new_group", (1,), "local"), ("new_group", A), ("new_group", (0, 1), "local")]]
    assert check(ok) == []
    assert summary(ok)["new_groups"]["per_rank"] == [1, 1]
    # rank 1 makes its one-rank group later than rank 0 (as a lazily created group would be): rank 0's split
    # waits for rank 1, which waits in the other split for rank 0
    late = [[("new_group", (0,), "local"), ("new_group", A)], [("new_group", A), ("new_group", (1,), "local")]]
    errors = check(late)
    assert any(e.startswith("new_group #0: rank 1 creates ranks [0, 1], rank 0 creates local group ranks [0]")
               for e in errors), errors
    assert any("deadlock" in e for e in errors) and any("rank 0 stuck at event #0" in e for e in errors), errors
    # a one-rank group made by one rank only (gloo would not mind): the others never join its split
    alone = [[("new_group", (0,), "local"), coll(W2)], [coll(W2)]]
    errors = check(alone)
    assert any("rank 1 creates nothing, rank 0 creates local group ranks [0]" in e for e in errors), errors
    assert any("rank 0 stuck at event #0 of 2: new_group" in e for e in errors), errors
    mixed = [[("new_group", (0, 1), "local")], [("new_group", (1,), "local")]]
    assert any("must name the same group" in e for e in check(mixed)), check(mixed)


# -- the executor's own calls at 64 ranks ------------------------------------------------------------------------
import pytest  # noqa: E402

WORLD = 64


def _tensor_parallel_plan(g, n):
    """Each level's MetaOps side by side on blocks of ranks, vision layers with tensor parallelism 4 and the
    others' layers 2; a transformer MetaOp's second half runs in a second wave on the next block (TP group to TP
    group messages; shared weights' gradient groups span blocks)."""
    from megatron_spindle.planner.assembly.manual import plan_from_waves
    from megatron_spindle.planner.workload.metaops import contract

    by_level: dict[int, list] = {}
    for m in contract(g):
        by_level.setdefault(m.level, []).append(m)
    tp, waves = {}, []
    for level in sorted(by_level):
        ms = by_level[level]
        size = n // len(ms) // 4 * 4
        block = [tuple(range(i * size, (i + 1) * size)) for i in range(len(ms))]
        first, second = [], []
        for i, m in enumerate(ms):
            if m.op_type == "transformer_layer":
                tp[m.name] = 4 if m.name.split(".")[1] == "vision" else 2
                half = m.num_layers // 2
                first.append((m.name, 0, half, block[i]))
                second.append((m.name, half, m.num_layers - half, block[(i + 1) % len(ms)]))
            else:
                first.append((m.name, 0, m.num_layers, block[i] if m.batch_splittable else block[i][:1]))
        waves += [first] + ([second] if second else [])
    return plan_from_waves(g, n, waves, tp=tp)


@pytest.fixture(scope="module")
def runs():
    """The executor's calls on every rank of two 64-rank plans of tiny Multitask-CLIP (one training pass each on
    the fake process group): the planner's plan of 10 tasks, and a hand-made plan of 4 tasks with tensor
    parallelism. (The full-size plans run the same way in ``scripts/comm_check.py``; at 64 ranks they take
    minutes on two cores, the tiny graphs seconds.)"""
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph
    from megatron_spindle.runtime.comm_dryrun import dry_run

    g10 = build_graph("multitask-clip", tasks=10, size="tiny")
    g4 = build_graph("multitask-clip", tasks=4, size="tiny")
    planned = make_plan(g10, load_cluster(None, num_devices=WORLD, gpus_per_node=8))
    tp = _tensor_parallel_plan(g4, WORLD)
    return {"planner": (planned, dry_run(planned, g10, timeout_s=60)), "tp": (tp, dry_run(tp, g4, timeout_s=60))}


@pytest.mark.parametrize("case", ["planner", "tp"])
def test_the_executor_at_64_ranks_keeps_nccls_rules(runs, case):
    import torch.distributed as dist

    from megatron_spindle.runtime import comm_record

    plan, events = runs[case]
    assert not dist.is_initialized() and comm_record.recorder() is None  # the dry run cleaned up
    assert len(events) == WORLD and all(events), "every rank communicates"
    assert check(events) == []
    colls = {e[2] for ev in events for e in ev if e[0] == "coll"}
    for t in {s.tp for s in plan.slices() if s.tp > 1}:  # tensor parallelism's collectives were recorded
        assert any(len(k) == t for k in colls), (t, sorted(map(len, colls)))
    s = summary(events)
    assert s["groups"]["max"] > 1 and s["ops"]["mean"] > 0
    if case == "planner":
        assert s["peers"]["max"] > 1 and any(e[0] == "p2p" for ev in events for e in ev)


@pytest.mark.parametrize("case", ["planner", "tp"])
def test_the_communicators_the_planner_charges_are_the_ones_the_runtime_makes(runs, case):
    """Per rank: the world's communicator and one per group with peers that the runtime creates is what the
    plan's memory check counts (``planner/assembly/communicators.py``)."""
    from megatron_spindle.planner.assembly.communicators import communicators_per_device

    plan, events = runs[case]
    made = [1 + len({e[1] for e in ev if e[0] == "new_group" and len(e[1]) > 1 and r in e[1]})
            for r, ev in enumerate(events)]
    assert made == communicators_per_device(plan)
    assert max(made) > 2


def test_perturbed_streams_fail_the_check(runs):
    events = [list(ev) for ev in runs["tp"][1]]
    # one rank issues two collectives of different communicators that share another rank q in the other order:
    # q issues them in the original order (else the original streams would deadlock), so they wait on each other
    r, i = next((r, i) for r, ev in enumerate(events) for i in range(len(ev) - 1)
                if ev[i][0] == ev[i + 1][0] == "coll" and ev[i][2] != ev[i + 1][2]
                and len(set(ev[i][2]) & set(ev[i + 1][2])) > 1)
    swapped = [list(ev) for ev in events]
    swapped[r][i], swapped[r][i + 1] = swapped[r][i + 1], swapped[r][i]
    assert any("deadlock" in e for e in check(swapped))
    # a receive dropped from one batch of the planner's plan: its send has no match, the sender waits forever
    events = [list(ev) for ev in runs["planner"][1]]
    r, i = next((r, i) for r, ev in enumerate(events) for i, e in enumerate(ev)
                if e[0] == "p2p" and any(op[0] == "recv" for op in e[1]))
    ops = events[r][i][1]
    j = next(j for j, op in enumerate(ops) if op[0] == "recv")
    dropped = [list(ev) for ev in events]
    dropped[r][i] = ("p2p", ops[:j] + ops[j + 1:])
    errors = check(dropped)
    assert any(f"->{r}: rank" in e and "receives" in e for e in errors), errors
    assert any("deadlock" in e for e in errors), errors


def test_the_scale_script_checks_full_size_plans():
    """``scripts/comm_check.py`` itself (docs/comm_check.md's table), on full-size plans at 8 ranks: exit 0
    and an ``ok`` row per model. Its failure path (exit 1, the problems printed) is the same ``check`` that
    ``test_perturbed_streams_fail_the_check`` shows failing."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, os.path.join(root, "scripts", "comm_check.py"), "--models",
                        "multitask-clip,ofasys", "--ranks", "8", "--markdown"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split("|") for line in p.stdout.splitlines() if line.startswith("| ") and "| 8 |" in line]
    assert sorted(r[1].strip() for r in rows) == ["multitask-clip", "ofasys"], p.stdout
    assert all(r[7].strip() == "ok" for r in rows), p.stdout


def test_the_one_rank_group_is_made_again_for_a_new_default_group(tmp_path):
    """The registry's one-rank group is made once per world (its first registry makes it, a second reuses it):
    after ``destroy_process_group`` and a new world (whose default group may reuse the old one's ``id``) a new
    one is made that works, not the destroyed one."""
    import torch
    import torch.distributed as dist

    from megatron_spindle import comm
    from megatron_spindle.runtime.groups import ProcessGroupRegistry

    groups = []
    for i in range(2):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store{i}", rank=0, world_size=1)
        try:
            g = ProcessGroupRegistry({}).one
            assert ProcessGroupRegistry({}).one is g  # one per world
            t = torch.ones(2)
            comm.all_reduce(t, group=g)
            assert t.tolist() == [1.0, 1.0]
            groups.append(g)
        finally:
            dist.destroy_process_group()
    assert groups[0] is not groups[1]


def test_layers_never_create_a_group():
    """Models take the one-rank group from the caller (the runtime's registry) or stand in for it; a layer
    built inside a world makes no ``new_group`` (a lazily created one would be a split only its rank joins)."""
    import tempfile

    import torch.distributed as dist

    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.models.reference import ReferenceModel
    from megatron_spindle.planner.workload.workloads import build_graph
    from megatron_spindle.runtime import comm_record

    d = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
    rec = comm_record.install(nccl_rules=True)
    try:
        g = build_graph("multitask-clip", tasks=4, size="tiny", batch=2)
        out = ReferenceModel(g, seed=0)(SyntheticData(g, seed=0).batch(0))
        sum(out.values()).backward()
        assert [e for e in rec.events if e[0] == "new_group"] == []
    finally:
        comm_record.uninstall()
        dist.destroy_process_group()
