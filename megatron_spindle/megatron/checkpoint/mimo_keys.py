"""A MIMO model's checkpoint entries under the ``MimoModel``'s own keys, so MIMO's own training reads them.

Under a user's ``MimoModel`` (:mod:`...mimo`), every parameter key's module is a part of the user's model
(:func:`...models.mimo_build.build_part`): a layer, an encoder around an empty block, the language model's
embedding or head, a projection. Each part's own ``sharded_state_dict()`` (megatron.core's) is asked with the prefix
and offsets that ``MimoModel.sharded_state_dict()`` gives it: ``<key>.`` for every part but a layer, and for layer
``i`` of a block of ``n`` the block's ``<owner>.layers.`` with the layer axis ``(0, i, n)`` prepended, as
``TransformerBlock.sharded_state_dict`` stacks its layers. The keys, shapes, tensor-parallel offsets and the
SwiGLU ``linear_fc1`` factory are therefore megatron.core's, and a checkpoint of Megatron-LM's own loop on the user's
``MimoModel`` (``SPINDLE=0``) holds the same tensors under the same keys, and ``_extra_state`` objects too.

Only the replica ids are Spindle's (a plan places copies where megatron's data-parallel group would not): the copy on
the first rank of a shard's group is the main one (``replica_id`` 0 in every place), a tensor-parallel shard's
copies across groups are not replicas of each other, and a tensor replicated over tensor parallelism has one main
copy, shard 0's.

Optimizer moments follow Megatron's naming (``optimizer.state.exp_avg.<key>``, as
``megatron.core.dist_checkpointing.optimizer.make_sharded_optimizer_tensor`` names them).
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.module import MegatronModule

from ...mimo.graph import is_mimo_graph
from ...models.blocks import LocalGroup
from ...models.layer_state import shard_spec
from ...models.mimo_layers import model as mimo_model

#: Megatron's prefix of an optimizer state's key (``megatron.core.optimizer``: ``optimizer.state.<state key>``).
OPTIMIZER_PREFIX = "optimizer.state"


def is_mimo(model) -> bool:
    """Whether ``model`` (a Spindle model) trains a user's ``MimoModel``."""
    return is_mimo_graph(model.graph)


def _layout(key: str) -> tuple[str, str, tuple]:
    """``(dict prefix, key prefix, sharded offsets)`` of the part behind parameter key ``key``."""
    owner, sep, index = key.rpartition(".layers.")
    if sep and index.isdigit() and _stacked(owner):
        n = len(mimo_model()[0].get_submodule(f"{owner}.layers"))
        return f"{key}.", f"{owner}.layers.", ((0, int(index), n),)
    return f"{key}.", f"{key}.", ()


_STACKED: dict = {}


def _stacked(owner: str) -> bool:
    """Whether the block ``owner`` of the user's model stacks its layers on one axis in its checkpoint (megatron.core
    keys layers by number instead for blocks it deems heterogeneous, by its own rules and version): asked of the
    block itself, on the meta device, once."""
    mimo = mimo_model()[0]
    if (id(mimo), owner) not in _STACKED:
        block = mimo.get_submodule(owner)
        one = LocalGroup()
        with _tp_group_everywhere(block, one):
            sd = block.sharded_state_dict(prefix=f"{owner}.", metadata={"dp_cp_group": one})
        first = f"{owner}.layers.{block.layers[0].layer_number - 1}." if len(block.layers) else None
        _STACKED[(id(mimo), owner)] = first is not None and not any(
            getattr(v, "key", "").startswith(first) for v in sd.values())
    return _STACKED[(id(mimo), owner)]


@contextlib.contextmanager
def _tp_group_everywhere(core: torch.nn.Module, tp_group):
    """megatron modules without a ``tp_group`` of their own read megatron's global parallel state in
    ``sharded_state_dict``, which Spindle never initialises: while the part is asked, they have the slice's."""
    added = [m for m in core.modules() if isinstance(m, MegatronModule) and not hasattr(m, "tp_group")]
    for m in added:
        m.tp_group = tp_group
    try:
        yield
    finally:
        for m in added:
            del m.tp_group


def part_state(layer, key: str, shard: int, idx: int, copy: int = 0) -> dict:
    """``{name within the key's module: entry}`` of one local holder of ``key`` (shard ``shard``, the
    ``idx``-th rank of the shard's rank list, the ``copy``-th holder on this rank): megatron.core's own
    ``ShardedTensor`` / ``ShardedTensorFactory`` / ``ShardedObject``s, with Spindle's replica ids."""
    prefix, sharded_prefix, offsets = _layout(key)
    group = layer.tp_group if layer.tp_group is not None else LocalGroup()
    with _tp_group_everywhere(layer.core, group):
        sd = layer.core.sharded_state_dict(prefix=prefix, sharded_offsets=offsets,
                                           metadata={"dp_cp_group": LocalGroup()})
    if sharded_prefix != prefix:
        replace_prefix_for_sharding(sd, prefix, sharded_prefix)
    out = {}
    for name, v in sd.items():
        data = v.data if isinstance(v, (ShardedTensor, ShardedTensorFactory)) else None
        split = data is not None and shard_spec(data) is not None
        rid = (0, idx) if split else (shard, idx)
        v.replica_id = (*rid, copy) if copy else rid
        out[name[len(prefix):]] = v
    return out


def optimizer_entry(entry, state: torch.Tensor, state_key: str):
    """The entry of an optimizer state tensor of ``entry``'s parameter, keyed as Megatron's optimizer keys it."""
    return make_sharded_optimizer_tensor(entry, state, prefix=f"{OPTIMIZER_PREFIX}.{state_key}")


def tensors(entry) -> list[ShardedTensor]:
    """The ShardedTensors an entry writes (a factory's built ones); none for an object."""
    if isinstance(entry, ShardedTensor):
        return [entry]
    if isinstance(entry, ShardedTensorFactory):
        built = entry.build()
        return [v for v in (built.values() if isinstance(built, dict) else built) if isinstance(v, ShardedTensor)]
    return []


def is_object(entry) -> bool:
    return isinstance(entry, ShardedObject)
