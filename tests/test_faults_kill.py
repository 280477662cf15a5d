"""Kill a random rank at a random point around a checkpoint save, several times, as torchrun runs training.

torchrun runs through ``megatron_spindle.launch`` (torchrun's own code, ending as the workers say), as the
launch scripts start it. For each kill (one before a save, one during, one after; rank, iteration and point
drawn from a seeded generator, ``SPINDLE_FAULT_SEED`` to vary it): the run fails with exit status 3 (a peer
failed), the surviving rank says so in one line and the launcher names the killed rank in one line, no
traceback; afterwards no process of the run is left (none carries the run's environment marker:
megatron.core's writer helpers would be orphans under init); the tracker names a checkpoint whose every file
matches its manifest; and resuming from it gives, iteration by iteration, exactly the losses of the
uninterrupted run. With torchrun's ``--max-restarts 1`` the run resumes by itself from its last checkpoint
and ends with the uninterrupted losses.
"""
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from launch_path import losses, run_processes  # every process a run started carries its marker
from mp_harness import free_port

ITERS = 4
TRAIN = ["--spindle", "--spindle-size", "tiny", "--spindle-tasks", "4", "--micro-batch-size", "4",
         "--lr", "1e-3", "--seed", "7", "--train-iters", str(ITERS), "--log-interval", "1",
         "--spindle-predict-interval", "0", "--spindle-timeout", "60"]
SEED = int(os.environ.get("SPINDLE_FAULT_SEED", "12"))



def torchrun(args, *, fault=None, nproc=2, timeout_s=300, log=None, torchrun_args=()):
    """Run the built-in loop under torchrun (through ``megatron_spindle.launch``); returns (returncode, output,
    processes of the run left alive).

    Output goes to a file, not a pipe: a leftover process holding the pipe would hang the reader.
    """
    import tempfile
    import uuid
    marker = uuid.uuid4().hex
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "SPINDLE_RUN_MARK": marker}
    env.pop("SPINDLE_FAULT", None)
    if fault:
        env["SPINDLE_FAULT"] = fault
    cmd = [sys.executable, "-m", "megatron_spindle.launch", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), "--monitor-interval", "0.2", *torchrun_args, "-m", "megatron_spindle.megatron.trainer.loop",
           *args]
    with tempfile.TemporaryFile("w+") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        fh.seek(0)
        out = fh.read()
    left = run_processes(marker)
    end = time.monotonic() + 15  # a worker torchrun signalled may take a moment to exit
    while left and time.monotonic() < end:
        time.sleep(0.3)
        left = run_processes(marker)
    for entry in left:  # do not leak them into the rest of the test session
        try:
            os.kill(int(entry.split()[0]), signal.SIGKILL)
        except OSError:
            pass
    return p.returncode, out, left



def scenarios(seed: int):
    """Three kills: before, during and after a save, each at a random rank and save iteration."""
    rng = random.Random(seed)
    out = []
    for kind in ("before", "during", "after"):
        rank, it = rng.randrange(2), rng.randrange(2, ITERS)
        if kind == "before":
            point, last = "save-start", it - 1
        elif kind == "during":
            point = rng.choice(["save-written", "save-renamed"] if rank == 0 else ["save-written"])
            last = it - 1
        else:
            point, last = "save-done", it
        out.append((f"{rank}:{it}:{point}", last))
    return out


@pytest.fixture(scope="module")
def reference():
    rc, out, left = torchrun(TRAIN)
    assert rc == 0 and not left, out[-3000:]
    full = losses(out)
    assert sorted(full) == list(range(1, ITERS + 1)), out[-3000:]
    return full


@pytest.mark.parametrize("case", range(3), ids=["before-save", "during-save", "after-save"])
def test_kill_a_rank_then_resume_gives_the_uninterrupted_losses(reference, case, tmp_path):
    from megatron_spindle.megatron.checkpoint.directory import latest_iteration
    from megatron_spindle.megatron.checkpoint.files import verify_checkpoint
    fault, last = scenarios(SEED)[case]
    ckpt = str(tmp_path / "ckpt")
    rc, out, left = torchrun(TRAIN + ["--save", ckpt, "--save-interval", "1"], fault=fault)
    assert rc == 3, f"{fault}: the run should have failed with status 3 (a peer failed)\n{out[-3000:]}"
    errors = [line for line in out.splitlines() if "error:" in line]
    assert "Traceback" not in out and 1 <= len(errors) <= 2, errors  # the survivor's line, the launcher's line
    assert any("was killed by SIGKILL" in e for e in errors), errors
    assert not left, f"{fault}: processes left behind: {left}"
    assert latest_iteration(ckpt) == last, fault
    verify_checkpoint(os.path.join(ckpt, f"iter_{last:07d}"))  # complete: every file matches the manifest
    for it, line in losses(out).items():
        assert line == reference[it], (fault, it)
    rc, out, left = torchrun(TRAIN + ["--load", ckpt, "--save", ckpt, "--save-interval", "1"])
    assert rc == 0 and not left, out[-3000:]
    resumed = losses(out)
    assert sorted(resumed) == list(range(last + 1, ITERS + 1)), out[-3000:]
    for it, line in resumed.items():
        assert line == reference[it], f"{fault}: iteration {it} after resuming from {last}"
    assert latest_iteration(ckpt) == ITERS


def test_torchrun_restarts_a_killed_run_from_its_last_checkpoint(reference, tmp_path):
    """--max-restarts 1: rank 1 is SIGKILLed right after saving iteration 2; torchrun starts the group again,
    which resumes from its own --save by itself and ends with the uninterrupted losses."""
    from megatron_spindle.megatron.checkpoint.directory import latest_iteration
    ckpt = str(tmp_path / "ckpt")
    rc, out, left = torchrun(TRAIN + ["--save", ckpt, "--save-interval", "1"], fault="1:2:save-done",
                             torchrun_args=["--max-restarts", "1"])
    assert rc == 0 and not left, out[-3000:]
    assert f"torchrun restart 1: resumed from {ckpt} at iteration 2" in out, out[-3000:]
    got = losses(out)  # iterations 1-2 from the first attempt, 3-4 from the restarted one
    assert sorted(got) == list(range(1, ITERS + 1)) and got == reference, out[-3000:]
    assert latest_iteration(ckpt) == ITERS and not os.path.exists(os.path.join(ckpt, ".spindle-save.lock"))
