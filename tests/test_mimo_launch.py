"""``scripts/run_mimo.sh`` as a user starts it: the tiny MIMO provider (two encoders, a language model, three tasks,
one text only) on 4 CPU ranks under the built-in megatron.core loop with ``--spindle-check-equivalence`` (the plan's
first step against the user's ``MimoModel`` in one process: within 1e-5), and bad input refused in one line
before any worker starts. Megatron-LM's own loop (with and without Spindle) is ``test_mimo_megatron_lm.py``.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

from mp_harness import free_port

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "run_mimo.sh"


def run_mimo(tmp_path, *args, env=None, timeout=600):
    """``(exit status, stdout, stderr lines)`` of one ``run_mimo.sh`` run (output through files, never pipes)."""
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    environ = {**os.environ, "PYTHON": sys.executable, "GPUS_PER_NODE": "4", "TRAIN_ITERS": "2",
               "MASTER_PORT": str(free_port()), "OUT": str(tmp_path / "run"), "PYTHONPATH": str(REPO),
               "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    with open(out, "w") as o, open(err, "w") as e:
        rc = subprocess.run(["bash", str(SCRIPT), *args], stdout=o, stderr=e, env=environ, cwd=tmp_path,
                            timeout=timeout).returncode
    lines = [ln for ln in err.read_text().splitlines() if ln.startswith("error:")]
    return rc, out.read_text() + err.read_text(), lines


def test_the_built_in_loop_trains_the_users_model_with_its_losses(tmp_path):
    rc, text, errors = run_mimo(tmp_path, "--spindle-check-equivalence")
    assert rc == 0, text[-3000:]
    diff = float(re.search(r"equivalence: max relative difference (\S+)", text).group(1))
    assert diff < 1e-5
    assert "backend loop" in text and re.search(r"iteration +2/2 \| loss \S+ \(image-text \S+ audio-text \S+ text",
                                                text)


def test_a_modality_the_model_lacks_is_one_line_before_any_worker(tmp_path):
    bad = tmp_path / "tasks.toml"
    bad.write_text('[[tasks]]\nname = "video-text"\nmodalities = ["video"]\nbatch = 8\n')
    rc, text, errors = run_mimo(tmp_path, env={"TASKS_FILE": str(bad)})
    assert rc == 2 and len(errors) == 1, text[-2000:]
    assert "tasks[0].modalities = ['video']: 'video' is not a modality of the model" in errors[0]
    assert "Traceback" not in text and "iteration" not in text


def test_a_provider_that_does_not_import_is_one_line(tmp_path):
    rc, text, errors = run_mimo(tmp_path, env={"PROVIDER": "my_models.vlm:provider"})
    assert rc == 2 and len(errors) == 1, text[-2000:]
    assert "model provider 'my_models.vlm:provider': cannot import module 'my_models.vlm'" in errors[0]
