"""The multi-task data iterators of a run (synthetic and deterministic), for both trainers.

:class:`Batches` yields one pass's batch of every task of the plan: ``{task: {stream: tensor}}``, drawn from
:class:`~megatron_spindle.models.data.SyntheticData` at pass index ``position``, so a resumed run (which starts
at ``iteration x passes``) sees the same data. :func:`data_iterators` gives Megatron's ``(train, valid, test)``
triple for ``--dataloader-type external``; validation and test read disjoint stretches of the same stream.
:func:`train_batches` picks real data instead when ``--spindle-data`` names per-task energon datasets
(:class:`~megatron_spindle.data.energon.EnergonData`: each rank reads only its slices' samples).
"""
from __future__ import annotations

from typing import Sequence

from ...models.data import SyntheticData

#: Where the validation and test iterators start in the synthetic stream, so they never meet training data.
VALID_OFFSET, TEST_OFFSET = 10 ** 9, 2 * 10 ** 9


class Batches:
    """Multi-task batches restricted to ``tasks``; ``position`` is the pass index of the next batch."""

    def __init__(self, graph, seed: int, tasks: Sequence[str], position: int = 0) -> None:
        self.data = SyntheticData(graph, seed=seed)
        self.tasks = tuple(tasks)
        self.position = position

    def __iter__(self):
        return self

    def peek(self) -> dict:
        """The next batch, without advancing (the equivalence check runs the first step twice)."""
        return self.data.batch(self.position)

    def __next__(self):
        batch = self.data.batch(self.position)
        self.position += 1
        return {t: batch[t] for t in self.tasks}


def data_iterators(graph, seed: int, tasks: Sequence[str], *, consumed_train: int = 0, consumed_valid: int = 0):
    """``(train, valid, test)`` for ``--dataloader-type external``; ``consumed_*`` are Megatron's sample counts
    (one pass consumes ``graph``'s per-pass batch of every task)."""
    per_pass = graph.operators[0].batch
    train = Batches(graph, seed, tasks, position=consumed_train // per_pass)
    valid = Batches(graph, seed, tasks, position=VALID_OFFSET + consumed_valid // per_pass)
    test = Batches(graph, seed, tasks, position=TEST_OFFSET)
    return train, valid, test


def train_batches(args, graph, plan, rank: int):
    """The built-in trainer's iterator: ``--spindle-data`` energon datasets, else synthetic :class:`Batches`."""
    if not getattr(args, "spindle_data", None):
        return Batches(graph, args.seed, plan.tasks)
    if getattr(args, "spindle_task_schedule", None):
        raise ValueError("--spindle-data cannot be combined with --spindle-task-schedule yet (each rank's "
                         "samples follow the first plan's layout)")
    from ...data.energon import EnergonData  # optional dependency: megatron-energon
    return EnergonData(args.spindle_data, graph, plan, rank, seed=args.seed)


def resume_counters(args, scheduler) -> bool:
    """After Megatron-LM loaded a checkpoint at ``args.iteration``: its sample counters in this run's units.

    Megatron counts a step's samples, and ``SPINDLE=0`` counts all tasks' (its ``--global-batch-size`` is their sum)
    where ``--spindle`` counts every task's; a checkpoint of the one read by the other would leave the schedule
    (``scheduler.num_steps``) and ``consumed_train_samples`` in the writer's units. Both become ``iteration x
    global_batch_size`` (this run's, no batch-size ramp-up) and the learning rate follows; a checkpoint of the
    same kind of run already counts so (nothing changes). Returns whether anything changed."""
    iteration = getattr(args, "iteration", 0) or 0
    want = iteration * args.global_batch_size
    if not iteration or scheduler is None or scheduler.num_steps == want:
        return False
    args.consumed_train_samples = want
    scheduler.num_steps = 0
    scheduler.step(increment=want)
    return True

