"""Megatron's training flags mean the same in Megatron-LM's own ``pretrain`` (through Spindle's hooks) as in
the built-in trainer (``test_training_flags.py``), on 2 gloo CPU ranks; needs ``megatron.training`` (``make
test-megatron-lm``).

* the learning rate per iteration follows Megatron's schedule (warm-up fraction, ``--lr-decay-iters``, cosine
  to ``--min-lr``) and equals the built-in loop's; with ``--weight-decay 0.1`` (Megatron's groups: none on
  biases and 1-D weights) and evaluation every 2 iterations both loops log the same training losses (1e-6);
* ``--init-method-std 0.5`` gives other losses, the same in both loops;
* ``--hidden-dropout 0.5 --attention-dropout 0.5`` changes the first loss (before any update: only dropout
  differs), Megatron's default dropout does not apply to Spindle's models (the first loss of the run without
  the flags is the built-in loop's).
"""
from __future__ import annotations

import math

import pytest

pytest.importorskip("megatron.training.training", reason="megatron.training needs megatron-core >= 0.17 "
                    "(Python >= 3.12): run `make test-megatron-lm`")

from mp_harness import run_ranks  # noqa: E402
from test_megatron_lm import _close, _megatron_run  # noqa: E402

FLAGS = ["--spindle", "--spindle-model", "multitask-clip", "--spindle-tasks", "4", "--spindle-size", "tiny",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--seed", "1234",
         "--log-interval", "1", "--train-iters", "4", "--lr-warmup-fraction", "0.5", "--lr-decay-iters", "6",
         "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--weight-decay", "0.1", "--spindle-predict-interval", "0",
         "--eval-interval", "1000", "--eval-iters", "0"]
EVAL = ["--eval-interval", "2", "--eval-iters", "1"]


def _megatron(argv: list[str]) -> dict:
    """Megatron-LM's loop on ``argv``: :func:`test_megatron_lm._megatron_run` plus each step's learning rate."""
    import megatron.training.training as mt

    lrs = []
    original = mt.train_step

    def train_step(*a, **kw):
        out = original(*a, **kw)
        scheduler = a[4] if len(a) > 4 else kw["opt_param_scheduler"]
        lrs.append(scheduler.get_lr(scheduler.optimizer.param_groups[0]))
        return out

    mt.train_step = train_step
    try:
        run = _megatron_run(argv)
    finally:
        mt.train_step = original
    return {**run, "lr": lrs}


def _loop(argv: list[str]) -> dict:
    from megatron_spindle.megatron.adapter.flags import fallback_args
    from megatron_spindle.megatron.trainer.loop import Trainer, pretrain

    got = []
    original = Trainer.train_step

    def train_step(self, it):
        out = original(self, it)
        got.append((out[0], self.optimizer.param_groups[0]["lr"]))
        return out

    Trainer.train_step = train_step
    try:
        pretrain(fallback_args(argv)[0])
    finally:
        Trainer.train_step = original
    return {"losses": [g[0] for g in got], "lr": [g[1] for g in got]}


def _rank(rank: int, world: int) -> dict:
    std, drop = ["--init-method-std", "0.5"], ["--hidden-dropout", "0.5", "--attention-dropout", "0.5"]
    out = {"megatron": _megatron(FLAGS + EVAL), "megatron_std": _megatron(FLAGS + std + ["--eval-iters", "0"]),
           "megatron_dropout": _megatron(FLAGS + drop + ["--eval-iters", "0"])}
    # the built-in loop last: its megatron.core globals (the memory buffer) would trip a later initialize_megatron
    return {**out, "loop": _loop(FLAGS + EVAL), "loop_std": _loop(FLAGS + std)}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_rank, 2, timeout_s=1200)[0]


def test_schedule_and_weight_decay_as_the_built_in_loop(runs):
    mega, loop = runs["megatron"], runs["loop"]
    cosine = [1e-3 / 3, 2e-3 / 3, 1e-3, 1e-4 + 0.5 * (math.cos(math.pi / 3) + 1) * 9e-4]
    assert mega["lr"] == pytest.approx(cosine, rel=1e-9) and loop["lr"] == pytest.approx(cosine, rel=1e-9)
    assert mega["counts"]["evaluate"] >= 2
    for step, (m, b) in enumerate(zip(mega["losses"], loop["losses"])):
        assert _close(m, b, 1e-6), f"step {step + 1}: Megatron {m} vs built-in loop {b}"


def test_init_std_in_both_loops(runs):
    mega, loop = runs["megatron_std"]["losses"], runs["loop_std"]["losses"]
    for step, (m, b) in enumerate(zip(mega, loop)):
        assert _close(m, b, 1e-6), f"step {step + 1}: Megatron {m} vs built-in loop {b}"
    plain = runs["megatron"]["losses"][0]
    assert any(abs(mega[0][t] - plain[t]) > 1e-3 * abs(plain[t]) for t in plain), (mega[0], plain)


def test_dropout_changes_the_first_loss(runs):
    first, plain = runs["megatron_dropout"]["losses"][0], runs["megatron"]["losses"][0]
    assert all(math.isfinite(v) for v in first.values())
    assert any(abs(first[t] - plain[t]) > 1e-3 * abs(plain[t]) for t in plain), (first, plain)
