"""Per-sample shapes of operator inputs and outputs, and example inputs (tests, the profiler, transfer sizes).

Follows the conventions of :mod:`.layers` (batch-first activations, a loss is a scalar, a decoder layer carries
its memory after the target).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..planner.workload.graph import DATA_PREFIX, Operator, TaskGraph
from .custom import custom_input_shape, torch_layer
from .data import stream_spec_for

#: Operator types that produce a loss scalar.
LOSS_OP_TYPES = frozenset({"contrastive_loss", "lm_head"})


def output_shape(op: Operator) -> tuple[int, ...]:
    """Per-sample shape of the operator's output (``()`` for a loss)."""
    c = op.layer
    if op.op_type in LOSS_OP_TYPES or getattr(torch_layer(op.op_type), "loss", False):
        return ()
    if op.op_type == "pool_head":
        return (c.proj_dim,)
    if op.op_type == "decoder_layer":
        return (c.seq_len + c.memory_seq_len, c.hidden)
    return (c.seq_len, c.hidden)


def input_shapes(op: Operator, graph: TaskGraph | None = None) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per-sample ``(shape, dtype)`` of each input of ``op``, in order.

    Operator inputs take their producer's :func:`output_shape` (``graph`` needed when there are several);
    a lone operator input is the shape the layer expects; data streams follow ``models.data``.
    """
    c = op.layer
    acts = [n for n in op.inputs if not n.startswith(DATA_PREFIX)]
    own = {"transformer_layer": (c.seq_len, c.hidden),
           "decoder_layer": (c.seq_len + c.memory_seq_len, c.hidden),
           "pool_head": (c.seq_len, c.hidden), "lm_head": (c.seq_len, c.hidden),
           "contrastive_loss": (c.proj_dim,),
           "cross_attn_adapter": (c.input_seq_len, c.input_dim),
           "linear_adapter": (c.input_seq_len or c.seq_len, c.input_dim)}.get(op.op_type) \
        or custom_input_shape(op)
    out = []
    for i, name in enumerate(op.inputs):
        if name.startswith(DATA_PREFIX):
            spec = stream_spec_for(op, i)
            out.append((spec.shape, spec.dtype))
        elif graph is not None:
            out.append((output_shape(graph[name]), torch.float32))
        elif len(acts) == 1 or op.op_type == "contrastive_loss":
            out.append((own, torch.float32))
        else:
            raise ValueError(f"operator {op.name!r} has {len(acts)} operator inputs: pass the graph to "
                             f"know how its sequence splits between them")
    return out


def example_inputs(op: Operator, batch: int, *, graph: TaskGraph | None = None,
                   generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
                   device=None, requires_grad: bool = False) -> list[Tensor]:
    """Random inputs of ``op`` for ``batch`` samples: normal activations, token ids below the vocabulary (a type
    registered with its own ``example_inputs``: those)."""
    own = torch_layer(op.op_type)
    if own is not None and own.example_inputs is not None:
        return own.example_inputs(op, batch, generator=generator, dtype=dtype, device=device,
                                  requires_grad=requires_grad, graph=graph)
    out = []
    for shape, dt in input_shapes(op, graph):
        if dt.is_floating_point:
            x = torch.randn((batch, *shape), generator=generator).to(dtype=dtype, device=device)
            out.append(x.requires_grad_(requires_grad))
        else:
            out.append(torch.randint(0, op.layer.vocab_size, (batch, *shape), generator=generator,
                                     device="cpu").to(device))
    return out
