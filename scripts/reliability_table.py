#!/usr/bin/env python
"""Run every bad input and fault below the way users run them; write what each gets as a table
(docs/reliability.md).

    .venv/bin/python scripts/reliability_table.py [--out docs/reliability.md] [--only GROUP[,GROUP]]

Each case starts what a user starts, in a scratch directory: ``scripts/run_multitask_clip.sh`` (its
one-process check, then torchrun through ``megatron_spindle.launch``) on 2 CPU ranks of the tiny model, a bare
``torchrun`` of ``examples/pretrain_multitask_clip.py``, or the ``spindle`` command. Recorded per case: the
exit status, what the user sees (every stderr line, or the line that matters on stdout), how many stderr
lines there were, whether a traceback was printed, and what was left behind (temporary files, processes of
the run, checkpoints, locks). The helpers and the bad inputs are ``tests/launch_path.py``'s, shared with
``tests/test_launch_path.py``. Cases that need a small tmpfs (a full disk) run only as root.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from launch_path import (BAD_INPUTS, Result, bare_torchrun, base_env, flip_bit, free_port,  # noqa: E402
                         launch, losses, make_inputs, run_processes, spindle, start, substitute)

SCRIPT = "`run_multitask_clip.sh`"
TORCHRUN = "bare `torchrun`"
CLI = "`spindle`"
PLAN = ["plan", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4", "--gpus", "4"]


def leftovers(*dirs: str, result: Result | None = None) -> str:
    found = []
    for d in dirs:
        if os.path.isdir(d):
            found += [f for f in os.listdir(d) if ".tmp" in f or f == ".spindle-save.lock"]
    if result is not None and result.left:
        found.append(f"{len(result.left)} processes")
    return ", ".join(found) or "nothing"


def row(item: str, what: str, how: str, r: Result | None, shown: str | None = None, left: str = "nothing"):
    if r is None:
        return item, what, how, "-", shown or "skipped", "-", "-", left
    lines = [x for x in r.err if not x.startswith(("W1", "I1")) or "error" in x]  # torchrun's own log lines
    text = shown if shown is not None else " / ".join(dict.fromkeys(lines)) or "(nothing)"
    tb = "yes" if any("Traceback" in x for x in r.err) or "Traceback" in r.out else "no"
    return item, what, how, str(r.rc), text, str(len(r.err)), tb, left


def out_line(r: Result, pattern: str) -> str:
    m = re.search(pattern, r.out, re.M)
    return m.group(0) if m else "(not found)"


@contextlib.contextmanager
def tmpfs(size: str):
    d = tempfile.mkdtemp(prefix="spindle-full-")
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True).returncode == 0
    try:
        yield d if ok else None
    finally:
        if ok:
            subprocess.run(["umount", d], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


def worker_pids(run) -> dict[int, int]:
    ranks = {}
    for entry in run_processes(run.marker):
        pid = entry.split()[0]
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = int(pid)
    return ranks


# ---------------------------------------------------------------------------------------------------
# Cases: each yields rows
# ---------------------------------------------------------------------------------------------------
def bad_inputs(w: str, files: dict):
    for item, what, args, env, _ in BAD_INPUTS:
        r = launch(substitute(args, files), w, **env).wait(300)
        yield row(f"launch.{item}", what, SCRIPT, r, left=leftovers(w, result=r))
    with contextlib.ExitStack() as stack:
        import fcntl
        save = os.path.join(w, "locked")
        os.makedirs(save, exist_ok=True)
        fd = os.open(os.path.join(save, ".spindle-save.lock"), os.O_RDWR | os.O_CREAT)
        stack.callback(os.close, fd)
        os.write(fd, b'{"host": "node-7", "pid": 4242, "started": "2026-12-01 10:00:00 UTC"}')
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield row("launch.1", "`--save` held by a run on another host", SCRIPT, launch(["--save", save], w).wait(300))
    r = spindle(["plan", "--model", files["UNUSED_MODULE"], "--size", "tiny", "--tasks", "4", "--gpus", "2"], w)
    yield row("launch.8", "spec module used by no task", CLI, r, shown=out_line(r, r"^warning:.*"))
    r = bare_torchrun(["--log-interval", "0"], w).wait(300)
    ours = [x for x in r.err if x.startswith("error: --log-interval")]
    yield row("launch.3", "`--log-interval 0` under a bare torchrun", TORCHRUN, r,
              shown=f"{ours[0] if ours else '(none)'} ({len(ours)} time(s)), then torchrun's own report "
                    f"(ChildFailedError) of the failed group")
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        yield row("input.5", "busy `MASTER_PORT`", SCRIPT, launch([], w, MASTER_PORT=s.getsockname()[1]).wait(300))


def owned_save_and_sigint(w: str):
    save = os.path.join(w, "owned")
    a = launch(["--save", save, "--save-interval", "1"], w, TRAIN_ITERS=200)
    a.wait_for(r"saved checkpoint \S+ at iteration 2\b")
    b = launch(["--save", save, "--seed", "7"], w).wait(300)
    yield row("launch.1", "a second run with the same `--save` while the first trains", SCRIPT, b)
    os.killpg(a.proc.pid, signal.SIGINT)
    r = a.wait(300)
    yield row("launch.6", "SIGINT (Ctrl-C: the whole process group)", SCRIPT, r, left=leftovers(save, result=r))


def sigterm_without_handler(w: str):
    save = os.path.join(w, "term")
    a = launch(["--save", save, "--save-interval", "1"], w, TRAIN_ITERS=200)
    a.wait_for(r"iteration +2/200")
    a.proc.send_signal(signal.SIGTERM)
    r = a.wait(300)
    yield row("launch.6", "SIGTERM to the launcher (without `--exit-signal-handler`)", SCRIPT, r,
              left=leftovers(save, result=r))


def orphans_then_exit_signal_handler(w: str):
    save = os.path.join(w, "orphan")
    run = bare_torchrun(["--train-iters", "200", "--log-interval", "1", "--save", save, "--save-interval", "1"], w)
    run.wait_for(r"saved checkpoint \S+ at iteration 2\b")
    t0 = time.monotonic()
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    left = run_processes(run.marker)
    while left and time.monotonic() - t0 < 10:
        time.sleep(0.1)
        left = run_processes(run.marker)
    gone = time.monotonic() - t0
    r = run.result()
    yield row("launch.2", "`kill -9` of torchrun during training", TORCHRUN, r,
              shown=f"torchrun killed; {len(left)} workers left {gone:.1f} s after the kill (parent-death signal)",
              left=f"{len(left)} processes; {leftovers(save)}")
    nxt = launch(["--save", save, "--load", save, "--save-interval", "1000", "--exit-signal-handler"], w,
                 TRAIN_ITERS=200)
    nxt.wait_for(r"iteration +\d+/200")
    time.sleep(1)
    nxt.proc.send_signal(signal.SIGTERM)
    r = nxt.wait(300)
    yield row("launch.1", "the next run with that `--save` (its lock left by the killed run)", SCRIPT, r,
              shown=out_line(r, r"^warning: --save .*"))
    yield row("launch.6", "SIGTERM to the launcher with `--exit-signal-handler`", SCRIPT, r,
              shown=out_line(r, r"^SIGTERM: finished.*"), left=leftovers(save, result=r))
    warned = [x for x in (r.out + "\n" + "\n".join(r.err)).splitlines() if "Warning" in x]
    yield row("launch.10", "`--load` (megatron.core's FutureWarnings)", SCRIPT, r,
              shown=f"{len(warned)} warning lines: " + (" / ".join(warned[:2]) or "none") + "; " +
              out_line(r, r"^resumed from .*"))


def peer_faults(w: str, files: dict):
    r = launch(["--save", os.path.join(w, "killed"), "--save-interval", "1"], w, TRAIN_ITERS=5,
               SPINDLE_FAULT="1:3:save-start").wait(300)
    yield row("launch.5", "a rank SIGKILLed (a node killed)", SCRIPT, r,
              left=leftovers(os.path.join(w, "killed"), result=r))
    run = launch(["--spindle-timeout", "8"], w, TRAIN_ITERS=200)
    run.wait_for(r"iteration +2/200")
    ranks = worker_pids(run)
    os.kill(ranks[1], signal.SIGSTOP)
    end = time.monotonic() + 120
    while "error: rank 0" not in open(run.err_path).read() and time.monotonic() < end:
        time.sleep(0.2)
    os.kill(ranks[1], signal.SIGCONT)
    yield row("launch.5", "a rank SIGSTOPped (`--spindle-timeout 8`), continued later", SCRIPT, run.wait(300))
    port = free_port()
    nodes = [launch([], w, NNODES=2, NODE_RANK=n, GPUS_PER_NODE=1, MASTER_PORT=port, TASKS=t, MICRO_BATCH=8)
             for n, t in ((0, 4), (1, 7))]
    for n, r in enumerate(x.wait(300) for x in nodes):
        yield row("launch.5", f"two nodes with other `TASKS` (4 and 7): node {n}", SCRIPT, r)
    env = base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RANK=0, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    r = start([sys.executable, "-m", "megatron_spindle.megatron.trainer.loop", "--spindle-size", "tiny", "--spindle-tasks",
               "4", "--micro-batch-size", "4", "--spindle-startup-timeout", "5"], env, w).wait(300)
    yield row("launch.2", "rank 0 of 2 started, rank 1 never (`--spindle-startup-timeout 5`)",
              "`python -m megatron_spindle.megatron.trainer.loop` by hand", r, shown=" / ".join(r.errors) + " (the other "
              "stderr lines: megatron.core's import warnings, which this entry point does not quiet)")
    save = os.path.join(w, "wide")
    launch(["--save", save], w, TRAIN_ITERS=1).wait(300)
    r = launch(["--spindle-model", files["WIDER"], "--load", save], w, TRAIN_ITERS=2).wait(300)
    yield row("launch.10", "a shape mismatch on load (another hidden size)", SCRIPT, r)


def restart(w: str):
    save = os.path.join(w, "restart")
    flags = ["--spindle", "--save", save, "--save-interval", "1"]
    ref = launch(["--spindle"], w, TRAIN_ITERS=4).wait(300)
    r = launch(flags, w, TRAIN_ITERS=4, SPINDLE_FAULT="1:2:save-done", TORCHRUN_ARGS="--max-restarts 1").wait(600)
    same = losses(r.out) == losses(ref.out) and sorted(losses(r.out)) == [1, 2, 3, 4]
    yield row("launch.5", "a rank SIGKILLed under torchrun `--max-restarts 1`", SCRIPT, r,
              shown=out_line(r, r"^torchrun restart 1: resumed.*") + f"; losses {'equal' if same else 'DIFFER from'}"
                    " the uninterrupted run", left=leftovers(save, result=r))


def failed_save(w: str):
    with tmpfs("8m") as d:
        if d is None:
            yield row("launch.6", "a save that fails (the disk fills during the run)", SCRIPT, None,
                      shown="skipped (needs root for a small tmpfs)")
            return
        run = launch(["--save", d, "--save-interval", "1"], w, TRAIN_ITERS=200)
        run.wait_for(r"saved checkpoint \S+ at iteration 1\b")
        with contextlib.suppress(OSError), open(os.path.join(d, "filler"), "wb") as fh:
            while True:
                fh.write(b"\0" * (1 << 20))
        r = run.wait(300)
        yield row("launch.6", "a save that fails (the disk fills during the run)", SCRIPT, r, left=leftovers(d, result=r))


def bad_values(w: str):
    ck = os.path.join(w, "ck")
    r = launch(["--lr", "1e6", "--save", os.path.join(w, "nan"), "--save-interval", "1"], w).wait(300)
    its = sorted(x for x in os.listdir(os.path.join(w, "nan")) if x.startswith("iter_"))
    yield row("input.1", "`--lr 1e6` (NaN from iteration 2)", SCRIPT, r, left="checkpoints: " + ", ".join(its))
    launch(["--save", ck], w).wait(300)
    yield row("input.5", "`--train-iters 2` below the checkpoint's 3", SCRIPT,
              launch(["--load", ck], w, TRAIN_ITERS=2).wait(300))
    bit = os.path.join(w, "ck-bit")
    shutil.copytree(ck, bit)
    flip_bit(os.path.join(bit, "iter_0000003"))
    yield row("input.1", "resume from a shard with one flipped bit", SCRIPT,
              launch(["--load", bit], w, TRAIN_ITERS=4).wait(300))
    pick = os.path.join(w, "ck-pickle")
    shutil.copytree(ck, pick)
    it = os.path.join(pick, "iter_0000003")
    marker = os.path.join(w, "pwned")
    with open(os.path.join(it, ".metadata"), "wb") as fh:
        fh.write(b"cposix\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.")
    from megatron_spindle.megatron.checkpoint.directory import MANIFEST
    from megatron_spindle.megatron.checkpoint.files import file_digest
    m = json.load(open(os.path.join(it, MANIFEST)))
    m["files"][".metadata"] = file_digest(os.path.join(it, ".metadata"))
    json.dump(m, open(os.path.join(it, MANIFEST), "w"))
    r = launch(["--load", pick], w, TRAIN_ITERS=4).wait(300)
    yield row("input.2", "resume from a crafted `.metadata` pickle (manifest rewritten to match)", SCRIPT, r,
              left="code ran!" if os.path.exists(marker) else "no code ran")
    for what, args in (("`spindle plan --out /dev/full`", PLAN + ["--out", "/dev/full"]),
                       ("`spindle plan --out DIR`", PLAN + ["--out", w]),
                       ("`spindle plan --curves DIR`", PLAN + ["--curves", w]),
                       ("`spindle plan --gpus 1000000000`",
                        ["plan", "--model", "multitask-clip", "--gpus", "1000000000"]),
                       ("`spindle plan --batch 100000000`", ["plan", "--model", "multitask-clip", "--gpus", "64",
                                                             "--batch", "100000000"])):
        yield row("input.6", what, CLI, spindle(args, w))


def kills(w: str):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_faults_kill import TRAIN as KILL_TRAIN, scenarios, torchrun
    for i, when in enumerate(("before", "during", "after")):
        fault, _ = scenarios(12)[i]
        d = os.path.join(w, f"kill{i}")
        rc, out, left = torchrun(KILL_TRAIN + ["--save", d, "--save-interval", "1"], fault=fault)
        from megatron_spindle.megatron.checkpoint.directory import latest_iteration
        from megatron_spindle.megatron.checkpoint.files import verify_checkpoint
        tracked = latest_iteration(d)
        verify_checkpoint(os.path.join(d, f"iter_{tracked:07d}"))
        err = [x for x in out.splitlines() if x.startswith("error:")]
        r = Result(rc, out, err, left)
        yield row("input.3", f"SIGKILL a rank {when} a save ({fault}, rank:iteration:point)", "torchrun via launch", r,
                  left=f"{len(left)} processes; the tracker names iteration {tracked}, every file matches its "
                       f"manifest")


def cases(w: str):
    files = make_inputs(os.path.join(w, "inputs"))
    yield from bad_inputs(w, files)
    yield from owned_save_and_sigint(w)
    yield from sigterm_without_handler(w)
    yield from orphans_then_exit_signal_handler(w)
    yield from peer_faults(w, files)
    yield from restart(w)
    yield from failed_save(w)
    yield from bad_values(w)
    yield from kills(w)


def file_faults(w: str):
    from reliability_files import files as file_cases
    yield from file_cases(w, row, tmpfs)


GROUPS = ("bad_inputs", "owned_save_and_sigint", "sigterm_without_handler", "orphans_then_exit_signal_handler",
          "peer_faults", "restart", "failed_save", "bad_values", "kills", "file_faults")


def selected(w: str, only: list[str]):
    """The cases of the groups named in ``only`` (all without it)."""
    if not only:
        yield from cases(w)
        yield from file_faults(w)
        return
    files = make_inputs(os.path.join(w, "inputs"))
    for name in only:
        fn = globals()[name]
        yield from (fn(w, files) if name in ("bad_inputs", "peer_faults") else fn(w))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "reliability.md"))
    ap.add_argument("--only", default="", metavar="GROUP[,GROUP]",
                    help=f"run these groups only ({', '.join(GROUPS)}); their rows replace the table's rows of the "
                         f"same groups, the other rows stay")
    a = ap.parse_args(argv)
    only = [g for g in a.only.split(",") if g]
    bad = [g for g in only if g not in GROUPS]
    if bad:
        ap.error(f"unknown group {bad[0]!r}; groups: {', '.join(GROUPS)}")
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="spindle-reliability-") as work:
        for r in selected(work, only):
            r = tuple(re.sub(r"/tmp/spindle-full-\w+", "$FULL", str(x).replace(work, "$WORK")).replace("|", "\\|")
                      for x in r)
            rows.append(r)
            print(" | ".join(r), flush=True)
    head = ["case", "input or fault", "started with", "exit status", "what the user sees", "stderr lines",
            "traceback", "left behind"]
    table = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    with open(a.out) as fh:
        doc = fh.read()
    begin, end = "<!-- table: begin -->", "<!-- table: end -->"
    i, j = doc.index(begin) + len(begin), doc.index(end)
    took = f"(generated in {time.time() - t0:.0f} s)"
    if only:  # keep the rows of the groups not run, and the note of how long they took
        groups = {r[0].split(".")[0] for r in rows}
        old = doc[i:j].strip().splitlines()
        kept = [x for x in old[1:] if x.startswith("| ") and x.split("|")[1].strip().split(".")[0] not in groups
                and not x.startswith(("| case", "| ---"))]
        took = f"{old[0].split(' (')[0] if old and old[0].startswith('(generated') else ''} ({', '.join(sorted(groups))} " \
               f"rows: {time.time() - t0:.0f} s, `--only {a.only}`)"
        table = table[:2] + kept + table[2:]
    doc = doc[:i] + f"\n{took}\n\n" + "\n".join(table) + "\n" + doc[j:]
    from megatron_spindle.atomic import write_file
    write_file(a.out, doc, "reliability table")
    print(f"table written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
