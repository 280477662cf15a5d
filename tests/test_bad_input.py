"""Bad input and faults, case by case: exit status 2, one line naming the value, no traceback,
nothing left behind (no temporary file, no process, no checkpoint of a bad state).

Numbering follows the issue: (1) numeric failure, (4) late or garbled save failures, (5) bad values, (6) the
CLI's files. (2) a crafted or corrupt checkpoint and (3) orphans are in test_faults_checkpoint.py and
test_faults_kill.py. The CLI cases run in this process (``spindle`` is pure Python until ``profile``); the
training cases start real ranks, two per case, to show every rank prints the same line.
"""
import contextlib
import os
import socket
import subprocess
import sys

import pytest

from launch_path import flip_bit
from mp_harness import communicate_all, free_port

TRAIN = ["--spindle-size", "tiny", "--spindle-tasks", "4", "--micro-batch-size", "4", "--train-iters", "3",
         "--spindle-predict-interval", "0", "--lr", "1e-3", "--seed", "7"]


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def spindle(capsys, *argv):
    """``spindle ARGV`` in this process: (exit status, stderr lines, stdout)."""
    from megatron_spindle.cli import main
    with pytest.raises(SystemExit) if argv and argv[0] == "--help" else contextlib.nullcontext():
        rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, [line for line in err.splitlines() if line.strip()], out


def one_error(lines, *names):
    """Exactly one error line, naming every one of ``names``, and no traceback."""
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, lines
    assert not any("Traceback" in line for line in lines), lines
    for n in names:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def temp_files(d):
    return [f for f in os.listdir(d) if f.endswith(".tmp") or ".tmp" in f]


def train_ranks(args, *, world=2, env_extra=None, timeout_s=240):
    """Start ``world`` ranks of the built-in trainer by hand (no torchrun: its own report would hide ours);
    returns [(returncode, stderr lines, stdout)] in rank order."""
    port = str(free_port())
    procs = []
    for r in range(world):
        env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
               **(env_extra or {})}
        procs.append(subprocess.Popen([sys.executable, "-m", "megatron_spindle.megatron.trainer.loop", *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    return [(rc, [line for line in se.splitlines() if line.strip()], so)
            for rc, so, se in communicate_all(procs, timeout_s)]


def same_line_on_every_rank(results, *names):
    lines = []
    for rc, err, _ in results:
        assert rc == 2, err[-5:]
        lines.append(one_error(err, *names))
    assert len(set(lines)) == 1, lines
    return lines[0]


def tiny_tmpfs(path, size):
    """Mount a tmpfs of ``size`` at ``path`` (root only); skip the test elsewhere."""
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.decode().strip()}")


def unmount(path):
    subprocess.run(["umount", path], capture_output=True)


# --------------------------------------------------------------------------------------------------
# (5) bad values: every check runs before any collective
# --------------------------------------------------------------------------------------------------
BAD_VALUES = [
    (["--log-interval", "0"], "--log-interval 0"),
    (["--spindle-timeout", "0"], "--spindle-timeout 0"),
    (["--spindle-timeout", "-5"], "--spindle-timeout -5"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0"),
    (["--global-batch-size", "0"], "--global-batch-size 0"),
    (["--spindle-gpus-per-node", "0"], "--spindle-gpus-per-node 0"),
    (["--spindle-nonfinite-skips", "-1"], "--spindle-nonfinite-skips -1"),
    (["--lr", "nan"], "--lr nan"),
    (["--spindle-task-schedule", "0:vision-text;0:audio-text"], "iteration 0 appears twice"),
    (["--spindle-curves", "CURVES_DIR"], "is a directory"),
    (["--spindle-curves", "CURVES_LATIN1"], "is not UTF-8"),
    (["--load", "EMPTY_DIR"], "holds no checkpoint"),
    (["--load", "AT_3", "--train-iters", "2"], "--train-iters 2 is below the iteration 3"),
    (["--save", "UNDER_FILE"], "is not writable"),
    (["--spindle-gantt", "CURVES_DIR"], "is a directory"),
    (["--spindle-trace", "UNDER_FILE"], "is not a directory"),
]


@pytest.mark.parametrize("extra,name", BAD_VALUES, ids=[b[1] for b in BAD_VALUES])
def test_check_args_names_the_bad_value(extra, name, tmp_path):
    from megatron_spindle.megatron.adapter.flags import build_parser, check_args
    (tmp_path / "file").write_text("x")
    (tmp_path / "latin1.json").write_bytes(b'{"a": "\xe9"}')
    (tmp_path / "empty").mkdir()
    (tmp_path / "at3").mkdir()
    (tmp_path / "at3" / "latest_checkpointed_iteration.txt").write_text("3")
    subst = {"CURVES_DIR": str(tmp_path), "CURVES_LATIN1": str(tmp_path / "latin1.json"),
             "EMPTY_DIR": str(tmp_path / "empty"), "UNDER_FILE": str(tmp_path / "file" / "ckpt"),
             "AT_3": str(tmp_path / "at3")}
    args = build_parser().parse_args(TRAIN + [subst.get(a, a) for a in extra])
    with pytest.raises(ValueError) as e:
        check_args(args, 2)
    assert name in str(e.value) and "\n" not in str(e.value)


def test_every_rank_prints_the_same_line_before_any_collective(tmp_path):
    """Rank 0 used to print the line while ranks 1-3 died in gloo; now all ranks stop before the rendezvous."""
    (tmp_path / "curves.json").write_text("{not json")
    same_line_on_every_rank(train_ranks(TRAIN + ["--spindle-curves", str(tmp_path / "curves.json")]),
                            "is not valid JSON")


def test_busy_master_port_is_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        [(rc, err, _)] = train_ranks(TRAIN, world=1, env_extra={"MASTER_PORT": str(port)})
    assert rc == 2
    one_error(err, f"MASTER_PORT {port}", "already in use")


# --------------------------------------------------------------------------------------------------
# (1) numeric failure and (2) a damaged checkpoint, end to end
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """``--lr 1e6`` (NaN from iteration 2) on two ranks, one skip allowed, saving every iteration."""
    save = str(tmp_path_factory.mktemp("nan") / "ckpt")
    return train_ranks(TRAIN + ["--spindle", "--lr", "1e6", "--spindle-nonfinite-skips", "1", "--save", save,
                                "--save-interval", "1"]), save


def test_nonfinite_loss_skips_then_stops_before_the_optimizer(nan_run):
    import json
    res, save = nan_run
    assert "iteration 2: non-finite loss" in res[0][2] and "step skipped (1 of --spindle-nonfinite-skips 1)" in res[0][2]
    line = same_line_on_every_rank(res, "iteration 3: non-finite loss", "MetaOp", "stopped before the optimizer")
    assert "nothing saved" in line
    # iterations 1 (finite) and 2 (skipped) were saved; iteration 3 never was
    from megatron_spindle.megatron.checkpoint.directory import MANIFEST, latest_iteration
    assert latest_iteration(save) == 2
    assert sorted(f for f in os.listdir(save) if f.startswith("iter_")) == ["iter_0000001", "iter_0000002"]
    # the skipped step changed nothing: every shard of iteration 2 is byte-equal to iteration 1's
    m1, m2 = (json.load(open(os.path.join(save, f"iter_000000{i}", MANIFEST)))["files"] for i in (1, 2))
    shards = [f for f in m1 if f.endswith(".distcp")]
    assert shards and all(m1[f] == m2[f] for f in shards)


def test_a_flipped_bit_is_refused_with_one_line(nan_run, tmp_path):
    import shutil
    d = str(tmp_path / "ck")
    shutil.copytree(nan_run[1], d)  # iteration 2 of the --lr 1e6 run: finite, complete
    shard = flip_bit(os.path.join(d, "iter_0000002"))  # an exponent bit of some float
    line = same_line_on_every_rank(train_ranks(TRAIN + ["--spindle", "--load", d]),
                                   "is corrupt", os.path.basename(shard))
    assert "does not match its checksum" in line


# --------------------------------------------------------------------------------------------------
# (4) save failures found at start, and named
# --------------------------------------------------------------------------------------------------
def test_unwritable_save_is_found_at_start(tmp_path):
    (tmp_path / "file").write_text("x")
    [(rc, err, out)] = train_ranks(TRAIN + ["--save", str(tmp_path / "file" / "ckpt")], world=1)
    one_error(err, "--save", "is not writable", "not a directory")
    assert "iteration " not in out  # nothing trained before the refusal


def test_a_full_disk_is_found_at_start_and_named(tmp_path):
    mnt = str(tmp_path / "small")
    tiny_tmpfs(mnt, "256k")
    try:
        [(rc, err, out)] = train_ranks(TRAIN + ["--spindle", "--save", mnt], world=1)
        line = one_error(err, "--save", "free", "a checkpoint needs about")
        assert rc == 2 and "iteration " not in out, line
        assert os.listdir(mnt) == []
    finally:
        unmount(mnt)


def test_enospc_during_a_save_is_named(tmp_path):
    """Past the start check (the disk fills up later): torch's writer error becomes 'no space left'."""
    from megatron_spindle.megatron.checkpoint.directory import describe_save_error
    mnt = str(tmp_path / "small")
    tiny_tmpfs(mnt, "64k")
    try:
        with pytest.raises(OSError) as e:
            with open(os.path.join(mnt, "big"), "wb") as fh:
                fh.write(b"\0" * (1 << 20))
                fh.flush()
        wrapped = RuntimeError("unexpected pos 704 vs 598")
        wrapped.__context__ = e.value
        assert describe_save_error(mnt, wrapped) == f"cannot write checkpoint to {mnt!r}: no space left on device"
        # torch's own writer drops the OSError: the free space tells
        msg = describe_save_error(mnt, RuntimeError("unexpected pos 704 vs 598"), need_bytes=1 << 20)
        assert "no space left on device" in msg
    finally:
        unmount(mnt)


# --------------------------------------------------------------------------------------------------
# (6) the CLI's files
# --------------------------------------------------------------------------------------------------
PLAN = ["plan", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4", "--gpus", "4"]


@pytest.mark.parametrize("target,cause", [("/dev/full", "is a device"), ("DIR", "is a directory"),
                                          ("FILE/plan.json", "is not a directory")])
def test_plan_out_refuses_what_is_not_a_regular_file(capsys, tmp_path, target, cause):
    (tmp_path / "file").write_text("x")
    path = target.replace("DIR", str(tmp_path)).replace("FILE", str(tmp_path / "file"))
    before = os.stat("/dev/full").st_mode
    rc, err, _ = spindle(capsys, *PLAN, "--out", path)
    assert rc == 2
    one_error(err, repr(path) if target != "FILE/plan.json" else "is not a directory", cause)
    assert os.stat("/dev/full").st_mode == before  # the device node is still a device
    assert temp_files(tmp_path) == []


def test_plan_out_on_a_full_disk_leaves_no_temp_file(capsys, tmp_path):
    mnt = str(tmp_path / "small")
    tiny_tmpfs(mnt, "4k")
    try:
        fd = os.open(os.path.join(mnt, "filler"), os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):  # fill it
            while True:
                os.write(fd, b"\0" * 1024)
        os.close(fd)
        rc, err, _ = spindle(capsys, *PLAN, "--out", os.path.join(mnt, "plan.json"))
        assert rc == 2
        one_error(err, "plan.json", "no space left on device")
        assert sorted(os.listdir(mnt)) == ["filler"]
    finally:
        unmount(mnt)


def test_gantt_writes_and_reports_exactly_the_path_given(capsys, tmp_path):
    path = str(tmp_path / "waves")  # no .png: matplotlib used to write waves.png and we reported 'waves'
    rc, err, out = spindle(capsys, *PLAN, "--gantt", path)
    assert rc == 0 and os.path.isfile(path) and not os.path.exists(path + ".png")
    assert f"Gantt chart written to {path}" in out
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    rc, err, _ = spindle(capsys, *PLAN, "--gantt", str(tmp_path))
    assert rc == 2
    one_error(err, "--gantt", "is a directory")


@pytest.mark.parametrize("kind", ["directory", "latin-1"])
def test_curves_and_cluster_files_that_are_not_json_text(capsys, tmp_path, kind):
    bad = tmp_path / "bad.json"
    if kind == "directory":
        bad.mkdir()
    else:
        bad.write_bytes(b'{"device": "\xe9"}')
    cause = "is a directory" if kind == "directory" else "is not UTF-8"
    rc, err, _ = spindle(capsys, *PLAN, "--curves", str(bad))
    assert rc == 2
    one_error(err, "curves file", cause)
    rc, err, _ = spindle(capsys, "compare", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4",
                         "--gpus", "4", "--cluster", str(bad))
    assert rc == 2
    one_error(err, "cluster file", cause)


def test_profile_checks_out_before_measuring(capsys, tmp_path):
    rc, err, out = spindle(capsys, "profile", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4",
                           "--nproc", "1", "--out", str(tmp_path), "--no-cache")
    assert rc == 2
    one_error(err, "--out", "is a directory")
    assert "[1/" not in out  # no point measured


def test_profile_fresh_replaces_a_corrupt_cache(tmp_path):
    from megatron_spindle.profiler.points import ProfileCache
    bad = tmp_path / "cache.json"
    bad.write_bytes(b"\xff\xfe not json")
    with pytest.raises(ValueError) as e:
        ProfileCache.load(str(bad))
    assert "pass --fresh" in str(e.value)
    cache = ProfileCache.load(str(bad), fresh=True)  # the advice works: starts empty, the save replaces it
    assert len(cache) == 0
    cache.save()
    assert ProfileCache.load(str(bad)).entries == {}
    assert temp_files(tmp_path) == []


def test_one_writer_for_every_output_file():
    """No module but atomic.py renames files into place or opens output files for writing itself."""
    import megatron_spindle
    root = os.path.dirname(megatron_spindle.__file__)
    allowed = {"megatron/checkpoint/save_load.py: os.replace("}  # renames the finished checkpoint directory into place
    offenders = []
    for d, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py") or f == "atomic.py":
                continue
            text = open(os.path.join(d, f)).read()
            for needle in ("os.replace(", "os.rename(", "mkstemp(", ".savefig(path"):
                if needle in text:
                    offenders.append(f"{os.path.relpath(os.path.join(d, f), root)}: {needle}")
    assert sorted(set(offenders) - allowed) == [], offenders
