#!/usr/bin/env python
"""Run every bad input and fault of issue 12 and write what each gets as a table (docs/reliability.md).

    .venv/bin/python scripts/reliability_table.py [--out docs/reliability.md] [--only SUBSTRING]

Each case runs as a user would run it (``spindle ...`` or the built-in trainer on two ranks started by hand,
or under torchrun for the kills) in a scratch directory. Recorded per case: the exit status of every rank,
the error line (the same on every rank, or each one), whether a traceback was printed, and what was left
behind (temporary files, processes of the run, checkpoints of a bad state). Cases that need a small tmpfs
(a full disk) run only as root. 4 to 9 minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the kill scenarios and the process census live there

from test_faults_kill import TRAIN as KILL_TRAIN, losses, scenarios, torchrun  # noqa: E402

PY = sys.executable
TRAIN = ["--spindle-size", "tiny", "--spindle-tasks", "4", "--micro-batch-size", "4", "--train-iters", "3",
         "--spindle-predict-interval", "0", "--lr", "1e-3", "--seed", "7"]
PLAN = ["plan", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4", "--gpus", "4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    return {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", **extra}


def run_cli(args: list[str]) -> list[tuple[int, str]]:
    r = subprocess.run([PY, "-m", "megatron_spindle.cli", *args], capture_output=True, text=True, env=_env())
    return [(r.returncode, r.stderr + r.stdout)]


def run_ranks(args: list[str], world: int = 2, port: int | None = None) -> list[tuple[int, str]]:
    port = port or free_port()
    procs = [subprocess.Popen([PY, "-m", "megatron_spindle.megatron.trainer", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                       WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)))
             for r in range(world)]
    return [(p.wait(timeout=600), p.stdout.read()) for p in procs]


def shown_lines(text: str) -> list[str]:
    """The error lines; without one, the last line naming a file written; else the last line (rank 0 only:
    the other ranks of a successful run print nothing of their own); a warning line outranks the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("error:", "spindle ")) and "error:" in line]
    written = [line for line in lines if "written to" in line or line.startswith("saved checkpoint")]
    killed = [line for line in lines if line.startswith("killed ")]  # the kill rows' own summary
    warned = [line for line in lines if line.startswith("warning:")]  # e.g. devices left idle
    return killed or errors or warned or written[-1:] or [line for line in lines if "Warning" not in line and "warn(" not in line][-1:]


def summarize(results: list[tuple[int, str]]) -> tuple[str, str, str]:
    codes = sorted({rc for rc, _ in results})
    lines = sorted({e for _, out in results for e in shown_lines(out)})
    tb = any("Traceback" in out for _, out in results)
    status = ",".join(map(str, codes)) + (f" (all {len(results)} ranks)" if len(results) > 1 else "")
    line = " / ".join(lines) if lines else "(no error line)"
    return status, line, "yes" if tb else "no"


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


def leftovers(d: str) -> str:
    tmp = [f for f in os.listdir(d) if ".tmp" in f] if os.path.isdir(d) else []
    return ", ".join(tmp) if tmp else "nothing"


def cases(work: str):
    """(issue item, case, runner) where runner() -> (results, left behind)."""
    os.makedirs(work, exist_ok=True)
    f = os.path.join(work, "file")
    open(f, "w").write("x")
    latin = os.path.join(work, "latin1.json")
    open(latin, "wb").write(b'{"a": "\xe9"}')
    notjson = os.path.join(work, "curves.json")
    open(notjson, "w").write("{not json")
    ck = os.path.join(work, "ck")

    def cli(args, where=work):
        return lambda: (run_cli(args), leftovers(where))

    def train(args, world=2, where=None, port=None):
        return lambda: (run_ranks(TRAIN + args, world, port), leftovers(where) if where else "nothing")

    def nan_run():
        save = os.path.join(work, "nan")
        res = run_ranks(TRAIN + ["--spindle", "--lr", "1e6", "--save", save, "--save-interval", "1"])
        its = sorted(x for x in os.listdir(save) if x.startswith("iter_")) if os.path.isdir(save) else []
        return res, "checkpoints: " + (", ".join(its) or "none") + " (iteration 1 was finite)"

    def full_disk_start():
        with tmpfs("256k") as d:
            if d is None:
                return None, "skipped (needs root for a small tmpfs)"
            return run_ranks(TRAIN + ["--spindle", "--save", d], 1), leftovers(d)

    def full_disk_plan():
        with tmpfs("4k") as d:
            if d is None:
                return None, "skipped (needs root for a small tmpfs)"
            fd = os.open(os.path.join(d, "filler"), os.O_WRONLY | os.O_CREAT)
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 1024)
            os.close(fd)
            return run_cli(PLAN + ["--out", os.path.join(d, "plan.json")]), leftovers(d)

    def busy_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            return run_ranks(TRAIN, 1, s.getsockname()[1]), "nothing"

    def damaged(kind):
        def go():
            d = os.path.join(work, f"ck-{kind}")
            shutil.copytree(ck, d)
            it = os.path.join(d, "iter_0000003")
            if kind == "bit":
                shard = os.path.join(it, sorted(x for x in os.listdir(it) if x.endswith(".distcp"))[0])
                with open(shard, "r+b") as fh:
                    fh.seek(os.path.getsize(shard) // 2)
                    b = fh.read(1)
                    fh.seek(-1, 1)
                    fh.write(bytes([b[0] ^ 0x40]))
            else:  # a .metadata pickle that runs a command, with a manifest that matches it
                import json
                import pickle
                marker = os.path.join(work, "pwned")

                class Payload:
                    def __reduce__(self):
                        return (os.system, (f"touch {marker}",))
                with open(os.path.join(it, ".metadata"), "wb") as fh:
                    pickle.dump(Payload(), fh)
                sys.path.insert(0, ROOT)
                from megatron_spindle.megatron.ckpt_files import MANIFEST, file_digest
                m = json.load(open(os.path.join(it, MANIFEST)))
                m["files"][".metadata"] = file_digest(os.path.join(it, ".metadata"))
                json.dump(m, open(os.path.join(it, MANIFEST), "w"))
            res = run_ranks(TRAIN + ["--spindle", "--load", d, "--train-iters", "4"])
            return res, ("code ran!" if os.path.exists(os.path.join(work, "pwned")) else "no code ran")
        return go

    def kill(case):
        def go():
            fault, last = scenarios(12)[case]
            d = os.path.join(work, f"kill{case}")
            rc, out, left = torchrun(KILL_TRAIN + ["--save", d, "--save-interval", "1"], fault=fault)
            from megatron_spindle.megatron.ckpt_files import latest_iteration, verify_checkpoint
            tracked = latest_iteration(d)
            verify_checkpoint(os.path.join(d, f"iter_{tracked:07d}"))
            rc2, out2, left2 = torchrun(KILL_TRAIN + ["--load", d, "--save", d, "--save-interval", "1"])
            ref = REFERENCE.setdefault("losses", losses(torchrun(KILL_TRAIN)[1]))
            same = all(ref[i] == v for i, v in losses(out2).items()) and sorted(losses(out2)) == list(
                range(tracked + 1, 5))
            res = [(rc, f"{out}\nkilled {fault} (rank:iteration:point); the tracker names iteration {tracked}, "
                        f"every file matches its manifest")]  # torchrun's own report of the kill is in `out`
            return res, (f"{len(left) + len(left2)} processes; resumed run exit {rc2}, losses "
                         f"{'equal' if same else 'DIFFER from'} the uninterrupted run")
        return go

    yield "5", "`--log-interval 0`", train(["--log-interval", "0"])
    yield "5", "`--spindle-timeout 0`", train(["--spindle-timeout", "0"])
    yield "5", "`--spindle-timeout -5`", train(["--spindle-timeout", "-5"])
    yield "5", "`--micro-batch-size 0`", train(["--micro-batch-size", "0"])
    yield "5", "`--global-batch-size 0`", train(["--global-batch-size", "0"])
    yield "5", "`--spindle-task-schedule '0:vision-text;0:audio-text'`", train(
        ["--spindle-task-schedule", "0:vision-text;0:audio-text"])
    yield "5", "`--spindle-curves` not JSON", train(["--spindle-curves", notjson])
    yield "5", "`--spindle-curves` a directory", train(["--spindle-curves", work])
    yield "5", "`--spindle-gpus-per-node 0`", train(["--spindle-gpus-per-node", "0"])
    yield "5", "busy `MASTER_PORT`", busy_port
    yield "4", "`--save` under a regular file", train(["--save", os.path.join(f, "ckpt")])
    yield "4", "`--save` on a full disk (256 KiB tmpfs)", full_disk_start
    yield "1", "`--lr 1e6` (NaN from iteration 2)", nan_run
    yield "5", "train a checkpoint to iteration 3 (for the next cases)", lambda: (
        run_ranks(TRAIN + ["--spindle", "--save", ck]), "checkpoint iter_0000003")
    yield "5", "`--train-iters 2` below the checkpoint's 3", train(["--spindle", "--load", ck, "--train-iters", "2"])
    yield "1", "resume from a shard with one flipped bit", damaged("bit")
    yield "2", "resume from a crafted `.metadata` pickle (manifest rewritten to match)", damaged("pickle")
    yield "6", "`spindle plan --out /dev/full`", cli(PLAN + ["--out", "/dev/full"])
    yield "6", "`spindle plan --out DIR`", cli(PLAN + ["--out", work])
    yield "6", "`spindle plan --out FILE/plan.json`", cli(PLAN + ["--out", os.path.join(f, "plan.json")])
    yield "6", "`spindle plan --out` on a full disk", full_disk_plan
    yield "6", "`spindle plan --gantt DIR`", cli(PLAN + ["--gantt", work])
    yield "6", "`spindle plan --gantt waves` (no .png)", cli(PLAN + ["--gantt", os.path.join(work, "waves")])
    yield "6", "`spindle plan --curves DIR`", cli(PLAN + ["--curves", work])
    yield "6", "`spindle plan --curves` latin-1 bytes", cli(PLAN + ["--curves", latin])
    yield "6", "`spindle compare --cluster DIR`", cli(["compare", "--model", "multitask-clip", "--size", "tiny",
                                                       "--tasks", "4", "--gpus", "4", "--cluster", work])
    yield "6", "`spindle profile --out DIR` (before measuring)", cli(
        ["profile", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4", "--nproc", "1", "--out", work,
         "--no-cache"])
    yield "7", "`spindle plan --gpus 1000000000`", cli(["plan", "--model", "multitask-clip", "--gpus", "1000000000"])
    yield "7", "`spindle plan --batch 100000000`", cli(["plan", "--model", "multitask-clip", "--gpus", "64",
                                                        "--batch", "100000000"])
    yield "7", "`spindle plan --gpus 4096` (devices left idle: a warning, exit 0)", cli(
        ["plan", "--model", "multitask-clip", "--tasks", "4", "--gpus", "4096", "--json"])
    for i, when in enumerate(("before", "during", "after")):
        yield "3", f"SIGKILL a rank {when} a save (torchrun, 2 ranks)", kill(i)


REFERENCE: dict = {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "reliability.md"))
    ap.add_argument("--only", default=None, help="run only the cases whose description contains this")
    a = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="spindle-reliability-") as work:
        for item, what, runner in cases(work):
            if a.only and a.only not in what and "for the next cases" not in what:
                continue
            res, left = runner()
            if res is None:
                rows.append((item, what, "-", left, "-", "-"))
            else:
                status, line, tb = summarize(res)
                line = re.sub(r"/tmp/spindle-full-\w+", "$FULL", line.replace(work, "$WORK"))
                rows.append((item, what, status, line.replace("|", "\\|"), tb, left))
            print(" | ".join(rows[-1]), flush=True)
    table = ["| issue item | input or fault | exit status | what the user sees | traceback | left behind |",
             "| --- | --- | --- | --- | --- | --- |"] + ["| " + " | ".join(r) + " |" for r in rows]
    with open(a.out) as fh:
        doc = fh.read()
    begin, end = "<!-- table: begin -->", "<!-- table: end -->"
    i, j = doc.index(begin) + len(begin), doc.index(end)
    doc = doc[:i] + f"\n(generated in {time.time() - t0:.0f} s)\n\n" + "\n".join(table) + "\n" + doc[j:]
    sys.path.insert(0, ROOT)
    from megatron_spindle.atomic import write_file
    write_file(a.out, doc, "reliability table")
    print(f"table written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
