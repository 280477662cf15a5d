"""Converting between a tensor-parallel layer's shards and its full (unsharded) parameters.

Needed to compare a sharded layer with the single-process reference and for checkpoints that load under
another plan (another tp degree). Sharded parameters are recognised by megatron's attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``); all others are replicated over tp.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import Tensor, nn

from .. import comm


class ShardedLayer(Protocol):
    """What these functions read of a layer (:class:`.layers.OperatorLayer` has it; this module does not
    import that one, which imports this one)."""

    core: nn.Module
    op: object
    tp_group: object
    tp_size: int
    tp_rank: int
    use_te: bool

#: TransformerEngine fuses the pre-attention / pre-MLP norms into the following linear; names are
#: reported in the local spec's form so that states move between GPU (TE) and CPU (local) runs.
_TE_TO_LOCAL = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
                "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}


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


def full_state_dict(layer: ShardedLayer, tp_group=None) -> dict[str, Tensor]:
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
            shards = comm.all_gather(t, group=group)
            t = unshard_tensors(shards, dim=spec[0], stride=spec[1])
        out[_canonical(name, layer.use_te)] = t.cpu().clone()
    return out


@torch.no_grad()
def load_full_state_dict(layer: ShardedLayer, state: dict[str, Tensor]) -> None:
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


def num_parameters(layer: ShardedLayer) -> int:
    """Parameters of the unsharded layer (shards counted at full size)."""
    return sum(p.numel() * (layer.tp_size if shard_spec(p) else 1) for p in layer.core.parameters())
