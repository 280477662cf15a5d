"""Megatron's training flags keep their meaning in the built-in trainer (the loop used where ``megatron.training``
does not import); Megatron-LM's own loop: ``test_megatron_flags.py``.

* the learning rate per iteration follows Megatron's schedule, computed here by hand: warm-up as a fraction of
  ``--lr-decay-iters``, cosine decay to ``--min-lr``; WSD's linear annealing over ``--lr-wsd-decay-iters``;
* ``--train-samples`` trains samples over the global batch iterations;
* ``--eval-interval/--eval-iters`` log Megatron's validation line during and after training (validation and
  test sets), forward only: the training losses are those of the same run without evaluation;
* ``--init-method-std`` and ``--hidden-dropout/--attention-dropout`` change the losses; dropout 0 (the
  default) leaves them as they were; ``--seed`` fixes the dropout masks (the same run twice, the same losses);
* weight decay spares biases and 1-D weights (Megatron's rule), ``--adam-eps`` reaches AdamW, and ``--fp16``
  is refused in one line (exit 2).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from mp_harness import run_ranks

BASE = ["--spindle", "--spindle-model", "multitask-clip", "--spindle-tasks", "4", "--spindle-size", "tiny",
        "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "1", "--spindle-predict-interval", "0"]


def _run(argv: list[str]) -> dict:
    """The built-in trainer on ``argv``: each step's losses and learning rate, the validation lines, the summary."""
    from megatron_spindle.megatron.adapter.flags import fallback_args
    from megatron_spindle.megatron.trainer.evaluate import Evaluation
    from megatron_spindle.megatron.trainer.loop import Trainer, pretrain

    steps, evals = [], []
    step, log = Trainer.train_step, Evaluation.log

    def train_step(self, it):
        out = step(self, it)
        steps.append((out[0], self.optimizer.param_groups[0]["lr"]))
        return out

    def evaluation_log(self, model, where, *, test=False):
        out = log(self, model, where, test=test)
        evals.append((where, out))
        return out

    Trainer.train_step, Evaluation.log = train_step, evaluation_log
    try:
        args, _ = fallback_args(BASE + argv)
        summary = pretrain(args)
    finally:
        Trainer.train_step, Evaluation.log = step, log
    return {"losses": [s[0] for s in steps], "lr": [s[1] for s in steps], "evals": evals, "summary": summary}


def _rank(rank: int, world: int) -> dict:
    return {
        "cosine": _run(["--train-iters", "4", "--lr-warmup-fraction", "0.5", "--lr-decay-iters", "6",
                        "--lr-decay-style", "cosine", "--min-lr", "1e-4"]),
        "wsd": _run(["--train-iters", "4", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2",
                     "--lr-wsd-decay-style", "linear", "--min-lr", "1e-4"]),
        "samples": _run(["--train-samples", "16", "--global-batch-size", "8"]),
        "plain": _run(["--train-iters", "2"]),
        "eval": _run(["--train-iters", "2", "--eval-interval", "1", "--eval-iters", "1"]),
        "zero_dropout": _run(["--train-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0"]),
        "std": _run(["--train-iters", "2", "--init-method-std", "0.5"]),
        "dropout": _run(["--train-iters", "2", "--hidden-dropout", "0.5", "--attention-dropout", "0.5"]),
        "dropout_again": _run(["--train-iters", "2", "--hidden-dropout", "0.5", "--attention-dropout", "0.5"]),
    }


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_rank, 2, timeout_s=900)[0]


def test_lr_follows_megatrons_schedule(runs):
    # warm-up 0.5 x 6 iterations = 3, from --lr-warmup-init 0; then cosine from 1e-3 to 1e-4 over iterations 3-6
    cosine = [1e-3 / 3, 2e-3 / 3, 1e-3, 1e-4 + 0.5 * (math.cos(math.pi / 3) + 1) * 9e-4]
    assert runs["cosine"]["lr"] == pytest.approx(cosine, rel=1e-9)
    # WSD: stable to iteration 2 of 4, then linear annealing to --min-lr over the last 2
    assert runs["wsd"]["lr"] == pytest.approx([1e-3, 1e-3, 1e-4 + 0.5 * 9e-4, 1e-4], rel=1e-9)


def test_train_samples_give_iterations(runs):
    assert runs["samples"]["summary"]["steps"] == 2  # 16 samples over a global batch of 8


def test_evaluation_logs_and_leaves_training_alone(runs):
    ev = runs["eval"]
    assert [w for w, _ in ev["evals"]] == ["iteration 1", "iteration 2", "iteration 2 on validation set",
                                           "iteration 2 on test set"]
    tasks = set(ev["losses"][0])
    assert all(set(losses) == tasks and all(math.isfinite(v) for v in losses.values()) for _, losses in ev["evals"])
    assert ev["evals"][1][1] != ev["evals"][3][1], "the test set is not the validation set"
    assert ev["losses"] == runs["plain"]["losses"], "evaluating changed training"
    assert runs["plain"]["evals"] == []  # --eval-iters 0 (the default): no evaluation


def test_init_std_and_dropout_change_losses(runs):
    plain = runs["plain"]["losses"]
    assert runs["zero_dropout"]["losses"] == plain
    for name in ("std", "dropout"):
        first = runs[name]["losses"][0]
        assert all(math.isfinite(v) for v in first.values())
        assert any(abs(first[t] - plain[0][t]) > 1e-3 * abs(plain[0][t]) for t in first), (name, first, plain[0])
    assert runs["dropout_again"]["losses"] == runs["dropout"]["losses"], "--seed does not fix the dropout masks"


def test_init_std_sets_weights():
    from megatron_spindle.models.blocks import LayerSettings
    from megatron_spindle.models.reference import ReferenceModel
    from megatron_spindle.planner.workload.workloads import build_graph

    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=2)
    for std in (0.02, 0.5):
        ref = ReferenceModel(g, seed=1, settings=LayerSettings(init_std=std))
        w = [p for n, p in ref.named_parameters() if n.endswith("linear_qkv.weight")][0]
        assert w.std().item() == pytest.approx(std, rel=0.1)


def test_weight_decay_groups_and_adam_eps():
    import argparse

    import torch

    from megatron_spindle.megatron.adapter.train_flags import add_optimizer_args
    from megatron_spindle.megatron.trainer.optim import make_optimizer, make_scheduler

    p = argparse.ArgumentParser()
    add_optimizer_args(p)
    args = p.parse_args(["--weight-decay", "0.1", "--adam-eps", "1e-3"])
    args.train_iters, args.train_samples = 4, None
    lin = torch.nn.Linear(3, 3)
    opt = make_optimizer(lin.parameters(), args)
    make_scheduler(opt, args, global_batch=8)
    by_shape = {tuple(q.shape): g for g in opt.param_groups for q in g["params"]}
    assert by_shape[(3, 3)]["weight_decay"] == 0.1 and by_shape[(3,)]["weight_decay"] == 0.0
    assert all(g["eps"] == 1e-3 and g["betas"] == (0.9, 0.999) for g in opt.param_groups)


def test_fp16_refused_in_one_line(tmp_path):
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "megatron_spindle.megatron.trainer.loop", *BASE, "--fp16"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--fp16" in lines[0] and "--bf16" in lines[0], r.stderr
