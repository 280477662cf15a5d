"""Files, disk and terminal misbehaving, for ``scripts/reliability_table.py`` (``--only file_faults``): one row per case, each run
the way ``tests/test_faults_files.py`` runs it (the launch script on 2 CPU ranks of the tiny model, or the
``spindle`` command). Rows are ``row(...)`` tuples of the table script, passed in as ``row``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

from launch_path import ROOT, SPEC, base_env, fill_disk, launch, losses, spindle, start

SCRIPT = "`run_multitask_clip.sh`"
CLI = "`spindle`"
SEVEN = "vision-text,audio-text,vision-depth,vision-thermal,vision-imu,audio-vision,depth-text"


def _tracker(save: str) -> str:
    try:
        with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as fh:
            return fh.read().strip()
    except OSError:
        return "none"


def _keys(save: str, it: int) -> int:
    from megatron.core import dist_checkpointing as dc
    return len(dc.load_tensors_metadata(os.path.join(save, f"iter_{it:07d}")))


def _out(r, prefix: str) -> str:
    got = [x for x in r.out.splitlines() if x.startswith(prefix)]
    return " / ".join(dict.fromkeys(got)) or "(none)"


def _dataset(w: str, name: str, samples: int) -> str:
    d = os.path.join(w, name)
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_energon_dataset.py"), "--tasks", "4",
                    "--samples", str(samples), "--shard-size", "32", "--out", d], env=base_env(), check=True,
                   capture_output=True)
    return d


def _plugin(w: str, name: str, body: str) -> str:
    d = os.path.join(w, name)
    os.makedirs(d, exist_ok=True)
    shutil.copy(os.path.join(ROOT, "examples", "models", "llava.toml"), d)
    with open(os.path.join(ROOT, "examples", "models", "llava_layers.py")) as fh:
        text = fh.read()
    with open(os.path.join(d, "llava_layers.py"), "w") as fh:
        fh.write(text + "\n" + body + "\n")
    return os.path.join(d, "llava.toml")


def files(w: str, row, tmpfs):
    # 1: --save over another run's checkpoints
    save = os.path.join(w, "ck1")
    launch(["--save", save, "--save-interval", "1"], w).wait(300)
    r = launch(["--save", save, "--save-interval", "1", "--seed", "99"], w, TRAIN_ITERS=2).wait(300)
    yield row("files.1", "`--save` over another run's checkpoints, no `--load`", SCRIPT, r,
              left=f"tracker still at {_tracker(save)}")
    # 2: a task schedule with --save, then a resume inside the second phase
    sched = ["--spindle-task-schedule", f"0:{SEVEN};2:vision-text,audio-text"]
    save = os.path.join(w, "ck2")
    ref = launch(sched, w, TASKS=7, TRAIN_ITERS=5).wait(400)
    launch([*sched, "--save", save, "--save-interval", "1", "--exit-interval", "3"], w, TASKS=7,
           TRAIN_ITERS=5).wait(400)
    keys = [_keys(save, i) for i in (1, 2, 3)]
    r = launch([*sched, "--load", save, "--save", save, "--save-interval", "1"], w, TASKS=7, TRAIN_ITERS=5).wait(400)
    same = all(losses(r.out).get(i) == losses(ref.out).get(i) for i in (4, 5)) and sorted(losses(r.out)) == [4, 5]
    yield row("files.2", "7 tasks, then 2 from iteration 2, `--save`; resumed at 3 (second phase)", SCRIPT, r,
              shown=f"checkpoint entries at iterations 1, 2, 3, 5: {', '.join(map(str, keys + [_keys(save, 5)]))}; "
                    f"{_out(r, 'resumed from')}; losses 4-5 {'equal' if same else 'DIFFER from'} the "
                    f"uninterrupted run")
    # 3: two profiles sharing one cache
    cache = os.path.join(w, "cache.json")
    common = ["--size", "tiny", "--batch", "4", "--nproc", "1", "--max-devices", "1", "--warmup", "0", "--repeats",
              "1", "--min-time", "0", "--no-link", "--cache", cache]
    runs = [start([sys.executable, "-m", "megatron_spindle.cli", "profile", "--model", m, *x, *common, "--out",
                   os.path.join(w, f"{m}.json")], base_env(), w) for m, x in (("multitask-clip", ["--tasks", "4"]),
                                                                             ("qwen-val", []))]
    rs = [p.wait(600) for p in runs]
    with open(cache) as fh:
        n = len(json.load(fh)["entries"])
    yield row("files.3", "two `spindle profile` runs at once, one `--cache` (13 + 10 points)", CLI, rs[1],
              shown=f"exit {rs[0].rc} and {rs[1].rc}; the cache holds {n} points")
    # 4: a disk that fills under --tensorboard-dir and the trace
    with tmpfs("1m") as mnt:
        if mnt is None:
            yield row("files.4", "`--tensorboard-dir` on a disk that fills mid-run", SCRIPT, None, "skipped (needs root)")
        else:
            run = launch(["--tensorboard-dir", os.path.join(mnt, "tb"), "--spindle-gantt", "", "--log-interval", "5"],
                         w, TRAIN_ITERS=120, OUT=mnt)
            run.wait_for(r"iteration +5/120")
            fill_disk(mnt)
            r = run.wait(600)
            yield row("files.4", "`--tensorboard-dir` and the trace on a disk that fills mid-run", SCRIPT, r,
                      shown=_out(r, "warning:") + ("; trained to 120/120" if "120/120" in r.out else ""))
    # 5: a truncated energon shard
    data = _dataset(w, "data5", 64)
    shard = os.path.join(data, "vision-depth", "part-0000.tar")
    os.truncate(shard, os.path.getsize(shard) // 3)
    yield row("files.5", "a truncated energon tar shard", SCRIPT, launch(["--spindle-data", data], w).wait(300))
    # 6: damaged Hugging Face weights
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import make_tiny_hf
    from megatron_spindle.models.hf_config import model_spec_toml, towers
    cut = make_tiny_hf.make("tiny-llama", os.path.join(w, "hf-cut"))
    weights = os.path.join(cut, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    shards = os.path.join(w, "hf-shards")
    make_tiny_hf.build("tiny-llama", 0).save_pretrained(shards, max_shard_size="100KB")
    os.unlink(os.path.join(shards, sorted(n for n in os.listdir(shards) if n.endswith(".safetensors"))[-1]))
    for what, d in (("`--spindle-init` from a truncated `.safetensors`", cut),
                    ("`--spindle-init` through an index naming a deleted shard", shards)):
        spec = os.path.join(w, f"{os.path.basename(d)}.toml")
        with open(spec, "w") as fh:
            fh.write(model_spec_toml(d, towers(d), name="m"))
        yield row("files.6", what, SCRIPT, launch(["--spindle-model", spec], w, TASKS="", MICRO_BATCH=1,
                                               MODEL_SIZE="full").wait(300))
    yield row("files.6", "`spindle hf check` on a truncated `.safetensors`", CLI, spindle(["hf", "check", cut], w))
    # 7: the full model on 2 CPU ranks against this machine's memory
    yield row("files.7", "`MODEL_SIZE=full` on 2 CPU ranks (the plan: about 46 GiB)", SCRIPT,
              launch([], w, MODEL_SIZE="full").wait(600))
    # 8: SIGHUP to the launcher
    save = os.path.join(w, "ck8")
    run = launch(["--save", save, "--save-interval", "1"], w, TRAIN_ITERS=200)
    run.wait_for(r"saved checkpoint \S+ at iteration 2\b")
    run.proc.send_signal(signal.SIGHUP)
    r = run.wait(300)
    left = [f for f in os.listdir(save) if ".tmp" in f or f.startswith(".spindle")]
    yield row("files.8", "SIGHUP to the launcher (a closed terminal)", SCRIPT, r, left=", ".join(left) or "nothing")
    # 9: every module renamed, resumed with --load
    with open(SPEC) as fh:
        text = re.sub(r"\b(vision|text|audio|depth|thermal|imu)\.(embed|layers|head)\b", r"r_\1.\2", fh.read())
    renamed = os.path.join(w, "renamed.toml")
    with open(renamed, "w") as fh:
        fh.write(text.replace("[modules.loss]", "[modules.r_loss]").replace("-> loss\"", "-> r_loss\""))
    save = os.path.join(w, "ck9")
    launch(["--save", save], w, TRAIN_ITERS=1).wait(300)
    yield row("files.9", "a spec copy with every module renamed, `--load`", SCRIPT,
              launch(["--spindle-model", renamed, "--load", save], w).wait(300))
    # 10: fewer samples per task than one pass
    data = _dataset(w, "data10", 3)
    yield row("files.10", "3 samples per task, a pass of 8", SCRIPT, launch(["--spindle-data", data], w).wait(300))
    # 11: a plugin that exits
    out = os.path.join(w, "p.json")
    r = spindle(["plan", "--model", _plugin(w, "exits", "import sys\nsys.exit(0)"), "--gpus", "2", "--out", out], w)
    yield row("files.11", "a layer plugin calling `sys.exit(0)`, `spindle plan --out`", CLI, r,
              left="no plan file" if not os.path.exists(out) else "a plan file")
    # 12: the trace cap
    r = launch(["--spindle-trace-max-spans", "300", "--spindle-predict-interval", "2"], w, TRAIN_ITERS=12).wait(300)
    yield row("files.12", "the trace cap reached (`--spindle-trace-max-spans 300`)", SCRIPT, r,
              shown=_out(r, "warning:") + f"; longest prediction line "
                    f"{max((len(x) for x in r.out.splitlines() if x.startswith('prediction |')), default=0)} chars")
    # 13: a tracker that is a FIFO
    d = os.path.join(w, "fifo")
    os.makedirs(d)
    os.mkfifo(os.path.join(d, "latest_checkpointed_iteration.txt"))
    yield row("files.13", "a tracker file that is a FIFO (`--load`)", SCRIPT, launch(["--load", d], w).wait(120))
    # 14: a spec naming a plugin
    r = spindle(["plan", "--model", _plugin(w, "plain", ""), "--gpus", "8"], w)
    yield row("files.14", "a spec naming a plugin (`spindle plan`)", CLI, r, shown=_out(r, "layer plugin:"))
    # 15: planning progress
    r = spindle(["plan", "--model", "multitask-clip", "--tasks", "10", "--gpus", "64", "--progress-interval", "1"], w)
    beats = _out(r, "planning:").split(" / ")
    yield row("files.15", "a long `spindle plan` (`--progress-interval 1`)", CLI, r,
              shown=f"{len(beats)} progress line(s), e.g. {beats[-1]}")
    # 16: relative paths
    os.makedirs(os.path.join(w, "here"), exist_ok=True)
    r = launch(["--save", "ck16"], w, cwd=os.path.join(w, "here"), OUT="out16", TRAIN_ITERS=1).wait(300)
    yield row("files.16", "relative `--save` and `OUT`, started outside the checkout", SCRIPT, r,
              shown=f"tracker at {_tracker(os.path.join(w, 'here', 'ck16'))} in the directory started from; "
                    f"trace {'there' if os.path.isfile(os.path.join(w, 'here', 'out16', 'trace.json')) else 'missing'}")
