"""The whole multi-task model in one process: the correctness reference for Spindle-executed steps.

:class:`ReferenceModel` builds every operator's layer with tp = 1 and one parameter module ("core") per
``param_key``, shared by all operators with that key, and runs the operators in the graph's topological
order. A multi-process step executed from a plan (same ``seed``) must reproduce its losses and, after the
optimizer step, its parameters within float32 rounding.

Parameter names: ``cores.<param_key with '.' replaced by '/'>.<name within the layer>``, e.g.
``cores.vision/layers/3.self_attention.linear_qkv.weight``. :func:`split_parameter_name` maps a name back to
``(param_key, name within the layer)``, the key that :func:`~megatron_spindle.models.layers.full_state_dict`
of a sharded layer uses too.
"""
from __future__ import annotations

from typing import Iterator, Mapping

import torch
from torch import Tensor, nn

from ..planner.workload.graph import DATA_PREFIX, TaskGraph
from .data import parse_data_input
from ..planner.workload.recompute import RECOMPUTABLE
from .shapes import LOSS_OP_TYPES
from .blocks import DEFAULT_SETTINGS, LayerSettings
from .layers import OperatorLayer, build_layer
from .pretrained import load_pretrained

_SEP = "/"


def encode_param_key(param_key: str) -> str:
    """Module name of a ``param_key`` (module names cannot contain dots)."""
    if _SEP in param_key or not param_key:
        raise ValueError(f"param_key must be non-empty and free of {_SEP!r}, got {param_key!r}")
    return param_key.replace(".", _SEP)


def split_parameter_name(full_name: str) -> tuple[str, str]:
    """``cores.vision/layers/3.mlp.linear_fc1.weight`` -> ``("vision.layers.3", "mlp.linear_fc1.weight")``."""
    prefix, _, rest = full_name.partition(".")
    key, _, name = rest.partition(".")
    if prefix != "cores" or not key or not name:
        raise ValueError(f"{full_name!r} is not a ReferenceModel parameter name 'cores.<key>.<name>'")
    return key.replace(_SEP, "."), name


class ReferenceModel(nn.Module):
    """Every operator of ``graph`` in one process, tp = 1, shared parameters per ``param_key``.

    ``forward(batch)`` takes ``{task: {stream: tensor [global batch, ...]}}`` (a subset of tasks is fine)
    and returns ``{task: loss}``: each task's weighted mean loss over its global batch (the sum of its loss
    operators' outputs). The training objective is the sum over tasks.
    """

    def __init__(self, graph: TaskGraph, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, init: Mapping[str, str] | None = None,
                 recompute: str = "none", backend: str = "local",
                 settings: LayerSettings = DEFAULT_SETTINGS) -> None:
        """``init``: module name -> Hugging Face directory to load (as ``SpindleModel``'s); ``recompute``: the
        activation recompute of every transformer and decoder layer (:mod:`.recompute`; the other layers never
        recompute); ``backend``: the layers' implementation (``local`` or ``te``, as :func:`.layers.build_layer`); ``settings``: init std and dropout (:class:`.blocks.LayerSettings`)."""
        super().__init__()
        self.graph = graph
        self.seed = seed
        self.cores = nn.ModuleDict()
        self._layers: dict[str, OperatorLayer] = {}
        by_key: dict[str, OperatorLayer] = {}
        for op in graph.operators:
            share = by_key.get(op.param_key) if op.param_key else None
            mode = recompute if op.op_type in RECOMPUTABLE else "none"
            layer = build_layer(op, seed=seed, graph=graph, dtype=dtype, device=device, share_with=share,
                                recompute_mode=mode, backend=backend, settings=settings)
            self._layers[op.name] = layer
            if op.param_key and share is None:
                by_key[op.param_key] = layer
                self.cores[encode_param_key(op.param_key)] = layer.core
        if init:
            load_pretrained(by_key.values(), graph, dict(init))

    def layer(self, op_name: str) -> OperatorLayer:
        """The layer of one operator (its ``core`` is shared with the operators of the same key)."""
        return self._layers[op_name]

    def core(self, param_key: str) -> nn.Module:
        return self.cores[encode_param_key(param_key)]

    def layer_state(self, param_key: str) -> dict[str, Tensor]:
        """Detached parameters of one key by name within the layer (the form of ``full_state_dict``)."""
        return {n: p.detach().clone() for n, p in self.core(param_key).named_parameters()}

    def keyed_parameters(self) -> Iterator[tuple[str, str, nn.Parameter]]:
        """``(param_key, name within the layer, parameter)`` for every parameter, each once."""
        for full, p in self.named_parameters():
            key, name = split_parameter_name(full)
            yield key, name, p

    def forward(self, batch: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor]:
        unknown = set(batch) - set(self.graph.tasks)
        if unknown:
            raise ValueError(f"batch has unknown tasks {sorted(unknown)}; tasks: {list(self.graph.tasks)}")
        acts: dict[str, Tensor] = {}
        losses: dict[str, Tensor] = {}
        for op in self.graph.operators:
            if op.task not in batch:
                continue
            inputs = []
            for name in op.inputs:
                if name.startswith(DATA_PREFIX):
                    task, stream = parse_data_input(name)
                    if stream not in batch[task]:
                        raise ValueError(f"batch of task {task!r} lacks stream {stream!r} "
                                         f"(read by {op.name!r})")
                    inputs.append(batch[task][stream])
                else:
                    inputs.append(acts[name])
            out = self._layers[op.name](inputs)
            if op.op_type in LOSS_OP_TYPES:
                losses[op.task] = losses[op.task] + out if op.task in losses else out
            else:
                acts[op.name] = out
        return losses
