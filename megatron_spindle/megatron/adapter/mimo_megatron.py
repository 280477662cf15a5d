"""A user's MIMO model trained by Megatron-LM's own loop, without Spindle: the reference for speed (and checkpoints).

What ``scripts/run_mimo.sh`` runs with ``SPINDLE=0``: Megatron-LM's ``pretrain`` with the user's provider as its model
provider (called with the keywords ``get_model`` passes), so Megatron builds the whole ``MimoModel`` on every rank
(MIMO's colocated mode: every module on every rank, Megatron's data parallelism over all of them), wraps it in its
``DistributedDataParallel``, steps its optimizer and writes its checkpoints. Nothing of Spindle runs in the step;
only the CPU stand-ins (:mod:`...compat.megatron_lm`, :mod:`...compat.cpu`) where there is no GPU.

Data: the tasks' synthetic batches that a Spindle run of the same flags trains on (:class:`...models.data.
SyntheticData` over the MIMO graph, step by step), cut into Megatron micro-batches of one task each: per step
every task's global batch (``--micro-batch-size`` x ranks per pass, as under ``--spindle``, or the tasks file's),
task after task, each rank its ``--micro-batch-size`` samples of every micro-batch; ``--global-batch-size`` must be
the sum of the tasks' batches. Loss: MIMO's per-token loss of ``MimoModel.forward``; a micro-batch of task ``t``
returns its loss sum scaled so that after Megatron's division by the micro-batches and its data-parallel average
the step's gradient is that of ``sum_t weight_t x (task t's mean over its loss tokens)``, the objective of a Spindle
run (Megatron-LM's MIMO example averages micro-batches instead, which weights tasks by their micro-batch counts).
Each task's loss is logged under its name, as Spindle's runs log it.
"""
from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch
from megatron.core import parallel_state as mpu
from megatron.core.enums import ModelType

from ...compat.mcore import run_pretrain
from ...compat.megatron_lm import apply_cpu_standins, apply_wheel_standins, cuda_on_cpu
from ...compat.mimo import apply_megatron_ddp_standins
from ...log import get_logger
from ...models.data import SyntheticData
from ...models.mimo_build import call_provider
from ...models.mimo_layers import provider as mimo_provider
from ...models.mimo_source import load_source
from .data import TEST_OFFSET, VALID_OFFSET
from .flags import add_spindle_args, spindle_args
from ..trainer.session import run_entry
from .hooks import MEGATRON_DEFAULTS, megatron_args, resumed_counters

log = get_logger(__name__)

_RUN: dict = {}
#: Megatron's flags this run sets where the command line does not: the Spindle hooks' (an external data loader...),
#: ``--lr`` and ``--lr-decay-style`` as the built-in trainer's defaults (so ``SPINDLE=0`` and a Spindle run of one
#: command train alike), and an evaluation interval (Megatron-LM 0.19 needs one).
DEFAULTS = {**MEGATRON_DEFAULTS, "lr": 3e-4, "lr_decay_style": "cosine", "eval_interval": 1000}


def model_provider(pre_process: bool = True, post_process: bool = True, **framework):
    """Megatron's model provider: the user's, with the keywords Megatron passes that it accepts. Megatron-LM's
    ``train`` (0.19) reads the model's ``pg_collection``, which ``MimoModel`` does not set: a colocated MIMO model
    runs on Megatron's groups, the ones ``get_model`` passes."""
    ref = _RUN["provider"]
    model = call_provider(mimo_provider(), ref, **framework)
    if getattr(model, "pg_collection", None) is None and framework.get("pg_collection") is not None:
        model.pg_collection = framework["pg_collection"]
    return model


class MicroBatches:
    """Megatron micro-batches of this data-parallel rank from step ``start`` (module docstring)."""

    def __init__(self, graph, seed: int, micro: int, start: int = 0) -> None:
        self.data, self.micro, self.step = SyntheticData(graph, seed=seed), micro, start
        self.dp, self.rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        self.pending: list = []

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.pending:
            batch = self.data.batch(self.step)
            self.step += 1
            for task in self.data.graph.tasks:
                streams = batch[task]
                b = next(iter(streams.values())).shape[0]
                for j in range(0, b, self.micro * self.dp):
                    a = j + self.rank * self.micro
                    self.pending.append((task, {k: v[a:a + self.micro] for k, v in streams.items()}))
        task, streams = self.pending.pop(0)
        return {"task": task, **streams}


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """``(train, valid, test)`` iterators for ``--dataloader-type external``, resumed at the consumed samples."""
    args = megatron_args()
    start = getattr(args, "iteration", 0) or 0  # a step per iteration (a --spindle checkpoint counts samples its way)
    g = _RUN["graph"]
    return (MicroBatches(g, args.seed, args.micro_batch_size, start),
            MicroBatches(g, args.seed, args.micro_batch_size, VALID_OFFSET),
            MicroBatches(g, args.seed, args.micro_batch_size, TEST_OFFSET))


datasets_provider.is_distributed = True


def forward_step(data_iterator, model):
    """The MIMO forward of one micro-batch of one task; :func:`loss_func` scales its loss."""
    batch = next(data_iterator)
    task = batch["task"]
    inputs: dict = {}
    for name, v in batch.items():
        if name.count(".") == 2:  # <modality>.<encoder>.<keyword>
            m, e, kw = name.split(".")
            inputs.setdefault(m, {}).setdefault(e, {})[kw] = v
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    ids = batch["input_ids"].to(device)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    inputs = {m: {e: {k: v.to(device) for k, v in kw.items()} for e, kw in es.items()} for m, es in inputs.items()}
    out, mask = model(input_ids=ids, position_ids=positions, attention_mask=None,
                      loss_mask=batch["loss_mask"].to(device), labels=batch["labels"].to(device),
                      modality_inputs=inputs or None)
    return out, partial(loss_func, task, mask)


def micro_batches(task: str | None = None) -> int:
    """Micro-batches per rank per step of ``task`` (None: of all tasks, Megatron's ``num_microbatches``)."""
    per = _RUN["micro"] * mpu.get_data_parallel_world_size()
    return sum(b // per for b in _RUN["batches"].values()) if task is None else _RUN["batches"][task] // per


def loss_func(task: str, mask, losses):
    """``(loss, {task: tensor([share of the task's weighted mean, share of one])})`` (module docstring)."""
    g, weights, tokens = _RUN["graph"], _RUN["weights"], _RUN["tokens"]
    dp = mpu.get_data_parallel_world_size()
    total = (losses.float() * mask.float()).sum()
    share = total * weights[task] / tokens[task]   # this micro-batch's part of the weighted task mean
    report = {t: torch.zeros(2, dtype=torch.float64, device=total.device) for t in g.tasks}
    report[task] = torch.stack([share.detach().double(),
                                torch.tensor(1.0 / (micro_batches(task) * dp), dtype=torch.float64, device=total.device)])
    return share * (micro_batches() * dp), report


def _known(argv, flag: str, kind=str, default=None):
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument(flag, type=kind, default=default)
    return getattr(p.parse_known_args(argv)[0], flag.lstrip("-").replace("-", "_"))


def setup(argv: list[str]) -> list[str]:
    """Read the MIMO run's flags (the provider, its tasks, ``--micro-batch-size``, ranks from ``WORLD_SIZE``), load
    the model's description and graph, check ``--global-batch-size``; returns ``argv`` with it set. One line on bad
    input (``ValueError``)."""
    flags = spindle_args(argv)
    if not flags.spindle_model_provider or not flags.spindle_tasks_file:
        raise ValueError("--spindle-model-provider MODULE:FUNCTION and --spindle-tasks-file TASKS.toml are required")
    micro = _known(argv, "--micro-batch-size", int)
    if micro is None:
        raise ValueError("--micro-batch-size is required (samples per rank in each micro-batch)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    source = load_source(flags.spindle_model_provider, flags.spindle_tasks_file, say=True)
    g = source.workload(task_count=flags.spindle_tasks, batch=micro * world, freeze=flags.spindle_freeze).graph(1)
    batches = {op.task: op.batch for op in g.operators}
    _RUN.update(provider=flags.spindle_model_provider, graph=g, weights=dict(zip(g.tasks, g.task_weights)),
                micro=micro, batches=batches,
                tokens={op.task: op.batch * op.layer.loss_tokens for op in g.operators if op.op_type == "mimo_lm_head"})
    glob = _known(argv, "--global-batch-size", int)
    if glob is not None and glob != sum(batches.values()):
        raise ValueError(f"--global-batch-size {glob}: a step is every task's batch, {' + '.join(map(str, batches.values()))}"
                         f" = {sum(batches.values())} samples (--micro-batch-size x ranks per task)")
    log.info(f"mimo: Megatron-LM's loop without Spindle: {flags.spindle_model_provider}, every module on every rank "
             f"(colocated), {len(g.tasks)} tasks of {', '.join(map(str, batches.values()))} samples per step, "
             f"micro-batches of {micro} per rank")
    return [*argv, *([] if glob is not None else ["--global-batch-size", str(sum(batches.values()))])]


def pretrain_mimo(argv: list[str]) -> None:
    """Megatron-LM's ``pretrain`` on the user's MIMO provider (module docstring); ``argv`` as Megatron parses it."""
    apply_wheel_standins()
    apply_cpu_standins()
    apply_megatron_ddp_standins()
    sys.argv = [sys.argv[0], *setup(argv)]
    with cuda_on_cpu(), resumed_counters():
        run_pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                     extra_args_provider=add_spindle_args, args_defaults=DEFAULTS)


def main(argv=None) -> int:
    """``examples/mimo/megatron_mimo.py``: :func:`pretrain_mimo`, ending as every entry does (one line, exit 2 on
    bad input: :func:`..trainer.session.run_entry`); with ``SPINDLE_PREFLIGHT=1`` only :func:`setup`'s checks, in
    this one process (the launch script's check before torchrun starts any worker)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("SPINDLE_PREFLIGHT") == "1":
        try:
            setup(argv)
        except ValueError as e:
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        return 0
    return run_entry(lambda: pretrain_mimo(argv))
