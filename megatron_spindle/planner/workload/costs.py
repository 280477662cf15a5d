"""Per-layer cost formulas: parameters, forward FLOPs and stashed activation bytes per sample.

Pure arithmetic on a :class:`~megatron_spindle.planner.workload.graph.LayerConfig`. The formulas count the matrix
multiplications (2 FLOPs per multiply-add) and the attention score/value products; element-wise work is
ignored. Activation bytes follow Korthikanti et al. (2022) for bf16 without recomputation, assuming a fused
(flash) attention kernel, so the ``5·a·s²`` score term is dropped:
``18·s·h + 4·s·f`` bytes per transformer layer and sample (``6·s·f`` for a gated MLP).
"""
from __future__ import annotations

from .graph import LayerConfig
from .layer_types import custom_cost

BF16_BYTES = 2


def _mlp_params(h: int, f: int, swiglu: bool) -> int:
    return 3 * h * f if swiglu else 2 * h * f + f + h


def _norm_params(c: LayerConfig) -> int:
    return c.hidden if c.normalization == "RMSNorm" else 2 * c.hidden


def _qkv_rows(c: LayerConfig) -> int:
    """Output rows of the fused QKV projection: h queries plus keys and values of the query groups."""
    h = c.hidden
    groups = c.num_query_groups or c.num_heads or 1
    return h + 2 * (h // (c.num_heads or 1)) * groups


def _transformer_params(c: LayerConfig) -> int:
    """megatron's TransformerLayer: fused QKV (grouped), output projection, MLP, two norms. Defaults: GELU
    layers have every linear bias; gated (Qwen) layers only the QKV bias."""
    h, f = c.hidden, c.ffn_hidden
    bias = (not c.swiglu) if c.add_bias_linear is None else c.add_bias_linear
    qkv_bias = (c.swiglu or bias) if c.add_qkv_bias is None else c.add_qkv_bias
    rows, gates = _qkv_rows(c), 2 if c.swiglu else 1
    attn = rows * h + (rows if qkv_bias else 0) + h * h + (h if bias else 0)
    mlp = gates * f * h + f * h + ((gates * f + h) if bias else 0)
    return attn + mlp + 2 * _norm_params(c)


def layer_params(op_type: str, c: LayerConfig) -> int:
    """Parameter count of one layer."""
    h = c.hidden
    if op_type == "transformer_layer":
        return _transformer_params(c)
    if op_type == "decoder_layer":
        return 8 * h * h + 8 * h + _mlp_params(h, c.ffn_hidden, c.swiglu) + 6 * h
    if op_type == "patch_embed":
        return c.input_dim * h + h + h + c.seq_len * h + (_norm_params(c) if c.embed_norm else 0)
    if op_type == "token_embed":
        return c.vocab_size * h + (0 if c.position_embedding_type == "none" else c.seq_len * h)
    if op_type == "pool_head":
        return _norm_params(c) + h * c.proj_dim
    if op_type == "contrastive_loss":
        return 0
    if op_type == "cross_attn_adapter":
        return c.seq_len * h + c.input_dim * h + 4 * h * h + 4 * h + 4 * h
    if op_type == "linear_adapter":
        return c.input_dim * h + h
    if op_type == "lm_head":
        return _norm_params(c) + h * c.vocab_size
    return custom_cost(op_type, c).params


def layer_fwd_flops_per_sample(op_type: str, c: LayerConfig) -> float:
    """Forward FLOPs of one layer for one sample."""
    h, s = c.hidden, c.seq_len
    if op_type == "transformer_layer":  # grouped queries: fewer key/value rows
        return 2.0 * s * ((_qkv_rows(c) + h) * h + _mlp_params(h, c.ffn_hidden, c.swiglu)) + 4.0 * s * s * h
    if op_type == "decoder_layer":
        m = c.memory_seq_len
        mats = 4 * h * h + 2 * h * h + _mlp_params(h, c.ffn_hidden, c.swiglu)
        return 2.0 * s * mats + 2.0 * m * 2 * h * h + 4.0 * s * s * h + 4.0 * s * m * h
    if op_type == "patch_embed":
        return 2.0 * (s - 1) * c.input_dim * h
    if op_type == "token_embed":
        return 2.0 * s * h
    if op_type == "pool_head":
        return 2.0 * h * c.proj_dim + 5.0 * s * h
    if op_type == "contrastive_loss":
        return 0.0  # depends on the batch: see contrastive_loss_flops
    if op_type == "cross_attn_adapter":
        n = c.input_seq_len
        return (2.0 * n * c.input_dim * h + 2.0 * n * 2 * h * h + 2.0 * s * 2 * h * h
                + 4.0 * s * n * h)
    if op_type == "linear_adapter":
        return 2.0 * s * c.input_dim * h
    if op_type == "lm_head":
        return 2.0 * c.loss_tokens * h * c.vocab_size
    return float(custom_cost(op_type, c).fwd_flops_per_sample)


def contrastive_loss_flops(batch: int, dim: int) -> float:
    """Forward FLOPs of a symmetric InfoNCE over ``batch`` pairs: one ``B×D @ D×B`` logits product."""
    return 2.0 * batch * batch * dim


def layer_act_bytes_per_sample(op_type: str, c: LayerConfig) -> float:
    """Bytes stashed for backward by one layer and one sample (bf16, fused attention)."""
    h, s, f = c.hidden, c.seq_len, c.ffn_hidden
    mlp = (6 if c.swiglu else 4) * s * f
    if op_type == "transformer_layer":
        return 18.0 * s * h + mlp
    if op_type == "decoder_layer":
        return 26.0 * s * h + mlp + 4.0 * c.memory_seq_len * h
    if op_type == "patch_embed":
        return BF16_BYTES * (s - 1) * c.input_dim
    if op_type == "token_embed":
        return BF16_BYTES * s * h
    if op_type == "pool_head":  # its whole input: more than it keeps where it reads one token (graph.read_token)
        return BF16_BYTES * (s * h + h)
    if op_type == "contrastive_loss":
        return 4.0 * 2 * c.proj_dim
    if op_type == "cross_attn_adapter":
        n = c.input_seq_len
        return BF16_BYTES * (n * c.input_dim + 2 * n * h + 4 * s * h)
    if op_type == "linear_adapter":
        return BF16_BYTES * c.input_seq_len * c.input_dim
    if op_type == "lm_head":
        return BF16_BYTES * s * h + 4.0 * c.loss_tokens * c.vocab_size
    return float(custom_cost(op_type, c).act_bytes_per_sample)


def out_elems_per_sample(op_type: str, c: LayerConfig) -> int:
    """Elements of the layer's output per sample; what crosses a wave boundary forward (and backward)."""
    if op_type == "pool_head":
        return c.proj_dim
    if op_type in ("contrastive_loss", "lm_head"):
        return 1
    if op_type == "decoder_layer":
        return (c.seq_len + c.memory_seq_len) * c.hidden  # the memory travels with the target stream
    return c.seq_len * c.hidden
