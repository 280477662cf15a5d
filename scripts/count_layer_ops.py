#!/usr/bin/env python3
"""Count the compute operators of one forward + backward of every layer type (the analytic model's latencies).

The analytic device model (``megatron_spindle/planner/workload/analytic.py``) gives each layer type a fixed
latency proportional to how many kernels one forward + backward of it launches, relative to a transformer
layer (whose latency comes from FasterTransformer's A100 measurements). This script builds one layer of each
type of the built-in models (tiny size, local backend, CPU), profiles one forward + backward with
``torch.profiler`` and counts the leaf ``aten::`` operators that would launch a kernel on a GPU: views,
reshapes, allocations and casts to the same device do not. The counts are the ``FWD_BWD_OPS`` table there.

    python scripts/count_layer_ops.py
"""
from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from megatron_spindle.compat.cpu import apply_cpu_patches  # noqa: E402

#: Operators that launch no kernel: views, metadata, allocation, dispatch wrappers.
NO_KERNEL = frozenset({
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::view_as",
    "aten::transpose", "aten::t", "aten::permute", "aten::numpy_T", "aten::expand", "aten::expand_as",
    "aten::as_strided", "aten::slice", "aten::select", "aten::narrow", "aten::split", "aten::split_with_sizes",
    "aten::chunk", "aten::unbind", "aten::unsqueeze", "aten::squeeze", "aten::unsqueeze_", "aten::squeeze_",
    "aten::flatten", "aten::unflatten", "aten::alias", "aten::detach", "aten::detach_", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::new_empty", "aten::new_empty_strided", "aten::zeros_like", "aten::ones_like", "aten::to",
    "aten::_to_copy", "aten::contiguous", "aten::result_type", "aten::is_nonzero", "aten::item",
    "aten::_local_scalar_dense", "aten::set_", "aten::resize_", "aten::is_same_size", "aten::size",
    "aten::stride", "aten::dim", "aten::requires_grad_", "aten::_has_compatible_shallow_copy_type"})
MODELS = ("multitask-clip", "qwen-val", "ofasys")


def count_ops(layer, inputs, loss_layer: bool) -> int:
    layer(inputs)  # warm-up: lazy initialisation is not part of a step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = layer(inputs)
        (out if loss_layer else out.sum()).backward()
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in NO_KERNEL:
            continue
        if any(c.name.startswith("aten::") and c.name not in NO_KERNEL for c in e.cpu_children):
            continue  # a composite: its children are counted
        n += 1
    return n


def main() -> None:
    apply_cpu_patches()
    warnings.filterwarnings("ignore")
    from megatron_spindle.models.shapes import LOSS_OP_TYPES, example_inputs
    from megatron_spindle.models.layers import build_layer
    from megatron_spindle.planner.workload.workloads import build_graph
    counts: dict[str, set[int]] = {}
    for model in MODELS:
        g = build_graph(model, size="tiny", batch=4)
        first = {}
        for op in g.operators:
            first.setdefault(op.op_type, op)
        for t, op in first.items():
            layer = build_layer(op, seed=0, graph=g, backend="local")
            inputs = example_inputs(op, 4, graph=g, generator=torch.Generator().manual_seed(0),
                                    requires_grad=True)
            counts.setdefault(t, set()).add(count_ops(layer, inputs, op.op_type in LOSS_OP_TYPES))
    ref = max(counts["transformer_layer"])
    print(f"{'layer type':20s} {'ops (fwd+bwd)':>14s} {'/ transformer':>14s}")
    for t, c in sorted(counts.items(), key=lambda kv: -max(kv[1])):
        print(f"{t:20s} {'/'.join(map(str, sorted(c))):>14s} {max(c) / ref:14.3f}")


if __name__ == "__main__":
    main()
