"""Command-line flags and the checks on them: Spindle's, registered through Megatron's ``extra_args_provider``.

* :func:`add_spindle_args` is what Megatron-LM's ``pretrain(..., extra_args_provider=...)`` calls with its
  argparse parser (it must return the parser); :func:`chain_args` chains a user's provider after it.
* :func:`add_training_args` adds, with Megatron's own names and defaults, the training flags the built-in
  trainer reads when ``megatron.training`` is not used (with :func:`.flag_contract.add_contract_args`), so one
  launch command works in both modes; :func:`fallback_args` parses a Megatron command line for it, judging every
  other Megatron-LM flag by the contract (:mod:`.flag_contract`).
* :func:`check_megatron_args`: Megatron settings a Spindle run cannot honour, for a caller of Megatron's
  ``pretrain`` that did not go through :func:`..hooks.pretrain_spindle` (which checks the command line first).

Pure argparse: no torch import.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import os
import sys
from typing import Callable

from ...argtypes import name_list
from ...atomic import check_output
from ..trainer.logs import check_log_args
from .flag_contract import (BUILT_IN_LOOP_ONLY, TE_MISSING, add_contract_args, check_flags, check_megatron_command_line,
                            check_megatron_device, constraints, entries, te_installed)
from ...planner.workload.workloads import build_graph
from ..job.input_files import require, check_spindle_inputs
from ..checkpoint.directory import TRACKER, check_save_dir, check_save_reuse, latest_iteration, probe_save_lock
from ..job.lifeline import report_once
from .train_flags import (add_eval_args, add_iteration_args, add_model_args, add_optimizer_args, check_training_values,
                          resolve_iterations)

STARTUP_TIMEOUT_S = 120.0
"""Default of ``--spindle-startup-timeout``: the slowest rank's imports on a busy machine take tens of seconds."""
MAX_TIMEOUT_S = 86400


def add_spindle_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``--spindle*`` flags (Megatron's ``extra_args_provider``); returns the parser."""
    g = parser.add_argument_group("spindle", "Spindle wavefront scheduling of multi-task models")
    g.add_argument("--spindle", action="store_true",
                   help="run the step as a Spindle wave plan (per-slice process groups, wave executor); "
                        "without it every task runs over all ranks one after another, as Megatron does")
    g.add_argument("--spindle-plan", default=None, metavar="PATH",
                   help="use this saved plan (spindle plan --out) instead of planning at start")
    g.add_argument("--spindle-curves", default=None, metavar="PATH",
                   help="scaling curves for the planner (spindle profile --out); default: analytic model")
    g.add_argument("--spindle-model", default="multitask-clip", metavar="NAME|SPEC.toml",
                   help="a shipped model (multitask-clip, qwen-val, ofasys) or a model spec file "
                        "(docs/model_spec.md)")
    g.add_argument("--spindle-model-provider", default=None, metavar="MODULE:FUNCTION",
                   help="train your own Megatron MIMO model: a model provider returning a MimoModel "
                        "(megatron.core.models.mimo), importable from PYTHONPATH, its tasks from --spindle-tasks-file "
                        "(docs/mimo.md); replaces --spindle-model")
    g.add_argument("--spindle-tasks-file", default=None, metavar="TASKS.toml",
                   help="the tasks of --spindle-model-provider's model: [[tasks]] name, modalities, batch")
    g.add_argument("--spindle-tasks", type=int, default=None,
                   help="number of tasks (multitask-clip 4/7/10, ofasys 4/7, qwen-val 3); default the most")
    g.add_argument("--spindle-size", default="full",
                   help="model size: full (the spec itself) or one of the spec's [sizes] (tiny: CPU runs, tests)")
    g.add_argument("--spindle-freeze", type=name_list, default=[], metavar="MODULE[,MODULE]",
                   help="freeze these modules' weights (a module, e.g. vision.layers, or a component: vision = "
                        "vision.*), like Megatron-LM's --freeze-ViT: no gradient, sync or optimizer state; "
                        "forward only when no module before them trains")
    g.add_argument("--spindle-data", default=None, metavar="DIR",
                   help="train on real data: DIR/<task> is one megatron-energon dataset per task (energon "
                        "prepare); each rank reads only the samples of its slices (default: synthetic data)")
    g.add_argument("--spindle-gpus-per-node", type=int, default=None,
                   help="devices per NVLink island for placement (default: GPU 0's NVLink island as NVML "
                        "reports it, else the node's GPUs; at most the ranks per node and 8)")
    g.add_argument("--spindle-memory-gib", type=float, default=None,
                   help="device memory the planner may fill, GiB (default: the GPU's, else the curves file's "
                        "device, else the preset's)")
    g.add_argument("--spindle-cluster", default=None, metavar="NAME|FILE.json",
                   help="cluster preset the planner prices links and peak with (a100, a800-8x8, h100, h200) or a "
                        "cluster JSON file (default: the preset of the GPU the job runs on; a800-8x8 on CPUs)")
    g.add_argument("--spindle-trace", default=None, metavar="DIR",
                   help="write a per-rank Chrome trace of every wave (forward, backward, transfer, sync) to DIR")
    g.add_argument("--spindle-gantt", default=None, metavar="PNG", help="draw the plan's waves per device")
    g.add_argument("--spindle-check-equivalence", action="store_true",
                   help="run the first step also as a single-process reference on rank 0 and print "
                        "'equivalence: max relative difference X' over losses and gradients")
    g.add_argument("--spindle-timeout", type=float, default=300.0,
                   help="seconds to wait for a peer before failing with the wave, slice and peer named")
    g.add_argument("--spindle-startup-timeout", type=float, default=STARTUP_TIMEOUT_S,
                   help="seconds every rank has to join the job and agree on flags and files before the "
                        "start-up fails, naming what it waited for (at most --spindle-timeout)")
    g.add_argument("--spindle-predict-interval", type=int, default=10,
                   help="every N iterations rank 0 logs predicted against measured step time and the "
                        "MetaOps with the largest error (0: never)")
    g.add_argument("--spindle-task-schedule", default=None, metavar="SPEC",
                   help="change the active tasks mid-training without restarting, e.g. "
                        "'0:vision-text,audio-text;10:vision-text' (iteration:tasks;...): replans and keeps "
                        "parameters and optimizer state")
    g.add_argument("--spindle-init", action="append", default=[], metavar="MODULE=DIR",
                   help="start MODULE (a spec module or component, e.g. vision) from the Hugging Face model in "
                        "DIR (config.json + safetensors; `spindle hf spec DIR` prints matching modules); "
                        "repeatable; adds to the spec's [model] init. Each rank reads only its own shards")
    g.add_argument("--spindle-nonfinite-skips", type=int, default=0, metavar="N",
                   help="a step whose loss or gradient norm is NaN or infinite is skipped (no optimizer step) "
                        "up to N times in a run; the next one stops training with the task and MetaOp named "
                        "(default 0: stop at the first)")
    g.add_argument("--spindle-overwrite-save", action="store_true",
                   help="let --save replace the checkpoints another run left there (without it a --save that holds "
                        "checkpoints is refused unless --load names the same directory, which resumes)")
    g.add_argument("--spindle-trace-max-spans", type=int, default=200_000, metavar="N",
                   help="spans each rank keeps for the trace and the prediction lines (a few per wave and step); "
                        "past it a warning, and iterations are no longer traced")
    return parser


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-named training flags for the CPU loop (a subset with Megatron's meanings)."""
    g = parser.add_argument_group("training", "Megatron-LM training flags read by the built-in loop")
    for add in (add_iteration_args, add_optimizer_args, add_model_args, add_eval_args):  # Megatron's own
        add(g)
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per task per rank in one pass, as in Megatron: a pass of the plan carries "
                        "this x world size samples of every task (default: the model's batch per pass)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per task per optimizer step; a multiple of micro batch x world size "
                        "(passes are accumulated)")
    g.add_argument("--seed", type=int, default=1234, help="model and data seed")
    g.add_argument("--log-interval", type=int, default=1, help="iterations between progress lines")
    g.add_argument("--save", default=None, metavar="DIR", help="checkpoint directory to write")
    g.add_argument("--load", default=None, metavar="DIR", help="checkpoint directory to resume from")
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after a checkpoint when --save is given) once the iteration is a multiple of this")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (or SIGHUP) finish the step, save a checkpoint (with --save) and exit 0, as "
                        "Megatron-LM does (a scheduler's preemption); without it SIGTERM stops after the step, unsaved")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations; fp32 losses, gradient "
                   "accumulation and reductions, master weights and optimizer (as Megatron-LM's --bf16)")
    g.add_argument("--transformer-impl", default="local", choices=("local", "transformer_engine"),
                   help="the layers' implementation, as Megatron-LM's flag: local (megatron.core's own modules) or "
                        "transformer_engine (TransformerEngine's; needs it installed and a GPU). Default local in "
                        "both loops: the layers never switch on because TransformerEngine happens to import")
    g.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help="rank 0 writes TensorBoard events here: each task's loss, learning-rate, grad-norm, "
                        "iteration-time, samples-per-second, Spindle's predicted and measured step")
    g.add_argument("--tensorboard-log-interval", type=int, default=1, help="iterations between event writes")
    g.add_argument("--wandb-project", default=None, help="also log to Weights & Biases, offline (wandb sync uploads)")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run's name")
    g.add_argument("--wandb-save-dir", default=None, metavar="DIR",
                   help="where W&B writes its offline run (default: <tensorboard-dir or .>/wandb)")
    return parser


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (``error: ...``, exit status 2), not the usage
    block; under torchrun once, by the first rank (:func:`..job.lifeline.report_once`)."""

    def error(self, message: str):
        report_once(f"error: {' '.join(message.split())} (see --help)")
        raise SystemExit(2)

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        if hasattr(ns, "train_samples"):  # the built-in trainer's flags: --train-samples to iterations, as Megatron
            try:
                resolve_iterations(ns, lambda: run_graph(ns, world_from_env()).operators[0].batch)
            except ValueError as e:
                self.error(str(e))
        return ns, rest


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The built-in trainer's parser: Megatron-named training flags plus the ``--spindle*`` flags."""
    parser = OneLineParser(description=description, allow_abbrev=False)
    add_training_args(parser)
    add_contract_args(parser)
    return add_spindle_args(parser)


def chain_args(*providers: Callable | None) -> Callable:
    """An ``extra_args_provider`` that adds the ``--spindle*`` flags, then runs ``providers`` in order.

    ``None`` entries are skipped, so ``chain_args(add_modelopt_args if has_modelopt else None)`` works.
    Like Megatron's hook, every provider takes the parser and must return it.
    """

    def spindle_extra_args_provider(parser):
        parser = add_spindle_args(parser)
        for provider in providers:
            if provider is None:
                continue
            out = provider(parser)
            if out is None:
                raise TypeError(f"extra_args_provider {getattr(provider, '__name__', provider)!r} returned None; "
                                f"Megatron's contract is to return the parser")
            parser = out
        return parser

    return spindle_extra_args_provider


def fallback_args(argv=None, extra_args_provider: Callable | None = None):
    """Parse ``argv`` for the built-in trainer, keeping Megatron's meaning of its flags.

    Every Megatron-LM flag is judged by the contract first (:func:`.flag_contract.check_flags`: a refused one
    is a ``ValueError``, one line); the mapped ones become ``args.spindle_constraints``
    (:class:`.flag_contract.Constraints`). Returns ``(args, at_default)``: the Megatron-LM flags this parser does
    not read because they are given at their default or have no effect here (``--pipeline-model-parallel-size
    1``, ``--num-workers``). A flag that is neither Megatron-LM's nor Spindle's (a misspelt ``--spindle*``
    flag included) is an error. ``--micro-batch-size`` is per rank, as in Megatron: a pass carries
    ``micro_batch_size x world`` samples per task.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser("Spindle pretraining (built-in megatron.core trainer)")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    check_flags(argv, "loop")
    args, unknown = parser.parse_known_args(argv)
    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("--")]
    bad = [f for f in flags if f.startswith("--spindle") or f not in entries()]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (neither a Megatron-LM flag nor Spindle's)")
    args.spindle_constraints = dataclasses.asdict(constraints(argv))
    return args, flags


def spindle_args(argv=None):
    """Only the ``--spindle*`` flags of a Megatron command line (the rest is Megatron's to parse)."""
    return add_spindle_args(OneLineParser(add_help=False, allow_abbrev=False)).parse_known_args(argv)[0]


def check_megatron_args(args) -> list[str]:
    """Megatron settings a Spindle run cannot honour, one sentence each (empty: all fine).

    The wave plan sets each slice's tensor- and data-parallel degree, so Megatron's global parallel sizes
    must stay 1 (then its data-parallel size is the world size). The executor owns the gradients, so the
    DDP-based features (distributed optimizer, FSDP, overlapped reduction) and fp16 loss scaling, which the
    schedule would have to apply, are out.
    """
    get = functools.partial(getattr, args)
    bad = []
    for name, flag in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                       ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                       ("context_parallel_size", "--context-parallel-size"),
                       ("expert_model_parallel_size", "--expert-model-parallel-size")):
        if (get(name, 1) or 1) != 1:
            bad.append(f"{flag} {get(name)}: must be 1; the Spindle plan sets every slice's parallel degrees")
    if get("virtual_pipeline_model_parallel_size", None) is not None:
        bad.append("virtual pipeline stages: Spindle runs one model chunk per rank")
    if get("fp16", False) or get("loss_scale", None) is not None:
        bad.append("--fp16 / --loss-scale: the wave executor applies no loss scaling; use --bf16")
    for name, flag in (("use_distributed_optimizer", "--use-distributed-optimizer"),
                       ("use_torch_fsdp2", "--use-torch-fsdp2"), ("use_megatron_fsdp", "--use-megatron-fsdp"),
                       ("overlap_grad_reduce", "--overlap-grad-reduce"),
                       ("overlap_param_gather", "--overlap-param-gather"),
                       ("init_model_with_meta_device", "--init-model-with-meta-device")):
        if get(name, False):
            bad.append(f"{flag}: needs Megatron's DDP buffers; Spindle synchronises gradients per parameter group")
    if get("dataloader_type", "external") != "external":
        bad.append(f"--dataloader-type {get('dataloader_type')}: Spindle feeds multi-task batches through "
                   f"--dataloader-type external")
    if (get("save", None) or get("load", None)) and get("ckpt_format", "torch_dist") != "torch_dist":
        bad.append(f"--ckpt-format {get('ckpt_format')}: Spindle checkpoints are torch_dist (sharded) only")
    bad += [f"{flag}: {why}" for flag, why in BUILT_IN_LOOP_ONLY.items()
            if get(flag[2:].replace("-", "_"), None)]
    if get("micro_batch_size", None) is None:
        bad.append("--micro-batch-size is required (samples of every task per rank per pass)")
    return bad


def parse_task_schedule(spec: str | None, tasks: tuple[str, ...],
                        train_iters: int | None = None) -> list[tuple[int, tuple[str, ...]]]:
    """``'0:a,b;10:a'`` -> ``[(0, ('a', 'b')), (10, ('a',))]``; names must be tasks of the model, and every
    change must come before ``train_iters`` (a change after the last iteration would never be applied).

    >>> parse_task_schedule("0:x,y;5:x", ("x", "y"))
    [(0, ('x', 'y')), (5, ('x',))]
    """
    if not spec:
        return [(0, tasks)]
    out = []
    for part in spec.split(";"):
        if not part.strip():
            continue
        it, _, names = part.partition(":")
        try:
            start = int(it)
        except ValueError:
            raise ValueError(f"--spindle-task-schedule: {part!r} does not start with an iteration number") from None
        chosen = tuple(n.strip() for n in names.split(",") if n.strip())
        bad = [n for n in chosen if n not in tasks]
        if bad or not chosen:
            raise ValueError(f"--spindle-task-schedule: unknown or no tasks {bad or chosen!r} at iteration {start}; "
                             f"tasks are {list(tasks)}")
        if any(s0 == start for s0, _ in out):
            raise ValueError(f"--spindle-task-schedule: iteration {start} appears twice in {spec!r}; give each "
                             f"iteration once with all its tasks, e.g. '{start}:{','.join(tasks[:2])}'")
        out.append((start, tuple(t for t in tasks if t in chosen)))
    out.sort()
    if not out or out[0][0] != 0:
        raise ValueError("--spindle-task-schedule must start at iteration 0")
    late = [s0 for s0, _ in out if train_iters is not None and s0 >= train_iters]
    if late:
        raise ValueError(f"--spindle-task-schedule changes the tasks at iteration {late[0]}, but --train-iters "
                         f"{train_iters} ends the run before it (iterations 0 to {train_iters - 1})")
    return out


def world_from_env() -> int:
    """The job's world size before ``torch.distributed`` starts: ``WORLD_SIZE`` (torchrun), else 1."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise ValueError(f"WORLD_SIZE {os.environ['WORLD_SIZE']!r} is not an integer") from None


def run_graph(args, world: int):
    """The task graph of a run: ``--spindle-model`` (or ``--spindle-model-provider`` and ``--spindle-tasks-file``),
    ``-tasks``, ``-size``, ``-freeze`` and one pass of ``--micro-batch-size`` x ``world`` samples per task (the
    model's default batch without it). An unknown
    ``--spindle-freeze`` module is a ``ValueError`` naming the flag and listing the modules."""
    freeze = getattr(args, "spindle_freeze", None) or ()
    batch = args.micro_batch_size * world if args.micro_batch_size else None
    provider, tasks_file = getattr(args, "spindle_model_provider", None), getattr(args, "spindle_tasks_file", None)
    if bool(provider) != bool(tasks_file):
        raise ValueError(f"--spindle-model-provider {provider} needs --spindle-tasks-file TASKS.toml" if provider else
                         f"--spindle-tasks-file {tasks_file} goes with --spindle-model-provider (docs/mimo.md)")
    try:
        if provider:
            from ...models.mimo_source import load_source  # optional: torch (a MIMO provider is built to read its shapes)
            workload = load_source(provider, tasks_file).workload(task_count=args.spindle_tasks, batch=batch,
                                                                  freeze=freeze)
            return workload.graph(1)
        return build_graph(args.spindle_model, tasks=args.spindle_tasks, size=args.spindle_size, batch=batch,
                           freeze=freeze)
    except ValueError as e:
        if str(e).startswith("cannot freeze"):
            raise ValueError(f"--spindle-freeze {','.join(freeze)}: {e}") from None
        raise


def check_args(args, world: int) -> None:
    """Every check of the flags that needs no peer, run by every rank before any collective.

    All ranks see the same flags and files, so all reject a bad value with the same one line (``ValueError``)
    instead of rank 0 printing it while the others die in a collective. Pure (no torch): numbers, the curves
    file, the cluster the planner would use, the task schedule, the checkpoint to resume and the save directory.
    """
    need = require
    for flag, v, low in (("--train-iters", args.train_iters, 1), ("--log-interval", args.log_interval, 1),
                         ("--micro-batch-size", args.micro_batch_size, 1),
                         ("--global-batch-size", args.global_batch_size, 1),
                         ("--save-interval", args.save_interval, 1), ("--exit-interval", args.exit_interval, 1),
                         ("--tensorboard-log-interval", getattr(args, "tensorboard_log_interval", 1), 1)):
        need(v is None or v >= low, f"{flag} {v} must be at least 1")
    check_spindle_values(args)
    for flag, v in (("--lr", args.lr), ("--min-lr", args.min_lr), ("--clip-grad", args.clip_grad),
                    ("--weight-decay", args.weight_decay)):
        need(math.isfinite(v) and v >= 0, f"{flag} {v:g} must be a finite number, zero or more")
    need(args.min_lr <= args.lr, f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}: the schedule decays from "
                                 f"--lr down to --min-lr")
    for flag, v in (("--adam-beta1", args.adam_beta1), ("--adam-beta2", args.adam_beta2)):
        need(math.isfinite(v) and 0 <= v < 1, f"{flag} {v:g} must be in [0, 1): the weight of the running "
                                              f"average's past")
    need(args.lr_warmup_iters >= 0, f"--lr-warmup-iters {args.lr_warmup_iters} must be zero or more")
    need(getattr(args, "transformer_impl", "local") != "transformer_engine" or te_installed(), TE_MISSING)
    need(not (getattr(args, "spindle_data", None) and args.spindle_task_schedule),
         "--spindle-data cannot be combined with --spindle-task-schedule yet (each rank's samples follow the "
         "first plan's layout)")
    graph = run_graph(args, world)
    check_spindle_inputs(args, world, graph)
    parse_task_schedule(args.spindle_task_schedule, graph.tasks, args.train_iters)
    check_log_args(args)
    if getattr(args, "tensorboard_dir", None):
        check_output(os.path.join(args.tensorboard_dir, "events.out.tfevents"), "--tensorboard-dir")
    if args.load:
        need(os.path.isdir(args.load), f"--load {args.load!r} is not a directory")
        it = latest_iteration(args.load)
        need(it is not None, f"--load {args.load!r} holds no checkpoint (no {TRACKER})")
        need(args.train_iters >= it, f"--train-iters {args.train_iters} is below the iteration {it} of the "
                                     f"checkpoint in {args.load!r}: nothing to train")
    if args.save:
        check_save_dir(args.save)
        probe_save_lock(args.save)  # a run writing there now is named before its checkpoints are
        check_save_reuse(args.save, args.load, getattr(args, "spindle_overwrite_save", False))


def check_spindle_values(args) -> None:
    """The ``--spindle*`` numbers (both loops)."""
    for flag, v, low in (("--spindle-tasks", args.spindle_tasks, 1),
                         ("--spindle-gpus-per-node", args.spindle_gpus_per_node, 1),
                         ("--spindle-predict-interval", args.spindle_predict_interval, 0),
                         ("--spindle-nonfinite-skips", getattr(args, "spindle_nonfinite_skips", 0), 0),
                         ("--spindle-trace-max-spans", getattr(args, "spindle_trace_max_spans", 1), 1)):
        require(v is None or v >= low, f"{flag} {v} must be {'at least 1' if low else 'zero or more'}")
    for flag, v in (("--spindle-timeout", args.spindle_timeout),
                    ("--spindle-startup-timeout", getattr(args, "spindle_startup_timeout", STARTUP_TIMEOUT_S))):
        require(math.isfinite(v) and 0 < v <= MAX_TIMEOUT_S,
              f"{flag} {v:g} must be a positive number of seconds, at most {MAX_TIMEOUT_S} (a day)")
    require(args.spindle_memory_gib is None or (math.isfinite(args.spindle_memory_gib) and args.spindle_memory_gib > 0),
          f"--spindle-memory-gib {args.spindle_memory_gib} must be a positive number")


def preflight_main(argv, description: str = "", extra_args_provider: Callable | None = None) -> int:
    """The launch scripts' check, in one process before torchrun starts any worker: parse ``argv`` as a
    worker would (the world size from ``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` as torchrun will set them), check
    it, and look at the ``--save`` lock. Where Megatron-LM's loop will run (``SPINDLE_BACKEND=megatron``, or
    ``megatron.training`` and a GPU driver), the flag contract and the ``--spindle*`` flags and files are checked
    here; Megatron judges the values of its own flags. ``extra_args_provider``: a script's own flags (parsed as its
    workers parse them). Bad input prints one line; returns the exit status."""
    try:
        world = world_from_env()
        gpu = os.path.exists("/proc/driver/nvidia/version")
        backend = os.environ.get("SPINDLE_BACKEND") or (
            "megatron" if gpu and importlib.util.find_spec("megatron.training") else "loop")
        if backend == "megatron":
            check_megatron_command_line(argv, {})  # the contract, and what Megatron-LM's loop requires
            check_megatron_device(argv, gpu)
            args = spindle_args(argv)
            check_spindle_values(args)
            # Megatron judges its own flag; the graph (and a --spindle-plan's fingerprint) is at the run's batch
            for name in ("micro_batch_size", "global_batch_size"):
                v = _known(argv, "--" + name.replace("_", "-"))
                setattr(args, name, int(v) if v and v.isdigit() and int(v) > 0 else None)
            check_spindle_inputs(args, world, run_graph(args, world))
            save = _known(argv, "--save")
            if save:
                probe_save_lock(save)
                check_save_reuse(save, _known(argv, "--load"), args.spindle_overwrite_save)
        else:
            args, _ = fallback_args(argv, extra_args_provider)  # a script's own flags are its parser's
            check_training_values(args)  # Megatron's checks of its optimizer, schedule and model flags
            check_args(args, world)
            save = args.save
        if save:
            probe_save_lock(save)
    except ValueError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


def _known(argv, flag: str):
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument(flag, default=None)
    return getattr(p.parse_known_args(argv)[0], flag.lstrip("-").replace("-", "_"))
