"""The runtime's own costs, measured on the backend: what the wave runtime spends beyond the layers and the link.

The step simulator charges them when a curves file carries them (``measured.runtime``; the forms and where they
enter: :mod:`megatron_spindle.planner.simulation.runtime_costs`). :func:`measure_runtime` times the runtime's own
code paths with every profile process at once, in the runtime's regime (as :func:`.link.measure_link`: all
processes meet at a barrier and compute for ``busy_ms`` before each timed repeat, as after a wave's slices;
each figure is the **mean** of its repeats: a step pays many posts, deliveries and collectives, and the mean
times their number is what they add up to, a process descheduled on shared cores counted as in a step):

* **post**: the executor's own posting path (:meth:`megatron_spindle.runtime.p2p.Transfers.post` with its trace,
  the executor's bookkeeping and one ``batch_isend_irecv`` through :func:`~megatron_spindle.runtime.p2p.post_p2p`)
  of one point's batch between paired processes (0-1, 2-3, ...): ``k`` sends and ``k`` receives each (``2k``
  operations), ``k`` sends on one side and ``k`` receives on the other (``k``), or ``k`` local copies
  (``local``), ``k`` in :data:`POST_MESSAGES`, :data:`MESSAGE_BYTES` each (the link's bandwidth prices the
  bytes). Each post is timed while the peer computes, as a rank reaches its point in a step while its
  peers run their slices; the pair take turns posting first and second, and both are kept: on 2 CPU ranks a
  receive posted after its send was announced costs more (one message: mean 0.50 ms against 0.21 posted
  first, medians 0.24 and 0.20), and the runtime meets both (its posts in a training step: median 0.165 ms,
  mean 0.31-0.37). Posting both at once is a third regime, not a step's: heavy-tailed (one message: median
  0.2-0.35 ms, mean 0.8-1.9, the slowest tenth over 3 ms), and fits of its medians put the CPU benchmark's
  predicted posting at 3.7 to 5.5 ms a step from one profile to the next.
  The messages' **delivery** (``one-way``, ``delivery_ms``): the receiver posts its receives and waits, its
  peer posts the sends half a ``busy_ms`` later and computes on, as a producer goes on to its next slice;
  from the end of the sender's post to the return of the receiver's last wait (the receiving side woken
  included), on ``perf_counter``, one clock for the processes of one host (the profile's). A receiver that
  posts after its sender mostly computes before it waits, and the message moves meanwhile (in a training
  step's trace: medians of 0.01-0.1 ms blocked after the wait began, for messages posted milliseconds
  before); timed instead as a receiver that posts second and waits at once (mean 0.4-0.6 ms), the
  benchmark's boundary-posted waits came out 5-8 times the measured. Both posting at once and timing the
  wait from the post, as this profile once did, measured 1.5-3.4 ms a batch;
* **collective**: ``j`` all-reduces of a 2-element float64 tensor over all processes back to back
  (:func:`megatron_spindle.comm.all_reduce_async` and a wait, as the step's end reduces the gradient norm
  and each task's loss), ``j`` in :data:`COLLECTIVES`;
* **grad_norm**: the gradient norm's sum of squares (``Σ g.double().pow(2).sum()``, as
  :meth:`megatron_spindle.runtime.grad_sync.GradSync.grad_sq` computes it) over :data:`NORM_SHAPES`.

:func:`fit_runtime` fits ``post_ms = a + b·operations`` (local copies apart: ``post_local``),
``delivery_ms = a' + b'·operations``,
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

from ..planner.assembly.plan import Message, Transfer

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
    >>> ms += [{"kind": "post", "pattern": "local", "ops": k, "ms": 0.01 + 0.005 * k} for k in (1, 4)]
    >>> [round(fit_runtime(ms)["post_local"][k], 6) for k in ("fixed_ms", "per_op_ms")]
    [0.01, 0.005]
    """
    by: dict[str, list] = {}
    for m in measurements:
        by.setdefault(m["kind"], []).append(m)
    for kind in ("post", "collective", "grad_norm"):
        if kind not in by:
            raise ValueError(f"runtime cost fit: no {kind!r} measurements")
    local = [m for m in by["post"] if m.get("pattern") == "local"]
    by["post"] = [m for m in by["post"] if m.get("pattern") != "local"]
    if not by["post"]:
        raise ValueError("runtime cost fit: no 'post' measurements between processes")
    (a, b), e_post = nonneg_fit([[1.0, m["ops"]] for m in by["post"]], [m["ms"] for m in by["post"]])
    (al, bl), e_local = nonneg_fit([[1.0, m["ops"]] for m in local], [m["ms"] for m in local]) \
        if local else ((0.0, 0.0), 0.0)
    waits = [(m["ops"], m["delivery_ms"]) for m in by["post"] if m.get("delivery_ms", 0.0) > 0]
    if not any("delivery_ms" in m for m in by["post"]):  # older measurements: both posted, then waited
        waits = [(m["ops"], m["exchange_ms"] - m["ms"]) for m in by["post"] if m.get("exchange_ms", 0.0) > m["ms"]]
    (a2, b2), e_del = nonneg_fit([[1.0, k] for k, _ in waits], [t for _, t in waits]) if waits else ((0.0, 0.0), 0.0)
    (c, d), e_coll = nonneg_fit([[1.0, m["count"]] for m in by["collective"]], [m["ms"] for m in by["collective"]])
    (e, f, g), e_norm = nonneg_fit([[1.0, m["tensors"], m["elements"] / 1e6] for m in by["grad_norm"]],
                                   [m["ms"] for m in by["grad_norm"]])
    return {"post": {"fixed_ms": a, "per_op_ms": b, "fit_error": e_post},
            **({"post_local": {"fixed_ms": al, "per_op_ms": bl, "fit_error": e_local}} if local else {}),
            "delivery": {"fixed_ms": a2, "per_op_ms": b2, "fit_error": e_del},
            "collective": {"first_ms": c, "per_collective_ms": d, "fit_error": e_coll},
            "grad_norm": {"fixed_ms": e, "per_tensor_ms": f, "per_melement_ms": g, "fit_error": e_norm},
            "measurements": [dict(m) for m in measurements]}


def _post_items(pattern: str, k: int, rank: int, peer: int | None, rows: int) -> list:
    """One measured batch as the executor posts it, ``(wire tag, edge, message)``: ``k`` messages of ``rows``
    samples each way with ``peer`` (``exchange``), from the even process to the odd one (``one-way``), or
    ``k`` local copies (``local``: an edge between two slices of this process)."""
    def edge(src: int, dst: int, j: int) -> tuple:
        msg = Message(src=src, dst=dst, start=j * rows, stop=(j + 1) * rows, bytes=float(MESSAGE_BYTES))
        e = Transfer(src=f"w0:profile.out{src}.{j}[0-0]x1", dst=f"w1:profile.in{dst}.{j}[0-0]x1", input_index=0,
                     forward=(msg,), backward=(), cross_island_bytes=0.0)
        return e, msg

    items = []
    if pattern == "local":
        return [(0, *edge(rank, rank, j)) for j in range(k)]
    if peer is None:
        return items
    for j in range(k):
        if pattern == "exchange" or rank % 2 == 0:
            items.append((2 * j + 1 + rank % 2, *edge(rank, peer, j)))  # tag: j, direction
        if pattern == "exchange" or rank % 2 == 1:
            items.append((2 * j + 2 - rank % 2, *edge(peer, rank, j)))
    return items


def measure_runtime(*, device, repeats: int = 30, post_repeats: int = 100, warmup: int = 3,
                    busy_ms: float | None = None,
                    messages: Sequence[int] = POST_MESSAGES, collectives: Sequence[int] = COLLECTIVES,
                    shapes: Sequence[tuple[int, int]] | None = None) -> list[dict]:
    """Time the runtime's code paths (module docstring); collective over the world (two or more processes).
    ``busy_ms``: compute before each repeat (default 2 ms on CPU, 0 on GPUs, as :func:`.link.measure_link`);
    ``post_repeats``: repeats of each post and delivery between processes (their means carry the rare slow
    post: on 2 CPU ranks a few in a hundred take 4-6 ms against 0.2-0.4), ``repeats`` of the rest.
    Returns the same list on every process: posts averaged over the processes that posted, collectives and
    the norm over all processes."""
    import torch  # optional: torch (fitting needs only numpy; measuring needs torch)
    import torch.distributed as dist  # optional: torch, as above

    from .. import comm  # optional: torch, as above (comm imports it)
    from ..runtime.p2p import Transfers  # optional: torch, as above
    from ..runtime.trace import clock_for, StepTrace  # optional: torch, as above

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

    def busy(ms: float) -> None:
        end = time.perf_counter() + ms * 1e-3
        while time.perf_counter() < end:
            work @ work

    def start():
        sync()
        comm.barrier()
        busy(busy_ms)
        return time.perf_counter()

    mine: dict[tuple, tuple] = {}  # (kind, case, size) -> (ms, ...) measured by this process
    # the executor's own posting path (runtime/p2p.py: Transfers, its trace on, as in training), fed edges of
    # MESSAGE_BYTES messages, so what is timed is what a training step's posting spans hold
    cols = 64
    rows = max(1, MESSAGE_BYTES // (4 * cols))
    out = torch.ones(rows * max(messages), cols, device=device)
    transfers = Transfers(rank=rank, dtype=torch.float32, device=device, timeout=timeout,
                          trace=StepTrace(rank=rank, clock=clock_for(device)),
                          shape_of=lambda e, msg: (msg.stop - msg.start, cols))
    pieces: list = []
    send_of = lambda e, msg: out[msg.start:msg.stop].detach()  # noqa: E731  (the executor slices an output)
    recv_into = lambda e, msg, t: pieces.append(t)  # noqa: E731  (and keeps the pieces)

    def wait_all(items) -> None:
        for name in {e.dst for _, e, msg in items if msg.dst == rank and not msg.local}:
            transfers.inputs_of(name, recv_into)
        transfers.pass_end(False, [1])
        sync()
        pieces.clear()

    delivered: dict[int, list[float]] = {}  # one-way k -> per repeat: the sender's post end (or receiver's arrival)
    for k in messages:
        for pattern in ("exchange", "one-way", "local"):
            items = _post_items(pattern, k, rank, peer, rows)
            n_ops = sum(1 for _, _, msg in items if msg.local or rank in (msg.src, msg.dst))
            posts = []
            for i in range(warmup + (repeats if pattern == "local" else post_repeats)):
                # each post while the peer computes, as a rank reaches its point in a step while its peers run
                # their slices: the pair take turns posting first (the peer's batch not posted yet) and second
                # (posted: a receive meets an announced send, a send a posted receive); both are timed
                first = (i + rank) % 2 == 0
                transfers.begin()
                t0 = start()
                if not first:
                    busy(busy_ms / 2)
                    t0 = time.perf_counter()
                transfers.post(1, False, items, send_of, recv_into)
                t1 = time.perf_counter()
                if first:
                    busy(busy_ms)
                wait_all(items)
                if i >= warmup and n_ops:
                    posts.append((t1 - t0) * 1e3)
            if posts:  # means (module docstring)
                mine[("post", pattern, n_ops)] = (statistics.mean(posts),)
            if pattern != "one-way":
                continue
            marks = delivered[k] = []
            for i in range(warmup + post_repeats):
                # the delivery: the receiver posts and waits; the sender posts later and computes on, as a
                # producer goes on to its next slice
                transfers.begin()
                start()
                if items and items[0][2].src == rank:
                    busy(busy_ms / 2)
                    transfers.post(1, False, items, send_of, recv_into)
                    mark = time.perf_counter()
                    busy(busy_ms)
                    wait_all(items)
                else:
                    transfers.post(1, False, items, send_of, recv_into)
                    wait_all(items)
                    mark = time.perf_counter()
                if i >= warmup:
                    marks.append(mark)
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
    marks = comm.all_gather_object(delivered)  # perf_counter: one clock for the processes of one host
    pairs = [(r, r + 1) for r in range(0, world - 1, 2)]
    delivery = {k: sum(statistics.mean(max(0.0, b - a) * 1e3 for a, b in zip(marks[s][k], marks[r][k]))
                       for s, r in pairs) / len(pairs) for k in delivered}  # the sender's post to the arrival
    out = []
    for key in dict.fromkeys(k for p in every for k in p):  # in measuring order
        kind, case, size = key
        got = [p[key] for p in every if key in p]
        mean = sum(g[0] for g in got) / len(got)
        if kind == "post":
            out.append({"kind": kind, "pattern": case, "ops": size, "ms": mean, "processes": len(got),
                        "busy_ms": busy_ms, **({"delivery_ms": delivery[size]} if case == "one-way" else {})})
        elif kind == "collective":
            out.append({"kind": kind, "count": size, "ranks": world, "ms": mean, "busy_ms": busy_ms})
        else:
            out.append({"kind": kind, "tensors": case, "elements": size, "ms": mean, "busy_ms": busy_ms})
    return out
