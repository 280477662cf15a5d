"""The runtime's own cost per slice, measured on the backend: what the executor spends on a slice beyond its layers.

The curves price a slice as the sum of its layers' forward + backward, each timed alone (:mod:`.timing`). The
executor (:class:`megatron_spindle.runtime.executor.SpindleModel`) spends more per slice: it assembles the
slice's inputs (the batch's rows of its samples, the received pieces concatenated, leaves made), enters the
slice's modules through their hooks, and in the backward runs megatron.core DDP's gradient hooks (each
parameter's gradient added into its bucket) and fills the gradients of unused inputs. :func:`measure_slices`
measures that directly, every profile process at once:

1. plan the profiled model on the profile's own processes (:func:`..planner.step.build.make_plan` with the
   analytic curves: only the slices' shapes are needed), build the executor on it and run ``warmup + passes``
   passes of synthetic data (:class:`..models.data.SyntheticData`), forward, backward and the gradient sync,
   as a training step does; a slice's ``fwd`` and ``bwd`` are the medians of its spans over the timed passes
   (a pass slowed by another process on shared cores does not move them; the training line's measured step is
   a median too, :mod:`..megatron.trainer.prediction`);
2. time every layer of this process's slices alone at the slice's local batch, as the profile's points are
   timed (:func:`.timing.time_layer`, the median of the repeats); a slice's **point** is their sum;
3. :func:`fit_slices`: ``fwd + bwd ≈ a + k·point`` over every measured slice of every process, least squares
   on the relative error with ``a ≥ 0`` and ``k ≥ 1`` (:func:`.runtime_costs.nonneg_fit` of ``fwd + bwd − point``
   on ``1`` and ``point``): ``a`` the fixed part (input assembly, entering the
   slice's modules), ``k`` the scale on its layers (megatron.core DDP's hook on every parameter's gradient, the
   layers run among the executor's other work rather than alone; seen here 1.1-1.4 on 2 CPU ranks, where a
   fixed part alone left big slices 0.5-1.8 ms short). ``a`` is split by the forward's own excess:
   ``fwd_ms = mean(fwd − s·k·point)`` clipped to ``[0, a]``, ``bwd_ms = a − fwd_ms``, ``s`` the simulator's
   forward share (:data:`..planner.workload.recompute.FORWARD_SHARE`, how the timeline splits a slice). The
   fit error is the largest relative error of ``a + k·point`` against a slice's measured ``fwd + bwd`` (large
   on the smallest slices, whose spans are a few tenths of a millisecond), ``rms_ms`` the root mean square of
   that residual in milliseconds.

Slices with tensor parallelism are not measured (a layer's point would need its group at once); nothing is
measured when no plan of the model fits the profile's processes, nor on CUDA (the executor's spans are host times there, not the device's), so a GPU profile charges
no per-slice cost.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Mapping, Sequence

import numpy as np

from ..planner.step.build import make_plan
from ..planner.workload.recompute import FORWARD_SHARE
from .runtime_costs import nonneg_fit


def fit_slices(measurements: Sequence[Mapping], share: float = FORWARD_SHARE) -> dict:
    """``{"fwd_ms", "bwd_ms", "scale", "fit_error", "rms_ms", "slices", "measurements"}`` (module docstring)
    from :func:`measure_slices`'s list of ``{"slice", "rank", "fwd_ms", "bwd_ms", "point_ms"}``.

    >>> r = fit_slices([{"fwd_ms": 1.5, "bwd_ms": 2.5, "point_ms": 3.0}, {"fwd_ms": 2.5, "bwd_ms": 4.5, "point_ms": 6.0}],
    ...                share=1/3)
    >>> round(r["fwd_ms"], 9), round(r["bwd_ms"], 9), round(r["scale"], 9)
    (0.5, 0.5, 1.0)
    >>> fit_slices([{"fwd_ms": 1.0, "bwd_ms": 2.0, "point_ms": 6.0}])["bwd_ms"]
    0.0
    """
    if not measurements:
        raise ValueError("per-slice cost fit: no measured slices")
    n = len(measurements)
    p = np.array([float(m["point_ms"]) for m in measurements])
    t = np.array([float(m["fwd_ms"]) + float(m["bwd_ms"]) for m in measurements])
    w = 1.0 / np.maximum(t, 1e-9)  # relative error: the many small slices and the few big ones alike
    # t − p ≈ a + r·p with a, r ≥ 0, on the relative error of t: k = 1 + r
    (a, r), _ = nonneg_fit(np.stack([np.ones_like(p), p], axis=1), t - p, weights=w)
    k = 1.0 + r
    fwd = min(a, max(0.0, float(np.mean([m["fwd_ms"] - share * k * m["point_ms"] for m in measurements]))))
    res = a + k * p - t
    err = float(np.max(np.abs(res) * w))
    return {"fwd_ms": fwd, "bwd_ms": a - fwd, "scale": k, "fit_error": err,
            "rms_ms": float(np.sqrt(np.mean(res * res))), "slices": n,
            "measurements": [dict(m) for m in measurements]}


def measure_slices(graph, cluster, *, device, passes: int = 15, warmup: int = 3, rounds: int = 3,
                   layer_warmup: int = 3, layer_repeats: int = 10, min_seconds: float = 0.2) -> list[dict]:
    """Every process's slices of one plan of ``graph`` on ``cluster`` resized to the world (module docstring);
    collective over the world; the same list on every process (empty on CUDA or without a plan that fits).

    The executor's passes and the layers' timings alternate in ``rounds`` rounds (``passes / rounds`` passes,
    then every layer for ``min_seconds / rounds``), so that a stretch of other load on a shared machine falls
    on both sides of the comparison alike instead of on one."""
    import torch  # optional: torch (fitting needs none)
    import torch.distributed as dist  # optional: torch, as above

    from .. import comm  # optional: torch, as above
    from ..models.data import SyntheticData  # optional: torch, as above
    from ..runtime.executor import SpindleModel  # optional: torch, as above
    from .timing import time_layer  # optional: torch, as above

    if rounds < 1 or passes < rounds:
        raise ValueError(f"per-slice cost: need 1 <= rounds <= passes, got rounds={rounds}, passes={passes}")
    device = torch.device(device)
    if device.type == "cuda":
        return []
    rank, world = dist.get_rank(), dist.get_world_size()
    try:  # the same on every process (planning is deterministic), before any collective
        plan = make_plan(graph, dataclasses.replace(cluster, num_devices=world,
                                                    gpus_per_node=min(cluster.gpus_per_node, world)))
    except ValueError:
        return []  # no plan of the model fits the profile's processes: not measured
    model = SpindleModel(plan, graph, seed=0, timeout_s=300, device=device)
    data = SyntheticData(graph, seed=0)
    metaops = {m.name: m for m in plan.metaops}
    mine = [s for s in plan.rank_slices(rank) if metaops[s.metaop].tp == 1]  # tensor-parallel: not measured
    samples: dict[tuple[str, int], list[float]] = {}  # (slice, layer) -> this layer's repeats, every round
    step = 0
    for r in range(rounds):
        for _ in range((warmup if r == 0 else 0) + passes // rounds + (r < passes % rounds)):
            model.trace.step = step
            st = model(data.batch(step))
            model.backward(st)
            model.finalize_grads()
            step += 1
        for s in mine:
            a, b = model.local_range(s)
            op = metaops[s.metaop]
            for layer in range(s.layer_start, s.layer_stop):
                samples.setdefault((s.name, layer), []).extend(time_layer(
                    graph, op.operators[layer], b - a, warmup=layer_warmup, repeats=layer_repeats,
                    min_seconds=min_seconds / rounds, device=device))
    per_pass: dict[str, dict[int, float]] = {}
    for sp in model.trace.spans:
        if sp.step >= warmup and sp.cat in ("forward", "backward"):
            got = per_pass.setdefault(sp.name, {})
            got[sp.step] = got.get(sp.step, 0.0) + sp.dur_s * 1e3
    spans = {name: statistics.median(got.values()) for name, got in per_pass.items()}
    out = []
    for s in mine:
        if f"{s.name} fwd" not in spans or f"{s.name} bwd" not in spans:
            continue  # no backward (frozen): not measured
        a, b = model.local_range(s)
        point = sum(statistics.median(samples[(s.name, layer)]) for layer in range(s.layer_start, s.layer_stop))
        out.append({"slice": s.name, "rank": rank, "layers": s.layer_stop - s.layer_start, "local_batch": b - a,
                    "fwd_ms": spans[f"{s.name} fwd"], "bwd_ms": spans[f"{s.name} bwd"], "point_ms": point})
    model.destroy()
    return [m for got in comm.all_gather_object(out) for m in got]
