"""Activation recompute of a transformer or decoder layer, as the plan's ``MetaOp.recompute`` says.

What each mode keeps for backward and what it costs is the planner's (:mod:`..planner.workload.recompute`);
here it is built from megatron.core's own machinery:

* ``selective``: the layer's ``TransformerConfig`` has ``recompute_granularity="selective"`` and
  ``recompute_modules=["layernorm", "mlp"]`` (:func:`config_kwargs`), so megatron's ``TransformerLayer`` runs its
  input and pre-MLP layer norms under ``tensor_parallel.CheckpointWithoutOutput`` (their outputs are freed once
  used and recomputed in backward) and its MLP under ``tensor_parallel.checkpoint`` (only the MLP's input is
  saved, itself a freed norm output). A decoder layer's norm before cross-attention is not one of megatron's
  recomputed modules and keeps its output;
* ``full``: only each layer's input is kept: the layer's forward runs inside ``tensor_parallel.checkpoint``
  (megatron's ``CheckpointFunction``: it saves the CPU generator, the RNG tracker's states and the CUDA
  generator's, and restores them around the recomputation, so dropout would draw the same masks), and the whole
  layer runs again in backward (:func:`run`). megatron.core's own full recompute (``recompute_granularity=
  "full"``) lives in ``TransformerBlock``, around chunks of a block's layers; a layer built on its own has no
  block, so the checkpoint goes around each layer, which is the block's ``uniform`` method with one layer
  per chunk.

Two defects of megatron.core (0.16.1 and 0.19.2 alike) are dealt with on the way:

1. ``CheckpointWithoutOutput`` needs TransformerEngine even without fp8
   (:func:`~megatron_spindle.compat.mcore.fix_checkpoint_without_te`);
2. the MLP returns its output projection's bias *Parameter* itself as the second output (``skip_bias_add``;
   our GELU layers have biases). Under ``tensor_parallel.checkpoint`` that Parameter becomes an output of
   ``CheckpointFunction``, autograd gives the leaf a ``grad_fn`` pointing to the checkpoint, and the backward
   recurses into itself until memory runs out. :func:`prepare_core` hooks the MLP to return a copy of the bias
   instead (``h`` numbers; its gradient flows back to the bias as before).

A weight shared by operators that recompute differently (two MetaOps of one encoder, one ``selective``, one
not) needs two megatron layers, since the config decides at construction: the second is built with its own
config and its parameters are replaced by the first one's (:func:`tie_parameters`), so both train one weight.
"""
from __future__ import annotations

from typing import Callable

import torch
from megatron.core import tensor_parallel
from torch import Tensor, nn

from ..compat.mcore import fix_checkpoint_without_te
from ..planner.workload.recompute import RECOMPUTABLE
from ..planner.workload.metaops import RECOMPUTE

#: megatron's modules that selective recompute runs again (``recompute_modules``).
SELECTIVE_MODULES = ("layernorm", "mlp")


def check_mode(op_name: str, op_type: str, mode: str) -> None:
    """One line naming the value when ``mode`` is not a mode ``op_type`` can run."""
    if mode not in RECOMPUTE:
        raise ValueError(f"operator {op_name!r}: recompute {mode!r} is not one of {list(RECOMPUTE)}")
    if mode != "none" and op_type not in RECOMPUTABLE:
        raise ValueError(f"operator {op_name!r} ({op_type}) cannot recompute ({mode!r}); only "
                         f"{sorted(RECOMPUTABLE)} layers can")


def config_kwargs(mode: str) -> dict:
    """The ``TransformerConfig`` fields of ``mode`` (only ``selective`` sets any)."""
    if mode != "selective":
        return {}
    return {"recompute_granularity": "selective", "recompute_modules": list(SELECTIVE_MODULES)}


def selective(core: nn.Module) -> bool:
    """Whether megatron built ``core`` to recompute selectively (from its config, megatron's record)."""
    return getattr(getattr(core, "config", None), "recompute_granularity", None) == "selective"


def _bias_copy(module: nn.Module, args, out):
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], nn.Parameter):
        return out[0], out[1].clone()
    return None


def prepare_core(core: nn.Module) -> nn.Module:
    """Make a selectively recomputing megatron layer run here (the two defects of the module docstring)."""
    if selective(core):
        fix_checkpoint_without_te()
        mlp = getattr(core, "mlp", None)
        if mlp is not None and not getattr(mlp, "_spindle_bias_copy", False):
            mlp.register_forward_hook(_bias_copy)
            mlp._spindle_bias_copy = True
    return core


def tie_parameters(core: nn.Module, source: nn.Module) -> nn.Module:
    """Replace every parameter of ``core`` by ``source``'s of the same name (the same objects: one weight)."""
    theirs = dict(source.named_parameters())
    mine = [name for name, _ in core.named_parameters()]
    if sorted(mine) != sorted(theirs):
        raise ValueError(f"cannot share parameters between layers with different parameters: "
                         f"{sorted(set(mine) ^ set(theirs))[:3]}")
    for name in mine:
        owner, _, leaf = name.rpartition(".")
        setattr(core.get_submodule(owner) if owner else core, leaf, theirs[name])
    return core


def run(mode: str, fn: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
    """``fn(*tensors)``; under ``full`` recompute inside megatron's ``tensor_parallel.checkpoint``.

    Only while gradients are recorded and an input needs one: megatron's checkpoint is reentrant, so a layer
    whose inputs need no gradient would hand none to its weights (no stash to save then, either way).
    """
    if mode == "full" and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return tensor_parallel.checkpoint(fn, False, *tensors)
    return fn(*tensors)
