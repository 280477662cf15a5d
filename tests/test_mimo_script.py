"""Megatron-LM's ``examples/mimo/train.py`` with ``--spindle``
(``patches/megatron-lm-core_v0.19.0-mimo-train-spindle.patch``):
:mod:`megatron_spindle.megatron.adapter.mimo_script` takes the script's provider table and flags.

The tag's script imports TransformerEngine specs, megatron-energon, ``soundfile`` and Hugging Face at its top, none
of which this CPU machine has; the test runs a stand-in with the script's shape (its ``add_mimo_args`` flags, a
``_MODEL_PROVIDERS`` table, the patch's three lines) whose table names the tiny MIMO provider, on 2 CPU ranks through
``scripts/run_multitask_clip.sh``, and checks the refusals in one line.
"""
from __future__ import annotations

import functools
import os
import re
import pathlib
import subprocess
import sys

import pytest

from mp_harness import free_port

REPO = pathlib.Path(__file__).resolve().parent.parent

STAND_IN = '''
import sys

from examples.mimo.tiny_avlm import tiny_avlm


def add_mimo_args(parser):  # the script's own flags (a few of them, as examples/mimo/train.py adds them)
    group = parser.add_argument_group("MIMO", "MIMO specific arguments")
    group.add_argument("--dataset-provider", type=str, default="mock")
    group.add_argument("--model-provider", type=str, default="mock")
    group.add_argument("--image-size", type=int, default=224)
    return parser


_MODEL_PROVIDERS = {"mock": tiny_avlm}

if __name__ == "__main__":
    if "--spindle" in sys.argv:  # megatron_spindle patch: this script's provider trained by Spindle
        from megatron_spindle.megatron.adapter import mimo_script
        sys.exit(mimo_script.main(_MODEL_PROVIDERS, add_mimo_args))
    raise SystemExit("Megatron-LM's own path: not run here")
'''


def _run(tmp_path, *args):
    script = tmp_path / "train.py"
    script.write_text(STAND_IN)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    env = {**os.environ, "PYTHON": sys.executable, "GPUS_PER_NODE": "2", "TRAIN_ITERS": "2", "SCRIPT": str(script),
           "MASTER_PORT": str(free_port()), "OUT": str(tmp_path / "run"), "PYTHONPATH": str(REPO), "TASKS": "",
           "MODEL_SIZE": "full", "MICRO_BATCH": "4", "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    with open(out, "w") as o, open(err, "w") as e:
        rc = subprocess.run(["bash", str(REPO / "scripts" / "run_multitask_clip.sh"), *args], stdout=o, stderr=e,
                            env=env, cwd=tmp_path, timeout=600).returncode
    text = out.read_text() + err.read_text()
    return rc, text, [ln for ln in err.read_text().splitlines() if ln.startswith("error:")]


TASKS = ["--spindle-tasks-file", str(REPO / "examples" / "mimo" / "tiny_tasks.toml")]


def test_the_scripts_own_provider_trains_under_spindle(tmp_path):
    rc, text, _ = _run(tmp_path, *TASKS, "--model-provider", "mock", "--image-size", "16")
    assert rc == 0, text[-3000:]
    assert "examples.mimo.tiny_avlm:tiny_avlm" in text
    assert re.search(r"iteration +2/2 \| loss .*image-text .*audio-text .*text", text), text[-2000:]


@pytest.mark.parametrize("flags, words", [
    (["--model-provider", "llava"], "--model-provider llava: not one of this script's providers (mock)"),
    (["--dataset-provider", "llava_vlm"], "--dataset-provider llava_vlm: under --spindle"),
])
def test_what_spindle_cannot_take_is_one_line_before_any_worker(tmp_path, flags, words):
    rc, text, lines = _run(tmp_path, *TASKS, *flags)
    assert rc == 2 and len(lines) == 1 and words in lines[0], text[-2000:]


def test_a_provider_that_is_not_a_function_by_name_is_refused():
    from megatron_spindle.megatron.adapter.mimo_script import provider_ref

    def tiny():
        pass

    assert provider_ref({"mock": provider_ref}, []) == "megatron_spindle.megatron.adapter.mimo_script:provider_ref"
    for fn in (functools.partial(provider_ref, {}), tiny):
        with pytest.raises(ValueError, match="not a module-level function"):
            provider_ref({"mock": fn}, ["--model-provider", "mock"])
