"""A user's MIMO model under Megatron-LM's own ``pretrain`` (``megatron.training``: megatron-core 0.19.2, ``make
test-megatron-lm``) on 4 CPU ranks, through ``scripts/run_mimo.sh``:

* with Spindle (``SPINDLE_BACKEND=megatron``): ``--spindle-check-equivalence`` puts the plan's first step within 1e-5
  of the user's ``MimoModel`` in one process, and Megatron logs every task's loss;
* without it (``SPINDLE=0``): Megatron builds the user's model on every rank, wraps it in its DDP and steps its
  optimizer; a run stopped at iteration 2 (``--exit-interval``, Megatron's checkpoint) and resumed gives the
  uninterrupted run's iteration-3 losses.
"""
from __future__ import annotations

import re

import pytest

pytest.importorskip("megatron.training.training", reason="megatron.training needs megatron-core >= 0.17 "
                    "(Python >= 3.12): run `make test-megatron-lm`")

from test_mimo_launch import run_mimo  # noqa: E402

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
