"""Per-device memory estimates: model states of the layers a device holds, plus stashed activations.

* **Model states**: a device that runs any slice containing layer ``k`` of a weight holds that layer's shard
  (``params / tp``) once, whatever number of slices and tasks use it (co-locating slices that share
  parameters saves memory). Mixed-precision Adam as Megatron-LM runs it: bf16 weight (2 bytes), fp32 main
  gradient (4), fp32 master weight and two moments (12: ``BYTES_PER_PARAM_STATE`` = 18, :mod:`.metaops`);
  with the distributed optimizer (ZeRO-1, megatron.core's ``DistributedOptimizer``) the 12 optimizer bytes
  are sharded over the devices that hold the weight; a frozen weight keeps only its 2 bytes.
* **Activations**: within a phase (the plan's waves run phase by phase, each phase's forward waves then its
  backward waves), every slice a device runs keeps its stash until its backward: ``local batch ×
  act bytes per sample (after recompute, :mod:`.recompute`) × layers``, reduced by tensor parallelism as in
  Korthikanti et al. (the ``10·s·h`` of norms and residuals stays replicated, the rest is split): factor
  ``0.3 + 0.7/tp``. A device's peak is its states plus its largest phase's activations.
"""
from __future__ import annotations

from typing import Iterable

from .metaops import BYTES_PER_PARAM_STATE, FROZEN_BYTES_PER_PARAM, MetaOp
from .recompute import act_bytes_per_sample

#: Bytes per parameter of a bf16 weight, its fp32 main gradient, and Adam's fp32 master weight + moments.
WEIGHT_BYTES = FROZEN_BYTES_PER_PARAM
GRAD_BYTES = 4
OPTIMIZER_BYTES = BYTES_PER_PARAM_STATE - WEIGHT_BYTES - GRAD_BYTES


def tp_activation_factor(tp: int) -> float:
    return 0.3 + 0.7 / tp


def slice_activation_bytes(m: MetaOp, num_layers: int, num_devices: int) -> float:
    """Stashed activation bytes per device of a slice of ``m`` on ``num_devices`` devices."""
    dp = num_devices // m.tp
    local = m.batch / dp if m.batch_splittable else m.batch
    return local * act_bytes_per_sample(m) * num_layers * tp_activation_factor(m.tp)


def layer_state_bytes(m: MetaOp, *, holders: int = 1, distributed_optimizer: bool = False) -> float:
    """Model-state bytes per device of one layer of ``m`` (its TP shard); ``holders``: devices holding this
    shard (the distributed optimizer splits the optimizer state over them)."""
    shard = m.params_per_layer / m.tp
    if not m.trainable:
        return shard * WEIGHT_BYTES
    opt = OPTIMIZER_BYTES / max(1, holders) if distributed_optimizer else OPTIMIZER_BYTES
    return shard * (WEIGHT_BYTES + GRAD_BYTES + opt)


def slice_param_keys(m: MetaOp, layer_start: int, num_layers: int) -> Iterable[str]:
    return (k for k in m.param_keys[layer_start:layer_start + num_layers] if k)
