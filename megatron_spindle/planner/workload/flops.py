"""Model FLOPs of one training step and MFU (model FLOPs utilization).

Model FLOPs are the FLOPs the model needs per optimizer step, whatever the system does to run it: every
layer's forward (:mod:`.costs`' count, the one the analytic curves use: matrix multiplications at 2 FLOPs per
multiply-add plus the attention products) and its backward, twice the forward for a trained layer
(:func:`.recompute.backward_share`: a frozen layer computes only its input's gradient, half the backward, or no
backward at all when nothing before it trains). Activation recompute is **not** model FLOPs: a system that
recomputes does more work for the same model FLOPs, so its MFU is lower, as Megatron-LM and the PaLM paper
count it.

    MFU = model FLOPs per step / (step time · devices · peak FLOP/s per device)

For reference, published end-to-end MFU of multi-modal training at scale: DistTrain 54.7 % (72B multimodal
model, 1,172 GPUs), OrchMLLM 41.6 % (84B, 2,560 H100s).
"""
from __future__ import annotations

from typing import Iterable

from .graph import TaskGraph
from .metaops import MetaOp, contract
from .recompute import backward_share


def metaop_model_flops(metaops: Iterable[MetaOp]) -> float:
    """Forward + backward model FLOPs of one pass of ``metaops`` (all their layers), nothing recomputed."""
    return sum(m.fwd_flops_per_layer * m.num_layers * (1.0 + 2.0 * backward_share(m)) for m in metaops)


def step_model_flops(pass_graph: TaskGraph, passes: int) -> float:
    """Model FLOPs of one optimizer step: ``passes`` passes of ``pass_graph`` (the graph of one pass)."""
    if passes < 1:
        raise ValueError(f"passes={passes!r} must be a positive integer")
    return passes * metaop_model_flops(contract(pass_graph))


def tflops_per_device(model_flops: float, step_ms: float, devices: int) -> float:
    """Model TFLOP/s per device: ``model_flops`` done in ``step_ms`` on ``devices`` devices."""
    if step_ms <= 0 or devices < 1:
        raise ValueError(f"step_ms={step_ms!r} and devices={devices!r} must be positive")
    return model_flops / (step_ms * 1e-3) / devices / 1e12


def mfu(model_flops: float, step_ms: float, devices: int, peak_tflops: float) -> float:
    """Model FLOPs utilization: achieved model TFLOP/s per device over the device's peak TFLOP/s."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops={peak_tflops!r} must be positive")
    return tflops_per_device(model_flops, step_ms, devices) / peak_tflops
