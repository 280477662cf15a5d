"""The training flags the launch scripts add where the user gave none, so that either loop has what it needs.

Megatron-LM's ``pretrain`` has no default for ``--micro-batch-size``, ``--lr`` or ``--eval-interval``
(megatron-core 0.19.2's parser: ``None``), and ends in a bare traceback without them (``assert
args.micro_batch_size is not None``, a comparison with ``None`` in the LR schedule, ``train_iters //
eval_interval``); the built-in loop has its own defaults. ``scripts/run_multitask_clip.sh`` (and the scripts
that run it: ``run_qwen_val.sh``, ``run_mimo.sh``) adds, after its own flags and before the user's, each of these
the user's flags leave out (:func:`added_flags`):

* ``--micro-batch-size`` (only where the script has none: on a GPU node without ``MICRO_BATCH``): the model's
  smallest per-task batch of one pass, from its spec or MIMO tasks file, over the job's ranks, at least 1; both
  loops get it, so one command trains the same batch in either;
* under Megatron-LM's loop, ``--lr``: the built-in loop's default (:func:`..adapter.flags.add_training_args`, so
  one command trains alike in both loops), and ``--eval-interval 1000 --eval-iters 10``: Megatron-LM's own example
  scripts' values (``examples/gpt3/train_gpt3_175b_distributed.sh``); a run of fewer iterations validates once,
  at its end.

The script runs :func:`main` (``python -m megatron_spindle.megatron.job.launch_defaults MODEL ARGS...``) before its
one-process check, which then checks the whole list. Pure (no torch).
"""
from __future__ import annotations

import argparse
import os
import sys

from ...mimo.tasks import load_tasks
from ...planner.workload.workloads import build_graph
from ..adapter.flags import add_training_args

EVAL_INTERVAL = 1000
"""``--eval-interval`` under Megatron-LM's loop: Megatron-LM's ``examples/gpt3/train_gpt3_175b_distributed.sh``."""
EVAL_ITERS = 10
"""``--eval-iters`` under Megatron-LM's loop: the same example script."""


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _model_flags(argv: list[str], model: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--spindle-model", default=model)
    p.add_argument("--spindle-model-provider", default=None)
    p.add_argument("--spindle-tasks-file", default=None)
    p.add_argument("--spindle-tasks", type=int, default=None)
    p.add_argument("--spindle-size", default="full")
    return p.parse_known_args(argv)[0]


def pass_batch(argv: list[str], model: str = "multitask-clip") -> int:
    """The smallest per-task batch of one pass of the model these flags name (``model`` where they name none),
    at its default batch: a MIMO tasks file's batches, or the model spec's (at ``--spindle-size``, its first
    ``--spindle-tasks`` tasks)."""
    a = _model_flags(argv, model)
    if a.spindle_model_provider and a.spindle_tasks_file:
        tasks = load_tasks(a.spindle_tasks_file).tasks
        return min(t.batch for t in tasks[:a.spindle_tasks or len(tasks)])
    graph = build_graph(a.spindle_model, tasks=a.spindle_tasks, size=a.spindle_size)
    return min(op.batch for op in graph.operators)


def added_flags(argv: list[str], world: int, backend: str, model: str = "multitask-clip") -> list[str]:
    """The flags to add to ``argv`` (the script's flags then the user's) for a job of ``world`` ranks whose
    workers run ``backend`` (``megatron``: Megatron-LM's ``pretrain``; ``loop``: the built-in loop) and whose
    pretrain script trains ``model`` unless ``argv`` names another. A bad model flag is left for the script's
    check to name (no ``--micro-batch-size`` added then)."""
    out = []
    if not _given(argv, "--micro-batch-size"):
        try:
            out += ["--micro-batch-size", str(max(1, pass_batch(argv, model) // max(1, world)))]
        except Exception:  # noqa: BLE001 - a bad model flag or file: the script's check names it in one line
            pass
    if backend == "megatron":
        lr = add_training_args(argparse.ArgumentParser()).get_default("lr")
        if not _given(argv, "--lr") and lr is not None:
            out += ["--lr", repr(lr)]
        if not _given(argv, "--eval-interval"):
            out += ["--eval-interval", str(EVAL_INTERVAL)]
        if not _given(argv, "--eval-iters"):
            out += ["--eval-iters", str(EVAL_ITERS)]
    return out


def main(argv: list[str] | None = None) -> int:
    """``MODEL ARGS...``: print :func:`added_flags` one per line, for the job the launch script exports
    (``WORLD_SIZE``, ``SPINDLE_BACKEND``)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    for flag in added_flags(argv[1:], world, os.environ.get("SPINDLE_BACKEND", "loop"), argv[0]):
        print(flag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
