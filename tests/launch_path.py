"""Runs started the way users start them, shared by ``test_launch_path.py`` and ``scripts/reliability_table.py``.

* :func:`launch`: ``scripts/run_multitask_clip.sh`` (its one-process check, then torchrun through
  ``megatron_spindle.launch``) on 2 CPU ranks of the tiny model;
* :func:`bare_torchrun`: ``torchrun ... examples/pretrain_multitask_clip.py``, as the README's other path;
* :func:`spindle`: the ``spindle`` command;
* :func:`make_inputs`: every bad input file of the launch rows (specs, a plugin, plans, curves files, an empty
  data folder) in one directory;
* :data:`BAD_INPUTS`: the launch rows' bad flags and files, each refused by the launch script's check before any
  worker starts: ``(finding, what, script args, environment, words the one line must hold)``.

Every process a run starts carries ``SPINDLE_RUN_MARK`` in its environment, so :func:`run_processes` finds
what is left of it whatever its parent became. Output goes to files, not pipes: a leftover process holding a
pipe would hang the reader.
"""
from __future__ import annotations

import dataclasses
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
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "run_multitask_clip.sh")
EXAMPLE = os.path.join(ROOT, "examples", "pretrain_multitask_clip.py")
SPEC = os.path.join(ROOT, "megatron_spindle", "specs", "multitask-clip.toml")
QUIET = ["--spindle-predict-interval", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra) -> dict:
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
           "GPUS_PER_NODE": "2", "TRAIN_ITERS": "3", "LOG_INTERVAL": "1",
           "PYTHONPATH": ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    for k in ("SPINDLE_FAULT", "SPINDLE_PREFLIGHT", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT",
              "TORCHRUN_ARGS", "MASTER_ADDR", "NNODES", "NODE_RANK", "TASKS"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


@dataclasses.dataclass
class Run:
    """A started run: its process, its output files and its marker."""

    proc: subprocess.Popen
    out_path: str
    err_path: str
    marker: str

    def wait(self, timeout: float = 600) -> "Result":
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return self.result()

    def result(self) -> "Result":
        left = run_processes(self.marker)
        end = time.monotonic() + 15  # a worker torchrun signalled may take a moment to exit
        while left and time.monotonic() < end:
            time.sleep(0.3)
            left = run_processes(self.marker)
        for entry in left:  # do not leak them into the rest of the test session
            try:
                os.kill(int(entry.split()[0]), signal.SIGKILL)
            except OSError:
                pass
        with open(self.out_path, errors="replace") as fh:
            out = fh.read()
        with open(self.err_path, errors="replace") as fh:
            err = fh.read()
        return Result(self.proc.returncode, out, [line for line in err.splitlines() if line.strip()], left)

    def stdout(self) -> str:
        with open(self.out_path, errors="replace") as fh:
            return fh.read()

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        """Block until ``pattern`` appears in the run's stdout (the run must still be going)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, self.stdout())
            if m:
                return m
            if self.proc.poll() is not None:
                raise AssertionError(f"run ended ({self.proc.returncode}) before {pattern!r}:\n"
                                     f"{self.stdout()[-2000:]}\n{open(self.err_path).read()[-2000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.stdout()[-2000:]}")


@dataclasses.dataclass
class Result:
    rc: int
    out: str
    err: list[str]
    """Non-empty stderr lines."""
    left: list[str]
    """Processes of the run still alive afterwards (killed by :meth:`Run.result`)."""

    @property
    def errors(self) -> list[str]:
        return [line for line in self.err if "error:" in line]


def fill_disk(directory: str, chunk: int = 1 << 16) -> None:
    """Write zeros into ``directory/filler`` until the file system refuses (a disk that fills mid-run)."""
    try:
        with open(os.path.join(directory, "filler"), "wb") as fh:
            while True:
                fh.write(b"\0" * chunk)
    except OSError:
        pass


def start(cmd: list[str], env: dict, tmp: str, cwd: str = ROOT) -> Run:
    marker = uuid.uuid4().hex
    env = {**env, "SPINDLE_RUN_MARK": marker}
    fd, out = tempfile.mkstemp(dir=tmp, prefix="out-", suffix=".txt")
    os.close(fd)
    fd, err = tempfile.mkstemp(dir=tmp, prefix="err-", suffix=".txt")
    os.close(fd)
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, env=env, cwd=cwd, start_new_session=True)
    return Run(proc, out, err, marker)


def launch(args: list[str], tmp: str, cwd: str = ROOT, **env_extra) -> Run:
    """``scripts/run_multitask_clip.sh ARGS`` on 2 CPU ranks (tiny model, 3 iterations unless told), started
    in ``cwd`` (the checkout unless told)."""
    env = base_env(**{"MASTER_PORT": free_port(), "OUT": os.path.join(tmp, "out"), **env_extra})
    return start(["bash", SCRIPT, *QUIET, *args], env, tmp, cwd)


def bare_torchrun(args: list[str], tmp: str, nproc: int = 2, torchrun_args=(), **env_extra) -> Run:
    """``torchrun --nproc-per-node N examples/pretrain_multitask_clip.py ARGS`` (tiny model)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), *torchrun_args, EXAMPLE, "--spindle-size", "tiny", "--spindle-tasks", "4",
           "--micro-batch-size", "4", *QUIET, *args]
    return start(cmd, base_env(**env_extra), tmp)


def spindle(args: list[str], tmp: str) -> Result:
    return start([sys.executable, "-m", "megatron_spindle.cli", *args], base_env(), tmp).wait(300)


def run_processes(marker: str) -> list[str]:
    """Processes alive whose environment carries ``SPINDLE_RUN_MARK=marker``: pid and command line."""
    out = []
    needle = f"SPINDLE_RUN_MARK={marker}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid} {cmd[:120]}")
        except (OSError, IndexError):
            continue
    return out


def flip_bit(iter_dir: str) -> str:
    """Flip one exponent bit in the middle of the first ``.distcp`` shard of a checkpoint iteration; its path."""
    shard = os.path.join(iter_dir, sorted(x for x in os.listdir(iter_dir) if x.endswith(".distcp"))[0])
    with open(shard, "r+b") as fh:
        fh.seek(os.path.getsize(shard) // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x40]))
    return shard


def losses(out: str) -> dict[int, str]:
    """{iteration: the loss fields of its progress line}"""
    got = {}
    for line in out.splitlines():
        if line.startswith("iteration ") and "| loss " in line:
            it = int(line.split()[1].split("/")[0])
            got[it] = line.split("| loss ")[1].split(" | step")[0]
    return got


# ---------------------------------------------------------------------------------------------------
# Bad input files
# ---------------------------------------------------------------------------------------------------
def _spec_variant(path: str, edit) -> str:
    with open(SPEC) as fh:
        text = fh.read()
    with open(path, "w") as fh:
        fh.write(edit(text))
    return path


def _insert_after(text: str, header: str, line: str) -> str:
    i = text.index(header)
    j = text.index("\n", i)
    return text[:j + 1] + line + "\n" + text[j + 1:]


def make_inputs(d: str) -> dict[str, str]:
    """Every bad input file the cases name, written into ``d``; returns ``{placeholder: path}``."""
    os.makedirs(d, exist_ok=True)
    f = {}
    f["HUGE_TINY"] = _spec_variant(os.path.join(d, "huge.toml"), lambda t: t.replace(
        "vision.layers = { hidden_size = 52, num_layers = 4",
        "vision.layers = { hidden_size = 52, num_layers = 1000000000"))
    f["NAN_TEMP"] = _spec_variant(os.path.join(d, "nan_temp.toml"),
                                  lambda t: t.replace("temperature = 0.07", "temperature = nan"))
    f["INF_WEIGHT"] = _spec_variant(os.path.join(d, "inf_weight.toml"),
                                    lambda t: _insert_after(t, "[tasks.vision-text]", "weight = inf"))
    f["SPACE_TASK"] = _spec_variant(os.path.join(d, "space_task.toml"),
                                    lambda t: t.replace("tasks.vision-text", 'tasks."vision text"'))
    f["ASCII_TASK"] = _spec_variant(os.path.join(d, "nonascii_task.toml"),
                                    lambda t: t.replace("tasks.vision-text", 'tasks."vision-tëxt"'))
    f["UNUSED_MODULE"] = _spec_variant(os.path.join(d, "unused.toml"), lambda t: t + (
        '\n[modules.extra.layers]\ntype = "transformer_layer"\nhidden_size = 64\nnum_attention_heads = 4\n'
        "num_layers = 2\n"))
    f["WIDER"] = _spec_variant(os.path.join(d, "wider.toml"), lambda t: t.replace(
        "vision.layers = { hidden_size = 52,", "vision.layers = { hidden_size = 56,").replace(
        "vision.embed = { hidden_size = 52", "vision.embed = { hidden_size = 56"))
    # a plugin whose cost function gives NaN FLOPs (the LLaVA example's projector)
    shutil.copy(os.path.join(ROOT, "examples", "models", "llava.toml"), os.path.join(d, "llava.toml"))
    with open(os.path.join(ROOT, "examples", "models", "llava_layers.py")) as fh:
        plugin = fh.read().replace("fwd_flops_per_sample=flops,", 'fwd_flops_per_sample=float("nan"),')
    with open(os.path.join(d, "llava_layers.py"), "w") as fh:
        fh.write(plugin)
    f["NAN_PLUGIN"] = os.path.join(d, "llava.toml")
    # plans: a good one for 2 ranks, then edited
    good = os.path.join(d, "plan.json")
    r = spindle(["plan", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4", "--gpus", "2",
                 "--batch", "8", "--passes", "1", "--out", good], d)
    if r.rc != 0:
        raise RuntimeError(f"spindle plan failed: {r.err}")
    with open(good) as fh:
        plan = json.load(fh)
    for name, edit in (("CUT_PLAN", lambda p: p.update(tasks=p["tasks"][:3], task_weights=p["task_weights"][:3])),
                       ("NAN_WEIGHT_PLAN", lambda p: p.update(task_weights=[float("nan"), 5.0, 1.0, 1.0])),
                       ("MODEL_PLAN", lambda p: p.update(model="qwen-val"))):
        p = json.loads(json.dumps(plan))
        edit(p)
        f[name] = os.path.join(d, f"{name.lower()}.json")
        with open(f[name], "w") as fh:
            json.dump(p, fh)
    point = {"metaop": "vision-text.vision.layers", "points": [[1, 1.0]]}
    for name, doc in (("EMPTY_CURVES", {"curves": []}),
                      ("HUGE_CURVES", {"curves": [{**point, "points": [[1, 1e300], [2, 1e300]]}]}),
                      ("NAN_OPT_CURVES", {"measured": {"model": "multitask-clip", "size": "tiny",
                                                       "optimizer": {"fixed_ms": float("nan")}}, "curves": [point]}),
                      ("OTHER_CURVES", {"measured": {"model": "qwen-val", "size": "tiny"}, "curves": [point]})):
        f[name] = os.path.join(d, f"{name.lower()}.json")
        with open(f[name], "w") as fh:
            json.dump(doc, fh)
    f["EMPTY_DATA"] = os.path.join(d, "data")
    os.makedirs(os.path.join(f["EMPTY_DATA"], "vision-text"), exist_ok=True)
    return f


#: (finding, what, script args, environment, words the one line holds); placeholders from make_inputs. Findings
#: are the launch rows' groups in order: 1 one --save, 2 orphans and hangs at start, 3 one line on the launch path,
#: 4 a huge spec, 5 a peer's failure, 6 signals and failed saves, 7 plan fields, 8 spec values, 9 curves,
#: 10 flags.
BAD_INPUTS = [
    ("3", "`--log-interval 0`", ["--log-interval", "0"], {}, ["--log-interval 0"]),
    ("10", "`--min-lr 1 --lr 1e-4`", ["--min-lr", "1", "--lr", "1e-4"], {}, ["--min-lr 1 is above --lr 0.0001"]),
    ("10", "`--spindle-timeout 1e15`", ["--spindle-timeout", "1e15"], {}, ["--spindle-timeout 1e+15"]),
    ("10", "`--adam-beta1 1.5`", ["--adam-beta1", "1.5"], {}, ["--adam-beta1 1.5", "[0, 1)"]),
    ("10", "a task schedule change after `--train-iters`",
     ["--spindle-task-schedule", "0:vision-text,audio-text;100:vision-text"], {"TRAIN_ITERS": "30"},
     ["iteration 100", "--train-iters 30"]),
    ("3", "`--spindle-bogus 1` (a misspelt flag)", ["--spindle-bogus", "1"], {}, ["--spindle-bogus"]),
    ("4", "spec `num_layers = 1000000000` under `[sizes.tiny]`", ["--spindle-model", "HUGE_TINY"], {},
     ["sizes.tiny.modules.vision.layers.num_layers = 1000000000", "1 to 512"]),
    ("8", "spec `temperature = nan`", ["--spindle-model", "NAN_TEMP"], {}, ["modules.loss.temperature = nan"]),
    ("8", "spec `weight = inf`", ["--spindle-model", "INF_WEIGHT"], {}, ["tasks.vision-text.weight = inf"]),
    ("8", "spec task name with a space", ["--spindle-model", "SPACE_TASK"], {}, ["'vision text'", "ASCII"]),
    ("8", "spec task name not ASCII", ["--spindle-model", "ASCII_TASK"], {}, ["vision-tëxt", "ASCII"]),
    ("8", "plugin cost with NaN FLOPs", ["--spindle-model", "NAN_PLUGIN", "--micro-batch-size", "2"],
     {"TASKS": ""}, ["plugin llava_layers.py", "mlp_projector", "nan"]),
    ("7", "plan with `tasks` cut to 3", ["--spindle", "--spindle-plan", "CUT_PLAN"], {},
     ["plan field tasks", "vision-thermal"]),
    ("7", "plan with `task_weights` NaN, 5.0", ["--spindle", "--spindle-plan", "NAN_WEIGHT_PLAN"], {},
     ["task_weights", "nan"]),
    ("7", "plan with another `model`", ["--spindle", "--spindle-plan", "MODEL_PLAN"], {},
     ["field model is 'qwen-val'"]),
    ("9", "curves file `\"curves\": []`", ["--spindle-curves", "EMPTY_CURVES"], {}, ["has no curves"]),
    ("9", "curves points of 1e300 ms", ["--spindle-curves", "HUGE_CURVES"], {}, ["invalid point [1, 1e+300]"]),
    ("9", "curves with a NaN optimizer constant", ["--spindle-curves", "NAN_OPT_CURVES"], {},
     ["measured.optimizer.fixed_ms = nan"]),
    ("9", "another model's curves", ["--spindle-curves", "OTHER_CURVES"], {}, ["profiled for model 'qwen-val'"]),
    ("2", "an empty task data folder", ["--spindle-data", "EMPTY_DATA"], {}, ["no energon dataset", "audio-text"]),
]


def substitute(args: list[str], files: dict[str, str]) -> list[str]:
    return [files.get(a, a) for a in args]
