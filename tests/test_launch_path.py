"""The launch rows of docs/reliability.md, case by case, through the launch path users take: ``scripts/run_multitask_clip.sh`` (its
one-process check, then torchrun through ``megatron_spindle.launch``), a bare ``torchrun`` of an example
script, and the ``spindle`` command. Exit status and line count are asserted for each.

Cheapest first: the bad flags and files never start a worker (about a second each); then a few whole runs
on 2 CPU ranks of the tiny model, several findings per run: a run that owns its ``--save`` (a second writer
refused) and stops on SIGINT; torchrun SIGKILLed (no worker left; the next run takes the stale lock over and
saves on SIGTERM with ``--exit-signal-handler``); a stopped peer; two "nodes" started with other flags; a
shape mismatch on load; the start-up deadline. The torchrun restart is in ``test_faults_kill.py``, next to
the kills it recovers from.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from launch_path import (BAD_INPUTS, base_env, bare_torchrun, fill_disk, free_port, launch, losses, make_inputs,
                         run_processes, spindle, start, substitute)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(str(tmp_path_factory.mktemp("inputs")))


def one_line(r, *words):
    """Exit status 2, exactly one stderr line, naming every one of ``words``; no traceback, nothing trained."""
    assert r.rc == 2, (r.rc, r.err[-8:])
    assert len(r.err) == 1, r.err
    assert "Traceback" not in r.out and "iteration " not in r.out
    for w in words:
        assert w in r.err[0], (w, r.err[0])
    return r.err[0]


# --------------------------------------------------------------------------------------------------
# Bad flags and files: refused by the launch script's check, before any worker starts
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("finding,what,args,env,words", BAD_INPUTS, ids=[b[1] for b in BAD_INPUTS])
def test_bad_input_is_one_line_before_any_worker(inputs, tmp_path, finding, what, args, env, words):
    r = launch(substitute(args, inputs), str(tmp_path), **env).wait(120)
    one_line(r, *words)
    assert not r.left


def test_a_locked_save_and_a_busy_port_are_one_line(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    fd = os.open(save / ".spindle-save.lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b'{"host": "node-7", "pid": 4242, "started": "2026-12-01 10:00:00 UTC"}')
    fcntl.flock(fd, fcntl.LOCK_EX)  # another run holds it
    try:
        r = launch(["--save", str(save)], str(tmp_path)).wait(120)
        one_line(r, "is in use by another run", "pid 4242 on host node-7")
    finally:
        os.close(fd)
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        r = launch([], str(tmp_path), MASTER_PORT=port).wait(120)
    one_line(r, f"MASTER_PORT {port}", "already in use")


def test_a_module_no_task_uses_is_named(inputs, tmp_path):
    r = spindle(["plan", "--model", inputs["UNUSED_MODULE"], "--size", "tiny", "--tasks", "4", "--gpus", "2"],
                str(tmp_path))
    assert r.rc == 0 and r.err == []
    warned = [line for line in r.out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "extra.layers is used by no task's flow" in warned[0], warned


def test_bare_torchrun_says_it_once(tmp_path):
    """Under a bare torchrun every worker finds the bad value; the first to claim it in torchrun's store
    prints it (torchrun's own report of the failed group follows: it is torchrun's)."""
    r = bare_torchrun(["--log-interval", "0"], str(tmp_path)).wait(300)
    assert r.rc == 1  # torchrun's own status for a failed worker group
    ours = [line for line in r.err if line.startswith("error: --log-interval 0")]
    assert len(ours) == 1, r.err


def test_start_up_deadline_names_what_it_waited_for(tmp_path):
    """Rank 0 of 2, started by hand, and the other never comes: it stops after --spindle-startup-timeout (not
    --spindle-timeout), exit status 3, one line."""
    env = base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RANK=0, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    t0 = time.monotonic()
    r = start([sys.executable, "-m", "megatron_spindle.megatron.trainer.loop", "--spindle-size", "tiny",
               "--spindle-tasks", "4", "--micro-batch-size", "4", "--spindle-startup-timeout", "5"],
              env, str(tmp_path)).wait(300)
    took = time.monotonic() - t0
    assert r.rc == 3, r.err
    assert len(r.errors) == 1 and "start-up did not finish within 5 s (--spindle-startup-timeout)" in r.errors[0]
    assert "init_process_group" in r.errors[0]
    assert took < 300  # --spindle-timeout's default: never waited out (no wall-clock bound asserted beyond it)


# --------------------------------------------------------------------------------------------------
# Whole runs
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sigint_run(tmp_path_factory):
    """A run that owns its --save: a second writer tries it, then Ctrl-C stops it; (result, second, save)."""
    tmp = str(tmp_path_factory.mktemp("sigint"))
    save = os.path.join(tmp, "ckpt")
    run = launch(["--save", save, "--save-interval", "1"], tmp, TRAIN_ITERS=200)
    run.wait_for(r"saved checkpoint \S+ at iteration 2\b")
    second = launch(["--save", save, "--seed", "7"], tmp).wait(120)  # finding 1: no silent overwrite
    os.killpg(run.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole process group
    return run.wait(300), second, save


def test_a_run_owns_its_save_and_stops_on_sigint_with_one_line(sigint_run):
    from megatron_spindle.megatron.checkpoint.directory import latest_iteration
    r, second, save = sigint_run
    one_line(second, f"--save {save!r} is in use by another run", "pid ")
    assert r.rc == 130, r.err
    assert len(r.err) == 1, r.err
    it = int(re.search(r"stopped by SIGINT after iteration (\d+) of 200", r.err[0]).group(1))
    assert f"last checkpoint: {save} at iteration {it}" in r.err[0]
    assert latest_iteration(save) == it and not r.left
    assert sorted(os.listdir(save)) == sorted([f"iter_{i:07d}" for i in range(1, it + 1)]
                                              + ["latest_checkpointed_iteration.txt"])  # no .tmp, lock released


def test_torchrun_killed_leaves_no_worker_then_sigterm_saves(tmp_path):
    """kill -9 of torchrun: its workers die with it (parent-death signal). The next run takes the lock the
    dead run left over with a warning, resumes, and on a scheduler's SIGTERM (to torchrun, which forwards
    it) with --exit-signal-handler finishes the step, saves and exits 0."""
    from megatron_spindle.megatron.checkpoint.directory import latest_iteration
    save = str(tmp_path / "ckpt")
    run = bare_torchrun(["--train-iters", "200", "--log-interval", "1", "--save", save, "--save-interval", "1"],
                        str(tmp_path))
    run.wait_for(r"saved checkpoint \S+ at iteration 2\b")
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    left = []
    for _ in range(40):  # the kernel signals them at once; give them a moment to be reaped
        left = run_processes(run.marker)
        if not left:
            break
        time.sleep(0.25)
    run.result()  # kills anything left, so that the assertion below does not leak processes
    assert not left, f"workers outlived torchrun: {left}"
    assert os.path.exists(os.path.join(save, ".spindle-save.lock"))  # left by the killed run

    nxt = launch(["--save", save, "--load", save, "--save-interval", "1000", "--exit-signal-handler"],
                 str(tmp_path), TRAIN_ITERS=200)
    m = nxt.wait_for(r"iteration +(\d+)/200")
    time.sleep(1)
    nxt.proc.send_signal(signal.SIGTERM)  # to the launcher only, as a scheduler would
    r = nxt.wait(300)
    assert r.rc == 0, r.err
    assert r.err == [], r.err
    assert "taking it over" in r.out and "was locked by a run that is gone" in r.out
    done = re.search(r"SIGTERM: finished iteration (\d+) of 200 and saved checkpoint \S+ at iteration (\d+); "
                     r"exiting \(--exit-signal-handler\)", r.out)
    assert done and done.group(1) == done.group(2) and int(done.group(1)) >= int(m.group(1)), r.out[-2000:]
    assert latest_iteration(save) == int(done.group(1)) and not r.left
    assert not os.path.exists(os.path.join(save, ".spindle-save.lock"))


def test_a_stopped_peer_is_one_line_per_rank_and_status_3(tmp_path):
    run = launch(["--spindle", "--spindle-timeout", "8"], str(tmp_path), TRAIN_ITERS=200)
    run.wait_for(r"iteration +2/200")
    ranks = {}
    for entry in run_processes(run.marker):  # the workers are the processes with a RANK
        pid = entry.split()[0]
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = int(pid)
    os.kill(ranks[1], signal.SIGSTOP)
    deadline = time.monotonic() + 120
    while "error: rank 0" not in open(run.err_path).read() and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(ranks[1], signal.SIGCONT)  # it wakes to find its peer gone
    r = run.wait(300)
    assert r.rc == 3, r.err
    assert "Traceback" not in "\n".join(r.err)
    assert len(r.err) <= 2 and all(line.startswith("error: rank ") for line in r.err), r.err
    assert re.search(r"^error: rank 0: (after )?iteration \d+: .*(timed out|failed)", r.err[0]), r.err


def test_nodes_started_with_other_tasks_fail_fast_naming_the_flag(tmp_path):
    """Two torchrun "nodes" of one rank each, TASKS 4 and 7: both stop at the start, naming --spindle-tasks."""
    port = free_port()
    runs = [launch([], str(tmp_path), NNODES=2, NODE_RANK=n, GPUS_PER_NODE=1, MASTER_PORT=port, TASKS=t,
                   MICRO_BATCH=8) for n, t in ((0, 4), (1, 7))]
    results = [r.wait(300) for r in runs]
    for r in results:
        assert r.rc == 2, r.err
        assert len(r.err) == 1 and "the ranks disagree: --spindle-tasks has different values: 4 on rank 0" in r.err[0]
        assert "7 on rank 1" in r.err[0]


def test_a_shape_mismatch_on_load_is_the_same_line_on_every_rank(inputs, sigint_run, tmp_path):
    save = sigint_run[2]  # a checkpoint of the shipped tiny model
    r = launch(["--spindle-model", inputs["WIDER"], "--load", save], str(tmp_path), TRAIN_ITERS=300).wait(300)
    line = one_line(r, "error: checkpoint", "vision.embed", "this model needs")  # every rank raised it; one said it
    assert "Connection reset" not in line and "FutureWarning" not in r.out


def test_a_save_that_fails_leaves_no_tmp(tmp_path):
    """The disk fills during the run: the failing save says so in one line and removes its iter_N.tmp
    (needs root for a small tmpfs)."""
    mnt = str(tmp_path / "small")
    os.makedirs(mnt)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mnt], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        run = launch(["--save", mnt, "--save-interval", "1"], str(tmp_path), TRAIN_ITERS=200)
        run.wait_for(r"saved checkpoint \S+ at iteration 1\b")
        fill_disk(mnt, 1 << 20)
        r = run.wait(300)
        assert r.rc == 2 and len(r.err) == 1, r.err
        assert "cannot write checkpoint" in r.err[0] and "no space left on device" in r.err[0], r.err
        assert [f for f in os.listdir(mnt) if ".tmp" in f] == [] and not r.left
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)


def test_seven_tasks_on_four_ranks_hold_nccls_rules(tmp_path):
    """A failure once seen: on 4 ranks with 7 tasks a boundary's batch carries several messages, and under NCCL
    ``batch_isend_irecv`` returns one work for the batch; pairing works with messages by position lost every
    message but the first (``input 1 assembled samples [], wanted [0, 16)``). ``SPINDLE_NCCL_RULES`` makes
    gloo return one work per batch and records every rank's calls; the run must match a single process and
    the records must pass every rule of :mod:`megatron_spindle.runtime.comm_check`."""
    import pickle

    from megatron_spindle.runtime import comm_check

    rules = tmp_path / "rules"
    r = launch(["--spindle-check-equivalence"], str(tmp_path), GPUS_PER_NODE=4, TASKS=7, TRAIN_ITERS=2,
               SPINDLE_NCCL_RULES=str(rules)).wait(600)
    assert r.rc == 0, r.err[-5:]
    assert re.search(r"equivalence: max relative difference \d", r.out)
    events = [pickle.loads((rules / f"rank{k}.pkl").read_bytes()) for k in range(4)]
    assert comm_check.check(events) == []
    assert any(len(e[1]) > 1 for evs in events for e in evs if e[0] == "p2p")  # batches of several messages


# --------------------------------------------------------------------------------------------------
# Two nodes on one machine: two launchers (NODE_RANK 0 and 1), as on two hosts
# --------------------------------------------------------------------------------------------------
def _loss_numbers(out: str) -> dict[int, list[float]]:
    """{iteration: the mean loss and every task's loss of rank 0's progress line}"""
    return {it: [float(x) for x in re.findall(r"-?\d+\.\d+(?:e[-+]?\d+)?", text)] for it, text in losses(out).items()}


def _two_nodes(tmp: str, iters: int, args=(), **env) -> list:
    port = free_port()
    return [launch(list(args), tmp, NNODES=2, NODE_RANK=n, GPUS_PER_NODE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   TRAIN_ITERS=iters, OUT=os.path.join(tmp, f"out{n}"), **env) for n in (0, 1)]


def test_two_nodes_of_two_ranks_train_as_one_node_of_four(tmp_path):
    """``NNODES=2`` with ``NODE_RANK`` 0 and 1 on one machine (two launchers, 2 ranks each, a static rendezvous
    at ``MASTER_ADDR=127.0.0.1``) trains with the losses of one node of 4 ranks (the planner sees islands of 2
    there, of 4 here: another plan, the same model, within float32 rounding)."""
    one = launch([], str(tmp_path), GPUS_PER_NODE=4, TRAIN_ITERS=3).wait(600)
    assert one.rc == 0, one.err[-5:]
    nodes = [r.wait(600) for r in _two_nodes(str(tmp_path), 3)]
    for r in nodes:
        assert r.rc == 0 and not r.errors and not r.left, (r.rc, r.err[-5:])
    assert "ranks 4 (2 node(s) x 2)" in nodes[0].out
    want, got = _loss_numbers(one.out), _loss_numbers(nodes[0].out)
    assert sorted(want) == sorted(got) == [1, 2, 3], (want, got)
    for it in want:
        assert len(got[it]) == len(want[it]) == 5
        for a, b in zip(got[it], want[it]):
            assert abs(a - b) <= 1e-5 * abs(b) + 1.5e-4, (it, got[it], want[it])  # printed to 4 decimals
    final = [json.loads(r.out.strip().splitlines()[-1])["final_loss"] for r in (one, nodes[0])]
    assert abs(final[0] - final[1]) <= 1e-5 * abs(final[0]), final  # the summary line: full precision


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_node_stopped_mid_run_ends_both_nodes(tmp_path, how):
    """Node 1 ends mid-run. ``SIGKILL`` to every process of it (the host went away): node 0 ends with status 3,
    each of its ranks in one line naming the operation that failed. ``SIGTERM`` to its launcher (a scheduler ending the job there): the
    launcher forwards it, every rank of both nodes agrees to stop after the step, and each node ends with status
    143 and one line. No process of either node is left."""
    runs = _two_nodes(str(tmp_path), 300, args=["--spindle-timeout", "60"])
    runs[0].wait_for(r"iteration\s+2/300", timeout=600)
    if how == "SIGKILL":
        os.killpg(runs[1].proc.pid, signal.SIGKILL)
    else:
        runs[1].proc.send_signal(signal.SIGTERM)
    node0, node1 = runs[0].wait(300), runs[1].wait(300)
    for r in (node0, node1):
        assert "Traceback" not in r.out + "\n".join(r.err)
        assert not r.left, r.left
    if how == "SIGKILL":
        assert node0.rc == 3 and 1 <= len(node0.err) <= 2, (node0.rc, node0.err)  # one line per rank at most
        assert all(re.match(r"error: rank [01]: .*(failed|timed out)", line) for line in node0.err), node0.err
        assert node1.rc == -signal.SIGKILL
    else:
        for r in (node0, node1):
            assert r.rc == 143 and len(r.err) == 1 and "SIGTERM" in r.err[0], (r.rc, r.err)
