"""The launch scripts in front of Megatron-LM's loop: what they add to a command, the GPU branch's argument list run
on CPU ranks, and ``--spindle-plan`` checked at the run's batch.

* :func:`~megatron_spindle.megatron.job.launch_defaults.added_flags`: ``--micro-batch-size`` (the model's
  smallest per-task batch of one pass over the ranks) where the script has none, ``--lr``, ``--eval-interval``
  and ``--eval-iters`` under Megatron-LM's loop, each only where the user's flags leave it out;
* the README's GPU commands, as the script builds them on a GPU node: a stand-in interpreter answers the
  script's one question to torch ("2 x NVIDIA H100") and passes every other call to this Python, so the script
  takes its GPU branch and its workers run Megatron-LM's ``pretrain`` (megatron-core >= 0.17) on gloo CPU ranks
  with exactly that list, at tiny size (``MODEL_SIZE=tiny``);
* the script's one-process check under Megatron-LM's loop fingerprints the graph at the run's
  ``--micro-batch-size``: a plan made for that batch passes (and trains), one made for another is refused in
  one line.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from launch_path import EXAMPLE, ROOT, base_env, free_port, launch, spindle

from megatron_spindle.megatron.job.launch_defaults import EVAL_INTERVAL, EVAL_ITERS, added_flags, pass_batch

try:
    import megatron.training.training  # noqa: F401
    HAS_TRAINING = True
except Exception:  # noqa: BLE001 - any import failure: no Megatron-LM loop here
    HAS_TRAINING = False
needs_training = pytest.mark.skipif(not HAS_TRAINING, reason="megatron.training needs megatron-core >= 0.17 "
                                    "(Python >= 3.12): run `make test-megatron-lm`")
TINY_CLIP = ["--spindle-size", "tiny", "--spindle-tasks", "4"]


def test_the_scripts_add_what_megatrons_loop_needs_unless_given():
    lr = "0.0003"  # the built-in loop's default --lr
    assert added_flags(TINY_CLIP, 2, "megatron") == [
        "--micro-batch-size", "64", "--lr", lr, "--eval-interval", str(EVAL_INTERVAL), "--eval-iters", str(EVAL_ITERS)]
    assert pass_batch(TINY_CLIP) == 128 and pass_batch(["--spindle-size", "tiny"], "qwen-val") == 8
    assert added_flags(TINY_CLIP, 256, "loop") == ["--micro-batch-size", "1"]  # at least one sample per rank
    given = TINY_CLIP + ["--micro-batch-size", "2", "--lr=1e-3", "--eval-interval", "5", "--eval-iters", "0"]
    assert added_flags(given, 2, "megatron") == [] and added_flags(given, 2, "loop") == []
    full = added_flags(["--spindle-size", "full", "--spindle-tasks", "4"], 8, "loop")
    assert full == ["--micro-batch-size", "4"]  # full Multitask-CLIP: 32 samples of its smallest task per pass
    assert added_flags(["--spindle-model", "/nonexistent.toml"], 2, "loop") == []  # the check names the file
    mimo = ["--spindle-model-provider", "examples.mimo.tiny_avlm:tiny_avlm", "--spindle-tasks-file",
            os.path.join(ROOT, "examples", "mimo", "tiny_tasks.toml")]
    assert added_flags(mimo, 2, "loop")[:1] == ["--micro-batch-size"]


def _check(tmp: str, plan: str, micro: str, *more, backend: str = "megatron") -> subprocess.CompletedProcess:
    """The launch script's one-process check of ``--spindle-plan`` for a job of 2 ranks (Megatron-LM's loop unless
    told), with the flags the launch script adds for Megatron-LM's loop."""
    env = base_env(SPINDLE_PREFLIGHT=1, SPINDLE_BACKEND=backend, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    return subprocess.run([sys.executable, EXAMPLE, *TINY_CLIP, "--spindle", "--spindle-plan", plan,
                           "--micro-batch-size", micro, "--lr", "1e-3", "--eval-interval", "10", *more], env=env,
                          cwd=tmp, capture_output=True, text=True, timeout=120)


def _one_line(r: subprocess.CompletedProcess, *words) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.fixture(scope="module")
def plan8(tmp_path_factory):
    """A plan of the tiny Multitask-CLIP for 2 ranks at 8 samples per task per pass (4 per rank)."""
    d = str(tmp_path_factory.mktemp("plan"))
    path = os.path.join(d, "plan.json")
    r = spindle(["plan", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4", "--gpus", "2", "--batch", "8",
                 "--passes", "1", "--out", path], d)
    assert r.rc == 0, r.err
    return path


@pytest.mark.parametrize("backend", ["megatron", "loop"])
def test_the_scripts_check_takes_a_plan_at_the_runs_batch(tmp_path, plan8, backend):
    """A plan made for the run's batch passes; one for another batch, another global batch or another world size
    is one line before any worker starts, in both loops."""
    ok = _check(str(tmp_path), plan8, "4", "--global-batch-size", "8", backend=backend)
    assert ok.returncode == 0 and ok.stderr.strip() == "", ok.stderr
    _one_line(_check(str(tmp_path), plan8, "2", backend=backend), "plan was made for model 'multitask-clip'", "re-plan")
    _one_line(_check(str(tmp_path), plan8, "4", "--global-batch-size", "16", backend=backend),
              "--global-batch-size 16 is not the plan's 1 pass per step x 8 samples per pass")
    four = os.path.join(str(tmp_path), "plan4.json")
    assert spindle(["plan", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4", "--gpus", "4", "--batch",
                    "8", "--passes", "1", "--out", four], str(tmp_path)).rc == 0
    _one_line(_check(str(tmp_path), four, "4", backend=backend), "plan is for 4 devices but the job has 2")


@needs_training
def test_a_plan_for_the_runs_batch_trains_through_the_script_under_megatrons_loop(tmp_path, plan8):
    r = launch(["--spindle", "--spindle-plan", plan8, "--eval-iters", "0"], str(tmp_path), SPINDLE_BACKEND="megatron",
               PYTHON=sys.executable, TRAIN_ITERS=2, MICRO_BATCH=4).wait(600)
    assert r.rc == 0, (r.err[-5:], r.out[-2000:])
    assert r.out.startswith("spindle launch: backend megatron (Megatron-LM's pretrain)"), r.out[:300]
    assert re.search(r"iteration\s+2/\s*2 \|", r.out) and "Traceback" not in "\n".join(r.err)


FAKE_GPU_PY = """#!/usr/bin/env bash
case "$*" in
  *device_count*) echo "2 NVIDIA_H100_80GB_HBM3";;
  *) exec {python} "$@";;
esac
"""


@needs_training
@pytest.mark.parametrize("script,args,micro", [
    ("run_multitask_clip.sh", ["--spindle-curves", "CURVES"], 64),
    ("run_qwen_val.sh", [], 4),
], ids=["multitask-clip --spindle-curves", "qwen-val"])
def test_the_gpu_branchs_arguments_run_megatrons_loop(tmp_path, script, args, micro):
    """README's GPU commands as the script runs them on a node of 2 GPUs (torch's answer stood in for; every other
    call is this Python), at tiny size: Megatron-LM's loop trains, validates at the end and exits 0. (README's
    ``run_qwen_val.sh --bf16`` needs CUDA tensors in Megatron's mixed-precision optimizer: the GPU check runs it.)"""
    fake = tmp_path / "python"
    fake.write_text(FAKE_GPU_PY.format(python=sys.executable))
    fake.chmod(0o755)
    curves = tmp_path / "curves.json"  # a profile of the tiny model (one measured MetaOp, the rest analytic)
    curves.write_text(json.dumps({"measured": {"model": "multitask-clip", "size": "tiny"},
                                  "curves": [{"metaop": "vision-text.vision.layers", "points": [[1, 2.0], [2, 1.2]]}]}))
    args = [str(curves) if a == "CURVES" else a for a in args]
    env = {k: v for k, v in base_env().items() if k not in ("GPUS_PER_NODE", "SPINDLE_BACKEND", "MODEL_SIZE",
                                                               "MICRO_BATCH", "CPU_MICRO_BATCH")}
    env.update(PYTHON=str(fake), MODEL_SIZE="tiny", TRAIN_ITERS="2", OUT=str(tmp_path / "out"),
               MASTER_PORT=str(free_port()))
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as o, open(err, "w") as e:
        rc = subprocess.run(["bash", os.path.join(ROOT, "scripts", script), "--spindle-predict-interval", "0", *args],
                            env=env, stdout=o, stderr=e, timeout=900).returncode
    text, errors = out.read_text(), [x for x in err.read_text().splitlines() if "error" in x]
    assert rc == 0, (errors, text[-3000:])
    lines = text.splitlines()
    assert lines[0].startswith("spindle launch: backend megatron (Megatron-LM's pretrain), device 2 x NVIDIA H100 "
                               "80GB HBM3 per node (NCCL), model size tiny, ranks 2"), lines[0]
    assert lines[1] == (f"spindle launch: added --micro-batch-size {micro} --lr 0.0003 --eval-interval {EVAL_INTERVAL} "
                        f"--eval-iters {EVAL_ITERS} (your flags leave them out; docs/training.md)"), lines[1]
    assert re.search(r"iteration\s+2/\s*2 \|", text) and "validation loss at iteration 2" in text
    assert not errors, errors

