"""The built-in trainer's optimizer and learning-rate schedule, as Megatron-LM builds them from its flags.

* :func:`make_optimizer`: AdamW (``--adam-beta1/2``, ``--adam-eps``), in Megatron's two parameter groups:
  weight decay on matrices, none on biases and other 1-D weights (megatron.core's default
  ``no_weight_decay_cond``); over fp32 master weights when the model is bf16 (:mod:`...runtime.mixed_precision`).
  The distributed optimizer's flat shards mix both kinds, so they take one group with weight decay.
* :func:`make_scheduler`: megatron.core's ``OptimizerParamScheduler`` with the arguments Megatron-LM's
  ``get_optimizer_param_scheduler`` gives it: every span counted in samples (iterations times the global
  batch, or the ``--*-samples`` flags), stepped by the global batch each iteration (:func:`scheduler_steps`).
"""
from __future__ import annotations

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ...runtime.mixed_precision import MasterWeightsOptimizer


def decays(p: torch.Tensor) -> bool:
    """Whether weight decay applies: megatron.core's default rule (``no_weight_decay_cond`` unset) exempts
    biases and every 1-D weight (norms, class tokens); a bias is 1-D, so the shape decides."""
    return p.dim() > 1


def make_optimizer(params, args, *, flat: bool = False):
    """AdamW over ``params`` in Megatron's weight-decay groups (``wd_mult`` 1 and 0, which megatron.core's
    scheduler reads); over fp32 master copies when they are bf16. ``flat``: distributed-optimizer shards
    (one group, every element decayed)."""
    params = list(params)
    if any(p.dtype != torch.float32 for p in params):
        return MasterWeightsOptimizer(params, lambda ps: make_optimizer(ps, args, flat=flat))
    groups = [{"params": [p for p in params if flat or decays(p)], "wd_mult": 1.0},
              {"params": [p for p in params if not flat and not decays(p)], "wd_mult": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]] or [{"params": []}], lr=args.lr,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                             weight_decay=args.weight_decay)


def scheduler_steps(args, global_batch: int) -> dict:
    """``OptimizerParamScheduler``'s spans, in samples, as Megatron-LM's ``get_optimizer_param_scheduler``
    derives them from the flags (``global_batch``: samples per task per iteration). A warm-up not shorter
    than the decay is a ``ValueError`` naming the flags (megatron.core asserts it)."""
    if getattr(args, "train_samples", None):
        decay = args.lr_decay_samples or args.train_samples
        wd_incr, wsd = args.train_samples, args.lr_wsd_decay_samples
        warmup = args.lr_warmup_samples
        what = "--lr-decay-samples (default --train-samples)"
    else:
        decay = (args.lr_decay_iters or args.train_iters) * global_batch
        wd_incr = args.train_iters * global_batch
        wsd = args.lr_wsd_decay_iters * global_batch if args.lr_wsd_decay_iters is not None else None
        warmup = args.lr_warmup_iters * global_batch
        what = "--lr-decay-iters (default --train-iters)"
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    if not 0 <= warmup < decay:
        raise ValueError(f"the learning-rate warm-up ({warmup:g} samples) must be shorter than the decay span "
                         f"{what} ({decay} samples): shorten the warm-up or lengthen the decay")
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wd_incr_steps": wd_incr, "wsd_decay_steps": wsd}


def make_scheduler(optimizer, args, global_batch: int) -> OptimizerParamScheduler:
    """megatron.core's OptimizerParamScheduler over the optimizer's parameter groups, at step 0 (step it by
    ``global_batch`` per iteration, as Megatron does)."""
    for g in optimizer.param_groups:
        g.setdefault("max_lr", args.lr)
        g.setdefault("min_lr", args.min_lr)
    constant = args.weight_decay_incr_style == "constant"
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay if constant else args.start_weight_decay,
        end_wd=args.weight_decay if constant else args.end_weight_decay,
        wd_incr_style=args.weight_decay_incr_style, lr_wsd_decay_style=args.lr_wsd_decay_style,
        **scheduler_steps(args, global_batch))
