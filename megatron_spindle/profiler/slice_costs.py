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
   as a training step does; each slice's ``fwd`` and ``bwd`` span of the executor's trace is averaged over the
   timed passes (means, as the other runtime costs: a descheduled slice counts as in a step);
2. time every layer of this process's slices alone at the slice's local batch, as the profile's points are
   timed (:func:`.timing.time_layer`, the median of the repeats); a slice's **point** is their sum;
3. :func:`fit_slices`: ``fwd_ms = mean(fwd − s·point)`` and ``bwd_ms = mean(bwd − (1 − s)·point)`` over
   every measured slice of every process, ``s`` the simulator's forward share
   (:data:`..planner.workload.recompute.FORWARD_SHARE`, how the timeline splits a slice), each clipped at 0;
   the fit error is the largest relative error of ``point + fwd_ms + bwd_ms`` against a slice's measured
   ``fwd + bwd`` (large on the smallest slices, whose spans are a few tenths of a millisecond), ``rms_ms`` the
   root mean square of that residual in milliseconds.

Slices with tensor parallelism are not measured (a layer's point would need its group at once); nothing is
measured when no plan of the model fits the profile's processes, nor on CUDA (the executor's spans are host times there, not the device's), so a GPU profile charges
no per-slice cost.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Mapping, Sequence

from ..planner.step.build import make_plan
from ..planner.workload.recompute import FORWARD_SHARE


def fit_slices(measurements: Sequence[Mapping], share: float = FORWARD_SHARE) -> dict:
    """``{"fwd_ms", "bwd_ms", "fit_error", "rms_ms", "slices", "measurements"}`` (module docstring) from
    :func:`measure_slices`'s list of ``{"slice", "rank", "fwd_ms", "bwd_ms", "point_ms"}``.

    >>> fit_slices([{"fwd_ms": 1.5, "bwd_ms": 2.5, "point_ms": 3.0}, {"fwd_ms": 2.5, "bwd_ms": 4.5, "point_ms": 6.0}],
    ...            share=1/3)["fwd_ms"], fit_slices([{"fwd_ms": 1.0, "bwd_ms": 2.0, "point_ms": 6.0}])["bwd_ms"]
    (0.5, 0.0)
    """
    if not measurements:
        raise ValueError("per-slice cost fit: no measured slices")
    n = len(measurements)
    fwd = max(0.0, sum(m["fwd_ms"] - share * m["point_ms"] for m in measurements) / n)
    bwd = max(0.0, sum(m["bwd_ms"] - (1 - share) * m["point_ms"] for m in measurements) / n)
    res = [m["point_ms"] + fwd + bwd - m["fwd_ms"] - m["bwd_ms"] for m in measurements]
    err = max(abs(r) / max(m["fwd_ms"] + m["bwd_ms"], 1e-9) for r, m in zip(res, measurements))
    return {"fwd_ms": fwd, "bwd_ms": bwd, "fit_error": err, "rms_ms": (sum(r * r for r in res) / n) ** 0.5,
            "slices": n, "measurements": [dict(m) for m in measurements]}


def measure_slices(graph, cluster, *, device, passes: int = 5, warmup: int = 2, layer_warmup: int = 3,
                   layer_repeats: int = 10, min_seconds: float = 0.2) -> list[dict]:
    """Every process's slices of one plan of ``graph`` on ``cluster`` resized to the world (module docstring);
    collective over the world; the same list on every process (empty on CUDA or without a plan that fits)."""
    import torch  # optional: torch (fitting needs none)
    import torch.distributed as dist  # optional: torch, as above

    from .. import comm  # optional: torch, as above
    from ..models.data import SyntheticData  # optional: torch, as above
    from ..runtime.executor import SpindleModel  # optional: torch, as above
    from .timing import time_layer  # optional: torch, as above

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
    for i in range(warmup + passes):
        model.trace.step = i
        st = model(data.batch(i))
        model.backward(st)
        model.finalize_grads()
    spans: dict[str, float] = {}
    for s in model.trace.spans:
        if s.step >= warmup and s.cat in ("forward", "backward"):
            spans[s.name] = spans.get(s.name, 0.0) + s.dur_s * 1e3 / passes
    metaops = {m.name: m for m in plan.metaops}
    mine = []
    for s in plan.rank_slices(rank):
        m = metaops[s.metaop]
        if m.tp > 1 or f"{s.name} fwd" not in spans or f"{s.name} bwd" not in spans:
            continue  # tensor-parallel, or no backward (frozen): not measured
        a, b = model._local_range(s)
        point = 0.0
        for layer in range(s.layer_start, s.layer_stop):
            point += statistics.median(time_layer(graph, m.operators[layer], b - a, warmup=layer_warmup,
                                                  repeats=layer_repeats, min_seconds=min_seconds, device=device))
        mine.append({"slice": s.name, "rank": rank, "layers": s.layer_stop - s.layer_start, "local_batch": b - a,
                     "fwd_ms": spans[f"{s.name} fwd"], "bwd_ms": spans[f"{s.name} bwd"], "point_ms": point})
    model.destroy()
    return [m for got in comm.all_gather_object(mine) for m in got]
