"""Timing one layer, forward + backward, the way the wave runtime runs it (torch + megatron.core).

The layer is built by :func:`megatron_spindle.models.layers.build_layer` (the runtime's own builder) on this
process's share: ``tp_size`` shards in ``tp_group`` at ``local_batch`` samples. Its float inputs are leaves that
require grad, as a slice's received inputs are in the runtime (so backward also computes input gradients); a
loss layer is backpropagated from 1, any other layer from a gradient of ones.

One repeat is ``forward + backward`` between two clock reads; with ``tp_size > 1`` the group meets at a barrier
before each repeat (so the repeat times the layer, not a peer's lateness), and on a GPU the device is
synchronised before each clock read. ``warmup`` repeats run first and are discarded (allocator, first-call
paths); parameter gradients are reset between repeats so accumulation does not grow.
"""
from __future__ import annotations

import time

import torch

from .. import comm
from ..models.layers import build_layer
from ..models.shapes import example_inputs
from ..planner.workload.graph import TaskGraph


def time_layer(graph: TaskGraph, operator: str, local_batch: int, *, warmup: int, repeats: int,
               min_seconds: float = 0.0, max_repeats: int = 1000, tp_group=None, tp_rank: int = 0,
               tp_size: int = 1, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> list[float]:
    """Milliseconds of each timed repeat of one forward + backward of ``operator``'s layer.

    At least ``repeats`` repeats are timed, more (up to ``max_repeats``) until they add up to ``min_seconds``:
    a fast layer is sampled over a longer window, so a short burst of other load does not move its median.
    With ``tp_size > 1`` every rank of the group runs the same number of repeats (rank 0 of the group decides).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    op = graph[operator]
    device = torch.device(device) if device is not None else torch.device("cpu")
    layer = build_layer(op, tp_group=tp_group, tp_rank=tp_rank, tp_size=tp_size, seed=seed, graph=graph,
                        dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)  # same inputs on every tensor-parallel rank
    inputs = example_inputs(op, local_batch, graph=graph, generator=gen, dtype=dtype, device=device,
                            requires_grad=True)
    cuda = device.type == "cuda"
    barrier = tp_size > 1 and tp_group is not None
    grad = None
    out_ms: list[float] = []
    total = warmup + repeats
    i = 0
    while i < total:
        layer.zero_grad(set_to_none=True)
        for x in inputs:
            x.grad = None
        if barrier:
            comm.barrier(tp_group)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        y = layer(inputs)
        if grad is None:
            grad = torch.ones_like(y)
        torch.autograd.backward(y, grad)
        if cuda:
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        if i >= warmup:
            out_ms.append((t1 - t0) * 1e3)
        i += 1
        if i == total:
            more = 0
            if sum(out_ms) < min_seconds * 1e3 and len(out_ms) < max_repeats:
                more = min(max_repeats - len(out_ms),
                           max(1, int((min_seconds * 1e3 - sum(out_ms)) / max(min(out_ms), 1e-3))))
            if barrier:  # every rank of the group runs the same repeats: group rank 0 decides
                n = torch.tensor([more], dtype=torch.int64, device=device)
                comm.broadcast(n, group_src=0, group=tp_group)
                more = int(n)
            total += more
    return out_ms
