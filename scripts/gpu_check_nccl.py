#!/usr/bin/env python3
"""NCCL's batch semantics on the real NCCL, on one rank (a step of scripts/gpu_check.sh).

One process, world size 1, its process group started the way the trainer starts it
(:func:`megatron_spindle.megatron.trainer.session.init_distributed`: NCCL on a GPU, gloo without). It posts batches of
point-to-point operations to itself through :func:`megatron_spindle.comm.batch_isend_irecv` (the runtime's
own path) and records, per batch, how many operations went in and how many works came back (NCCL coalesces
a batch of CUDA tensors into ONE work, gloo returns one per operation), whether waiting on those works
delivered every message, and the backend's and torch's versions. Prints one JSON line:
``{"nccl_check": {...}}``. A batch the backend refuses (an exception) is recorded with its first line, not
raised: what the backend does is the result.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_spindle import comm
from megatron_spindle.megatron.trainer.session import init_distributed


def one_batch(pairs: int) -> dict:
    """``pairs`` sends to this rank and ``pairs`` receives from it, in one batch."""
    dev = comm.comm_device()
    sent = [torch.full((1024,), float(i + 1), device=dev) for i in range(pairs)]
    bufs = [comm.empty((1024,), torch.float32) for _ in range(pairs)]
    ops = []
    for i in range(pairs):
        ops.append(comm.send_op(sent[i], 0, tag=i))
        ops.append(comm.recv_op(bufs[i], 0, tag=i))
    row = {"ops": len(ops)}
    try:
        works = comm.batch_isend_irecv(ops)
        row["works"] = len(works)
        row["work_types"] = sorted({type(w).__name__ for w in works})
        for w in works:
            w.wait()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        row["delivered"] = all(torch.equal(b, s) for b, s in zip(bufs, sent))
    except Exception as e:  # noqa: BLE001 - the backend's answer is the result
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return row


def main() -> int:
    os.environ.setdefault("MASTER_PORT", "29655")
    init_distributed(60.0)
    try:
        backend = str(dist.get_backend())
        batches = [one_batch(1), one_batch(3)]
        result = {"backend": backend, "world_size": dist.get_world_size(), "torch": torch.__version__,
                  "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                  "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None,
                  "batches": batches}
        counts = {(b["ops"], b.get("works")) for b in batches}
        if all("works" in b for b in batches):
            result["semantics"] = ("one work per batch (coalesced)" if all(w == 1 for _, w in counts) else
                                   "one work per operation" if all(o == w for o, w in counts) else "mixed")
        print(json.dumps({"nccl_check": result}), flush=True)
        return 0  # recorded; whether each batch delivered is in the result (gloo cannot send to itself)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
