"""Building blocks of the operator layers: megatron configs and specs, process-group helpers, the
parameter modules that megatron has no block for, and a vocab-parallel cross-entropy over an explicit group.

Everything here is wiring; :mod:`megatron_spindle.models.layers` documents the conventions.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import torch

from .. import comm
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.core.activations import quick_gelu
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.models.T5 import t5_spec as t5_specs
from megatron.core.models.gpt import gpt_layer_specs as gpt_specs
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  VocabParallelEmbedding)
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import init_method_normal

from ..planner.workload.graph import Operator
from .recompute import config_kwargs as recompute_fields

INIT_STD = 0.02
"""Megatron-LM's default ``--init-method-std`` (``TransformerConfig.init_method_std``)."""
_BACKENDS = ("auto", "local", "te")


@dataclasses.dataclass(frozen=True)
class LayerSettings:
    """Megatron's model flags every layer honours: ``--init-method-std`` (the std of every weight drawn from a
    normal: megatron's layers through ``TransformerConfig.init_method_std``, the parameter modules below
    directly), ``--hidden-dropout`` and ``--attention-dropout`` (``TransformerConfig``'s, applied by
    megatron.core's transformer layers in training mode). Dropout defaults to 0 for Spindle's models: a mask
    is drawn per rank, so a plan's step equals the single-process reference only without it."""

    init_std: float = INIT_STD
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    @classmethod
    def from_args(cls, args) -> "LayerSettings":
        """From Megatron's parsed arguments (or the built-in loop's); an absent flag keeps the default."""
        given = {f.name: getattr(args, name, None) for f, name in
                 zip(dataclasses.fields(cls), ("init_method_std", "hidden_dropout", "attention_dropout"))}
        return cls(**{k: float(v) for k, v in given.items() if v is not None})

    @property
    def dropout(self) -> bool:
        return bool(self.hidden_dropout or self.attention_dropout)


DEFAULT_SETTINGS = LayerSettings()


# --------------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------------
class LocalGroup:
    """Stand-in for a one-rank process group: megatron only asks a size-1 group for ``size()`` and ``rank()``
    (every collective is bypassed), so layers built without a real one (the single-process reference, or no
    torch.distributed at all) get this.

    The runtime passes a real one-rank group instead, created collectively with its other groups
    (:class:`megatron_spindle.runtime.groups.ProcessGroupRegistry`): under eager NCCL initialisation every
    ``new_group`` is a split of the world communicator that every rank must join, so no layer creates one.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def pg_collection(tp_group, one=None) -> ProcessGroupCollection:
    """megatron's groups of one layer: ``tp_group``, and ``one`` (a one-rank group; a :class:`LocalGroup`
    when None) for pipeline and context parallelism."""
    one = LocalGroup() if one is None else one
    return ProcessGroupCollection(tp=tp_group, pp=one, cp=one, tp_cp=tp_group, mp=tp_group)


def use_te_backend(backend: str) -> bool:
    """Whether layers use TransformerEngine's modules: only for ``backend="te"`` (Megatron-LM's
    ``--transformer-impl transformer_engine``), which needs TE and a CUDA device. ``"local"`` and ``"auto"``
    (the old default, kept for callers that pass it) build megatron.core's local modules: the layers never
    switch to TE because it happens to import (an NGC container has it; that path is chosen, not stumbled into)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend != "te":
        return False
    try:
        import transformer_engine  # noqa: F401  # optional: TransformerEngine, asked for
        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        raise ValueError("backend='te' (--transformer-impl transformer_engine) needs transformer_engine and a CUDA device")
    return True


# --------------------------------------------------------------------------------------------------
# megatron configs and specs
# --------------------------------------------------------------------------------------------------
_HAS_CUDA_GRAPH_SCOPE = "cuda_graph_scope" in {f.name for f in dataclasses.fields(TransformerConfig)}


def no_cuda_graph_scope() -> dict:
    """Config keyword arguments for "no CUDA-graph scope": megatron.core 0.16's default ``cuda_graph_scope="full"``
    warns on every config that "full" is deprecated in favour of the empty list, which means the same; the empty
    list where the field exists (any config built from ``TransformerConfig``'s fields), nothing otherwise."""
    return {"cuda_graph_scope": []} if _HAS_CUDA_GRAPH_SCOPE else {}


#: MLP activations by the spec's name (``quick_gelu``: CLIP's ``x * sigmoid(1.702 x)``, megatron.core's own)
ACTIVATIONS = {"gelu": F.gelu, "quick_gelu": quick_gelu, "silu": F.silu}


def transformer_config(op: Operator, tp_size: int, dtype: torch.dtype, *, recompute: str = "none",
                       settings: LayerSettings = DEFAULT_SETTINGS) -> TransformerConfig:
    """One layer's TransformerConfig: init std and dropout from ``settings``, no fusions, CPU initialisation; megatron's selective recompute
    fields for ``recompute="selective"`` (:mod:`.recompute`).

    Defaults: GELU MLP with biases and LayerNorm (ViT/CLIP); ``swiglu`` layers (Qwen) use a gated SiLU MLP
    without linear biases but with a QKV bias. A spec's checkpoint-matching keys (grouped queries,
    activation, RMSNorm and its epsilon, biases) override them. ``num_layers=1``: megatron scales the
    output-projection init by the depth of the block, which a single operator does not know.
    """
    c = op.layer
    bias = (not c.swiglu) if c.add_bias_linear is None else c.add_bias_linear
    return TransformerConfig(
        num_layers=1, hidden_size=c.hidden, num_attention_heads=c.num_heads,
        num_query_groups=c.num_query_groups or None,
        ffn_hidden_size=c.ffn_hidden or 4 * c.hidden, tensor_model_parallel_size=tp_size,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, hidden_dropout=settings.hidden_dropout,
        attention_dropout=settings.attention_dropout,
        gated_linear_unit=c.swiglu, activation_func=ACTIVATIONS[c.activation or ("silu" if c.swiglu else "gelu")],
        add_bias_linear=bias, add_qkv_bias=(c.swiglu or bias) if c.add_qkv_bias is None else c.add_qkv_bias,
        normalization=c.normalization or "LayerNorm", layernorm_epsilon=c.norm_epsilon or 1e-5,
        init_method_std=settings.init_std, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, **recompute_fields(recompute), **no_cuda_graph_scope())


def parallel_config(tp_size: int, dtype: torch.dtype) -> ModelParallelConfig:
    return ModelParallelConfig(tensor_model_parallel_size=tp_size, use_cpu_initialization=True,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               fp16=dtype == torch.float16, gradient_accumulation_fusion=False)


def _with_tp_group(spec, tp_group):
    """megatron's CrossAttention builds linear_q / linear_kv without ``tp_group`` (0.16.1), so with an
    explicit group they would fall back to the global one; bind ours."""
    if isinstance(spec, type) or callable(spec):
        return functools.partial(spec, tp_group=tp_group)
    return spec


def layer_spec(op: Operator, tp_group, use_te: bool):
    """The layer spec: megatron's GPT layer (transformer_layer) or T5 decoder layer (decoder_layer)."""
    if op.op_type == "transformer_layer":
        spec = (gpt_specs.get_gpt_layer_with_transformer_engine_spec() if use_te
                else gpt_specs.get_gpt_layer_local_spec(normalization=op.layer.normalization or "LayerNorm"))
    else:
        spec = (t5_specs.decoder_model_with_transformer_engine_default_spec() if use_te
                else t5_specs.decoder_model_with_local_spec())
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
def _normal_(t: Tensor, std: float = INIT_STD) -> Tensor:
    return nn.init.normal_(t, mean=0.0, std=std)


def make_norm(c, hidden: int | None = None) -> nn.Module:
    """The norm a layer config asks for: ``LayerNorm`` (default) or ``RMSNorm``, epsilon 1e-5 by default."""
    cls = nn.RMSNorm if c.normalization == "RMSNorm" else nn.LayerNorm
    return cls(hidden or c.hidden, eps=c.norm_epsilon or 1e-5)


def rotary_embedding(seq_len: int, kv_channels: int, base: float, device=None) -> Tensor:
    """RoPE frequencies ``[s, 1, 1, kv_channels]`` for megatron's ``rotary_pos_emb`` (non-interleaved halves,
    as Hugging Face's ``rotate_half``): megatron.core's ``RotaryEmbedding.get_emb`` without its move to CUDA
    and its context-parallel split, which need megatron's global state."""
    inv_freq = 1.0 / (base ** (torch.arange(0, kv_channels, 2, dtype=torch.float32, device=device) / kv_channels))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


class PatchEmbedding(nn.Module):
    """Linear projection of pre-cut patches, a class token and learned positions (ViT)."""

    def __init__(self, input_dim: int, hidden: int, positions: int, norm: nn.Module | None = None, *,
                 std: float = INIT_STD) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, hidden)
        self.cls_token = nn.Parameter(torch.empty(hidden))
        self.positions = nn.Parameter(torch.empty(positions, hidden))
        _normal_(self.proj.weight, std)
        nn.init.zeros_(self.proj.bias)
        _normal_(self.cls_token, std)
        _normal_(self.positions, std)
        if norm is not None:  # CLIP's pre_layrnorm, over the embedded tokens
            self.norm = norm


class TokenEmbedding(nn.Module):
    """Vocabulary-parallel token embedding and learned positions (replicated over tp)."""

    def __init__(self, vocab: int, hidden: int, positions: int, *, config, tp_group, std: float = INIT_STD) -> None:
        """``positions`` 0: no table (RoPE models position in attention)."""
        super().__init__()
        self.word = VocabParallelEmbedding(vocab, hidden, init_method=init_method_normal(std),
                                           config=config, tp_group=tp_group)
        if positions:
            self.positions = nn.Parameter(_normal_(torch.empty(positions, hidden), std))


class PoolHead(nn.Module):
    """Final norm and bias-free projection to the contrastive space."""

    def __init__(self, hidden: int, proj_dim: int, norm: nn.Module | None = None, *, std: float = INIT_STD) -> None:
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, proj_dim, bias=False)
        _normal_(self.proj.weight, std)


class CrossAttentionAdapter(nn.Module):
    """Qwen-VL resampler: learned queries cross-attend to projected encoder features.

    ``kv_proj`` (encoder width -> hidden, column-parallel, gathered), ``kv_norm`` and ``query_norm``
    (replicated), megatron ``CrossAttention`` (heads split over tp). No residual, as in Qwen-VL.
    """

    def __init__(self, op: Operator, queries: int, *, config: TransformerConfig, tp_group, one=None) -> None:
        super().__init__()
        c = op.layer
        self.queries = nn.Parameter(_normal_(torch.empty(queries, c.hidden), config.init_method_std))
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
                                        pg_collection=pg_collection(tp_group, one))


class LinearAdapter(nn.Module):
    """Column-parallel projection (gathered output) after average pooling."""

    def __init__(self, input_dim: int, hidden: int, *, config, tp_group, std: float = INIT_STD) -> None:
        super().__init__()
        self.proj = ColumnParallelLinear(input_dim, hidden, config=config,
                                         init_method=init_method_normal(std), bias=True,
                                         gather_output=True, tp_group=tp_group)


class LMHead(nn.Module):
    """Final norm (replicated) and a bias-free vocabulary projection split over tp by vocabulary."""

    def __init__(self, hidden: int, vocab: int, *, config, tp_group, norm: nn.Module | None = None,
                 std: float = INIT_STD) -> None:
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(hidden)
        self.output = ColumnParallelLinear(hidden, vocab, config=config,
                                           init_method=init_method_normal(std), bias=False,
                                           gather_output=False, tp_group=tp_group)


class GroupVocabParallelCrossEntropy(torch.autograd.Function):
    """megatron's vocab-parallel cross-entropy with an explicit tp group.

    ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` reads the global tp group; this is the
    same computation (megatron's own ``VocabParallelCrossEntropy`` steps) with the group passed in.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group, rank: int, size: int) -> Tensor:
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(logits)
        if size > 1:
            comm.all_reduce(logits_max, op=comm.ReduceOp.MAX, group=group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.size(-1), rank, size)
        mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(logits, target, logits_max, start, end))
        if size > 1:
            comm.all_reduce(predicted, group=group)
            comm.all_reduce(sum_exp, group=group)
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
