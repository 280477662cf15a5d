"""The user's ``MimoModel`` in one process, with Spindle's weights: the reference a MIMO plan is checked against.

:class:`MimoReference` calls the user's provider (real weights, in this process: one-rank groups where megatron's
parallel state is not initialised, :func:`.mimo_build.single_process_groups`) and loads into it the weights every
Spindle rank starts from: each parameter key's module built as :func:`.layers.build_layer` builds it (tensor
parallel 1, seeded from the key), its parameter ``name`` copied to the model's ``<key>.<name>``. Its forward is
the model's own ``MimoModel.forward`` per task (``modality_inputs`` from the task's streams, ``position_ids``
``0 ... S-1``, no mask: causal as the layer specs say) with ``labels=None``, and the next-token cross-entropy of the
logits where ``loss_mask`` is 1, over the task's loss tokens, times the task's weight: what Megatron-LM's MIMO
``loss_func`` computes for a batch (its sum over ``loss_mask``, divided by the tokens). The cross-entropy is
computed here because ``GPTModel``'s own (megatron-core 0.16.1) reads megatron's global tensor-parallel group,
which a one-process reference inside a multi-rank job must not use.
"""
from __future__ import annotations

from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..planner.workload.graph import DATA_PREFIX, TaskGraph
from .data import parse_data_input
from .layers import build_layer
from .mimo_build import call_provider, single_process_groups
from .mimo_layers import model, provider


@torch.no_grad()
def load_run_weights(mimo: nn.Module, graph: TaskGraph, *, seed: int, dtype: torch.dtype = torch.float32,
                     device=None) -> dict:
    """Copy into the user's ``mimo`` the weights a Spindle run of ``seed`` starts from (each key's module built as
    :func:`.layers.build_layer` builds it, tp 1); a frozen key's parameters stop requiring gradients. Returns
    ``{param_key: operator}``."""
    ops = {op.param_key: op for op in graph.operators if op.param_key}
    params = dict(mimo.named_parameters())
    for key, op in ops.items():
        core = build_layer(op, seed=seed, graph=graph, dtype=dtype, device=device).core
        for name, p in core.named_parameters():
            mine = params.get(f"{key}.{name}")
            if mine is None or mine.shape != p.shape:
                raise ValueError(f"MIMO reference: {key}.{name} {list(p.shape)} is not a parameter of the "
                                 f"provider's MimoModel (found {None if mine is None else list(mine.shape)})")
            mine.copy_(p)
            mine.requires_grad_(op.trainable)
    return ops


class MimoReference(nn.Module):
    """The user's whole ``MimoModel`` (tp 1) with the weights of a Spindle run of seed ``seed``.

    ``forward(batch)`` takes ``{task: {stream: tensor [global batch, ...]}}`` and returns ``{task: loss}``.
    """

    def __init__(self, graph: TaskGraph, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, **_) -> None:
        super().__init__()
        _, desc = model()
        self.graph, self.seed = graph, seed
        with single_process_groups():
            self.mimo = call_provider(provider(), desc.name).to(dtype=dtype, device=device)
        ops = load_run_weights(self.mimo, graph, seed=seed, dtype=dtype, device=device)
        self.keys = sorted(ops, key=len, reverse=True)
        self.task_inputs = {t: {} for t in graph.tasks}
        for op in graph.operators:
            for name in op.inputs:
                if name.startswith(DATA_PREFIX) and op.op_type in ("mimo_encoder", "mimo_module"):
                    stream = parse_data_input(name)[1]
                    m, e, kw = stream.split(".")
                    self.task_inputs[op.task].setdefault(m, {}).setdefault(e, {})[kw] = stream
        self.loss_tokens = {op.task: op.layer.loss_tokens for op in graph.operators if op.op_type == "mimo_lm_head"}

    def keyed_parameters(self) -> Iterator[tuple[str, str, nn.Parameter]]:
        """``(param_key, name within the key's module, parameter)`` of every parameter some operator holds."""
        for full, p in self.mimo.named_parameters():
            key = next((k for k in self.keys if full.startswith(k + ".")), None)
            if key is not None:
                yield key, full[len(key) + 1:], p

    def forward(self, batch: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor]:
        out = {}
        weights = dict(zip(self.graph.tasks, self.graph.task_weights))
        for task, streams in batch.items():
            ids = streams["input_ids"]
            inputs = {m: {e: {kw: streams[s] for kw, s in kws.items()} for e, kws in encs.items()}
                      for m, encs in self.task_inputs[task].items()}
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            logits, mask = self.mimo(input_ids=ids, position_ids=positions, attention_mask=None,
                                     loss_mask=streams["loss_mask"], labels=None, modality_inputs=inputs or None)
            ce = F.cross_entropy(logits.float().flatten(0, 1), streams["labels"].flatten(), reduction="none")
            count = ids.shape[0] * self.loss_tokens[task]
            out[task] = (ce * mask.float().flatten()).sum() * (weights[task] / count)
        return out
