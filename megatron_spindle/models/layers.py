"""Torch layers for the operators of a task graph, built from megatron.core blocks.

:func:`build_layer` turns one :class:`~megatron_spindle.planner.graph.Operator` into an
:class:`OperatorLayer`: ``layer(inputs) -> Tensor`` where ``inputs`` are the operator's inputs in the order
of ``op.inputs`` (``data:`` streams included), each batch-first and already sliced to the local batch.

Conventions (from the docstring of ``planner/graph.py``, followed exactly):

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
"""
from __future__ import annotations

import functools
import hashlib
import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import init_method_normal

from ..planner.graph import DATA_PREFIX, OP_TYPES, Operator, TaskGraph
from ..runtime.cpu_compat import ensure_megatron_globals

#: Operator types whose layers accept tp > 1.
TP_OP_TYPES = frozenset({"transformer_layer", "decoder_layer", "cross_attn_adapter", "linear_adapter",
                         "token_embed", "lm_head"})
#: Operator types that produce a loss scalar.
LOSS_OP_TYPES = frozenset({"contrastive_loss", "lm_head"})
INIT_STD = 0.02
_BACKENDS = ("auto", "local", "te")
#: TransformerEngine fuses the pre-attention / pre-MLP norms into the following linear; names are
#: reported in the local spec's form so that states move between GPU (TE) and CPU (local) runs.
_TE_TO_LOCAL = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
                "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}


def layer_seed(seed: int, param_key: str) -> int:
    """Stable 63-bit seed of a parameter key: independent of placement, process and Python hash seed."""
    digest = hashlib.sha256(f"{seed}:{param_key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------------
class LocalGroup:
    """Stand-in for a one-rank process group when torch.distributed is not initialised.

    megatron only asks a size-1 group for ``size()`` and ``rank()``: every collective is bypassed.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


_SELF_GROUPS: dict = {}


def self_group():
    """A process group holding only this rank (a real one when torch.distributed is initialised).

    Created with ``use_local_synchronization=True``: no other rank has to take part, and the name is a hash
    of the ranks, so it does not disturb the order of groups created collectively elsewhere.
    """
    if not dist.is_initialized():
        return LocalGroup()
    key = (id(dist.distributed_c10d._get_default_group()), dist.get_rank())
    if key not in _SELF_GROUPS:
        _SELF_GROUPS[key] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return _SELF_GROUPS[key]


def _pg_collection(tp_group) -> ProcessGroupCollection:
    one = self_group()
    return ProcessGroupCollection(tp=tp_group, pp=one, cp=one, tp_cp=tp_group, mp=tp_group)


def _use_te(backend: str) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "local":
        return False
    try:
        import transformer_engine  # noqa: F401
        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if backend == "te" and not available:
        raise ValueError("backend='te' needs transformer_engine and a CUDA device")
    return available


# --------------------------------------------------------------------------------------------------
# megatron configs and specs
# --------------------------------------------------------------------------------------------------
def _transformer_config(op: Operator, tp_size: int, dtype: torch.dtype) -> TransformerConfig:
    """One layer's TransformerConfig: no dropout, no fusions, LayerNorm, CPU initialisation.

    GELU MLP with biases (ViT/CLIP); ``swiglu`` layers (Qwen) use a gated SiLU MLP without linear biases but
    with a QKV bias. ``num_layers=1``: megatron scales the output-projection init by the depth of the
    block, which a single operator does not know.
    """
    c = op.layer
    return TransformerConfig(
        num_layers=1, hidden_size=c.hidden, num_attention_heads=c.num_heads,
        ffn_hidden_size=c.ffn_hidden or 4 * c.hidden, tensor_model_parallel_size=tp_size,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, hidden_dropout=0.0, attention_dropout=0.0,
        gated_linear_unit=c.swiglu, activation_func=F.silu if c.swiglu else F.gelu,
        add_bias_linear=not c.swiglu, add_qkv_bias=c.swiglu, normalization="LayerNorm",
        init_method_std=INIT_STD, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False)


def _parallel_config(tp_size: int, dtype: torch.dtype) -> ModelParallelConfig:
    return ModelParallelConfig(tensor_model_parallel_size=tp_size, use_cpu_initialization=True,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               fp16=dtype == torch.float16, gradient_accumulation_fusion=False)


def _with_tp_group(spec, tp_group):
    """megatron's CrossAttention builds linear_q / linear_kv without ``tp_group`` (0.16.1), so with an
    explicit group they would fall back to the global one; bind ours."""
    if isinstance(spec, type) or callable(spec):
        return functools.partial(spec, tp_group=tp_group)
    return spec


def _layer_spec(op: Operator, tp_group, use_te: bool):
    """The layer spec: megatron's GPT layer (transformer_layer) or T5 decoder layer (decoder_layer)."""
    import copy

    if op.op_type == "transformer_layer":
        from megatron.core.models.gpt import gpt_layer_specs as g
        spec = g.get_gpt_layer_with_transformer_engine_spec() if use_te else g.get_gpt_layer_local_spec()
    else:
        from megatron.core.models.T5 import t5_spec as t
        spec = (t.decoder_model_with_transformer_engine_default_spec() if use_te
                else t.decoder_model_with_local_spec())
    spec = copy.deepcopy(spec)
    sub = spec.submodules
    sub.self_attention.params = dict(sub.self_attention.params or {},
                                     attn_mask_type=AttnMaskType.causal if op.layer.causal
                                     else AttnMaskType.no_mask)
    if op.op_type == "decoder_layer":
        cross = sub.cross_attention
        cross.params = dict(cross.params or {}, attn_mask_type=AttnMaskType.no_mask)
        cross.submodules.linear_q = _with_tp_group(cross.submodules.linear_q, tp_group)
        cross.submodules.linear_kv = _with_tp_group(cross.submodules.linear_kv, tp_group)
    return spec


# --------------------------------------------------------------------------------------------------
# Parameter holders ("cores") that are not megatron blocks
# --------------------------------------------------------------------------------------------------
def _normal_(t: Tensor) -> Tensor:
    return nn.init.normal_(t, mean=0.0, std=INIT_STD)


class PatchEmbedding(nn.Module):
    """Linear projection of pre-cut patches, a class token and learned positions (ViT)."""

    def __init__(self, input_dim: int, hidden: int, positions: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, hidden)
        self.cls_token = nn.Parameter(torch.empty(hidden))
        self.positions = nn.Parameter(torch.empty(positions, hidden))
        _normal_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        _normal_(self.cls_token)
        _normal_(self.positions)


class TokenEmbedding(nn.Module):
    """Vocabulary-parallel token embedding and learned positions (replicated over tp)."""

    def __init__(self, vocab: int, hidden: int, positions: int, *, config, tp_group) -> None:
        super().__init__()
        self.word = VocabParallelEmbedding(vocab, hidden, init_method=init_method_normal(INIT_STD),
                                           config=config, tp_group=tp_group)
        self.positions = nn.Parameter(_normal_(torch.empty(positions, hidden)))


class PoolHead(nn.Module):
    """Final norm and bias-free projection to the contrastive space."""

    def __init__(self, hidden: int, proj_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, proj_dim, bias=False)
        _normal_(self.proj.weight)


class CrossAttentionAdapter(nn.Module):
    """Qwen-VL resampler: learned queries cross-attend to projected encoder features.

    ``kv_proj`` (encoder width -> hidden, column-parallel, gathered), ``kv_norm`` and ``query_norm``
    (replicated), megatron ``CrossAttention`` (heads split over tp). No residual, as in Qwen-VL.
    """

    def __init__(self, op: Operator, queries: int, *, config: TransformerConfig, tp_group) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import RowParallelLinear
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        c = op.layer
        self.queries = nn.Parameter(_normal_(torch.empty(queries, c.hidden)))
        self.kv_proj = ColumnParallelLinear(c.input_dim, c.hidden, config=config,
                                            init_method=config.init_method, bias=False,
                                            gather_output=True, tp_group=tp_group)
        self.kv_norm = nn.LayerNorm(c.hidden)
        self.query_norm = nn.LayerNorm(c.hidden)
        sub = CrossAttentionSubmodules(
            linear_q=functools.partial(ColumnParallelLinear, tp_group=tp_group),
            linear_kv=functools.partial(ColumnParallelLinear, tp_group=tp_group),
            core_attention=DotProductAttention, linear_proj=RowParallelLinear)
        self.attention = CrossAttention(config, sub, layer_number=1, attn_mask_type=AttnMaskType.no_mask,
                                        pg_collection=_pg_collection(tp_group))


class LinearAdapter(nn.Module):
    """Column-parallel projection (gathered output) after average pooling."""

    def __init__(self, input_dim: int, hidden: int, *, config, tp_group) -> None:
        super().__init__()
        self.proj = ColumnParallelLinear(input_dim, hidden, config=config,
                                         init_method=init_method_normal(INIT_STD), bias=True,
                                         gather_output=True, tp_group=tp_group)


class LMHead(nn.Module):
    """Final norm (replicated) and a bias-free vocabulary projection split over tp by vocabulary."""

    def __init__(self, hidden: int, vocab: int, *, config, tp_group) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.output = ColumnParallelLinear(hidden, vocab, config=config,
                                           init_method=init_method_normal(INIT_STD), bias=False,
                                           gather_output=False, tp_group=tp_group)


class _GroupVocabParallelCrossEntropy(torch.autograd.Function):
    """megatron's vocab-parallel cross-entropy with an explicit tp group.

    ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` reads the global tp group; this is the
    same computation (megatron's own ``VocabParallelCrossEntropy`` steps) with the group passed in.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group, rank: int, size: int) -> Tensor:
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(logits)
        if size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.size(-1), rank, size)
        mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(logits, target, logits_max, start, end))
        if size > 1:
            dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(exp_logits, predicted,
                                                                               sum_exp)
        ctx.save_for_backward(softmax, mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        softmax, mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, mask))
        grad_input = VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output)
        return grad_input, None, None, None, None


# --------------------------------------------------------------------------------------------------
# Operator layers
# --------------------------------------------------------------------------------------------------
class OperatorLayer(nn.Module):
    """One operator applied to its inputs: shared parameters in ``self.core`` plus per-operator logic."""

    def __init__(self, op: Operator, core: nn.Module, *, tp_group, tp_rank: int, tp_size: int,
                 task_weight: float, use_te: bool) -> None:
        super().__init__()
        self.op = op
        self.core = core
        self.tp_group = tp_group
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.task_weight = float(task_weight)
        self.use_te = use_te

    @property
    def param_key(self) -> str:
        return self.op.param_key

    def extra_repr(self) -> str:
        return f"op={self.op.name!r}, type={self.op.op_type}, tp={self.tp_size}"

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


class PatchEmbedLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        _, (x,) = self._split(inputs)
        c = self.op.layer
        self._check(x, (c.seq_len - 1, c.input_dim), "patches")
        y = self.core.proj(x)
        cls = self.core.cls_token.expand(y.shape[0], 1, -1)
        return torch.cat([cls, y], dim=1) + self.core.positions[:c.seq_len]


class TokenEmbedLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        _, (tokens,) = self._split(inputs)
        self._check(tokens, (self.op.layer.seq_len,), "tokens")
        return self.core.word(tokens) + self.core.positions[:tokens.shape[1]]


class TransformerOpLayer(OperatorLayer):
    """megatron TransformerLayer on ``[b, s, h]`` (the concatenation of its operator inputs)."""

    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, _ = self._split(inputs)
        self._check(x, (self.op.layer.seq_len, self.op.layer.hidden), "input")
        out, _ = self.core(hidden_states=x.transpose(0, 1), attention_mask=None)
        return out.transpose(0, 1)


class DecoderOpLayer(OperatorLayer):
    """megatron TransformerLayer with the T5 decoder spec; carries the memory after the target."""

    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, _ = self._split(inputs)
        c = self.op.layer
        self._check(x, (c.seq_len + c.memory_seq_len, c.hidden), "input [target, memory]")
        target, memory = x[:, :c.seq_len], x[:, c.seq_len:]
        out, _ = self.core(hidden_states=target.transpose(0, 1), attention_mask=None,
                           context=memory.transpose(0, 1), context_mask=None)
        return torch.cat([out.transpose(0, 1), memory], dim=1)


class PoolHeadLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, _ = self._split(inputs)
        c = self.op.layer
        self._check(x, (c.seq_len, c.hidden), "input")
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
        loss = _GroupVocabParallelCrossEntropy.apply(logits, labels, self.tp_group, self.tp_rank,
                                                     self.tp_size)
        return loss.sum() * (self.task_weight / (self.op.batch * c.loss_tokens))


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
    if op.op_type not in TP_OP_TYPES or not op.tp_splittable:
        raise ValueError(f"operator {op.name!r} ({op.op_type}, tp_splittable={op.tp_splittable}) cannot "
                         f"run with tp_size={tp_size}; tp > 1 layers: {sorted(TP_OP_TYPES)}")
    if tp_group is None or tp_group.size() != tp_size or tp_group.rank() != tp_rank:
        got = None if tp_group is None else (tp_group.size(), tp_group.rank())
        raise ValueError(f"operator {op.name!r}: tp_group (size, rank) must be ({tp_size}, {tp_rank}), "
                         f"got {got}")
    c = op.layer
    divisible = {"hidden": c.hidden, "num_heads": c.num_heads, "ffn_hidden": c.ffn_hidden,
                 "vocab_size": c.vocab_size}
    bad = {k: v for k, v in divisible.items() if v % tp_size}
    if bad:
        raise ValueError(f"operator {op.name!r}: {bad} not divisible by tp_size={tp_size}")


def _build_core(op: Operator, *, tp_group, tp_size: int, dtype: torch.dtype, rows: int,
                use_te: bool) -> nn.Module:
    c, t = op.layer, op.op_type
    if t in ("transformer_layer", "decoder_layer"):
        config = _transformer_config(op, tp_size, dtype)
        spec = _layer_spec(op, tp_group, use_te)
        return TransformerLayer(config, spec.submodules, layer_number=1,
                                pg_collection=_pg_collection(tp_group))
    if t == "cross_attn_adapter":
        return CrossAttentionAdapter(op, rows, config=_transformer_config(op, tp_size, dtype),
                                     tp_group=tp_group)
    pconfig = _parallel_config(tp_size, dtype)
    if t == "patch_embed":
        return PatchEmbedding(c.input_dim, c.hidden, rows)
    if t == "token_embed":
        return TokenEmbedding(c.vocab_size, c.hidden, rows, config=pconfig, tp_group=tp_group)
    if t == "pool_head":
        return PoolHead(c.hidden, c.proj_dim)
    if t == "linear_adapter":
        return LinearAdapter(c.input_dim, c.hidden, config=pconfig, tp_group=tp_group)
    if t == "lm_head":
        return LMHead(c.hidden, c.vocab_size, config=pconfig, tp_group=tp_group)
    return nn.Module()  # contrastive_loss: no parameters


def build_layer(op: Operator, *, tp_group=None, tp_rank: int = 0, tp_size: int = 1, seed: int,
                graph: TaskGraph | None = None, task_weight: float | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                share_with: OperatorLayer | None = None, backend: str = "auto") -> OperatorLayer:
    """The layer of one operator, on this rank's tensor-parallel shard.

    Args:
        op: the operator.
        tp_group, tp_rank, tp_size: the operator's tensor-parallel group (None when ``tp_size == 1``:
            a one-rank group is used), this rank's index in it and its size.
        seed: global seed; the core is initialised from :func:`layer_seed` ``(seed, op.param_key)``.
        graph: the task graph; gives the task weight and sizes shared tables (see :func:`table_rows`).
            Pass it whenever the layer must match other processes' copies of the same ``param_key``.
        task_weight: weight of the task's loss (default: from ``graph``, else 1.0); loss layers only.
        dtype: parameter dtype (float32 on CPU; bfloat16 on GPU). device: where parameters live (CPU).
        share_with: an existing layer with the same ``param_key`` and tp layout whose core to reuse.
        backend: ``auto`` (TransformerEngine specs when TE imports and CUDA is available), ``local``, ``te``.
    """
    if op.op_type not in _LAYER_CLASSES:
        raise ValueError(f"operator {op.name!r}: unknown op_type {op.op_type!r}")
    _check_tp(op, tp_group, tp_rank, tp_size)
    use_te = _use_te(backend)
    ensure_megatron_globals(seed=seed, tp_rank=tp_rank)
    if tp_size == 1 and tp_group is None:
        tp_group = self_group()
    if task_weight is None:
        task_weight = graph.task_weights[graph.tasks.index(op.task)] if graph is not None else 1.0
    if share_with is not None:
        if (share_with.op.param_key != op.param_key or not op.param_key
                or share_with.op.op_type != op.op_type or share_with.tp_size != tp_size):
            raise ValueError(f"operator {op.name!r} (key {op.param_key!r}, {op.op_type}, tp={tp_size}) cannot "
                             f"share parameters with {share_with.op.name!r} (key {share_with.op.param_key!r}, "
                             f"{share_with.op.op_type}, tp={share_with.tp_size})")
        core = share_with.core
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, op.param_key or op.name))
            core = _build_core(op, tp_group=tp_group, tp_size=tp_size, dtype=dtype,
                               rows=table_rows(op, graph), use_te=use_te)
        core = core.to(dtype=dtype, device=device)
    return _LAYER_CLASSES[op.op_type](op, core, tp_group=tp_group, tp_rank=tp_rank, tp_size=tp_size,
                                      task_weight=task_weight, use_te=use_te)


# --------------------------------------------------------------------------------------------------
# Full (unsharded) state
# --------------------------------------------------------------------------------------------------
def shard_spec(param: Tensor) -> tuple[int, int] | None:
    """``(partition_dim, partition_stride)`` of a tensor-parallel shard, None for a replicated tensor."""
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim), int(getattr(param, "partition_stride", 1))
    return None


def shard_tensor(full: Tensor, *, dim: int, stride: int, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s shard of ``full`` the way megatron's CPU initialisation cuts it.

    ``full`` is split along ``dim`` into ``stride * size`` equal chunks and rank r keeps chunks
    r, r + size, ... (stride 2 for a SwiGLU ``linear_fc1``: each rank holds its gate and its up slice).
    """
    n = full.shape[dim]
    if n % (stride * size):
        raise ValueError(f"dimension {dim} of size {n} does not split into {stride} x {size} chunks")
    chunks = torch.split(full, n // (stride * size), dim=dim)
    return torch.cat(chunks[rank::size], dim=dim)


def unshard_tensors(shards: Sequence[Tensor], *, dim: int, stride: int) -> Tensor:
    """Inverse of :func:`shard_tensor` over all ranks' shards (in tp rank order)."""
    pieces = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


def _canonical(name: str, use_te: bool) -> str:
    if use_te:
        for te, local in _TE_TO_LOCAL.items():
            if name.startswith(te):
                return local + name[len(te):]
    return name


def full_state_dict(layer: OperatorLayer, tp_group=None) -> dict[str, Tensor]:
    """The unsharded parameters of ``layer`` as CPU tensors, keyed by name within the layer.

    Collective over the layer's tp group (``tp_group`` defaults to the one it was built with): every tp
    rank must call it. Names follow the local (non-TE) spec, so a GPU (TE) layer and a CPU layer agree.
    """
    group = tp_group if tp_group is not None else layer.tp_group
    size = layer.tp_size
    out = {}
    for name, p in layer.core.named_parameters():
        t = p.detach()
        spec = shard_spec(p)
        if spec is not None and size > 1:
            shards = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(shards, t.contiguous(), group=group)
            t = unshard_tensors(shards, dim=spec[0], stride=spec[1])
        out[_canonical(name, layer.use_te)] = t.cpu().clone()
    return out


@torch.no_grad()
def load_full_state_dict(layer: OperatorLayer, state: dict[str, Tensor]) -> None:
    """Copy unsharded parameters (as from :func:`full_state_dict` or ``ReferenceModel.layer_state``)
    into ``layer``'s shard. Every parameter must be present with its full shape; no communication."""
    params = dict(layer.core.named_parameters())
    names = {_canonical(n, layer.use_te): n for n in params}
    missing, unexpected = sorted(set(names) - set(state)), sorted(set(state) - set(names))
    if missing or unexpected:
        raise ValueError(f"layer {layer.op.name!r}: state is missing {missing}, has unexpected {unexpected}")
    for cname, name in names.items():
        p, full = params[name], state[cname]
        spec = shard_spec(p)
        if spec is not None and layer.tp_size > 1:
            full = shard_tensor(full, dim=spec[0], stride=spec[1], rank=layer.tp_rank, size=layer.tp_size)
        if full.shape != p.shape:
            raise ValueError(f"layer {layer.op.name!r}: {cname} has shape {list(full.shape)}, "
                             f"the layer expects {list(p.shape)} (tp {layer.tp_rank}/{layer.tp_size})")
        p.copy_(full)


def num_parameters(layer: OperatorLayer) -> int:
    """Parameters of the unsharded layer (shards counted at full size)."""
    return sum(p.numel() * (layer.tp_size if shard_spec(p) else 1) for p in layer.core.parameters())


__all__ = ["OperatorLayer", "build_layer", "full_state_dict", "load_full_state_dict", "layer_seed",
           "shard_spec", "shard_tensor", "unshard_tensors", "table_rows", "self_group", "LocalGroup",
           "num_parameters", "TP_OP_TYPES", "LOSS_OP_TYPES"]
