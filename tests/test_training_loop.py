"""The training loop: checkpoint resume (same plan, another plan), atomic checkpoints, bad input, the plan's
passes and distributed optimizer.

Resume must continue with exactly the losses of an uninterrupted run (same data positions, same optimizer
state, same learning-rate schedule), also when the checkpoint loads under another plan (4 ranks -> 2 ranks,
and the sequential plan -> the Spindle plan).

A loaded plan's passes per step and distributed optimizer are what the loop runs: a plan of 2 passes with
ZeRO-1 trains like the same plan without it given ``--global-batch-size`` for 2 passes; a contradicting
``--global-batch-size``, or ``--save`` with a sharded optimizer state, is refused in one line.
"""
import hashlib
import os
import subprocess
import sys

import pytest

from mp_harness import run_ranks

BASE = ["--spindle-size", "tiny", "--spindle-tasks", "4", "--log-interval", "100",
        "--spindle-predict-interval", "0", "--lr", "1e-3", "--seed", "7"]


def _args(extra):
    from megatron_spindle.megatron.adapter.flags import build_parser
    return build_parser().parse_args(BASE + extra)


def _run(rank, world, ckpt, script):
    micro = ["--micro-batch-size", str(8 // world)]  # 8 samples per task per pass on any world size
    """Run several trainings in one process group; returns each run's summary (task losses of the last step)."""
    import io
    import logging
    from megatron_spindle.megatron.trainer.loop import pretrain
    out = []
    for extra in script:
        if extra == "FAIL_SAVE":
            out.append(_failing_save(ckpt))
            continue
        buf = io.StringIO()
        handler = logging.StreamHandler(buf)  # the trainer logs through `logging` (rank 0 at the entry point)
        logger = logging.getLogger("megatron_spindle")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            res = pretrain(_args(micro + [a.replace("CKPT", ckpt) for a in extra]))
        finally:
            logger.removeHandler(handler)
        lines = [l for l in buf.getvalue().splitlines() if l.startswith("iteration ")]
        resumed = [l for l in buf.getvalue().splitlines() if l.startswith("resumed ")]
        plan_lines = [l for l in buf.getvalue().splitlines() if l.startswith("spindle: ")]
        out.append({"result": res, "lines": lines, "resumed": resumed, "plan_lines": plan_lines})
    return out


def _failing_save(ckpt):
    """A save that dies half-way must leave the previous checkpoint and the tracker untouched."""
    import megatron.core.dist_checkpointing as dc
    from megatron_spindle.megatron.checkpoint import save_load as C
    from megatron_spindle.megatron.adapter.model import graph_for as make_graph, plan_for
    from megatron_spindle.megatron.trainer.loop import make_optimizer
    from megatron_spindle.runtime.executor import SpindleModel
    import torch.distributed as dist
    args = _args(["--spindle", "--micro-batch-size", str(8 // dist.get_world_size())])
    g = make_graph(args, dist.get_world_size())
    model = SpindleModel(plan_for(args, g, dist.get_world_size()), g, seed=7)
    opt = make_optimizer(model.unique_parameters(), args)
    real = dc.save

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    dc.save = boom
    try:
        C.save_checkpoint(ckpt, 999, model, opt)
        raised = False
    except C.CheckpointError as e:  # every rank: one line naming the cause
        raised = "no space left on device" in str(e)
    finally:
        dc.save = real
    dist.barrier()
    model.destroy()
    return {"raised": raised, "latest": C.latest_iteration(ckpt)}


def _digest(path):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            with open(os.path.join(root, f), "rb") as fh:
                h.update(f.encode() + fh.read())
    return h.hexdigest()


def _iters(lines):
    """{iteration: line without timing fields}"""
    out = {}
    for l in lines:
        it = int(l.split()[1].split("/")[0])
        out[it] = l.split(" | step")[0].split("| loss ")[1]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt"))
    four = run_ranks(_run, 4, d, [
        ["--spindle", "--train-iters", "6", "--log-interval", "1"],                         # uninterrupted
        ["--spindle", "--train-iters", "6", "--exit-interval", "3", "--log-interval", "1", "--save", "CKPT"],
        ["--spindle", "--train-iters", "6", "--log-interval", "1", "--load", "CKPT"],       # resume, same plan
        ["--train-iters", "6", "--log-interval", "1", "--load", "CKPT"],                    # sequential plan
        "FAIL_SAVE",
        ["--spindle", "--spindle-tasks", "7", "--train-iters", "4", "--load", "CKPT"],     # another task mix
    ], timeout_s=400)
    plans = _plans_for_two(tmp_path_factory.mktemp("plans"))
    two = run_ranks(_run, 2, d, [["--spindle", "--train-iters", "6", "--log-interval", "1", "--load", "CKPT"],
                                 ["--spindle", "--spindle-plan", plans["zero"], "--train-iters", "3", "--log-interval",
                                  "1"],
                                 ["--spindle", "--spindle-plan", plans["plain"], "--train-iters", "3", "--log-interval",
                                  "1", "--global-batch-size", "16"]],
                    timeout_s=300)
    return d, four, two


def _plans_for_two(d) -> dict[str, str]:
    """The Spindle plan for 2 ranks made for 2 passes, as is and with the distributed optimizer."""
    import dataclasses
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=8),
                     load_cluster(None, num_devices=2, gpus_per_node=2), passes=2)
    out = {"plain": str(d / "plain.json"), "zero": str(d / "zero.json")}
    plan.save(out["plain"])
    dataclasses.replace(plan, distributed_optimizer=True).save(out["zero"])
    return out


def test_the_plans_passes_and_distributed_optimizer_are_what_trains(runs):
    """2 passes per step and ZeRO-1 from the plan alone: the losses of the same plan without ZeRO-1 (its 2
    passes given by --global-batch-size), to the 4 digits logged."""
    _, _, two = runs
    zero, plain = _iters(two[0][1]["lines"]), _iters(two[0][2]["lines"])
    assert sorted(zero) == [1, 2, 3] and zero == plain
    assert two[0][1]["result"]["samples_per_s"] and "x 2 passes" in " ".join(two[0][1]["plan_lines"])


def test_resume_continues_with_the_uninterrupted_losses(runs):
    _, four, two = runs
    full = _iters(four[0][0]["lines"])
    first, resumed, other_plan = (_iters(four[0][i]["lines"]) for i in (1, 2, 3))
    assert sorted(first) == [1, 2, 3] and sorted(resumed) == [4, 5, 6]
    for it in (1, 2, 3):
        assert first[it] == full[it]
    for it in (4, 5, 6):
        assert resumed[it] == full[it], "same plan"
        assert other_plan[it] == full[it], "the sequential plan on the same ranks"
        assert _iters(two[0][0]["lines"])[it] == full[it], "another world size (4 -> 2 ranks)"


def test_a_failed_save_leaves_the_last_checkpoint(runs):
    d, four, _ = runs
    assert four[0][4] == {"raised": True, "latest": 3}
    assert os.path.isdir(os.path.join(d, "iter_0000003"))
    assert not os.path.exists(os.path.join(d, "iter_0000999"))


def _cli(args, env_extra=None, cwd=None):
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_port())}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "megatron_spindle.megatron.trainer.loop", *BASE, "--micro-batch-size", "8",
                           *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def _port():
    from mp_harness import free_port
    return free_port()


def test_bad_input_one_clear_error_and_checkpoints_intact(runs, tmp_path):
    d, _, _ = runs
    r = subprocess.run([sys.executable, "-m", "megatron_spindle.megatron.trainer.loop", "--spindle-model", "gpt5"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: unknown model 'gpt5'; built-in models: imagebind, multitask-clip, ofasys, qwen-val (or give the "
        "path of a .toml model spec)"]
    # a plan for another model, and for another world size
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph
    other = tmp_path / "ofasys.json"
    make_plan(build_graph("ofasys", tasks=4, size="tiny", batch=8), load_cluster(None, num_devices=1)).save(str(other))
    r = _cli(["--spindle", "--spindle-plan", str(other), "--train-iters", "1"])
    assert r.returncode == 2 and "not for this model" in r.stderr, r.stderr[-2000:]
    wrong_world = tmp_path / "four.json"
    make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=8),
              load_cluster(None, num_devices=4)).save(str(wrong_world))
    r = _cli(["--spindle", "--spindle-plan", str(wrong_world), "--train-iters", "1"])
    assert r.returncode == 2 and "plan is for 4 devices but the job has 1" in r.stderr, r.stderr[-2000:]
    # the plan's passes against --global-batch-size, and a sharded optimizer state with --save
    import dataclasses
    two_passes = tmp_path / "two_passes.json"
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=8), load_cluster(None, num_devices=1),
                     passes=2)
    plan.save(str(two_passes))
    r = _cli(["--spindle", "--spindle-plan", str(two_passes), "--train-iters", "1", "--global-batch-size", "24"])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --global-batch-size 24 is not the plan's 2 passes per step x 8 samples per pass (--micro-batch-size "
        "x ranks) = 16: give --global-batch-size 16 or a plan made for 3 passes"], r.stderr[-2000:]
    zero = tmp_path / "zero.json"
    dataclasses.replace(plan, distributed_optimizer=True).save(str(zero))
    r = _cli(["--spindle", "--spindle-plan", str(zero), "--train-iters", "1", "--save", str(tmp_path / "z")])
    assert r.returncode == 2 and "shards the optimizer state (distributed_optimizer)" in r.stderr, r.stderr[-2000:]
    # a corrupt checkpoint: one clear error, nothing on disk changes
    corrupt = tmp_path / "corrupt"
    import shutil
    shutil.copytree(d, corrupt)
    shard = next(p for p in (corrupt / "iter_0000003").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:64])
    before = _digest(corrupt)
    r = _cli(["--spindle", "--train-iters", "4", "--load", str(corrupt), "--save", str(corrupt)])
    assert r.returncode == 2 and "corrupt" in r.stderr and "iter_0000003" in r.stderr, r.stderr[-2000:]
    assert _digest(corrupt) == before


def test_a_checkpoint_loads_under_another_task_mix(runs):
    _, four, _ = runs
    seven = four[0][5]
    assert sorted(_iters(seven["lines"])) == [4]
    assert len(seven["result"]["task_losses"]) == 7
    (line,) = seven["resumed"]
    assert "at iteration 3" in line and "fresh weights for" in line and "imu" in line  # the new tasks' encoder
