"""Validation in the built-in trainer, as Megatron-LM's ``evaluate_and_print_results`` does it.

Every ``--eval-interval`` iterations (and at the end of training, on the validation and then the test stream)
``--eval-iters`` iterations of forward-only passes run over held-out synthetic batches (the validation and
test stretches of Megatron's external data iterators, :func:`..adapter.data.data_iterators`, never met by
training), each iteration the plan's passes per step, with dropout off (the model in eval mode). Rank 0 logs
each task's mean loss and perplexity in Megatron's line (``where``: ``iteration N``, or at the end ``iteration N
on validation set`` and ``... on test set``)::

    validation loss at iteration 2 | vision-text value: 6.931472E+00 | vision-text PPL: 1.024000E+03 |
"""
from __future__ import annotations

import math

from ...log import get_logger
from ..adapter.data import TEST_OFFSET, VALID_OFFSET, Batches
from ..adapter.schedule import forward_step, reduce_reports, spindle_forward_backward

log = get_logger(__name__)


class Evaluation:
    """Held-out batches of ``graph``'s tasks and the loss over them; ``passes`` per iteration, as a step."""

    def __init__(self, graph, seed: int, tasks, passes: int, iters: int, *, consumed: int = 0) -> None:
        self.passes, self.iters = passes, iters
        self.valid = Batches(graph, seed, tasks, position=VALID_OFFSET + consumed * passes)
        self.test = Batches(graph, seed, tasks, position=TEST_OFFSET)
        self.runs = consumed

    def run(self, model, batches) -> dict[str, float]:
        """Each task's mean loss over ``iters`` forward-only iterations of ``batches`` (collective)."""
        was = model.training
        model.eval()  # dropout off, as Megatron's evaluate
        try:
            reports = []
            for _ in range(self.iters):
                reports += spindle_forward_backward(forward_step_func=forward_step, data_iterator=batches,
                                                    model=[model], num_microbatches=self.passes, forward_only=True)
        finally:
            model.train(was)
        return reduce_reports(reports)

    def log(self, model, where: str, *, test: bool = False) -> dict[str, float]:
        """Run on the validation (or test) stream and log Megatron's line; returns the task losses."""
        losses = self.run(model, self.test if test else self.valid)
        if not test:
            self.runs += self.iters
        line = "".join(f"{t} value: {v:.6E} | {t} PPL: {math.exp(min(20.0, v)):.6E} | " for t, v in losses.items())
        text = f" validation loss at {where} | {line}"
        log.info("-" * len(text) + "\n" + text + "\n" + "-" * len(text))
        return losses
