"""A user's MIMO model under Megatron-LM's own ``pretrain`` (``megatron.training``: megatron-core 0.19.2, ``make
test-megatron-lm``) on 4 CPU ranks, through ``scripts/run_mimo.sh``:

* with Spindle (``SPINDLE_BACKEND=megatron``): ``--spindle-check-equivalence`` puts the plan's first step within 1e-5
  of the user's ``MimoModel`` in one process, and Megatron logs every task's loss;
* without it (``SPINDLE=0``): Megatron builds the user's model on every rank, wraps it in its DDP and steps its
  optimizer; a run stopped at iteration 2 (``--exit-interval``, Megatron's checkpoint) and resumed gives the
  uninterrupted run's iteration-3 losses;
* the two train one objective on one data stream: on 2 ranks, ``SPINDLE=0`` started from the weights a Spindle run
  starts from (:func:`megatron_spindle.models.mimo_reference.load_run_weights`) logs the Spindle run's losses,
  every task at every one of 3 steps within 1e-5 (Megatron's Adam in both).
"""
from __future__ import annotations

import re

import pytest

pytest.importorskip("megatron.training.training", reason="megatron.training needs megatron-core >= 0.17 "
                    "(Python >= 3.12): run `make test-megatron-lm`")

from mp_harness import run_ranks  # noqa: E402
from test_mimo_launch import REPO, run_mimo  # noqa: E402

MEGATRON = ["--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1",
            "--eval-interval", "10", "--eval-iters", "1", "--seed", "1234"]


def megatron_losses(text: str) -> dict[int, dict[str, float]]:
    """``{iteration: {task: loss}}`` from Megatron's training log lines."""
    out = {}
    for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|(.*)", text):
        out[int(m.group(1))] = {k: float(v) for k, v in re.findall(r"\| ([\w-]+): ([0-9.E+-]+)", m.group(2))
                                if k in ("image-text", "audio-text", "text")}
    return out


def test_spindle_under_megatron_lms_loop_has_the_users_losses(tmp_path):
    rc, text, _ = run_mimo(tmp_path, "--spindle-check-equivalence", "--global-batch-size", "8", *MEGATRON,
                           env={"SPINDLE_BACKEND": "megatron", "MICRO_BATCH": "2"})
    assert rc == 0, text[-3000:]
    assert float(re.search(r"equivalence: max relative difference (\S+)", text).group(1)) < 1e-5
    assert set(megatron_losses(text)[2]) == {"image-text", "audio-text", "text"}


def test_without_spindle_megatron_trains_the_model_and_resumes_it(tmp_path):
    whole, stopped, resumed = (tmp_path / d for d in ("whole", "stopped", "resumed"))
    for d in (whole, stopped, resumed):
        d.mkdir()
    env = {"SPINDLE": "0", "TRAIN_ITERS": "3", "MICRO_BATCH": "2"}
    rc, text, _ = run_mimo(whole, *MEGATRON, env=env)
    assert rc == 0, text[-3000:]
    assert "every module on every rank (colocated)" in text and "backend megatron" in text
    want = megatron_losses(text)
    assert sorted(want) == [1, 2, 3] and want[3]["text"] < want[1]["text"] + 1.0
    ckpt = str(tmp_path / "ckpt")
    rc, text, _ = run_mimo(stopped, *MEGATRON, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2", env=env)
    assert rc == 0, text[-3000:]
    assert megatron_losses(text)[2] == want[2]
    rc, text, _ = run_mimo(resumed, *MEGATRON, "--load", ckpt, env=env)
    assert rc == 0, text[-3000:]
    got = megatron_losses(text)
    assert sorted(got) == [3], text[-2000:]
    for task, v in want[3].items():
        assert got[3][task] == pytest.approx(v, rel=1e-6), task


def _logged_run(run) -> list[dict]:
    """Megatron's ``train_step`` losses of every step of ``run()``."""
    import megatron.training.training as mt

    from megatron_spindle.megatron.adapter import hooks
    losses, original = [], mt.train_step

    def train_step(*a, **kw):
        out = original(*a, **kw)
        losses.append({k: float(v) for k, v in out[0].items()})
        return out

    mt.train_step = train_step
    try:
        run()
    finally:
        mt.train_step = original
        hooks.uninstall()
        hooks._BUILT.clear()
        mt.destroy_global_state()
    return losses


def _both_rank(rank: int, world: int) -> dict:
    import sys

    from megatron_spindle.megatron.adapter import hooks, mimo_megatron
    from megatron_spindle.models.mimo_reference import load_run_weights

    flags = ["--spindle-model-provider", "examples.mimo.tiny_avlm:tiny_avlm", "--spindle-tasks-file",
             str(REPO / "examples" / "mimo" / "tiny_tasks.toml"), "--train-iters", "3", "--micro-batch-size", "2",
             *MEGATRON, "--eval-iters", "0"]
    sys.argv = ["pretrain_mimo.py", "--spindle", *flags, "--global-batch-size", "4"]
    spindle = _logged_run(lambda: hooks.pretrain_spindle(backend="megatron"))
    original = mimo_megatron.model_provider

    def seeded(*a, **kw):  # the user's model, from the weights the Spindle run started from
        model = original(*a, **kw)
        load_run_weights(model, mimo_megatron._RUN["graph"], seed=1234)
        return model

    mimo_megatron.model_provider = seeded
    try:
        megatron = _logged_run(lambda: mimo_megatron.pretrain_mimo(flags))
    finally:
        mimo_megatron.model_provider = original
    return {"spindle": spindle, "megatron": megatron}


def test_without_spindle_megatron_trains_spindles_objective_on_its_data():
    out = run_ranks(_both_rank, 2, timeout_s=600, nccl_rules=False)[0]
    assert len(out["spindle"]) == len(out["megatron"]) == 3
    for step, (a, b) in enumerate(zip(out["spindle"], out["megatron"])):
        assert set(a) == set(b) == {"image-text", "audio-text", "text"}
        for task in a:
            assert b[task] == pytest.approx(a[task], rel=1e-5), (step, task, a, b)
