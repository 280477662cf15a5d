"""Torch layers for the operators of a task graph, built from megatron.core blocks.

:func:`build_layer` turns one :class:`~megatron_spindle.planner.workload.graph.Operator` into an
:class:`OperatorLayer`: ``layer(inputs) -> Tensor`` where ``inputs`` are the operator's inputs in the order
of ``op.inputs`` (``data:`` streams included), each batch-first and already sliced to the local batch.

Conventions (from the docstring of ``planner/workload/graph.py``, followed exactly):

* activations between operators are ONE batch-first tensor ``[b, seq, hidden]`` (``[b, proj_dim]`` after a
  pool head); megatron blocks work sequence-first, so the layers transpose in and out (views, no copies);
* several operator inputs are concatenated along dim 1 in input order (the LLM's first layer gets
  ``[adapter tokens, text tokens]``); ``data:`` streams are passed separately (``lm_head`` labels);
* ``decoder_layer`` inputs/outputs are ``concat([target (seq_len), memory (memory_seq_len)], dim=1)``; the
  memory goes through unchanged (its gradient is the pass-through plus the cross-attention's);
* loss layers return a scalar: the SUM over the local samples (local loss tokens for ``lm_head``) divided by
  the GLOBAL count (``op.batch`` samples, ``op.batch * loss_tokens`` tokens), times the task weight. Summing
  the local losses (and their gradients) over data-parallel replicas gives the task loss (and gradient).
  With tp > 1 every tensor-parallel rank returns the same value: count one rank per tp group.

Parameters live in ``layer.core``, a module that operators with the same ``param_key`` share
(``build_layer(op2, share_with=layer1)``): the core holds weights, the :class:`OperatorLayer` around it holds
the per-operator behaviour (sequence length, loss normaliser, task weight). A parameter's *name within the
layer* is its name in ``layer.core.named_parameters()`` (megatron's names for transformer layers, e.g.
``self_attention.linear_qkv.weight``); ``(param_key, name)`` identifies it across plans and processes.

Tensor parallelism: ``transformer_layer``, ``decoder_layer``, ``cross_attn_adapter`` and
``linear_adapter`` (megatron Column/RowParallelLinear), ``token_embed`` (VocabParallelEmbedding) and
``lm_head`` (column-parallel vocabulary projection with a vocab-parallel cross-entropy over the explicit tp
group) support tp > 1. ``patch_embed``, ``pool_head`` and ``contrastive_loss`` are plain torch and tp = 1 only
(the graph marks them ``tp_splittable=False``). Sharded parameters carry megatron's attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``); every other parameter of a tp layer is
replicated and gets the same gradient on every tp rank. :func:`full_state_dict` and
:func:`load_full_state_dict` convert between a sharded layer and the unsharded names and shapes.

Initialisation does not depend on placement: each core is built under a CPU generator seeded from
``(seed, param_key)`` (:func:`layer_seed`) with ``use_cpu_initialization=True``, so megatron draws every full
weight and keeps this rank's slice: a tp shard is bitwise equal to the slice of the tp = 1 weight.

Process groups: megatron blocks get theirs explicitly (``pg_collection`` with tp, and one-rank pp / cp
groups), never from megatron's global parallel state; no layer creates a group (the caller passes them, the
one-rank group included, or a :class:`.blocks.LocalGroup` stands in). The wiring (configs, specs, the
parameter modules megatron has no block for) is in :mod:`.blocks`; the shard <-> full conversions in
:mod:`.layer_state`.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.core.transformer.transformer_layer import TransformerLayer

from ..planner.workload.graph import DATA_PREFIX, Operator, TaskGraph, read_token
from ..planner.workload.layer_types import OP_TYPES
from . import recompute
from .megatron_state import ensure_megatron_globals
from .custom import build_custom_core, custom_forward, custom_supports_tp, torch_layer
from .blocks import (DEFAULT_SETTINGS, CrossAttentionAdapter, GroupVocabParallelCrossEntropy, LayerSettings,
                     LinearAdapter, LMHead, PatchEmbedding, PoolHead, TokenEmbedding, layer_spec, make_norm, parallel_config, pg_collection,
                     rotary_embedding, LocalGroup, transformer_config, use_te_backend)

#: Operator types whose layers accept tp > 1.
TP_OP_TYPES = frozenset({"transformer_layer", "decoder_layer", "cross_attn_adapter", "linear_adapter",
                         "token_embed", "lm_head"})


def layer_seed(seed: int, param_key: str) -> int:
    """Stable 63-bit seed of a parameter key: independent of placement, process and Python hash seed."""
    digest = hashlib.sha256(f"{seed}:{param_key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------------------------------
# Operator layers
# --------------------------------------------------------------------------------------------------
class OperatorLayer(nn.Module):
    """One operator applied to its inputs: shared parameters in ``self.core`` plus per-operator logic."""

    def __init__(self, op: Operator, core: nn.Module, *, tp_group, tp_rank: int, tp_size: int,
                 task_weight: float, use_te: bool, recompute: str = "none") -> None:
        super().__init__()
        self.op = op
        self.recompute = recompute
        """Activation recompute of this operator (:mod:`.recompute`): ``none``, ``selective`` or ``full``."""
        self.core = core
        self.tp_group = tp_group
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.task_weight = float(task_weight)
        self.use_te = use_te
        self.register_forward_pre_hook(_cast_inputs_to_layer_dtype)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype of the layer's floating parameters (None for a layer without any)."""
        for p in self.core.parameters():
            if p.is_floating_point():
                return p.dtype
        return None

    @property
    def param_key(self) -> str:
        return self.op.param_key

    def extra_repr(self) -> str:
        return f"op={self.op.name!r}, type={self.op.op_type}, tp={self.tp_size}, recompute={self.recompute}"

    def _split(self, inputs: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """(operator inputs concatenated along dim 1, data streams in order)."""
        if len(inputs) != len(self.op.inputs):
            raise ValueError(f"operator {self.op.name!r} takes {len(self.op.inputs)} inputs "
                             f"{list(self.op.inputs)}, got {len(inputs)}")
        acts = [x for x, n in zip(inputs, self.op.inputs) if not n.startswith(DATA_PREFIX)]
        data = [x for x, n in zip(inputs, self.op.inputs) if n.startswith(DATA_PREFIX)]
        x = acts[0] if len(acts) == 1 else (torch.cat(acts, dim=1) if acts else None)
        return x, data

    def _check(self, x: Tensor, dims: tuple, what: str) -> None:
        if tuple(x.shape[1:]) != dims:
            raise ValueError(f"operator {self.op.name!r}: {what} must be [b, {', '.join(map(str, dims))}], "
                             f"got {list(x.shape)}")


def _cast_inputs_to_layer_dtype(layer: "OperatorLayer", args: tuple):
    """Float16Module's rule at every layer: floating inputs (data and received activations) are cast to the
    layer's parameter dtype, so a bf16 layer takes fp32 patches; integer inputs (tokens, labels) pass.
    Losses stay fp32: the loss layers compute their cross-entropy in fp32 (``.float()``)."""
    dtype = layer.compute_dtype
    if dtype is None or not args:
        return None
    inputs = args[0]
    if not any(torch.is_tensor(x) and x.is_floating_point() and x.dtype != dtype for x in inputs):
        return None
    cast = [x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs]
    return (cast, *args[1:])


class PatchEmbedLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        _, (x,) = self._split(inputs)
        c = self.op.layer
        self._check(x, (c.seq_len - 1, c.input_dim), "patches")
        y = self.core.proj(x)
        cls = self.core.cls_token.expand(y.shape[0], 1, -1)
        y = torch.cat([cls, y], dim=1) + self.core.positions[:c.seq_len]
        return self.core.norm(y) if c.embed_norm else y


class TokenEmbedLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        _, (tokens,) = self._split(inputs)
        self._check(tokens, (self.op.layer.seq_len,), "tokens")
        x = self.core.word(tokens)
        return x if self.op.layer.position_embedding_type == "none" else x + self.core.positions[:tokens.shape[1]]


class TransformerOpLayer(OperatorLayer):
    """megatron TransformerLayer on ``[b, s, h]`` (the concatenation of its operator inputs)."""

    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, _ = self._split(inputs)
        c = self.op.layer
        self._check(x, (c.seq_len, c.hidden), "input")
        rope = (rotary_embedding(c.seq_len, c.hidden // c.num_heads, c.rotary_base or 10000.0, x.device)
                if c.position_embedding_type == "rope" else None)
        out = recompute.run(self.recompute,
                            lambda h: self.core(hidden_states=h, attention_mask=None, rotary_pos_emb=rope)[0],
                            x.transpose(0, 1))
        return out.transpose(0, 1)


class DecoderOpLayer(OperatorLayer):
    """megatron TransformerLayer with the T5 decoder spec; carries the memory after the target."""

    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, _ = self._split(inputs)
        c = self.op.layer
        self._check(x, (c.seq_len + c.memory_seq_len, c.hidden), "input [target, memory]")
        target, memory = x[:, :c.seq_len], x[:, c.seq_len:]
        out = recompute.run(self.recompute, lambda t, m: self.core(hidden_states=t, attention_mask=None, context=m,
                                                                   context_mask=None)[0],
                            target.transpose(0, 1), memory.transpose(0, 1))
        return torch.cat([out.transpose(0, 1), memory], dim=1)


class PoolHeadLayer(OperatorLayer):
    """Final norm, pooling, projection, L2 normalisation. Pooling ``cls`` or ``eos`` reads one token, so it also
    takes that token alone (``[b, 1, hidden]``: what the runtime sends it, :func:`~megatron_spindle.planner.
    workload.graph.read_token`); the norm works token by token, so the result is the same."""

    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, _ = self._split(inputs)
        c = self.op.layer
        one = read_token(self.op.op_type, c) is not None and x.dim() == 3 and x.shape[1] == 1
        self._check(x, (1 if one else c.seq_len, c.hidden), "input")
        x = self.core.norm(x)
        pooled = {"cls": lambda: x[:, 0], "eos": lambda: x[:, -1], "mean": lambda: x.mean(dim=1)}
        return F.normalize(self.core.proj(pooled[c.pooling]()), dim=-1)


class ContrastiveLossLayer(OperatorLayer):
    """Symmetric InfoNCE over the whole batch: ``(CE(a b^T / T, i) + CE(b a^T / T, i)) / 2``."""

    def forward(self, inputs: list[Tensor]) -> Tensor:
        if len(inputs) != 2:
            raise ValueError(f"operator {self.op.name!r} takes a pair of embeddings, got {len(inputs)}")
        a, b = inputs
        if a.shape != b.shape or a.shape[0] != self.op.batch:
            raise ValueError(f"operator {self.op.name!r}: needs two [{self.op.batch}, d] embeddings (the "
                             f"whole batch), got {list(a.shape)} and {list(b.shape)}")
        logits = a @ b.t() / self.op.layer.temperature
        labels = torch.arange(a.shape[0], device=a.device)
        total = (F.cross_entropy(logits.float(), labels, reduction="sum")
                 + F.cross_entropy(logits.t().float(), labels, reduction="sum")) / 2
        return total * (self.task_weight / self.op.batch)


class CrossAttnAdapterLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, _ = self._split(inputs)
        c = self.op.layer
        self._check(x, (c.input_seq_len, c.input_dim), "encoder features")
        core = self.core
        kv, _ = core.kv_proj(x.transpose(0, 1))
        kv = core.kv_norm(kv)
        q = core.query_norm(core.queries[:c.seq_len]).unsqueeze(1).expand(-1, x.shape[0], -1)
        out, bias = core.attention(q, attention_mask=None, key_value_states=kv)
        if bias is not None:
            out = out + bias
        return out.transpose(0, 1)


class LinearAdapterLayer(OperatorLayer):
    """Average-pool ``input_seq_len`` tokens (dropping any beyond) in groups of
    ``input_seq_len // seq_len``, then project."""

    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, _ = self._split(inputs)
        c = self.op.layer
        n = c.input_seq_len or c.seq_len
        if x.dim() != 3 or x.shape[1] < n or x.shape[2] != c.input_dim:
            raise ValueError(f"operator {self.op.name!r}: input must be [b, >={n}, {c.input_dim}], "
                             f"got {list(x.shape)}")
        x = x[:, :n].reshape(x.shape[0], c.seq_len, n // c.seq_len, c.input_dim).mean(dim=2)
        y, _ = self.core.proj(x)
        return y


class LMHeadLayer(OperatorLayer):
    """Keep the first ``seq_len`` tokens, take the last ``loss_tokens`` of those, next-token CE."""

    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, (labels,) = self._split(inputs)
        c = self.op.layer
        if x.dim() != 3 or x.shape[1] < c.seq_len or labels.shape[1:] != (c.loss_tokens,):
            raise ValueError(f"operator {self.op.name!r}: needs hidden [b, >={c.seq_len}, {c.hidden}] and "
                             f"labels [b, {c.loss_tokens}], got {list(x.shape)} and {list(labels.shape)}")
        h = x[:, c.seq_len - c.loss_tokens:c.seq_len]
        logits, _ = self.core.output(self.core.norm(h))
        loss = GroupVocabParallelCrossEntropy.apply(logits, labels, self.tp_group, self.tp_rank,
                                                     self.tp_size)
        return loss.float().sum() * (self.task_weight / (self.op.batch * c.loss_tokens))


class CustomOpLayer(OperatorLayer):
    """A registered layer type (:mod:`.custom`): ``[b, input_seq_len, input_dim] -> [b, seq_len, hidden]``."""

    def forward(self, inputs: list[Tensor]) -> Tensor:
        return custom_forward(self, inputs)


_LAYER_CLASSES = {
    "patch_embed": PatchEmbedLayer, "token_embed": TokenEmbedLayer,
    "transformer_layer": TransformerOpLayer, "decoder_layer": DecoderOpLayer,
    "pool_head": PoolHeadLayer, "contrastive_loss": ContrastiveLossLayer,
    "cross_attn_adapter": CrossAttnAdapterLayer, "linear_adapter": LinearAdapterLayer,
    "lm_head": LMHeadLayer,
}
assert set(_LAYER_CLASSES) == set(OP_TYPES), "every graph op_type needs a layer class"


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------
def table_rows(op: Operator, graph: TaskGraph | None) -> int:
    """Rows of a learned table (positions, adapter queries): the largest ``seq_len`` of all operators
    sharing ``op.param_key`` (an LLM embedding serves tasks with different text lengths), so parameter
    shapes depend on the key, not on which operator built them."""
    if graph is None or not op.param_key:
        return op.layer.seq_len
    return max(o.layer.seq_len for o in graph.operators if o.param_key == op.param_key)


def _check_tp(op: Operator, tp_group, tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"operator {op.name!r}: need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, "
                         f"tp_size={tp_size}")
    if tp_size == 1:
        return
    if (op.op_type not in TP_OP_TYPES and not custom_supports_tp(op.op_type)) or not op.tp_splittable:
        raise ValueError(f"operator {op.name!r} ({op.op_type}, tp_splittable={op.tp_splittable}) cannot "
                         f"run with tp_size={tp_size}; tp > 1 layers: {sorted(TP_OP_TYPES)}")
    if tp_group is None or tp_group.size() != tp_size or tp_group.rank() != tp_rank:
        got = None if tp_group is None else (tp_group.size(), tp_group.rank())
        raise ValueError(f"operator {op.name!r}: tp_group (size, rank) must be ({tp_size}, {tp_rank}), "
                         f"got {got}")
    c = op.layer
    divisible = {"hidden": c.hidden, "num_heads": c.num_heads, "ffn_hidden": c.ffn_hidden,
                 "vocab_size": c.vocab_size, "num_query_groups": c.num_query_groups}
    bad = {k: v for k, v in divisible.items() if v % tp_size}
    if bad:
        raise ValueError(f"operator {op.name!r}: {bad} not divisible by tp_size={tp_size}")


def _build_core(op: Operator, *, tp_group, tp_size: int, dtype: torch.dtype, rows: int,
                use_te: bool, recompute_mode: str = "none", one=None,
                settings: LayerSettings = DEFAULT_SETTINGS) -> nn.Module:
    c, t, std = op.layer, op.op_type, settings.init_std
    if t not in OP_TYPES:
        return build_custom_core(op, tp_group=tp_group, tp_size=tp_size, dtype=dtype)
    if t in ("transformer_layer", "decoder_layer"):
        config = transformer_config(op, tp_size, dtype, recompute=recompute_mode, settings=settings)
        spec = layer_spec(op, tp_group, use_te)
        return recompute.prepare_core(TransformerLayer(config, spec.submodules, layer_number=1,
                                                       pg_collection=pg_collection(tp_group, one)))
    if t == "cross_attn_adapter":
        return CrossAttentionAdapter(op, rows, config=transformer_config(op, tp_size, dtype, settings=settings),
                                     tp_group=tp_group, one=one)
    pconfig = parallel_config(tp_size, dtype)
    if t == "patch_embed":
        return PatchEmbedding(c.input_dim, c.hidden, rows, make_norm(c) if c.embed_norm else None, std=std)
    if t == "token_embed":
        return TokenEmbedding(c.vocab_size, c.hidden, 0 if c.position_embedding_type == "none" else rows,
                              config=pconfig, tp_group=tp_group, std=std)
    if t == "pool_head":
        return PoolHead(c.hidden, c.proj_dim, make_norm(c), std=std)
    if t == "linear_adapter":
        return LinearAdapter(c.input_dim, c.hidden, config=pconfig, tp_group=tp_group, std=std)
    if t == "lm_head":
        return LMHead(c.hidden, c.vocab_size, config=pconfig, tp_group=tp_group, norm=make_norm(c), std=std)
    return nn.Module()  # contrastive_loss: no parameters


def build_layer(op: Operator, *, tp_group=None, tp_rank: int = 0, tp_size: int = 1, seed: int,
                graph: TaskGraph | None = None, task_weight: float | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                share_with: OperatorLayer | None = None, backend: str = "local",
                recompute_mode: str = "none", one_group=None,
                settings: LayerSettings = DEFAULT_SETTINGS) -> OperatorLayer:
    """The layer of one operator, on this rank's tensor-parallel shard.

    Args:
        op: the operator (``op.trainable`` False: a frozen weight, its parameters ``requires_grad=False``).
        tp_group, tp_rank, tp_size: the operator's tensor-parallel group (None when ``tp_size == 1``:
            ``one_group`` is used), this rank's index in it and its size.
        seed: global seed; the core is initialised from :func:`layer_seed` ``(seed, op.param_key)``.
        graph: the task graph; gives the task weight and sizes shared tables (see :func:`table_rows`).
            Pass it whenever the layer must match other processes' copies of the same ``param_key``.
        task_weight: weight of the task's loss (default: from ``graph``, else 1.0); loss layers only.
        dtype: parameter dtype (float32 on CPU; bfloat16 on GPU). device: where parameters live (CPU).
        share_with: an existing layer with the same ``param_key`` and tp layout whose core to reuse.
        backend: ``local`` (megatron.core's modules) or ``te`` (TransformerEngine specs: TE and CUDA needed);
            ``auto`` is ``local`` (see :func:`.blocks.use_te_backend`).
        recompute_mode: the operator's activation recompute (the plan's ``MetaOp.recompute``, :mod:`.recompute`).
        one_group: a one-rank process group for the layer's size-1 dimensions (the runtime's, created with its
            other groups); None: a :class:`.blocks.LocalGroup` stand-in (layers never create groups).
        settings: Megatron's ``--init-method-std``, ``--hidden-dropout``, ``--attention-dropout``
            (:class:`.blocks.LayerSettings`).
    """
    own = torch_layer(op.op_type)
    layer_class = _LAYER_CLASSES.get(op.op_type) or (own.layer_class if own is not None else CustomOpLayer)
    _check_tp(op, tp_group, tp_rank, tp_size)
    recompute.check_mode(op.name, op.op_type, recompute_mode)
    use_te = use_te_backend(backend)
    ensure_megatron_globals(seed=seed, tp_rank=tp_rank)
    one = LocalGroup() if one_group is None else one_group
    if tp_size == 1 and tp_group is None:
        tp_group = one
    if task_weight is None:
        task_weight = graph.task_weights[graph.tasks.index(op.task)] if graph is not None else 1.0
    if share_with is not None:
        if (share_with.op.param_key != op.param_key or not op.param_key
                or share_with.op.op_type != op.op_type or share_with.tp_size != tp_size):
            raise ValueError(f"operator {op.name!r} (key {op.param_key!r}, {op.op_type}, tp={tp_size}) cannot "
                             f"share parameters with {share_with.op.name!r} (key {share_with.op.param_key!r}, "
                             f"{share_with.op.op_type}, tp={share_with.tp_size})")
        core = share_with.core
    if share_with is None or recompute.selective(core) != (recompute_mode == "selective"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, op.param_key or op.name))
            core = _build_core(op, tp_group=tp_group, tp_size=tp_size, dtype=dtype,
                               rows=table_rows(op, graph), use_te=use_te, recompute_mode=recompute_mode, one=one,
                               settings=settings)
        core = core.to(dtype=dtype, device=device).requires_grad_(op.trainable)  # frozen: no gradient
        if share_with is not None:  # megatron's config decides selective recompute: one layer per mode, one weight
            core = recompute.tie_parameters(core, share_with.core)
    return layer_class(op, core, tp_group=tp_group, tp_rank=tp_rank, tp_size=tp_size,
                       task_weight=task_weight, use_te=use_te, recompute=recompute_mode)


__all__ = ["OperatorLayer", "build_layer", "full_state_dict", "load_full_state_dict", "layer_seed",
           "shard_spec", "shard_tensor", "unshard_tensors", "table_rows", "LocalGroup",
           "num_parameters", "output_shape", "input_shapes", "example_inputs", "TP_OP_TYPES",
           "LOSS_OP_TYPES"]
