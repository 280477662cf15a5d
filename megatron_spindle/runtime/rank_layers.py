"""The layers one rank builds for a plan: one per (MetaOp, layer) of the slices it runs, and who holds what.

:func:`build_rank_layers` walks this rank's slices wave by wave, in the plan's order, and builds, with
:func:`..models.layers.build_layer`, one layer for every layer of every slice this rank runs, keyed by
:func:`module_key` (``"<metaop>#<layer>"``, dots as slashes: the keys of the model's state dict and
checkpoints). The rules:

* **a core once per (param_key, tensor-parallel ranks)**: the first layer of a weight (``param_key``) built
  for one tensor-parallel group (the ranks of this rank's replica of the slice) owns its parameters (its
  core); every later layer with that key and those ranks shares that core (``share_with``). The same weight
  under another tensor-parallel group gets a core of its own: a rank serving one shard of a weight in two
  layouts holds two copies of it (:mod:`.grad_sync` keeps them identical);
* **reuse takes over parameters**: with ``reuse`` (layers keyed by ``(param_key, tensor-parallel ranks)``, a
  replanned model's, :mod:`.replan`), a weight not yet built here shares the reused layer's core: the very same
  ``Parameter`` objects, so their optimizer state carries over;
* **fresh**: the layers whose parameters were built here, neither shared with an earlier layer nor reused
  (where pretrained weights are loaded, :mod:`..models.pretrained`); a layer whose operator has no
  ``param_key`` is never fresh.

What it returns (:class:`RankLayers`) is what the executor and the gradient sync need to know about them:
the layers, each weight shard's local copies and each tensor-parallel group's core.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from ..models.blocks import DEFAULT_SETTINGS, LayerSettings
from ..models.layers import build_layer
from ..planner.assembly.communicators import tp_group_name
from ..planner.assembly.plan import Plan
from ..planner.workload.graph import TaskGraph
from .groups import ProcessGroupRegistry


def module_key(metaop: str, layer: int) -> str:
    """The key of a MetaOp's layer among the rank's layers (``nn.ModuleDict`` keys may hold no dot)."""
    return f"{metaop}#{layer}".replace(".", "/")


@dataclass
class RankLayers:
    """This rank's layers for a plan and who holds which weight."""

    layers: nn.ModuleDict
    """:func:`module_key` (MetaOp, layer) -> the layer, for every layer of every slice this rank runs."""
    copies: dict[tuple[str, int], list[nn.Module]]
    """(param_key, tensor-parallel shard) -> the local layers holding it, one per tensor-parallel group."""
    cores: dict[tuple[str, tuple[int, ...]], nn.Module]
    """(param_key, tensor-parallel ranks) -> the layer holding those parameters on this rank."""
    fresh: list[nn.Module]
    """The layers whose parameters were built here (not shared with an earlier layer, not reused)."""


def build_rank_layers(plan: Plan, graph: TaskGraph, rank: int, registry: ProcessGroupRegistry, *, seed: int,
                      dtype: torch.dtype, device: torch.device, layer_graph: TaskGraph | None = None,
                      reuse: Mapping[tuple[str, tuple[int, ...]], object] | None = None, backend: str = "local",
                      settings: LayerSettings = DEFAULT_SETTINGS) -> RankLayers:
    """Build the layers of ``rank``'s slices of ``plan`` (see the module docstring).

    ``registry`` holds the plan's process groups (each tensor-parallel slice's group, the one-rank group);
    ``layer_graph``: the full model graph when ``graph`` is a subset of its tasks (tables are sized and tasks
    weighted by the full model); ``reuse``: existing layers keyed by ``(param_key, tensor-parallel ranks)``
    whose parameters are taken over; ``seed``, ``dtype``, ``device``, ``backend``, ``settings``: as
    :func:`..models.layers.build_layer`.
    """
    metaops = {m.name: m for m in plan.metaops}
    layers = nn.ModuleDict()
    copies: dict[tuple[str, int], list[nn.Module]] = {}
    shared: dict[tuple[str, tuple[int, ...]], nn.Module] = {}
    fresh: list[nn.Module] = []
    for wave in plan.waves:
        for s in wave.slices:
            if rank not in s.ranks:
                continue
            m = metaops[s.metaop]
            pos = s.ranks.index(rank)
            replica, tp_rank = pos // m.tp, pos % m.tp
            tp_ranks = s.ranks[replica * m.tp:(replica + 1) * m.tp]
            group = registry.get(tp_group_name(s.name, replica)) if m.tp > 1 else None
            for layer in range(s.layer_start, s.layer_stop):
                op = graph[m.operators[layer]]
                share = shared.get((op.param_key, tp_ranks)) if op.param_key else None
                if share is None and op.param_key and reuse:
                    share = reuse.get((op.param_key, tp_ranks))
                mod = build_layer(op, tp_group=group, tp_rank=tp_rank, tp_size=m.tp, seed=seed,
                                  graph=layer_graph or graph, dtype=dtype, device=device, share_with=share,
                                  backend=backend, recompute_mode=m.recompute, one_group=registry.one,
                                  settings=settings)
                layers[module_key(m.name, layer)] = mod
                if share is None and op.param_key:
                    fresh.append(mod)
                if op.param_key and (op.param_key, tp_ranks) not in shared:
                    shared[(op.param_key, tp_ranks)] = mod
                    copies.setdefault((op.param_key, tp_rank), []).append(mod)
    return RankLayers(layers=layers, copies=copies, cores=shared, fresh=fresh)
