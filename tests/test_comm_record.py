"""The communication recorder (``runtime/comm_record.py``) on gloo ranks: every call recorded once, in issue
order, with its group's global ranks; with NCCL's rules a batch returns one work that waits for the whole batch
(and the received data is right), and a tensor off the communication device is refused."""
from mp_harness import run_ranks


def _ranks(rank, world):
    import torch
    import torch.distributed as dist

    from megatron_spindle import comm
    from megatron_spindle.runtime import comm_record

    rec = comm_record.install(nccl_rules=True)
    assert comm_record.install() is rec  # idempotent
    out = {}
    pair = dist.new_group([0, 1])
    t = torch.full((3,), float(rank + 1))
    if rank in (0, 1):
        comm.all_reduce(t, group=pair)
    comm.all_reduce(torch.zeros(2, 2, dtype=torch.float64))
    comm.all_gather_object({"r": rank})
    # a ring: two messages to the next rank, two from the previous one, in one batch
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    bufs = [comm.empty((2,), torch.float32), comm.empty((5,), torch.float32)]
    ops = [comm.send_op(torch.full((2,), 10.0 * rank), nxt, tag=1), comm.recv_op(bufs[0], prv, tag=1),
           comm.send_op(torch.full((5,), 10.0 * rank + 1), nxt, tag=2), comm.recv_op(bufs[1], prv, tag=2)]
    works = comm.batch_isend_irecv(ops)
    out["works"] = len(works)
    out["done"] = works[0].wait() and works[0].is_completed()
    out["received"] = [b.tolist() for b in bufs]
    # a tensor off the communication device (meta here) is refused before any communication
    try:
        getattr(dist, "all_reduce")(torch.empty(2, device="meta"))
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    from megatron.core.distributed import param_and_grad_buffer as buf
    out["mcore_patched"] = hasattr(buf.dist_reduce_scatter_func, "__spindle_original__")
    dist.destroy_process_group(pair)
    out["events"] = list(rec.events)
    comm_record.uninstall()
    out["restored"] = not hasattr(getattr(dist, "all_reduce"), "__spindle_original__")
    return out


def test_recorder_on_three_gloo_ranks():
    world = 3
    out = run_ranks(_ranks, world, timeout_s=120)
    w = (0, 1, 2)
    for rank, o in enumerate(out):
        assert o["works"] == 1 and o["done"], o  # NCCL's one work per batch, complete once waited
        prv = (rank - 1) % world
        assert o["received"] == [[10.0 * prv] * 2, [10.0 * prv + 1] * 5]
        assert o["refused"] and "meta" in o["refused"]
        assert o["mcore_patched"] and o["restored"]
        nxt = (rank + 1) % world
        want = [("new_group", (0, 1))]
        if rank in (0, 1):
            want.append(("coll", "all_reduce", (0, 1), (3,), "torch.float32"))
        want += [("coll", "all_reduce", w, (2, 2), "torch.float64"),
                 ("coll", "all_gather_object", w, (), "object"),
                 ("p2p", (("send", nxt, (2,), "torch.float32", 1), ("recv", prv, (2,), "torch.float32", 1),
                          ("send", nxt, (5,), "torch.float32", 2), ("recv", prv, (5,), "torch.float32", 2))),
                 ("destroy_group", (0, 1))]
        # the refused all-reduce raised before it was recorded: it is not in the list
        assert o["events"] == want, (rank, o["events"])
