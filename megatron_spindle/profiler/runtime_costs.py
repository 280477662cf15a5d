"""The runtime's own costs, measured on the backend: what the wave runtime spends beyond the layers and the link.

The step simulator charges them when a curves file carries them (``measured.runtime``; the forms and where they
enter: :mod:`megatron_spindle.planner.simulation.runtime_costs`). :func:`measure_runtime` times the runtime's own
code paths with every profile process at once, in the runtime's regime (as :func:`.link.measure_link`: all
processes meet at a barrier and compute for ``busy_ms`` before each timed repeat, as after a wave's slices; a
post and its delivery are the **median** of their repeats, the collectives and the norm the **mean**, so a
process descheduled on shared cores counts as it does at a step's end). Why medians for the posts: their
repeats here are heavy-tailed (on 2 CPU ranks: means 0.4-1.2 ms against medians 0.1-0.4 ms, a few
repeats 5-10 times the rest), while the executor's own boundaries in a training step take the medians' size
(the demo's ``w<k> fwd transfer`` spans: 0.1-0.3 ms for one or two messages when the peer is not late), so the
means charged every boundary of a step 1.1-1.3 ms and overpredicted the step's transfer by 5-8 ms:

* **post**: :func:`megatron_spindle.runtime.p2p.post_p2p` (the executor's only point-to-point call) of one
  boundary's batch between paired processes (0-1, 2-3, ...): ``k`` sends and ``k`` receives each
  (``2k`` operations), or ``k`` sends on one side and ``k`` receives on the other (``k``), ``k`` in
  :data:`POST_MESSAGES`, :data:`MESSAGE_BYTES` each (the link's bandwidth prices the bytes); the host time
  of the post, averaged over every process that posts, and the time from the post's end to the last wait's
  return (``exchange_ms`` less the post: the messages' delivery, the receiving side woken included);
* **collective**: ``j`` all-reduces of a 2-element float64 tensor over all processes back to back
  (:func:`megatron_spindle.comm.all_reduce_async` and a wait, as the step's end reduces the gradient norm
  and each task's loss), ``j`` in :data:`COLLECTIVES`;
* **grad_norm**: the gradient norm's sum of squares (``Σ g.double().pow(2).sum()``, as
  :meth:`megatron_spindle.runtime.grad_sync.GradSync.grad_sq` computes it) over :data:`NORM_SHAPES`.

:func:`fit_runtime` fits ``post_ms = a + b·operations``, ``delivery_ms = a' + b'·operations``,
``collectives_ms = c + d·j`` and
``norm_ms = e + f·tensors + g·elements/1e6`` by least squares weighted by ``1/t`` (relative errors;
coefficients clipped at 0 and the rest refitted), each with its fit error (largest relative error).
Fitting needs numpy only; measuring needs torch.
"""
from __future__ import annotations

import datetime
import statistics
import time
from typing import Mapping, Sequence

import numpy as np

#: Messages per process in a measured boundary batch.
POST_MESSAGES = (1, 2, 4, 8)
#: Bytes of each measured message: small, so the post's own cost is what is timed.
MESSAGE_BYTES = 1024
#: Back-to-back small all-reduces measured.
COLLECTIVES = (1, 2, 4, 8)
#: (tensors, elements per tensor) of the gradient norm's measurement: few and many tensors, up to a million
#: elements, no tensor over 16 Ki elements (a float64 copy of a larger one is a fresh mapping of memory on
#: CPU, a cost that is not linear in its elements; the tiny models' largest tensor has 10,816).
NORM_SHAPES = ((4, 1 << 12), (64, 1 << 12), (16, 1 << 14), (128, 1 << 10), (64, 1 << 14))


def nonneg_fit(rows: Sequence[Sequence[float]], t: Sequence[float],
               weights: Sequence[float] | None = None) -> tuple[list[float], float]:
    """``(coefficients, fit error)`` of ``t ≈ rows · coef`` by least squares weighted by ``1/t`` (or by
    ``weights``), every coefficient ≥ 0 (a negative one is set to 0 and the rest refitted: a cost cannot shrink
    with more work); the error is the largest relative error over the rows."""
    A = np.asarray(rows, dtype=float)
    y = np.asarray(t, dtype=float)
    if A.ndim != 2 or len(A) != len(y) or len(y) == 0:
        raise ValueError("runtime cost fit: need one row of coefficients per measured time")
    w = 1.0 / np.maximum(y, 1e-9) if weights is None else np.asarray(weights, dtype=float)
    free = list(range(A.shape[1]))
    coef = np.zeros(A.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(A[:, free] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    err = float(np.max(np.abs(A @ coef - y) / np.maximum(y, 1e-9)))
    return [float(c) for c in coef], err


def fit_runtime(measurements: Sequence[Mapping]) -> dict:
    """``{"post", "collective", "grad_norm", "measurements"}`` from :func:`measure_runtime`'s list (module
    docstring): the block ``spindle profile`` writes as ``measured.runtime``.

    >>> ms = [{"kind": "post", "ops": k, "ms": 0.1 + 0.02 * k, "exchange_ms": 0.4 + 0.03 * k} for k in (1, 2, 8)]
    >>> ms += [{"kind": "collective", "count": j, "ms": 0.3 + 0.5 * j} for j in (1, 4)]
    >>> ms += [{"kind": "grad_norm", "tensors": k, "elements": e, "ms": 0.01 + 0.002 * k + e / 1e6}
    ...        for k, e in ((4, 1000), (64, 1000), (4, 10**6))]
    >>> r = fit_runtime(ms)
    >>> [round(r["post"][k], 6) for k in ("fixed_ms", "per_op_ms")], round(r["collective"]["per_collective_ms"], 6)
    ([0.1, 0.02], 0.5)
    >>> [round(r["delivery"][k], 6) for k in ("fixed_ms", "per_op_ms")]
    [0.3, 0.01]
    """
    by: dict[str, list] = {}
    for m in measurements:
        by.setdefault(m["kind"], []).append(m)
    for kind in ("post", "collective", "grad_norm"):
        if kind not in by:
            raise ValueError(f"runtime cost fit: no {kind!r} measurements")
    (a, b), e_post = nonneg_fit([[1.0, m["ops"]] for m in by["post"]], [m["ms"] for m in by["post"]])
    waits = [m for m in by["post"] if m.get("exchange_ms", 0.0) > m["ms"]]
    (a2, b2), e_del = nonneg_fit([[1.0, m["ops"]] for m in waits], [m["exchange_ms"] - m["ms"] for m in waits]) \
        if waits else ((0.0, 0.0), 0.0)
    (c, d), e_coll = nonneg_fit([[1.0, m["count"]] for m in by["collective"]], [m["ms"] for m in by["collective"]])
    (e, f, g), e_norm = nonneg_fit([[1.0, m["tensors"], m["elements"] / 1e6] for m in by["grad_norm"]],
                                   [m["ms"] for m in by["grad_norm"]])
    return {"post": {"fixed_ms": a, "per_op_ms": b, "fit_error": e_post},
            "delivery": {"fixed_ms": a2, "per_op_ms": b2, "fit_error": e_del},
            "collective": {"first_ms": c, "per_collective_ms": d, "fit_error": e_coll},
            "grad_norm": {"fixed_ms": e, "per_tensor_ms": f, "per_melement_ms": g, "fit_error": e_norm},
            "measurements": [dict(m) for m in measurements]}


def measure_runtime(*, device, repeats: int = 30, warmup: int = 3, busy_ms: float | None = None,
                    messages: Sequence[int] = POST_MESSAGES, collectives: Sequence[int] = COLLECTIVES,
                    shapes: Sequence[tuple[int, int]] | None = None) -> list[dict]:
    """Time the runtime's code paths (module docstring); collective over the world (two or more processes).
    ``busy_ms``: compute before each repeat (default 2 ms on CPU, 0 on GPUs, as :func:`.link.measure_link`).
    Returns the same list on every process: posts averaged over the processes that posted, collectives and
    the norm over all processes."""
    import torch  # optional: torch (fitting needs only numpy; measuring needs torch)
    import torch.distributed as dist  # optional: torch, as above

    from .. import comm  # optional: torch, as above (comm imports it)
    from ..runtime.p2p import post_p2p  # optional: torch, as above

    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ValueError("measuring the runtime's costs needs at least two processes")
    device = torch.device(device)
    cuda = device.type == "cuda"
    busy_ms = (0.0 if cuda else 2.0) if busy_ms is None else busy_ms
    timeout = datetime.timedelta(seconds=300)
    work = torch.randn(96, 96)
    peer = rank ^ 1 if (rank ^ 1) < world else None

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def start():
        sync()
        comm.barrier()
        end = time.perf_counter() + busy_ms * 1e-3
        while time.perf_counter() < end:
            work @ work
        return time.perf_counter()

    mine: dict[tuple, tuple] = {}  # (kind, case, size) -> (ms, exchange ms) measured by this process
    sends = [torch.ones(MESSAGE_BYTES // 4, device=device) for _ in range(max(messages))]
    for k in messages:
        for pattern in ("exchange", "one-way"):
            posts, totals, n_ops = [], [], 0
            for i in range(warmup + repeats):
                t0 = start()
                ops = []
                if peer is not None:
                    for j in range(k):
                        if pattern == "exchange" or rank % 2 == 0:
                            ops.append(("send", sends[j], peer, 2 * j + 1 + rank % 2))  # tag: j, direction
                        if pattern == "exchange" or rank % 2 == 1:
                            ops.append(("recv", comm.empty(sends[j].shape, torch.float32), peer, 2 * j + 2 - rank % 2))
                works = post_p2p(ops)
                t1 = time.perf_counter()
                comm.wait_all(works, [f"runtime cost measurement: message {j} with rank {peer}"
                                      for j in range(len(works))], timeout)
                sync()
                if i >= warmup and ops:
                    posts.append((t1 - t0) * 1e3)
                    totals.append((time.perf_counter() - t0) * 1e3)
                n_ops = len(ops)
            if posts:  # medians (module docstring)
                mine[("post", pattern, n_ops)] = (statistics.median(posts), statistics.median(totals))
    for j in collectives:
        times = []
        for i in range(warmup + repeats):
            t0 = start()
            for _ in range(j):
                x, w = comm.all_reduce_async(torch.zeros(2, dtype=torch.float64, device=device))
                comm.wait_all([w], ["runtime cost measurement: small all-reduce"], timeout)
            sync()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        mine[("collective", "", j)] = (sum(times) / len(times), None)
    for k, size in (shapes or NORM_SHAPES):
        grads = [torch.randn(size, device=device) for _ in range(k)]
        times = []
        for i in range(warmup + repeats):
            t0 = start()
            sq = torch.zeros((), dtype=torch.float64, device=device)
            for g in grads:
                sq += g.double().pow(2).sum()
            sync()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        mine[("grad_norm", k, k * size)] = (sum(times) / len(times), None)
        del grads
    every = comm.all_gather_object(mine)
    out = []
    for key in dict.fromkeys(k for p in every for k in p):  # in measuring order
        kind, case, size = key
        got = [p[key] for p in every if key in p]
        mean = sum(g[0] for g in got) / len(got)
        if kind == "post":
            out.append({"kind": kind, "pattern": case, "ops": size, "ms": mean,
                        "exchange_ms": sum(g[1] for g in got) / len(got), "processes": len(got), "busy_ms": busy_ms})
        elif kind == "collective":
            out.append({"kind": kind, "count": size, "ranks": world, "ms": mean, "busy_ms": busy_ms})
        else:
            out.append({"kind": kind, "tensors": case, "elements": size, "ms": mean, "busy_ms": busy_ms})
    return out
