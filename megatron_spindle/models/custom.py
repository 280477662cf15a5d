"""The torch side of custom layer types (registered in :mod:`megatron_spindle.planner.workload.layer_types`).

A custom type's build function returns a module whose ``forward(x)`` maps the concatenation of the
operator's inputs, ``[b, input_seq_len, input_dim]`` (batch first), to ``[b, seq_len, hidden]``.
``layers.CustomOpLayer`` (through :func:`custom_forward`) checks both shapes around it; everything else
(seeded initialisation per ``param_key``, weight sharing, tensor-parallel shards through megatron's
parameter attributes, gradient sync over the parameter device group) is what every built-in layer gets from
``layers.build_layer``.

A type whose forward needs more (its data streams, several inputs kept apart, a loss) registers its torch half
here too (:func:`register_torch_layer`, :class:`TorchLayerType`): its own ``OperatorLayer`` subclass, the shapes of
the data streams it reads, and optionally how synthetic data and profiling inputs for it are made. The MIMO
operators (:mod:`.mimo_layers`) are such types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from ..planner.workload.graph import Operator
from ..planner.workload.layer_types import custom_layer_type


@dataclass(frozen=True, kw_only=True)
class TorchLayerType:
    """The torch half of a registered layer type whose forward is its own."""

    build: Callable
    """``build(op, *, tp_group, tp_rank, tp_size, dtype) -> nn.Module``: the parameter module ("core")."""
    layer_class: type
    """An ``OperatorLayer`` subclass; ``forward(inputs)`` gets every input in ``op.inputs`` order, data included."""
    loss: bool = False
    """Its output is a loss (a scalar: the sum over the local samples over the global count, as every loss)."""
    stream_spec: Callable | None = None
    """``stream_spec(op, position, task, stream) -> models.data.StreamSpec`` of the data stream at ``position``."""
    synthesize: Callable | None = None
    """``synthesize(op, specs, z, seed) -> {stream: tensor}``: streams of its task's synthetic batch (latent ``z``)."""
    example_inputs: Callable | None = None
    """``example_inputs(op, batch, *, generator, dtype, device, requires_grad, graph) -> [tensor]`` (profiling)."""


_TORCH: dict[str, TorchLayerType] = {}


def register_torch_layer(op_type: str, t: TorchLayerType) -> None:
    """Register (or replace) the torch half of a layer type registered in the planner's registry."""
    if custom_layer_type(op_type) is None:
        raise ValueError(f"layer type {op_type!r} is not registered (planner.workload.layer_types.register_layer_type)")
    _TORCH[op_type] = t


def torch_layer(op_type: str) -> TorchLayerType | None:
    return _TORCH.get(op_type)


def build_custom_core(op: Operator, *, tp_group, tp_size: int, dtype: torch.dtype) -> nn.Module:
    """The parameter module of a custom-type operator, from its registered build function."""
    own = _TORCH.get(op.op_type)
    t = custom_layer_type(op.op_type)
    if own is not None:
        t = own
    elif t is None or t.build is None:
        raise ValueError(f"operator {op.name!r}: layer type {op.op_type!r} has no registered build function "
                         f"(register_layer_type(..., build=...) in the spec's layer_plugins)")
    tp_rank = tp_group.rank() if tp_group is not None and tp_size > 1 else 0
    core = t.build(op, tp_group=tp_group, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
    if not isinstance(core, nn.Module):
        raise ValueError(f"build function of layer type {op.op_type!r} returned {type(core).__name__}, "
                         f"not a torch.nn.Module")
    return core


def custom_supports_tp(op_type: str) -> bool:
    t = custom_layer_type(op_type)
    return t is not None and t.tensor_parallel


def custom_input_shape(op: Operator) -> tuple[int, int]:
    c = op.layer
    return (c.input_seq_len or c.seq_len, c.input_dim or c.hidden)


def custom_forward(layer, inputs: list[Tensor]) -> Tensor:
    """Forward of a custom-type operator layer: check the input, run the registered module, check the output."""
    x, _ = layer._split(inputs)
    layer._check(x, custom_input_shape(layer.op), "input")
    y = layer.core(x)
    c = layer.op.layer
    if tuple(y.shape) != (x.shape[0], c.seq_len, c.hidden):
        raise ValueError(f"operator {layer.op.name!r} ({layer.op.op_type}): the registered layer returned "
                         f"{list(y.shape)}, expected [{x.shape[0]}, {c.seq_len}, {c.hidden}]")
    return y
