"""The backend's link, measured: latency and bandwidth in the simulator's own cost model.

The step simulator (:mod:`megatron_spindle.planner.simulation.simulate`) times communication with two formulas over one
latency ``λ`` and one bandwidth ``B`` per link kind:

* a wave boundary (batched send/recv, every device sending and receiving ``S`` bytes): ``t = λ + S / B``;
* a ring all-reduce of ``S`` bytes over ``n`` devices: ``t = 2(n-1)·λ + 2(n-1)/n · S / B``.

:func:`measure_link` times both on the live backend (the exchange between processes 0 and 1 exactly as the
runtime posts it, one ``batch_isend_irecv``; the all-reduce over all processes) at a few sizes, and
:func:`fit_link` fits ``(λ, B)`` to each kind. Both formulas are linear in ``(λ, 1/B)``, so each fit is a
2-parameter least squares with relative weights (each time weighted by ``1/t``), with ``λ ≥ 0`` and ``B > 0``
enforced by refitting the other parameter alone. The link takes the exchange's latency and the all-reduce's
bandwidth (see :func:`fit_link`); the fit error (largest relative error at a measurement) says how well one
``(λ, B)`` describes the backend: gloo's all-reduce is not a textbook ring.

:func:`cluster_fields` writes the result as :class:`~megatron_spindle.planner.workload.cluster.Cluster` fields, one
island (intra = inter), for ``spindle compare --cluster FILE`` and the CPU benchmark.
"""
from __future__ import annotations

import math
import time
from typing import Mapping, Sequence

#: Message sizes of the link measurement (bytes): latency-bound to bandwidth-bound.
SIZES_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _coefficients(m: Mapping) -> tuple[float, float]:
    """``(a, c)`` with ``t_ms = a·λ_ms + c·(1/B in ms per byte)`` for one measurement."""
    s = float(m["bytes"])
    if m["kind"] == "exchange":
        return 1.0, s
    if m["kind"] == "allreduce":
        n = int(m["ranks"])
        return 2.0 * (n - 1), 2.0 * (n - 1) / n * s
    raise ValueError(f"unknown link measurement kind {m['kind']!r} (exchange or allreduce)")


def _lsq(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Relative least squares ``t ≈ a·λ + c·u`` over ``(a, c, t)`` rows, with ``λ ≥ 0`` and ``u > 0``."""
    w = [1.0 / t for _, _, t in rows]  # minimise Σ ((model - t) / t)²
    saa = sum(wi * wi * a * a for wi, (a, c, t) in zip(w, rows))
    sac = sum(wi * wi * a * c for wi, (a, c, t) in zip(w, rows))
    scc = sum(wi * wi * c * c for wi, (a, c, t) in zip(w, rows))
    sat = sum(wi * wi * a * t for wi, (a, c, t) in zip(w, rows))
    sct = sum(wi * wi * c * t for wi, (a, c, t) in zip(w, rows))
    det = saa * scc - sac * sac
    lat, inv_bw = ((sat * scc - sct * sac) / det, (saa * sct - sac * sat) / det) if det > 1e-30 * saa * scc else (-1.0, -1.0)
    if lat < 0 or inv_bw <= 0:
        if inv_bw > 0 and scc > 0:  # latency alone would be negative: bandwidth only
            lat, inv_bw = 0.0, sct / scc
        else:                       # bandwidth would be infinite (or not measurable): latency only
            lat, inv_bw = max(sat / saa, 1e-9), 1e-15
    return lat, inv_bw


def fit_link(measurements: Sequence[Mapping]) -> dict:
    """``{"latency_us", "bandwidth_gbps", "fit_error", "by_kind"}`` from ``[{"kind", "ranks", "bytes", "ms"}]``.

    The simulator has one ``(λ, B)`` for both uses of a link, but a backend need not behave alike in both
    (gloo's all-reduce reaches a quarter of its send/recv bandwidth). So each kind is fitted on its own
    (``by_kind``) and the link takes the latency of the **exchange** (wave boundaries move small activations:
    latency-bound) and the bandwidth of the **all-reduce** (gradient sync moves the large messages:
    bandwidth-bound); with one kind only, both come from it. ``fit_error`` is the largest relative error of
    the chosen ``(λ, B)`` over all measurements.

    >>> ms = [{"kind": "exchange", "ranks": 2, "bytes": s, "ms": 0.1 + s / 2e6} for s in (1e3, 1e6)]
    >>> ms += [{"kind": "allreduce", "ranks": 2, "bytes": s, "ms": 0.2 + s / 2e6} for s in (1e3, 1e6)]
    >>> r = fit_link(ms); round(r["latency_us"], 6), round(r["bandwidth_gbps"], 6), r["fit_error"] < 1e-9
    (100.0, 2.0, True)
    """
    rows = {}
    for m in measurements:
        if float(m["ms"]) > 0:
            rows.setdefault(m["kind"], []).append((*_coefficients(m), float(m["ms"])))
    if not rows:
        raise ValueError("no link measurements to fit")
    by_kind = {}
    for kind, rs in rows.items():
        lat, inv_bw = _lsq(rs)
        by_kind[kind] = {"latency_us": lat * 1e3, "bandwidth_gbps": 1.0 / inv_bw / 1e6,
                         "fit_error": max(abs(a * lat + c * inv_bw - t) / t for a, c, t in rs)}
    lat_kind = "exchange" if "exchange" in by_kind else next(iter(by_kind))
    bw_kind = "allreduce" if "allreduce" in by_kind else next(iter(by_kind))
    lat = by_kind[lat_kind]["latency_us"] * 1e-3
    inv_bw = 1.0 / (by_kind[bw_kind]["bandwidth_gbps"] * 1e6)
    err = max(abs(a * lat + c * inv_bw - t) / t for rs in rows.values() for a, c, t in rs)
    return {"latency_us": lat * 1e3, "bandwidth_gbps": 1.0 / inv_bw / 1e6, "fit_error": err, "by_kind": by_kind}


def cluster_fields(link: Mapping, *, name: str, gpus_per_node: int, memory_gib: float) -> dict:
    """:class:`~megatron_spindle.planner.workload.cluster.Cluster` fields for the measured link (one island): the
    link's latency and bandwidth, and the all-reduce's own ring-step latency when both kinds were measured."""
    bw = float(link["bandwidth_gbps"])
    lat = max(float(link["latency_us"]), 1e-3)
    if not (math.isfinite(bw) and bw > 0):
        raise ValueError(f"measured bandwidth {bw} GB/s is not a positive number")
    out = {"name": name, "gpus_per_node": gpus_per_node, "intra_bandwidth_gbps": bw,
           "inter_bandwidth_gbps": bw, "intra_latency_us": lat, "inter_latency_us": lat, "memory_gib": memory_gib}
    ar = (link.get("by_kind") or {}).get("allreduce")
    if ar is not None and "exchange" in link.get("by_kind", {}):  # both measured: the ring step's own latency
        out["allreduce_latency_us"] = max(float(ar["latency_us"]), 1e-3)
    return out


def measure_link(*, device, repeats: int = 30, warmup: int = 3, busy_ms: float | None = None,
                 sizes: Sequence[int] = SIZES_BYTES) -> list[dict]:
    """Time the exchange (processes 0 and 1) and the all-reduce (all processes); collective over the world.

    Measured in the runtime's regime: in the wave runtime an exchange follows a wave's compute, and a step
    adds up many of them. So before every timed repeat all processes compute for ``busy_ms`` (default 2 ms on
    CPU, 0 on GPUs, where the host is idle while kernels run) after a common barrier, and the point is the
    **mean** of the repeats, not the median. On a CPU whose cores are all busy with ranks, a message waits for
    the receiving thread to be scheduled; on a small VM this costs milliseconds now and then (2-core
    Firecracker VM, gloo: median 0.2 ms, mean 1-2 ms after 1-3 ms of compute), and only the mean adds up.

    Returns ``[{"kind", "ranks", "bytes", "ms" (mean), "median_ms", "busy_ms"}, ...]`` on every process (rank 0's
    clock). Needs at least two processes.
    """
    import torch  # optional: torch (fitting a link needs only numpy; measuring one needs torch)
    import torch.distributed as dist  # optional: torch, as above

    from .. import comm  # optional: torch, as above (comm imports it)

    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ValueError("measuring a link needs at least two processes")
    cuda = torch.device(device).type == "cuda"
    if busy_ms is None:
        busy_ms = 0.0 if cuda else 2.0
    work = torch.randn(96, 96)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def busy():
        end = time.perf_counter() + busy_ms * 1e-3
        while time.perf_counter() < end:
            work @ work

    out = []
    for nbytes in sizes:
        send = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        recv = torch.empty_like(send)
        for kind in ("exchange", "allreduce"):
            times = []
            for i in range(warmup + repeats):
                sync()
                comm.barrier()
                busy()
                t0 = time.perf_counter()
                if kind == "exchange":
                    if rank < 2:
                        peer = 1 - rank
                        works = comm.batch_isend_irecv([comm.send_op(send, peer), comm.recv_op(recv, peer)])
                        for w in works:
                            w.wait()
                else:
                    comm.all_reduce(send)
                sync()
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            times.sort()
            out.append({"kind": kind, "ranks": 2 if kind == "exchange" else world, "bytes": nbytes,
                        "ms": sum(times) / len(times), "median_ms": times[len(times) // 2], "busy_ms": busy_ms})
    return out
