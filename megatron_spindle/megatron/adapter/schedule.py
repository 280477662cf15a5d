"""The forward-backward function Megatron's ``train_step`` calls, run by the wave executor.

Megatron-LM's ``train_step`` gets its schedule from ``get_forward_backward_func()`` and calls it with
keywords ``forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
decoder_seq_length, forward_only, ...``; it expects one report dict per microbatch whose values are
``tensor([sum, count])``: it adds them over microbatches and all-reduces over the data-parallel group
(here: all ranks, since the global TP = PP = 1) and logs ``sum / count``.
:func:`spindle_forward_backward` has that contract:

* ``forward_step_func(data_iterator, model) -> (state, loss_func)``: :func:`forward_step` below is the one
  our models use: it takes the next multi-task batch (once per pass) and starts the pass (``model(batch)``:
  the plan's first phase forward; every phase's under ``forward_only``);
* the model's ``backward(state)`` runs the rest of the pass phase by phase (each phase's backward, then the
  next phase's forward and backward; :mod:`...runtime.executor`);
* ``loss_func(state) -> (loss, report)``, called once the pass has run every phase: each task's loss
  contribution of this rank with count ``1/world``, so Megatron's sum over ranks gives ``[task loss, 1]`` and
  the logged mean is the task loss (tensors on the model's device, none read on the host);
* the passes per step are the plan's (``plan.passes``): a training call for another number of microbatches is
  refused (one line naming both); every pass but the last runs under the model's ``no_sync`` (gradients
  accumulate, no reduce); after the last one it waits for the group-wise gradient sync (what
  ``finalize_model_grads`` does for Megatron's own DDP), unless ``forward_only``.
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist

from ... import comm


def forward_step(data_iterator, model):
    """Megatron-style forward step of a Spindle model: one multi-task batch through every wave."""
    trace = getattr(model, "trace", None)
    t0 = trace.now() if trace is not None else None
    batch = next(data_iterator)
    if trace is not None:
        trace.span("data", "next batch", t0)
    state = model(batch)
    return state, partial(loss_func, model)


def loss_func(model, state):
    """``(loss, {task: tensor([this rank's share of the task loss, 1/world])})``, every tensor on the rank's
    device (the model's): nothing is read on the host (a GPU would make the host wait once per task and pass)."""
    dev = comm.comm_device()
    none = torch.zeros((), dtype=torch.float64, device=dev)
    share = torch.full((), 1.0 / dist.get_world_size(), dtype=torch.float64, device=dev)
    losses = [state.losses[t].double() if t in state.losses else none for t in model.plan.tasks]
    report = {t: torch.stack([v, share]) for t, v in zip(model.plan.tasks, losses)}
    return torch.stack(losses).sum(), report


def spindle_forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int,
                             seq_length: int | None = None, micro_batch_size: int | None = None,
                             decoder_seq_length: int | None = None, forward_only: bool = False,
                             collect_non_loss_data: bool = False, first_val_step=None, **kwargs) -> list[dict]:
    """Run ``num_microbatches`` passes of the plan; gradients accumulate, then sync once.

    ``model`` may be the Spindle model or a one-element list of it (Megatron passes a list of chunks).
    ``seq_length`` and ``micro_batch_size`` are accepted for signature compatibility: the plan fixes them.
    """
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"Spindle runs one model chunk per rank, got {len(model)} (no virtual pipeline)")
        model = model[0]
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    passes = model.plan.passes
    if not forward_only and num_microbatches != passes:
        raise ValueError(f"num_microbatches {num_microbatches} per step, but the plan runs {passes} passes per step "
                         f"(plan.passes): set --global-batch-size to {passes} x --micro-batch-size x ranks, or "
                         f"re-plan for {num_microbatches} passes")
    reports = []
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    for i in range(num_microbatches):
        # Megatron's schedules: every pass but the last under no_sync, so K passes reduce once
        last = forward_only or i == num_microbatches - 1
        with (contextlib.nullcontext() if last else no_sync()):
            if forward_only:
                with torch.no_grad():
                    state, fn = forward_step_func(data_iterator, model)
            else:
                state, fn = forward_step_func(data_iterator, model)
                model.backward(state, loss_scale=1.0 / num_microbatches)  # the pass's later phases too
            _, report = fn(state)  # every phase has run: every task's loss is in
        reports.append(report)
    if not forward_only:
        model.finalize_grads()
    return reports


def reduce_reports(reports: list[dict]) -> dict[str, float]:
    """What Megatron's ``train_step`` does with the reports: sum, all-reduce, divide; every key in one
    all-reduce, read on the host once."""
    keys = list(reports[0])
    val = torch.stack([torch.stack([r[k] for r in reports]).sum(0) for k in keys])
    comm.all_reduce(val)
    return {k: s / n for k, (s, n) in zip(keys, val.tolist())}
