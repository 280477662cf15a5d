"""The optimizer step, measured: the part of a training step after the gradient sync that has no curve.

The trainer's optimizer step (:func:`megatron_spindle.megatron.trainer.loop.make_optimizer`: ``torch.optim.AdamW``
over the rank's unique parameters, fp32 master weights when training in bf16) costs a fixed part, a part
per parameter tensor (PyTorch's CPU AdamW loops over tensors) and a part per element. :func:`measure_optimizer`
times ``zero_grad + step`` of a fresh AdamW on a few shapes (tensors x elements), every process at once (so
processes sharing cores are measured as they train), and :func:`fit_optimizer` fits::

    t_ms = a + b · tensors + c · elements / 1e6

by least squares weighted by ``1/t`` (relative errors; coefficients clipped at 0 and the rest refitted).
:func:`optimizer_ms` evaluates it for one rank's parameters. The result goes into the curves file's
``measured.optimizer`` (:mod:`.run`); the trainer's live prediction (:mod:`megatron_spindle.megatron.trainer.prediction`)
reads it.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

import torch

from .points import median
from .runtime_costs import nonneg_fit

#: (tensors, elements per tensor) of the measured shapes: few and many tensors, small and large totals.
SHAPES = ((4, 1 << 12), (64, 1 << 12), (4, 1 << 18), (32, 1 << 16), (8, 1 << 19))
WARMUP = 3
REPEATS = 9


def measure_optimizer(device: torch.device, *, shapes: Sequence[tuple[int, int]] = SHAPES,
                      warmup: int = WARMUP, repeats: int = REPEATS) -> list[dict]:
    """Median milliseconds of one AdamW ``step`` + ``zero_grad`` per shape, as the trainer runs it."""
    out = []
    for k, size in shapes:
        params = [torch.nn.Parameter(torch.randn(size, device=device)) for _ in range(k)]
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
        times = []
        for i in range(warmup + repeats):
            for p in params:
                p.grad = torch.ones_like(p)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        out.append({"tensors": k, "elements": k * size, "ms": median(times)})
        del opt, params
    return out


def fit_optimizer(measurements: Sequence[Mapping]) -> dict:
    """``{"fixed_ms", "per_tensor_ms", "per_melement_ms", "fit_error", "measurements"}`` (see the module docstring)."""
    coef, err = nonneg_fit([[1.0, m["tensors"], m["elements"] / 1e6] for m in measurements],
                           [float(m["ms"]) for m in measurements])
    return {"fixed_ms": coef[0], "per_tensor_ms": coef[1], "per_melement_ms": coef[2],
            "fit_error": err, "measurements": [dict(m) for m in measurements]}


def optimizer_ms(fit: Mapping, *, tensors: int, elements: int) -> float:
    """Predicted milliseconds of one optimizer step over ``tensors`` tensors of ``elements`` elements in all."""
    return float(fit["fixed_ms"]) + float(fit["per_tensor_ms"]) * tensors + float(fit["per_melement_ms"]) * elements / 1e6
