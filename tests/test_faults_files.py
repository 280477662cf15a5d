"""Files, disk and terminal misbehaving, case by case, through the launch path (``scripts/run_multitask_clip.sh`` on 2 CPU ranks of
the tiny model) or the ``spindle`` command: nothing lost when the files, the disk or the terminal misbehave.
Exit status and line count are asserted for each; numbers in the test names are the issue's findings.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys

from launch_path import base_env, fill_disk, launch, losses, start

TRACKER = "latest_checkpointed_iteration.txt"


def one_line(r, *words, rc=2):
    """Exit status ``rc``, exactly one stderr line naming every one of ``words``; no traceback, nothing trained."""
    assert r.rc == rc, (r.rc, r.err[-8:])
    assert len(r.err) == 1, r.err
    assert "Traceback" not in r.out and "iteration " not in r.out
    for w in words:
        assert w in r.err[0], (w, r.err[0])
    return r.err[0]


def tracker(save: str) -> int:
    with open(os.path.join(save, TRACKER)) as fh:
        return int(fh.read())


def test_1_save_over_another_runs_checkpoints_is_refused_unless_resumed_or_told(tmp_path):
    save = str(tmp_path / "ck")
    first = launch(["--save", save, "--save-interval", "1"], str(tmp_path)).wait(300)
    assert first.rc == 0 and tracker(save) == 3, first.err
    again = launch(["--save", save, "--save-interval", "1", "--seed", "99"], str(tmp_path), TRAIN_ITERS=2).wait(300)
    one_line(again, f"--save {save!r} already holds the checkpoints of another run (up to iteration 3)",
             f"--load {save}", "--spindle-overwrite-save")
    assert tracker(save) == 3 and not again.left
    resumed = launch(["--save", save, "--load", save, "--save-interval", "1"], str(tmp_path), TRAIN_ITERS=4).wait(300)
    assert resumed.rc == 0 and resumed.err == [], resumed.err
    assert f"resumed from {save} at iteration 3" in resumed.out and tracker(save) == 4
    told = launch(["--save", save, "--spindle-overwrite-save"], str(tmp_path), TRAIN_ITERS=1).wait(300)
    assert told.rc == 0 and told.err == [] and tracker(save) == 1, told.err


def test_13_a_tracker_that_is_a_fifo_is_one_line_not_a_hang(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    os.mkfifo(d / TRACKER)
    for args in (["--load", str(d)], ["--save", str(d)]):
        r = launch(args, str(tmp_path)).wait(120)  # a hang would be killed at 120 s and fail the status
        one_line(r, f"checkpoint tracker {d / TRACKER} is not a regular file")


SEVEN = "vision-text,audio-text,vision-depth,vision-thermal,vision-imu,audio-vision,depth-text"


def checkpoint_keys(save: str, it: int) -> set[str]:
    from megatron.core import dist_checkpointing as dc
    return set(dc.load_tensors_metadata(os.path.join(save, f"iter_{it:07d}")))


def test_2_a_task_schedule_keeps_every_module_in_every_checkpoint_and_resumes_in_a_later_phase(tmp_path):
    """Seven tasks, then two from iteration 2: the five that left keep their encoders and AdamW moments in
    every later checkpoint, and a run resumed in the second phase gives the uninterrupted losses."""
    sched = ["--spindle-task-schedule", f"0:{SEVEN};2:vision-text,audio-text"]
    save = str(tmp_path / "ck")
    ref = launch(sched, str(tmp_path), TASKS=7, TRAIN_ITERS=5).wait(400)
    assert ref.rc == 0 and ref.err == [], ref.err
    first = launch([*sched, "--save", save, "--save-interval", "1", "--exit-interval", "3"], str(tmp_path),
                   TASKS=7, TRAIN_ITERS=5).wait(400)
    assert first.rc == 0 and first.err == [], first.err
    keys = checkpoint_keys(save, 1)
    assert any("depth" in k for k in keys) and any(k.startswith("optim/") and "imu" in k for k in keys)
    assert checkpoint_keys(save, 2) == keys and checkpoint_keys(save, 3) == keys
    resumed = launch([*sched, "--load", save, "--save", save, "--save-interval", "1"], str(tmp_path),
                     TASKS=7, TRAIN_ITERS=5).wait(400)
    assert resumed.rc == 0 and resumed.err == [], resumed.err
    assert f"resumed from {save} at iteration 3" in resumed.out and "fresh weights" not in resumed.out
    got = losses(resumed.out)
    assert sorted(got) == [4, 5] and all(got[i] == losses(ref.out)[i] for i in got), (got, losses(ref.out))
    assert checkpoint_keys(save, 5) == keys


def test_3_two_profiles_sharing_one_cache_keep_both_runs_points(tmp_path):
    """Multitask-CLIP (13 points) and Qwen-VAL (10 points) profiled at once into one --cache: both runs'
    points are in it afterwards (each save merges what the file holds under a lock)."""
    cache = str(tmp_path / "cache.json")
    common = ["--size", "tiny", "--batch", "4", "--nproc", "1", "--max-devices", "1", "--warmup", "0", "--repeats",
              "1", "--min-time", "0", "--no-link", "--cache", cache]
    runs = [start([sys.executable, "-m", "megatron_spindle.cli", "profile", "--model", model, *extra, *common,
                   "--out", str(tmp_path / f"{model}.json")], base_env(), str(tmp_path))
            for model, extra in (("multitask-clip", ["--tasks", "4"]), ("qwen-val", []))]
    results = [r.wait(600) for r in runs]
    for r in results:
        assert r.rc == 0 and r.err == [], r.err
    assert "13 to measure" in results[0].out and "10 to measure" in results[1].out
    with open(cache) as fh:
        assert len(json.load(fh)["entries"]) == 23


def test_8_sighup_to_the_launcher_stops_after_the_step_like_sigterm(tmp_path):
    """A closed terminal (SIGHUP to the launcher, which torchrun forwards): the ranks finish the step, rank 0
    says where the run stands in one line, exit 129; no iter_N.tmp, no lock left."""
    from megatron_spindle.megatron.checkpoint.directory import latest_iteration
    save = str(tmp_path / "ck")
    run = launch(["--save", save, "--save-interval", "1"], str(tmp_path), TRAIN_ITERS=200)
    run.wait_for(r"saved checkpoint \S+ at iteration 2\b")
    run.proc.send_signal(signal.SIGHUP)
    r = run.wait(300)
    assert r.rc == 129, r.err
    assert len(r.err) == 1, r.err
    it = int(re.search(r"stopped by SIGHUP after iteration (\d+) of 200", r.err[0]).group(1))
    assert f"last checkpoint: {save} at iteration {it}" in r.err[0]
    assert latest_iteration(save) == it and not r.left
    assert [f for f in os.listdir(save) if ".tmp" in f or f.startswith(".spindle")] == []


def test_4_a_failing_tensorboard_writer_is_one_warning_and_training_goes_on(tmp_path, caplog):
    """The writer raises ENOSPC (as on a full disk): one warning naming the flag and the cause, then no more
    writes; nothing raised into the loop."""
    import argparse
    import errno
    import logging
    from megatron_spindle.megatron.trainer.logs import TrainLogs
    logs = TrainLogs(argparse.Namespace(tensorboard_dir=str(tmp_path / "tb"), wandb_project=None), 0)
    calls = []

    def full(*a, **k):
        calls.append(a)
        raise OSError(errno.ENOSPC, "No space left on device")

    logs.tb.add_scalar = full
    with caplog.at_level(logging.WARNING, logger="megatron_spindle"):
        for it in (1, 2, 3):
            logs.step(it, losses={"a": 1.0}, grad_norm=1.0, lr=1e-3, batch_size=8, step_s=0.1)
        logs.close()
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warning:")]
    assert len(warned) == 1 and len(calls) == 1, warned
    assert f"--tensorboard-dir {tmp_path / 'tb'}: cannot write (no space left on device)" in warned[0]
    assert "training goes on" in warned[0]


def test_4_a_disk_that_fills_under_tensorboard_and_the_trace_is_a_warning_each(tmp_path):
    """--tensorboard-dir and the trace on a 1 MiB tmpfs that fills after iteration 5 (needs root): the run
    trains to the end, exit 0, nothing on stderr, one warning per logger."""
    import subprocess
    import pytest
    mnt = str(tmp_path / "small")
    os.makedirs(mnt)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        run = launch(["--tensorboard-dir", os.path.join(mnt, "tb"), "--spindle-gantt", "", "--log-interval", "5"],
                     str(tmp_path), TRAIN_ITERS=120, OUT=mnt)
        run.wait_for(r"iteration +5/120")
        fill_disk(mnt)
        r = run.wait(600)
        assert r.rc == 0 and r.err == [], r.err
        warned = [line for line in r.out.splitlines() if line.startswith("warning:")]
        assert len(warned) == 2, warned
        assert any(w.startswith(f"warning: --tensorboard-dir {mnt}/tb: cannot write (no space left on device)")
                   for w in warned), warned
        assert any(w.startswith(f"warning: --spindle-trace {mnt}:") and "no space left on device" in w
                   for w in warned), warned
        assert "iteration   120/120" in r.out
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)


def plugin_spec(d, body: str) -> str:
    """The LLaVA example spec beside a copy of its plugin with ``body`` appended."""
    import shutil
    from launch_path import ROOT
    shutil.copy(os.path.join(ROOT, "examples", "models", "llava.toml"), os.path.join(d, "llava.toml"))
    with open(os.path.join(ROOT, "examples", "models", "llava_layers.py")) as fh:
        text = fh.read()
    with open(os.path.join(d, "llava_layers.py"), "w") as fh:
        fh.write(text + "\n" + body + "\n")
    return os.path.join(d, "llava.toml")


def test_11_a_plugin_that_exits_is_refused_and_no_plan_claimed(tmp_path):
    from launch_path import spindle
    spec = plugin_spec(str(tmp_path), "import sys\nsys.exit(0)")
    out = str(tmp_path / "p.json")
    r = spindle(["plan", "--model", spec, "--gpus", "2", "--out", out], str(tmp_path))
    assert r.rc == 2 and len(r.err) == 1, (r.rc, r.err)
    assert "model.layer_plugins[0]" in r.err[0] and "called sys.exit(0)" in r.err[0], r.err
    assert not os.path.exists(out)


def test_14_each_plugin_file_run_is_named_in_one_line(tmp_path):
    from launch_path import spindle
    spec = plugin_spec(str(tmp_path), "")
    r = spindle(["plan", "--model", spec, "--gpus", "8"], str(tmp_path))
    assert r.rc == 0 and r.err == [], r.err
    ran = [line for line in r.out.splitlines() if line.startswith("layer plugin: ran")]
    assert len(ran) == 1 and str(tmp_path / "llava_layers.py") in ran[0] and "use only specs you trust" in ran[0]


def test_16_relative_paths_mean_where_the_user_started_the_script(tmp_path):
    from launch_path import ROOT
    os.makedirs(tmp_path / "data" / "vision-text")
    r = launch(["--spindle-data", "data"], str(tmp_path), cwd=str(tmp_path)).wait(120)
    one_line(r, "no energon dataset", "audio-text")  # found tmp/data, not a missing ROOT/data
    name = f"ck-{os.getpid()}"
    r = launch(["--save", name], str(tmp_path), cwd=str(tmp_path), OUT=f"out-{name}", TRAIN_ITERS=1).wait(300)
    assert r.rc == 0 and r.err == [], r.err
    assert tracker(str(tmp_path / name)) == 1 and os.path.isfile(tmp_path / f"out-{name}" / "trace.json")
    assert not os.path.exists(os.path.join(ROOT, name)) and not os.path.exists(os.path.join(ROOT, f"out-{name}"))


def test_5_a_truncated_energon_shard_is_named_before_the_first_step(tmp_path):
    import subprocess
    from launch_path import ROOT
    data = str(tmp_path / "data")
    made = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_energon_dataset.py"), "--tasks", "4",
                           "--samples", "64", "--shard-size", "32", "--out", data], env=base_env(),
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    shard = os.path.join(data, "vision-depth", "part-0000.tar")
    os.truncate(shard, os.path.getsize(shard) // 3)
    r = launch(["--spindle-data", data], str(tmp_path)).wait(120)
    one_line(r, f"shard {shard} of task 'vision-depth' is", "truncated")


def test_6_damaged_pretrained_weights_are_one_line_naming_the_file(tmp_path):
    """--spindle-init weights from a truncated model.safetensors, or through an index naming a deleted shard:
    refused by the launch check in one line naming the file; `spindle hf check` on the truncated one too."""
    import pytest
    pytest.importorskip("transformers")
    from launch_path import ROOT, spindle
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import make_tiny_hf
    from megatron_spindle.models.hf_config import model_spec_toml, towers
    cut = make_tiny_hf.make("tiny-llama", str(tmp_path / "cut"))
    shards = str(tmp_path / "shards")
    make_tiny_hf.build("tiny-llama", 0).save_pretrained(shards, max_shard_size="100KB")
    names = sorted(n for n in os.listdir(shards) if n.endswith(".safetensors"))
    assert len(names) > 1, names
    os.unlink(os.path.join(shards, names[-1]))
    weights = os.path.join(cut, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    for d, words in ((cut, [f"{weights} is truncated", "download it again"]),
                     (shards, [f"names the shard {names[-1]}, which is not in {shards}"])):
        spec = tmp_path / f"{os.path.basename(d)}.toml"
        spec.write_text(model_spec_toml(d, towers(d), name="m"))
        r = launch(["--spindle-model", str(spec)], str(tmp_path), TASKS="", MICRO_BATCH=1, MODEL_SIZE="full").wait(120)
        one_line(r, "pretrained weights of", *words)
    r = spindle(["hf", "check", cut], str(tmp_path))
    assert r.rc == 2 and len(r.err) == 1 and f"{weights} is truncated" in r.err[0], (r.rc, r.err)


def test_9_a_spec_with_every_module_renamed_does_not_resume_from_nothing(tmp_path):
    from launch_path import SPEC
    with open(SPEC) as fh:
        text = re.sub(r"\b(vision|text|audio|depth|thermal|imu)\.(embed|layers|head)\b", r"r_\1.\2", fh.read())
    text = text.replace("[modules.loss]", "[modules.r_loss]").replace("-> loss\"", "-> r_loss\"")
    renamed = tmp_path / "renamed.toml"
    renamed.write_text(text)
    save = str(tmp_path / "ck")
    first = launch(["--save", save], str(tmp_path), TRAIN_ITERS=1).wait(300)
    assert first.rc == 0, first.err
    r = launch(["--spindle-model", str(renamed), "--load", save], str(tmp_path)).wait(300)
    one_line(r, f"checkpoint {save}/iter_0000001 holds none of this model's weights", "r_")


def test_10_fewer_samples_per_task_than_one_batch_is_refused(tmp_path):
    import subprocess
    from launch_path import ROOT
    data = str(tmp_path / "data")
    made = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_energon_dataset.py"), "--tasks", "4",
                           "--samples", "3", "--out", data], env=base_env(), capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    r = launch(["--spindle-data", data], str(tmp_path)).wait(120)  # 4 per rank x 2 ranks: 8 samples a pass
    one_line(r, "task 'vision-text' has 3 samples, one pass takes 8", "repeat samples")


def test_12_the_trace_cap_is_one_warning_and_prediction_lines_stay_short(tmp_path):
    r = launch(["--spindle-trace-max-spans", "300", "--spindle-predict-interval", "2"], str(tmp_path),
               TRAIN_ITERS=12).wait(300)
    assert r.rc == 0 and r.err == [], r.err
    lines = r.out.splitlines()
    warned = [i for i, line in enumerate(lines) if line.startswith("warning: the step trace reached its cap of 300")]
    assert len(warned) == 1, r.out[-3000:]
    predictions = [i for i, line in enumerate(lines) if line.startswith("prediction |")]
    assert predictions and all(i < warned[0] for i in predictions), r.out[-3000:]
    assert all(len(lines[i]) < 2000 and "no step prediction" not in lines[i] for i in predictions), \
        [lines[i] for i in predictions]
    assert "iteration    12/12" in r.out and os.path.isfile(tmp_path / "out" / "trace.json")


def test_15_long_planning_shows_progress(tmp_path):
    from launch_path import spindle
    plan = ["plan", "--model", "multitask-clip", "--tasks", "10", "--gpus", "64", "--progress-interval", "0.05"]
    r = spindle(plan, str(tmp_path))
    assert r.rc == 0 and r.err == [], r.err
    beats = [line for line in r.out.splitlines() if line.startswith("planning: ")]
    assert beats and all(line.endswith("s so far (multitask-clip, 64 devices, batch of the model)") for line in beats)
    r = spindle([*plan, "--json"], str(tmp_path))  # stdout stays one JSON object; the lines go to stderr
    assert r.rc == 0 and json.loads(r.out)["gpus"] == 64
    assert r.err and all(line.startswith("planning: ") for line in r.err), r.err


def test_7_a_plan_that_does_not_fit_this_machine_is_one_line(tmp_path):
    """MODEL_SIZE=full on 2 CPU ranks: the planner's estimate (about 46 GiB) against the host's available
    memory, before any layer is built; skipped on a machine with room for it."""
    import pytest
    from megatron_spindle.megatron.job.preflight import _host_available_bytes
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph
    need = sum(make_plan(build_graph("multitask-clip", tasks=4, batch=8),
                         load_cluster(None, num_devices=2, gpus_per_node=2)).device_memory_bytes)
    have = _host_available_bytes()
    if have is None or have > need:
        pytest.skip(f"this machine has {have} bytes available, the full model's plan needs {need:.0f}")
    r = launch([], str(tmp_path), MODEL_SIZE="full").wait(600)
    one_line(r, "GiB of host memory for the 2 rank(s) on this machine", "MODEL_SIZE=tiny")
