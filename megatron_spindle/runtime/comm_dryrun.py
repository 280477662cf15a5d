"""Every rank's communication for a plan, produced by the executor itself on torch's fake process group.

:func:`dry_run` runs, in this one process and one rank after the other, what each rank of a job runs: it joins a
fake process group of the plan's world size as that rank (``torch.testing._internal.distributed.fake_pg``: every
collective and point-to-point call returns at once without moving data), records its calls
(:mod:`.comm_record`), builds :class:`~.executor.SpindleModel` for the plan and runs one training pass (forward,
backward, ``finalize_grads``, the gradient norm, the loss reduction) and destroys its groups. The events are the
executor's own calls (group creation, the P2P batches at wave boundaries, megatron.core DDP's bucket
reductions, the norm and loss all-reduces): not a second model of the runtime. :mod:`.comm_check` then checks
them across ranks.

Sizes: the plan is made for the model at full size; the executor builds the layers of :func:`narrow_graph`
instead, the same graph (operators, layer counts, batch, tasks) with the widths, sequence lengths and vocabularies
of the spec's ``tiny`` size, rounded so that any tensor-parallel degree up to 8 divides them. The plan's
slices, ranks, messages (sample ranges) and parameter groups are those of the full-size plan; only the bytes of
each message differ, which changes no call, peer or order.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..compat.cpu import apply_cpu_patches
from ..models.data import SyntheticData
from ..planner.assembly.plan import Plan
from ..planner.workload.graph import TaskGraph
from ..planner.workload.spec import load_spec
from . import comm_record
from .executor import SpindleModel

__all__ = ["narrow_graph", "for_graph", "dry_run", "DRY_SIZE", "MAX_TP"]

#: the size name of the narrow graph
DRY_SIZE = "comm-dry-run"
#: widths and head counts are multiples of this, so every tensor-parallel degree a plan uses (1, 2, 4, 8) divides
MAX_TP = 8


def _round_up(v: int, k: int) -> int:
    return int(math.ceil(v / k) * k)


def narrow_graph(model: str, *, tasks: int | None = None) -> TaskGraph:
    """``model``'s full-size graph (same operators, layer counts, batch and passes) with the ``tiny`` size's
    widths: hidden sizes, head counts (``MAX_TP``), FFN sizes and vocabularies made multiples of ``MAX_TP``."""
    spec = load_spec(model)
    tiny = spec.sizes.get("tiny")
    if tiny is None:
        raise ValueError(f"model {model!r} has no 'tiny' size to take narrow widths from")
    modules = {}
    for m, keys in tiny.get("modules", {}).items():
        keys = {k: v for k, v in keys.items() if k != "num_layers"}
        for k in ("hidden_size", "ffn_hidden_size", "vocab_size", "proj_dim"):
            if k in keys:
                keys[k] = _round_up(keys[k], 2 * MAX_TP)
        if "num_attention_heads" in keys or spec.modules[m].get("num_attention_heads"):
            keys["num_attention_heads"] = MAX_TP
            if spec.modules[m].get("num_query_groups"):
                keys["num_query_groups"] = MAX_TP
        modules[m] = keys
    sizes = dict(spec.sizes)
    sizes[DRY_SIZE] = {"modules": modules, "tasks": tiny.get("tasks", {})}
    return dataclasses.replace(spec, sizes=sizes).build_graph(tasks=tasks, size=DRY_SIZE)


def for_graph(plan: Plan, graph: TaskGraph) -> Plan:
    """``plan`` stamped for ``graph`` (its narrow twin): the fingerprint is the only field that names the sizes."""
    return dataclasses.replace(plan, graph_fingerprint=graph.fingerprint())


def dry_run(plan: Plan, graph: TaskGraph, *, ranks: Sequence[int] | None = None, seed: int = 0,
            progress: Callable[[int], None] | None = None, **model_kwargs) -> list[list[tuple]]:
    """Every rank's recorded events (index = rank) of one training pass of ``plan`` on ``graph``; ``ranks``
    limits the run to some ranks (the others get empty lists). ``model_kwargs`` go to ``SpindleModel``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # optional: torch's test backend "fake"

    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group (it joins a fake one per rank)")
    apply_cpu_patches()
    world = plan.world_size
    batch = SyntheticData(graph, seed=seed).batch(0)
    mine = comm_record.recorder() is None
    rec = comm_record.install()
    out: list[list[tuple]] = [[] for _ in range(world)]
    try:
        for r in (range(world) if ranks is None else ranks):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=world)
            rec.clear()
            try:
                model = SpindleModel(plan, graph, seed=seed, **model_kwargs)
                with torch.random.fork_rng(devices=[]):
                    st = model(batch)
                    model.backward(st)
                    model.finalize_grads()
                    model.grad_norm()
                    model.reduce_losses(st)
                model.destroy()
                out[r] = list(rec.events)
            finally:
                dist.destroy_process_group()
            if progress is not None:
                progress(r)
    finally:
        if mine:
            comm_record.uninstall()
    return out
