"""Per-device memory estimates: model states of the layers a device holds, plus stashed activations.

* **Model states**: a device that runs any slice containing layer ``k`` of a weight holds that layer's shard
  (``params / tp``) once, whatever number of slices and tasks use it (co-locating slices that share
  parameters saves memory). ``BYTES_PER_PARAM_STATE`` bytes per parameter (see :mod:`.metaops`).
* **Activations**: a step runs every forward wave before any backward wave, so every slice a device runs
  keeps its stash until the backward pass: ``local batch × act_bytes_per_sample × layers``, reduced by
  tensor parallelism as in Korthikanti et al. (the ``10·s·h`` of norms and residuals stays replicated, the
  rest is split): factor ``0.3 + 0.7/tp``.
"""
from __future__ import annotations

from typing import Iterable

from .metaops import BYTES_PER_PARAM_STATE, MetaOp


def tp_activation_factor(tp: int) -> float:
    return 0.3 + 0.7 / tp


def slice_activation_bytes(m: MetaOp, num_layers: int, num_devices: int) -> float:
    """Stashed activation bytes per device of a slice of ``m`` on ``num_devices`` devices."""
    dp = num_devices // m.tp
    local = m.batch / dp if m.batch_splittable else m.batch
    return local * m.act_bytes_per_sample * num_layers * tp_activation_factor(m.tp)


def layer_state_bytes(m: MetaOp) -> float:
    """Model-state bytes per device of one layer of ``m`` (its TP shard)."""
    return m.params_per_layer / m.tp * BYTES_PER_PARAM_STATE


def slice_param_keys(m: MetaOp, layer_start: int, num_layers: int) -> Iterable[str]:
    return (k for k in m.param_keys[layer_start:layer_start + num_layers] if k)
