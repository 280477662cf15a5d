"""The node a run trains on, read at train time for the planner: which cluster preset its GPU is, how much
memory a device has, how many devices form one NVLink island.

The planner stays pure (:mod:`...planner.workload.cluster` takes a preset name, a memory size and an island
size); this module asks torch and, where it is installed, NVML (``nvidia-ml-py``'s ``pynvml``):

* :func:`preset_for_gpu`: a device name (``torch.cuda.get_device_name``) -> a preset (``a100``, ``a800-8x8``,
  ``h100``, ``h200``), ``None`` for a GPU we have no preset for;
* :func:`nvlink_island`: the number of visible GPUs joined to GPU 0 by NVLink (NVML's peer-to-peer status,
  ``NVML_P2P_CAPS_INDEX_NVLINK``), ``None`` where NVML is absent or cannot tell;
* :func:`node_cluster`: all of it for a run, with ``--spindle-cluster``, ``--spindle-memory-gib`` and
  ``--spindle-gpus-per-node`` taking precedence, and the one warning line for an unknown GPU.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from ...log import get_logger
from ...planner.workload.cluster import DEFAULT_PRESET, PRESETS

log = get_logger(__name__)
_WARNED: set[str] = set()  # GPU names warned about (one line per run, not one per plan)

#: Substrings of ``torch.cuda.get_device_name()`` (e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3",
#: "NVIDIA A100-SXM4-80GB", "NVIDIA A800-SXM4-80GB") -> preset, first match wins.
GPU_PRESETS = (("H200", "h200"), ("H100", "h100"), ("A800", "a800-8x8"), ("A100", "a100"))
MAX_ISLAND = 8
"""Islands of at most this many devices when neither NVML nor the flag says (an NVSwitch node's eight)."""


def preset_for_gpu(name: str) -> str | None:
    """The preset of a GPU by its name, ``None`` when there is none.

    >>> preset_for_gpu("NVIDIA H100 80GB HBM3"), preset_for_gpu("NVIDIA A100-SXM4-40GB"), preset_for_gpu("Tesla T4")
    ('h100', 'a100', None)
    """
    upper = name.upper()
    for key, preset in GPU_PRESETS:
        if key in upper:
            return preset
    return None


def _visible_handles(nvml, count: int) -> list | None:
    """NVML handles of the CUDA devices this process sees, in CUDA's order; ``None`` when
    ``CUDA_VISIBLE_DEVICES`` names devices NVML cannot look up (MIG instances)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    handles = []
    for item in [v.strip() for v in visible.split(",") if v.strip()][:count]:
        if item.isdigit():
            handles.append(nvml.nvmlDeviceGetHandleByIndex(int(item)))
        elif item.startswith("GPU-"):
            handles.append(nvml.nvmlDeviceGetHandleByUUID(item))
        else:
            return None
    return handles


def nvlink_island(count: int | None = None, nvml=None) -> int | None:
    """How many of the ``count`` visible GPUs (default: torch's device count) share GPU 0's NVLink island:
    GPU 0 and every GPU whose peer-to-peer status to it over NVLink is OK. ``None`` when NVML (``pynvml``)
    is not installed or cannot answer: the caller falls back to the node's GPU count."""
    if nvml is None:
        try:
            import pynvml as nvml  # optional: nvidia-ml-py
        except ImportError:
            return None
    count = torch.cuda.device_count() if count is None else count
    if count < 1:
        return None
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError: no driver here
        return None
    try:
        handles = _visible_handles(nvml, count)
        if not handles:
            return None
        link = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK")
        ok = getattr(nvml, "NVML_P2P_STATUS_OK")
        return 1 + sum(nvml.nvmlDeviceGetP2PStatus(handles[0], h, link) == ok for h in handles[1:])
    except Exception:  # noqa: BLE001 - an NVML call the driver does not support: no answer
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


@dataclasses.dataclass(frozen=True)
class NodeChoice:
    """What the planner gets: a preset (or cluster file), the memory per device and the island size (``None``:
    the preset's or the curves file's), and where each came from (for the plan's log line)."""

    preset: str | None
    memory_gib: float | None
    gpus_per_node: int
    source: str


def node_cluster(args, world: int) -> NodeChoice:
    """The cluster settings of a run on this node.

    Preset: ``--spindle-cluster``, else the GPU's (:func:`preset_for_gpu`; an unknown GPU gets one warning line
    naming it and the preset used), else (no GPU) the default. Memory: ``--spindle-memory-gib``, else the
    device's total memory (``torch.cuda.get_device_properties``), else ``None`` (the curves file's or the
    preset's). Islands: ``--spindle-gpus-per-node``, else the NVLink island (:func:`nvlink_island`) or, without
    NVML, the node's GPU count, at most the ranks per node (``LOCAL_WORLD_SIZE``) and :data:`MAX_ISLAND`.
    """
    per_node_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = torch.cuda.is_available()
    preset, memory, notes = getattr(args, "spindle_cluster", None), args.spindle_memory_gib, []
    if cuda:
        name = torch.cuda.get_device_name(0)
        if preset is None:
            preset = preset_for_gpu(name)
            if preset is None:
                preset = DEFAULT_PRESET
                if name not in _WARNED:
                    _WARNED.add(name)
                    log.warning(f"warning: no cluster preset for GPU {name!r}; planning with preset {preset} "
                                f"(links and peak) and this device's memory; --spindle-cluster NAME|FILE.json "
                                f"chooses another ({', '.join(PRESETS)})")
            notes.append(f"{name} -> {preset}")
        if memory is None:
            memory = torch.cuda.get_device_properties(0).total_memory / 2**30
            notes.append(f"{memory:.1f} GiB per device")
    per_node = args.spindle_gpus_per_node
    if per_node is None:
        island = nvlink_island() if cuda else None
        if island is not None:
            notes.append(f"NVLink island of {island} (NVML)")
        else:
            island = torch.cuda.device_count() if cuda else per_node_ranks
            if cuda:
                notes.append(f"{island} GPUs on this node (no NVML)")
        per_node = max(1, min(MAX_ISLAND, island, per_node_ranks))
    return NodeChoice(preset, memory, per_node, "; ".join(notes))
