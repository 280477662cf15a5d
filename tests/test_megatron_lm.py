"""Megatron-LM's own ``pretrain`` (``megatron.training``) driving our hooks on 2 gloo CPU ranks.

Needs ``megatron.training``: megatron-core >= 0.17 wheels ship it (Python >= 3.12). ``make test-megatron-lm``
builds that environment (``.venv-mlm``: Python 3.12, megatron-core 0.19.2) and runs this file; under the
Python 3.11 ``.venv`` (megatron-core 0.16.1, no ``megatron.training``) it is skipped. Megatron's CUDA-only
start-up is stood in for by :mod:`megatron_spindle.compat.megatron_lm` (applied only without CUDA).

What is checked, per model (Multitask-CLIP tiny, Qwen-VAL tiny), in one set of processes:

* Megatron's ``train_step`` ran our schedule and our gradient sync: counted calls of the hooked
  forward-backward function and of ``SpindleModel.finalize_grads`` equal Megatron's ``train_step`` calls,
  and each training step's losses come from our executor (without the hooks Megatron's own schedule would
  run and these counts would be 0);
* ``evaluate`` ran (validation losses per task) and checkpoints were written;
* the losses Megatron logs equal the built-in loop's on the same plan, seeds and data, 1e-6 relative over
  3 steps;
* (Qwen-VAL) with ``--tensorboard-dir`` every task's loss reaches Megatron's own TensorBoard writer under the
  task's name at every iteration (read back with tensorboard's ``EventAccumulator``);
* (CLIP) resuming from the iteration-2 checkpoint reproduces the uninterrupted run's later losses exactly,
  and a checkpoint of 4 tasks resumes with 7 (a task-mix change): the 4 tasks' weights are loaded, the 3 new
  tasks start from their seeds, training continues;
* (lean plan) a loaded plan that runs a phase per task, recomputes activations (full and selective, a shared
  weight both ways) and takes 2 passes per step trains under Megatron's loop with the losses of the built-in
  loop on the same plan (1e-6) and of the same waves in one phase without recompute (fp32 rounding, 1e-5).
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest

pytest.importorskip("megatron.training.training", reason="megatron.training needs megatron-core >= 0.17 "
                    "(Python >= 3.12): run `make test-megatron-lm`")

from mp_harness import run_ranks  # noqa: E402

COMMON = ["--micro-batch-size", "{micro}", "--global-batch-size", "{glob}", "--lr", "1e-3", "--min-lr", "0",
          "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--weight-decay", "0",
          "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--clip-grad", "1.0", "--seed", "1234",
          "--log-interval", "1"]


def _flags(model: str, tasks: int | None, micro: int, glob: int, iters: int, extra=()) -> list[str]:
    out = ["--spindle", "--spindle-model", model, "--spindle-size", "tiny", "--train-iters", str(iters)]
    if tasks:
        out += ["--spindle-tasks", str(tasks)]
    return out + [f.format(micro=micro, glob=glob) for f in COMMON] + list(extra)


def _megatron_run(argv: list[str]) -> dict:
    """One ``pretrain_spindle(backend="megatron")``: losses per training step and call counts."""
    import megatron.training.training as mt

    from megatron_spindle.megatron.adapter import hooks
    from megatron_spindle.runtime.executor import SpindleModel

    counts = {"train_step": 0, "spindle_forward_backward": 0, "finalize_grads": 0, "evaluate": 0}
    losses: list[dict] = []
    originals = (mt.train_step, mt.evaluate, hooks.megatron_forward_backward, SpindleModel.finalize_grads)

    def train_step(*a, **kw):
        counts["train_step"] += 1
        out = originals[0](*a, **kw)
        losses.append({k: float(v) for k, v in out[0].items()})
        return out

    def evaluate(*a, **kw):
        counts["evaluate"] += 1
        return originals[1](*a, **kw)

    def forward_backward(**kw):
        if not kw.get("forward_only"):
            counts["spindle_forward_backward"] += 1
        return originals[2](**kw)

    def finalize_grads(self):
        counts["finalize_grads"] += 1
        return originals[3](self)

    mt.train_step, mt.evaluate, hooks.megatron_forward_backward = train_step, evaluate, forward_backward
    SpindleModel.finalize_grads = finalize_grads
    sys.argv = ["pretrain_spindle.py", *argv]
    try:
        hooks.pretrain_spindle(backend="megatron")
        chunk = hooks._BUILT[0]
        tasks = list(chunk.plan.tasks)
        chunk.module.destroy()
    finally:
        mt.train_step, mt.evaluate, hooks.megatron_forward_backward, SpindleModel.finalize_grads = originals
        hooks.uninstall()
        hooks._BUILT.clear()
        mt.destroy_global_state()
    return {"losses": losses, "counts": counts, "tasks": tasks}


def _loop_run(argv: list[str]) -> list[dict]:
    """The built-in trainer on the same flags: the losses of every step."""
    from megatron_spindle.megatron.adapter.flags import fallback_args
    from megatron_spindle.megatron.trainer.loop import Trainer, pretrain

    got = []
    original = Trainer.train_step

    def train_step(self, it):
        out = original(self, it)
        got.append(out[0])
        return out

    Trainer.train_step = train_step
    try:
        args, _ = fallback_args(argv)
        pretrain(args)
    finally:
        Trainer.train_step = original
    return got


def _restart_at(src: str, dst: str, iteration: int) -> None:
    """A checkpoint directory holding only ``src``'s iteration ``iteration`` (rank 0 copies, all wait)."""
    import torch.distributed as dist

    from megatron_spindle import comm
    if dist.get_rank() == 0:
        name = f"iter_{iteration:07d}"
        shutil.copytree(os.path.join(src, name), os.path.join(dst, name))
        with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    comm.barrier()


def _clip_rank(rank: int, world: int, tmp: str) -> dict:
    full = os.path.join(tmp, "full")
    flags = dict(model="multitask-clip", tasks=7, micro=2, glob=8)
    out = {"megatron": _megatron_run(_flags(**flags, iters=4, extra=("--eval-interval", "2", "--eval-iters", "1",
                                                                  "--save", full, "--save-interval", "2")))}
    resume = os.path.join(tmp, "resume")
    _restart_at(full, resume, 2)
    out["resumed"] = _megatron_run(_flags(**flags, iters=4, extra=("--load", resume, "--eval-iters", "0", "--eval-interval", "1000")))
    mix = os.path.join(tmp, "mix")
    _restart_at(full, mix, 2)
    out["mix"] = _megatron_run(_flags(**{**flags, "tasks": 4}, iters=3,
                                      extra=("--load", mix, "--eval-iters", "0", "--eval-interval", "1000",
                                             "--no-load-optim")))
    out["loop"] = _loop_run(_flags(**flags, iters=4))
    out["saved"] = sorted(os.listdir(full)) if rank == 0 else None
    return out


def _qwen_rank(rank: int, world: int, tmp: str) -> dict:
    flags = dict(model="qwen-val", tasks=None, micro=1, glob=2)
    tb = ("--tensorboard-dir", os.path.join(tmp, "tb"))  # Megatron's own writer (on its last rank)
    return {"megatron": _megatron_run(_flags(**flags, iters=3, extra=("--eval-interval", "3", "--eval-iters", "1",
                                                                      *tb))),
            "loop": _loop_run(_flags(**flags, iters=3))}


def _check_hooks_ran(run: dict, steps: int) -> None:
    c = run["counts"]
    assert c["train_step"] == steps, c
    assert c["spindle_forward_backward"] == steps, f"Megatron's train_step did not run our schedule: {c}"
    assert c["finalize_grads"] == steps, f"our gradient sync did not run once per step: {c}"
    assert len(run["losses"]) == steps and all(set(l) == set(run["tasks"]) for l in run["losses"]), run["losses"]


def _close(a: dict, b: dict, rel: float) -> bool:
    return set(a) == set(b) and all(abs(a[k] - b[k]) <= rel * max(abs(b[k]), 1e-12) for k in a)


def test_megatron_pretrain_multitask_clip(tmp_path):
    results = run_ranks(_clip_rank, 2, str(tmp_path), timeout_s=900)
    r0 = results[0]
    run = r0["megatron"]
    _check_hooks_ran(run, steps=4)
    assert run["counts"]["evaluate"] >= 1
    assert {"iter_0000002", "iter_0000004"} <= set(r0["saved"])
    for step, (mega, loop) in enumerate(zip(run["losses"][:3], r0["loop"][:3])):
        assert _close(mega, loop, 1e-6), f"step {step + 1}: Megatron {mega} vs built-in loop {loop}"
    resumed = r0["resumed"]
    _check_hooks_ran(resumed, steps=2)
    assert resumed["losses"] == run["losses"][2:], "resuming at iteration 2 changed the losses"
    mix = r0["mix"]
    _check_hooks_ran(mix, steps=1)
    assert len(mix["tasks"]) == 4 and set(mix["tasks"]) < set(run["tasks"])
    for task in mix["tasks"]:  # the kept tasks continue where training left off, not from scratch
        assert mix["losses"][0][task] < run["losses"][0][task], (task, mix["losses"][0], run["losses"][0])
    assert all(r["megatron"]["losses"] == run["losses"] for r in results), "ranks logged different losses"


def test_megatron_pretrain_qwen_val(tmp_path):
    results = run_ranks(_qwen_rank, 2, str(tmp_path), timeout_s=900)
    run = results[0]["megatron"]
    _check_hooks_ran(run, steps=3)
    assert run["counts"]["evaluate"] >= 1
    for step, (mega, loop) in enumerate(zip(run["losses"], results[0]["loop"])):
        assert _close(mega, loop, 1e-6), f"step {step + 1}: Megatron {mega} vs built-in loop {loop}"
    # every task's loss reached Megatron's TensorBoard writer, under the task's name, at every iteration
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(run["tasks"]) <= tags and {"learning-rate", "grad-norm"} <= tags, tags
    for task in run["tasks"]:
        got = [(e.step, e.value) for e in events.Scalars(task)]
        assert [s for s, _ in got] == [1, 2, 3], got
        assert all(abs(v - run["losses"][i][task]) <= 1e-6 * abs(v) for i, (_, v) in enumerate(got)), (task, got)


def _lean_plans(d: str, world: int, micro: int) -> dict[str, str]:
    """Task by task on ``world`` ranks, 2 passes per step: in one phase without recompute, and a phase per task
    with mixed recompute (the waves of ``test_runtime_exec._by_task``)."""
    from test_runtime_exec import MIXED, _by_task

    from megatron_spindle.planner.workload.workloads import build_graph
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=micro * world)
    out = {"plain": os.path.join(d, "plain.json"), "lean": os.path.join(d, "lean.json")}
    import dataclasses
    dataclasses.replace(_by_task(g, world), passes=2).save(out["plain"])
    dataclasses.replace(_by_task(g, world, [0, 1, 2, 3], recompute=MIXED), passes=2).save(out["lean"])
    return out


def _lean_rank(rank: int, world: int, plans: dict) -> dict:
    flags = dict(model="multitask-clip", tasks=4, micro=2, glob=8)
    extra = ("--eval-iters", "0", "--eval-interval", "1000")
    return {"megatron": _megatron_run(_flags(**flags, iters=3, extra=("--spindle-plan", plans["lean"], *extra))),
            "loop": _loop_run(_flags(**flags, iters=3, extra=("--spindle-plan", plans["lean"]))),
            "plain": _loop_run(_flags(**flags, iters=3, extra=("--spindle-plan", plans["plain"])))}


def test_megatron_pretrain_lean_plan(tmp_path):
    plans = _lean_plans(str(tmp_path), 2, 2)
    r0 = run_ranks(_lean_rank, 2, plans, timeout_s=900)[0]
    run = r0["megatron"]
    _check_hooks_ran(run, steps=3)
    for step, (mega, loop, plain) in enumerate(zip(run["losses"], r0["loop"], r0["plain"])):
        assert _close(mega, loop, 1e-6), f"step {step + 1}: Megatron {mega} vs built-in loop {loop}"
        assert _close(mega, plain, 1e-5), f"step {step + 1}: phased + recompute {mega} vs one phase {plain}"


def test_megatron_exit_signal_handler_saves_on_sigterm(tmp_path):
    """Megatron-LM's ``pretrain`` through the launch script (its check, then torchrun through
    ``megatron_spindle.launch``) with Megatron's ``--exit-signal-handler``: a scheduler's SIGTERM to the
    launcher reaches the workers, Megatron's own handler finishes the step, saves and exits 0."""
    import re
    import signal

    from launch_path import launch

    save = str(tmp_path / "ckpt")
    run = launch(["--global-batch-size", "8", "--lr", "1e-3", "--eval-iters", "0", "--eval-interval", "1000",
                  "--save", save, "--save-interval", "1000", "--exit-signal-handler"], str(tmp_path),
                 SPINDLE_BACKEND="megatron", TRAIN_ITERS=200, PYTHON=sys.executable)
    run.wait_for(r"iteration\s+2/\s*200", timeout=600)
    run.proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler would; torchrun forwards it
    r = run.wait(600)
    assert r.rc == 0, (r.err[-10:], r.out[-3000:])
    assert "exiting program after receiving SIGTERM" in r.out and not r.left
    logged = [int(m) for m in re.findall(r"iteration\s+(\d+)/\s*200", r.out)]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as fh:
        saved = int(fh.read().strip())
    assert saved == max(logged) >= 2, (saved, logged)  # the step it was in finished, then it saved
    assert not os.path.exists(os.path.join(save, ".spindle-save.lock"))
