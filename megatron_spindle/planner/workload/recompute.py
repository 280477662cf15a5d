"""What a MetaOp's backward pass costs and keeps: activation recompute, and the state its weights hold.

One layer's scaling curve times forward + backward with every activation stashed (:mod:`.curves`). A
MetaOp may instead **recompute** (the plan's ``MetaOp.recompute``; megatron.core's activation
checkpointing, executed by the runtime):

* ``none``: the layer keeps what its backward reads (:func:`.costs.layer_act_bytes_per_sample`);
* ``selective``: megatron.core's selective recompute of the layer norms and the MLP
  (``recompute_granularity="selective"``, ``recompute_modules=["layernorm", "mlp"]``): the layer keeps its
  input, Q, K, V, the attention output and the MLP's input; the norms' outputs, the MLP's two hidden
  activations and its dropout mask are recomputed in the backward pass;
* ``full``: only the layer's input is kept, the whole forward runs again in the backward pass (a checkpoint
  around each layer).

Its cost is one more forward of what it recomputes (the issue's rule, and Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", MLSys 2023, §5: recomputation re-runs the forward of
the recomputed part): with forward = :data:`FORWARD_SHARE` of forward + backward (backward ≈ 2 × forward
FLOPs), a layer's time is multiplied by ``1 + FORWARD_SHARE · r``, where ``r`` is the recomputed share of the
layer's forward FLOPs (1 for ``full``; the MLP's share for ``selective``, the norms being memory-bound and
not counted in FLOPs). Only transformer and decoder layers recompute; the other layer types are small.

Stash per sample and layer, bf16, flash attention (the ``5·a·s²`` score term is never stored), in Korthikanti
et al.'s accounting (their Table 2 without the attention scores): transformer layer ``18·s·h + 4·s·f`` =
input 2 + norm output 2 + Q, K, V 6 + attention output 2 + dropout mask 1 + residual 2 + norm output 2 +
dropout mask 1 (× ``s·h``) + MLP hidden 2 + 2 (× ``s·f``, ``6·s·f`` gated). Selective drops the two norm outputs,
the MLP dropout mask and the MLP hidden activations: ``13·s·h``. Full keeps the input, ``2·s·h``.
"""
from __future__ import annotations

from .graph import LayerConfig
from .metaops import RECOMPUTE, MetaOp  # noqa: F401 - RECOMPUTE re-exported
#: Layer types that can recompute (megatron.core transformer layers); the others always keep their stash.
RECOMPUTABLE = frozenset({"transformer_layer", "decoder_layer"})
#: Share of a layer's forward + backward time spent in the forward pass (backward ≈ 2 × forward FLOPs).
FORWARD_SHARE = 1.0 / 3.0


def options(m: MetaOp) -> tuple[str, ...]:
    """The recompute modes ``m`` can use."""
    return RECOMPUTE if m.op_type in RECOMPUTABLE else ("none",)


def _mlp_flops(c: LayerConfig) -> float:
    return 2.0 * c.seq_len * (3 if c.swiglu else 2) * c.hidden * c.ffn_hidden


def recomputed_share(m: MetaOp, mode: str | None = None) -> float:
    """Share of one layer's forward FLOPs that ``mode`` (default: the MetaOp's own) runs again."""
    mode = m.recompute if mode is None else mode
    if mode == "none" or m.op_type not in RECOMPUTABLE:
        return 0.0
    if mode == "full":
        return 1.0
    fwd = m.fwd_flops_per_layer / m.batch if m.batch else 0.0
    return min(1.0, _mlp_flops(m.layer) / fwd) if fwd > 0 else 0.0


def backward_share(m: MetaOp) -> float:
    """Share of a layer's backward that runs: all of it for a trainable MetaOp; for a frozen one only its
    input's gradient (half the backward FLOPs) when a MetaOp before it trains, else none."""
    if m.trainable:
        return 1.0
    return 0.5 if m.input_grad else 0.0


def time_factor(m: MetaOp, mode: str | None = None) -> float:
    """One layer's time with ``mode`` relative to its curve (forward + backward, nothing recomputed, weights
    trained): a frozen MetaOp runs less backward (:func:`backward_share`), a recomputed one more forward."""
    back = backward_share(m)
    if back == 0.0:
        return FORWARD_SHARE
    return FORWARD_SHARE * (1.0 + recomputed_share(m, mode)) + (1.0 - FORWARD_SHARE) * back


def act_bytes_per_sample(m: MetaOp, mode: str | None = None) -> float:
    """Bytes one layer of ``m`` stashes per sample under ``mode`` (default: the MetaOp's own); nothing when
    no backward runs through it (a frozen MetaOp with nothing trainable before it)."""
    mode = m.recompute if mode is None else mode
    if backward_share(m) == 0.0:
        return 0.0
    if mode == "none" or m.op_type not in RECOMPUTABLE:
        return m.act_bytes_per_sample
    c = m.layer
    sh = float(c.seq_len * c.hidden)
    if mode == "full":
        return 2.0 * sh
    if m.op_type == "transformer_layer":
        return 13.0 * sh
    # decoder layer: three norms (6·s·h), the MLP's dropout mask and hidden activations are recomputed
    mlp = (6 if c.swiglu else 4) * c.seq_len * c.ffn_hidden
    return max(2.0 * sh, m.act_bytes_per_sample - 7.0 * sh - mlp)
