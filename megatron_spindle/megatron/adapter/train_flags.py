"""Megatron-LM's optimizer, schedule, model and evaluation flags for the built-in trainer, with Megatron's names,
defaults and checks, so one command means the same in both loops.

* :func:`add_optimizer_args`: ``--lr`` and its schedule (warm-up by iterations, fraction or samples, decay by
  iterations or samples, ``--min-lr``, WSD, ``--lr-warmup-init``), weight decay and its increment style, Adam's
  betas and epsilon, ``--clip-grad``;
* :func:`add_model_args`: ``--init-method-std``, ``--hidden-dropout``, ``--attention-dropout``,
  ``--calculate-per-token-loss`` (``--fp16`` is refused by the flag contract; :func:`check_training_values` too);
* :func:`add_eval_args`: ``--eval-interval``, ``--eval-iters``;
* :func:`resolve_iterations`: ``--train-samples`` to iterations as Megatron converts them (samples over the
  global batch), and the built-in trainer's default of :data:`DEFAULT_TRAIN_ITERS` iterations;
* :func:`check_training_values`: the checks Megatron's ``validate_args`` makes on these, one line each;
* :func:`local_layers_default`: the defaults Megatron-LM's parser takes for a Spindle model (its loop).

Megatron-LM's loop parses these itself (``megatron.training.arguments``). Pure argparse: no torch import.
"""
from __future__ import annotations

import argparse
import math

DEFAULT_TRAIN_ITERS = 30
"""The built-in trainer's iterations without ``--train-iters`` or ``--train-samples`` (Megatron requires one)."""

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
INCR_STYLES = ("constant", "linear", "cosine")


def add_optimizer_args(g) -> None:
    """Adam and its learning-rate and weight-decay schedule (megatron.core's ``OptimizerParamScheduler``)."""
    g.add_argument("--lr", type=float, default=3e-4,
                   help="peak learning rate (Megatron-LM requires it; the built-in trainer defaults to 3e-4)")
    g.add_argument("--min-lr", type=float, default=0.0, help="final learning rate")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warm-up")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up iterations")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay span (instead of --lr-warmup-iters/-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="warm-up samples (with --train-samples)")
    g.add_argument("--lr-decay-style", default="linear", choices=DECAY_STYLES,
                   help="learning-rate decay after warm-up (Megatron's default linear)")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="iterations to decay over (default --train-iters)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="samples to decay over, with --train-samples (default --train-samples)")
    g.add_argument("--lr-wsd-decay-style", default="exponential", choices=WSD_STYLES,
                   help="the annealing of --lr-decay-style WSD")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD's annealing iterations")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None, help="WSD's annealing samples")
    g.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW weight decay (not on biases and 1-D weights, as Megatron)")
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="weight decay at the start (with a --weight-decay-incr-style other than constant)")
    g.add_argument("--end-weight-decay", type=float, default=None, help="weight decay at the end")
    g.add_argument("--weight-decay-incr-style", default="constant", choices=INCR_STYLES,
                   help="how weight decay goes from --start-weight-decay to --end-weight-decay")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off)")


def add_model_args(g) -> None:
    """The model flags every Spindle layer honours (:class:`...models.blocks.LayerSettings`)."""
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="standard deviation of every weight drawn from a normal (Megatron's default 0.02)")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="dropout after each transformer layer's attention and MLP (default 0 for Spindle's "
                        "models in both loops: see docs/training.md)")
    g.add_argument("--attention-dropout", type=float, default=0.0, help="dropout of the attention weights")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over tokens rather than microbatches (every pass of a task carries "
                        "the same number of loss tokens here, so both give the same loss)")


def add_eval_args(g) -> None:
    """Validation: forward-only passes over held-out batches, the loss logged as Megatron logs it."""
    g.add_argument("--eval-interval", type=int, default=None,
                   help="iterations between validation runs (default: none during training)")
    g.add_argument("--eval-iters", type=int, default=0,
                   help="passes per validation; also run at the end on the validation and test sets when above "
                        "0 (default 0 in the built-in trainer; Megatron-LM's loop defaults to 100)")


def add_iteration_args(g) -> None:
    g.add_argument("--train-iters", type=int, default=None,
                   help=f"optimizer steps (default {DEFAULT_TRAIN_ITERS} without --train-samples)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples per task to train on: iterations = this over --global-batch-size, as Megatron")


def resolve_iterations(args, one_pass: "callable") -> None:
    """``args.train_iters`` from ``--train-samples`` (Megatron's ``update_train_iters`` without ramp-up: the
    samples over the global batch, ``one_pass()`` samples per task when ``--global-batch-size`` is not given),
    or :data:`DEFAULT_TRAIN_ITERS`. Both flags: a ``ValueError`` naming them."""
    samples = getattr(args, "train_samples", None)
    if samples is None:
        if args.train_iters is None:
            args.train_iters = DEFAULT_TRAIN_ITERS
        return
    if args.train_iters is not None and not getattr(args, "_iters_from_samples", False):
        raise ValueError(f"--train-iters {args.train_iters} and --train-samples {samples}: give one (Megatron "
                         f"trains by iterations or by samples)")
    if samples < 1:
        raise ValueError(f"--train-samples {samples} must be at least 1")
    glob = args.global_batch_size or one_pass()
    args.train_iters = samples // glob
    args._iters_from_samples = True
    if args.train_iters < 1:
        raise ValueError(f"--train-samples {samples} is less than one step's global batch {glob}: nothing to train")


def check_training_values(args) -> None:
    """What Megatron's ``validate_args`` asserts on these flags, and the built-in trainer's refusals: a
    ``ValueError`` naming the value (one line, exit status 2)."""

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)

    need(not getattr(args, "fp16", False),
         "--fp16: Spindle's wave executor applies no dynamic loss scaling; use --bf16")
    frac = args.lr_warmup_fraction
    need(frac is None or (math.isfinite(frac) and 0 <= frac < 1),
         f"--lr-warmup-fraction {frac} must be in [0, 1): the share of the decay span spent warming up")
    need(frac is None or (args.lr_warmup_iters == 0 and args.lr_warmup_samples == 0),
         "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples: give one (Megatron: 'can only specify "
         "one of lr-warmup-fraction and lr-warmup-iters')")
    for flag, v in (("--lr-warmup-samples", args.lr_warmup_samples), ("--lr-decay-iters", args.lr_decay_iters),
                    ("--lr-decay-samples", args.lr_decay_samples), ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters),
                    ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples), ("--eval-iters", args.eval_iters)):
        need(v is None or v >= 0, f"{flag} {v} must be zero or more")
    need(args.eval_interval is None or args.eval_interval >= 1, f"--eval-interval {args.eval_interval} must be at "
                                                                f"least 1")
    need(math.isfinite(args.lr_warmup_init) and 0 <= args.lr_warmup_init <= args.lr,
         f"--lr-warmup-init {args.lr_warmup_init:g} must be between 0 and --lr {args.lr:g}")
    need(math.isfinite(args.adam_eps) and args.adam_eps > 0, f"--adam-eps {args.adam_eps:g} must be positive")
    need(math.isfinite(args.init_method_std) and args.init_method_std > 0,
         f"--init-method-std {args.init_method_std:g} must be positive")
    for flag, v in (("--hidden-dropout", args.hidden_dropout), ("--attention-dropout", args.attention_dropout)):
        need(math.isfinite(v) and 0 <= v < 1, f"{flag} {v:g} must be in [0, 1): a dropout probability")
    if args.weight_decay_incr_style == "constant":
        need(args.start_weight_decay is None and args.end_weight_decay is None,
             "--start-weight-decay/--end-weight-decay go with --weight-decay-incr-style linear or cosine (constant "
             "uses --weight-decay)")
    else:
        s, e = args.start_weight_decay, args.end_weight_decay
        need(s is not None and e is not None and 0 <= s <= e,
             f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
             f"--end-weight-decay, 0 <= start <= end (given {s} and {e})")
    need(args.lr_decay_style != "WSD" or args.lr_wsd_decay_iters is not None or args.lr_wsd_decay_samples is not None,
         "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with --train-samples)")


def local_layers_default(parser):
    """``extra_args_provider`` of :func:`.hooks.pretrain_spindle`: Megatron-LM's ``--transformer-impl`` defaults to
    ``local`` for a Spindle model, as in the built-in loop (one command, the same layers in both loops; the TE
    path is chosen with the flag, never by Megatron's default meeting a container that has TE). Likewise
    ``--hidden-dropout`` and ``--attention-dropout`` default to 0 as in the built-in loop (a value given is
    honoured: :class:`...models.blocks.LayerSettings`). ``--eval-interval`` has no default in Megatron-LM (its
    loop divides by it): the flag contract refuses a command without it in one line, and the launch scripts add
    it where a command leaves it out."""
    acts = {a.dest: a for a in parser._actions}
    parser.set_defaults(**{k: v for k, v in (("transformer_impl", "local"), ("hidden_dropout", 0.0),
                                             ("attention_dropout", 0.0)) if k in acts})
    return parser
