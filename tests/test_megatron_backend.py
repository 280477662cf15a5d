"""Which loop ``pretrain_spindle`` runs (split from ``test_megatron_hooks.py``): the hooks import without
``megatron.training``, the backend decision, and the fallback to the built-in trainer with one notice."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_spindle.megatron.adapter import flags
from megatron_spindle.megatron.adapter import hooks
from megatron_spindle.megatron.trainer import loop as trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_hooks_import_without_megatron_training():
    code = ("import sys; sys.modules['megatron.training'] = None\n"
            "from megatron_spindle.megatron.adapter import hooks\n"
            "backend, why = hooks.choose_backend()\n"
            "assert backend == 'loop' and 'megatron.training' in why, why\n"
            "print('ok')")
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_backend_decision():
    assert hooks.choose_backend(has_training=True, has_cuda=True) == ("megatron", "")
    backend, why = hooks.choose_backend(has_training=False, has_cuda=True)
    assert backend == "loop" and "megatron.training" in why
    backend, why = hooks.choose_backend(has_training=True, has_cuda=False)
    assert backend == "loop" and "CUDA" in why


def test_pretrain_spindle_falls_back_to_the_trainer_with_one_notice(monkeypatch, capsys, caplog):
    seen = {}
    monkeypatch.setattr(hooks, "choose_backend", lambda: ("loop", "megatron.training is not importable (test)"))
    monkeypatch.setattr(trainer, "pretrain", lambda args: seen.setdefault("args", args) and {"steps": 0})
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    caplog.set_level("INFO", logger="megatron_spindle")
    hooks.pretrain_spindle(argv=["--spindle", "--micro-batch-size", "2", "--pipeline-model-parallel-size", "1",
                                 "--train-iters", "3"])  # a Megatron flag at its default: accepted
    notice = [r.getMessage() for r in caplog.records]
    assert len(notice) == 1 and "built-in megatron.core trainer" in notice[0]
    args = seen["args"]
    assert args.spindle and args.train_iters == 3
    assert args.micro_batch_size == 2  # per rank, as in Megatron; model.graph_for multiplies by the world size
    with pytest.raises(SystemExit):
        flags.fallback_args(["--spindle-plna", "x"])
    with pytest.raises(ValueError, match="--num-layers 2 is refused .*--spindle-model"):  # the flag contract
        hooks.pretrain_spindle(argv=["--spindle", "--num-layers", "2"])
    capsys.readouterr()
