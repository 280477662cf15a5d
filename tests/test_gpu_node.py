"""The node a run trains on, read for the planner (``megatron/job/gpu_node.py``) and Megatron's layer choice
(``--transformer-impl``), checked on the CPU with the device stubbed: torch's CUDA queries and NVML are
replaced by the values an H200, an A100 or an unknown GPU would give.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_spindle.megatron.job import gpu_node
from megatron_spindle.megatron.adapter.flags import fallback_args
from megatron_spindle.megatron.adapter.model import layer_backend, make_cluster

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def fake_gpu(monkeypatch, name: str, memory_gib: float, count: int = 1) -> None:
    """torch.cuda as a node of ``count`` GPUs called ``name`` with ``memory_gib`` each would answer; no NVML."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(name=name, total_memory=int(memory_gib * GIB)))
    monkeypatch.setattr(gpu_node, "nvlink_island", lambda count=None, nvml=None: None)
    monkeypatch.setattr(gpu_node, "_WARNED", set())


def run_args(*extra):
    return fallback_args(["--spindle", "--spindle-size", "tiny", *extra])[0]


@pytest.mark.parametrize("name, memory, preset, peak", [
    ("NVIDIA H200", 139.8, "h200", 989.0),
    ("NVIDIA H100 80GB HBM3", 79.1, "h100", 989.0),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100", 312.0),
    ("NVIDIA A800-SXM4-80GB", 79.3, "a800-8x8", 312.0),
])
def test_the_preset_and_memory_come_from_the_device(monkeypatch, name, memory, preset, peak):
    fake_gpu(monkeypatch, name, memory, count=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cluster, _ = make_cluster(run_args(), 16)
    assert (cluster.name, cluster.peak_tflops, cluster.num_devices) == (preset, peak, 16)
    assert cluster.memory_gib == pytest.approx(memory, abs=1e-6)  # the device's, not the preset's 80 or 141
    assert cluster.gpus_per_node == 8  # no NVML: the node's GPU count


def test_flags_override_the_device(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H200", 139.8, count=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cluster, _ = make_cluster(run_args("--spindle-cluster", "a100", "--spindle-memory-gib", "40",
                                       "--spindle-gpus-per-node", "4"), 8)
    assert (cluster.name, cluster.memory_gib, cluster.gpus_per_node) == ("a100", 40.0, 4)


def test_an_unknown_gpu_is_named_once_and_planned_with_the_default(monkeypatch, caplog):
    fake_gpu(monkeypatch, "Tesla T4", 14.6, count=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with caplog.at_level(logging.WARNING, logger="megatron_spindle"):
        cluster, _ = make_cluster(run_args(), 4)
        make_cluster(run_args(), 4)  # the prediction line asks again: still one warning
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "'Tesla T4'" in lines[0] and "a800-8x8" in lines[0], lines
    assert (cluster.name, cluster.gpus_per_node) == ("a800-8x8", 4)
    assert cluster.memory_gib == pytest.approx(14.6)


def test_without_a_gpu_the_cpu_run_keeps_its_defaults(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    cluster, _ = make_cluster(run_args(), 3)
    assert (cluster.name, cluster.memory_gib, cluster.gpus_per_node) == ("a800-8x8", 80.0, 3)


class FakeNVML:
    """pynvml's calls the island function uses, over a node of GPUs with NVLink between ``linked`` pairs
    (physical indices), UUIDs ``GPU-<index>``."""

    NVML_P2P_CAPS_INDEX_NVLINK = 3
    NVML_P2P_STATUS_OK = 0
    NOT_SUPPORTED = 5

    def __init__(self, count: int, linked: set[frozenset]):
        self.count, self.linked, self.open = count, linked, 0

    def nvmlInit(self):
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetHandleByIndex(self, i):
        assert 0 <= i < self.count
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return int(uuid.removeprefix("GPU-"))

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert index == self.NVML_P2P_CAPS_INDEX_NVLINK
        return self.NVML_P2P_STATUS_OK if frozenset((a, b)) in self.linked else self.NOT_SUPPORTED


def test_nvlink_island_from_a_stubbed_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    full = FakeNVML(8, {frozenset((a, b)) for a in range(8) for b in range(8) if a != b})  # NVSwitch node
    assert gpu_node.nvlink_island(8, nvml=full) == 8 and full.open == 0
    pairs = FakeNVML(4, {frozenset((0, 1)), frozenset((2, 3))})  # two NVLink bridges on PCIe
    assert gpu_node.nvlink_island(4, nvml=pairs) == 2
    assert gpu_node.nvlink_island(4, nvml=FakeNVML(4, set())) == 1  # PCIe only
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,0")  # CUDA's device 0 is physical GPU 2
    assert gpu_node.nvlink_island(3, nvml=pairs) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1,GPU-2")
    assert gpu_node.nvlink_island(2, nvml=pairs) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-abc")  # NVML cannot map it: no answer, the caller falls back
    assert gpu_node.nvlink_island(1, nvml=pairs) is None


def test_nvml_decides_the_islands_up_to_the_ranks_per_node(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 79.1, count=8)
    monkeypatch.setattr(gpu_node, "nvlink_island", lambda count=None, nvml=None: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert make_cluster(run_args(), 16)[0].gpus_per_node == 2
    monkeypatch.setattr(gpu_node, "nvlink_island", lambda count=None, nvml=None: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert make_cluster(run_args(), 4)[0].gpus_per_node == 4


def test_an_unknown_cluster_flag_is_one_line_naming_it():
    from megatron_spindle.megatron.adapter.flags import check_args
    with pytest.raises(ValueError, match=r"--spindle-cluster b200: unknown cluster preset 'b200'"):
        check_args(run_args("--spindle-cluster", "b200", "--micro-batch-size", "4"), 1)


# --------------------------------------------------------------------------------------------------
# --transformer-impl
# --------------------------------------------------------------------------------------------------
def test_transformer_impl_chooses_the_layers_not_the_presence_of_te(monkeypatch):
    from megatron_spindle.models.blocks import use_te_backend
    assert run_args().transformer_impl == "local"
    assert layer_backend(run_args()) == "local"
    # a machine where TE imports and CUDA is there: still local unless asked for
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert use_te_backend("auto") is False and use_te_backend("local") is False
    assert layer_backend(run_args("--transformer-impl", "local")) == "local"


def test_transformer_engine_without_te_is_one_line_naming_the_flag(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails, as where TE is not installed
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(ValueError, match=r"^--transformer-impl transformer_engine: TransformerEngine does not import"):
        layer_backend(run_args("--transformer-impl", "transformer_engine"))


def test_the_trainer_refuses_transformer_engine_where_it_cannot_run(tmp_path):
    try:
        import transformer_engine.pytorch  # noqa: F401
        if torch.cuda.is_available():
            pytest.skip("TransformerEngine and a GPU are here: the flag would train")
    except Exception:  # noqa: BLE001
        pass
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29877",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "megatron_spindle.megatron.trainer.loop", "--spindle", "--spindle-size",
                           "tiny", "--micro-batch-size", "4", "--train-iters", "1", "--transformer-impl",
                           "transformer_engine"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]  # not torch's own warnings
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith("error: --transformer-impl transformer_engine"), errors


# --------------------------------------------------------------------------------------------------
# the launch scripts' device choice (a stand-in interpreter answers torch's question as a 1-GPU node would)
# --------------------------------------------------------------------------------------------------
FAKE_PY = """#!/usr/bin/env bash
case "$*" in
  *device_count*) echo "1 NVIDIA_H200";;
  *megatron.training*) exit 1;;
  *launch_defaults*) echo "--micro-batch-size"; echo "4";;
  *) echo "worker started: $*"; exit 7;;
esac
"""


def launch(tmp_path, env_extra, script="run_multitask_clip.sh"):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS_PER_NODE", "SPINDLE_BACKEND", "MODEL_SIZE")}
    env.update(PYTHON=str(fake), OUT=str(tmp_path / "out"), **env_extra)
    return subprocess.run(["bash", str(ROOT / "scripts" / script)], env=env, capture_output=True, text=True,
                          timeout=60)


def test_launch_refuses_gpus_that_are_not_there(tmp_path):
    proc = launch(tmp_path, {"GPUS_PER_NODE": "4"})
    assert proc.returncode == 2 and "worker started" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: GPUS_PER_NODE=4 asks for more GPUs than torch sees on this node: 1 (NVIDIA H200)"]
    bad = launch(tmp_path, {"GPUS_PER_NODE": "two"})
    assert bad.returncode == 2 and bad.stderr.strip() == "error: GPUS_PER_NODE=two must be a positive integer"


@pytest.mark.parametrize("script", ["run_multitask_clip.sh", "run_qwen_val.sh"])
def test_launch_says_what_it_chose(tmp_path, script):
    proc = launch(tmp_path, {}, script)
    line = proc.stdout.splitlines()[0]
    assert line == ("spindle launch: backend loop (built-in megatron.core loop), device 1 x NVIDIA H200 per node "
                    "(NCCL), model size full, ranks 1 (1 node(s) x 1)"), proc.stdout
    assert ("spindle launch: added --micro-batch-size 4 (your flags leave them out; docs/training.md)"
            in proc.stdout.splitlines()), proc.stdout  # the stand-in's answer for the model's batch per rank
    assert proc.returncode == 7  # then the one-process check ran (the stand-in interpreter stops there)


def test_megatron_wheel_without_makefile_never_runs_make(monkeypatch):
    """Megatron-LM's ``_compile_dependencies`` runs ``make`` in megatron/core/datasets on rank 0, GPU or not; a
    wheel has no Makefile there (its helpers are prebuilt): the stand-in imports them instead."""
    from megatron.core.datasets import utils
    from megatron_spindle.compat import megatron_lm

    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)  # restored after the test
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    has_makefile = os.path.exists(os.path.join(os.path.dirname(utils.__file__), "Makefile"))
    assert megatron_lm.apply_wheel_standins() is (not has_makefile)
    if not has_makefile:
        utils.compile_helpers()  # no make, no exit


def test_megatron_loop_defaults_to_local_layers_and_the_flag_wins():
    """Megatron-LM parses --transformer-impl (its default: transformer_engine); a Spindle run through
    pretrain_spindle defaults it to local, as the built-in loop, and an explicit value is kept."""
    import argparse

    from megatron_spindle.megatron.adapter.train_flags import local_layers_default

    parser = argparse.ArgumentParser()
    parser.add_argument("--transformer-impl", default="transformer_engine",
                        choices=["local", "transformer_engine", "inference_optimized"])
    parser = local_layers_default(parser)
    assert parser.parse_args([]).transformer_impl == "local"
    assert parser.parse_args(["--transformer-impl", "transformer_engine"]).transformer_impl == "transformer_engine"
    assert local_layers_default(argparse.ArgumentParser()).parse_args([]) == argparse.Namespace()  # no such flag
