"""A registry of custom layer types: a model spec names them, the planner costs them, the runtime builds them.

Pure Python (the planner's rule): registering a type stores its cost function (plain arithmetic on a
:class:`~megatron_spindle.planner.workload.graph.LayerConfig`) and a reference to its build function; the planner
only ever calls the cost function. The build function is called by ``models/layers.py`` on the ranks that
run the layer, so a plugin file keeps its ``import torch`` inside the build function and stays importable
where torch is absent (``spindle plan`` on a laptop).

A custom layer takes the concatenation of its operator inputs, ``[b, input_seq_len, input_dim]``
(batch first, as every activation between operators), and returns ``[b, seq_len, hidden]``. Its
:class:`LayerConfig` carries ``hidden`` (the spec's ``hidden_size``), ``seq_len`` (the spec's
``seq_length``, default: the input's tokens), ``input_dim`` and ``input_seq_len`` (from the inputs), and
``num_heads`` / ``ffn_hidden`` / ``causal`` / ``swiglu`` when the spec sets them.

Example (``examples/models/llava_layers.py`` is a complete one)::

    from megatron_spindle.planner.workload.layer_types import LayerCost, register_layer_type

    def cost(c):
        params = c.input_dim * c.ffn_hidden + c.ffn_hidden * c.hidden
        return LayerCost(params=params, fwd_flops_per_sample=2.0 * c.seq_len * params,
                         act_bytes_per_sample=2.0 * c.seq_len * (c.input_dim + c.ffn_hidden))

    def build(op, *, tp_group, tp_rank, tp_size, dtype):
        import torch  # only the ranks that run the layer need torch
        ...           # megatron.core modules with tp_group=tp_group; forward(x [b, s, d]) -> [b, s', h]

    register_layer_type("mlp_projector", cost=cost, build=build)
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

#: Operator types the runtime knows how to build. Each is documented where the layer is built
#: (``megatron_spindle/models/layers.py``); the planner only needs their costs.
OP_TYPES = (
    "patch_embed",        # linear projection of pre-cut patches/frames + class token + positions
    "token_embed",        # token embedding + learned positions
    "transformer_layer",  # pre-norm self-attention + MLP (megatron.core TransformerLayer)
    "decoder_layer",      # causal self-attention + cross-attention over memory + MLP
    "pool_head",          # final norm, pooling (cls / eos / mean), projection, L2 normalisation
    "contrastive_loss",   # symmetric InfoNCE over a pair of embeddings, global batch
    "cross_attn_adapter", # learned queries cross-attending to encoder features (Qwen-VL resampler)
    "linear_adapter",     # average-pool along the sequence, then a linear projection
    "lm_head",            # final norm, vocabulary projection, next-token cross-entropy
)


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """What the planner needs to know about one layer for one sample."""

    params: int
    """Parameters of the layer (0 when it has none)."""
    fwd_flops_per_sample: float
    """Forward FLOPs for one sample (backward is counted as twice this)."""
    act_bytes_per_sample: float
    """Bytes stashed for the backward pass per sample."""

    def __post_init__(self) -> None:
        if not isinstance(self.params, int) or isinstance(self.params, bool) or not 0 <= self.params < 2 ** 53:
            raise ValueError(f"LayerCost.params must be a non-negative int below 2^53, got {self.params!r}")
        for name in ("fwd_flops_per_sample", "act_bytes_per_sample"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"LayerCost.{name} must be a finite non-negative number, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class CustomLayerType:
    name: str
    cost: Callable[[Any], LayerCost]
    """``cost(layer_config) -> LayerCost``: pure arithmetic, no torch."""
    build: Callable | None = None
    """``build(op, *, tp_group, tp_rank, tp_size, dtype) -> torch.nn.Module`` (runtime only)."""
    tensor_parallel: bool = False
    """Whether the build function shards the layer over a tensor-parallel group (tp > 1 allowed)."""
    origin: str = ""
    """The plugin that registered it (a file or module name; empty when registered by other code)."""
    like: str = ""
    """A built-in type whose analytic constants (its fixed per-layer latency) time this one ("": none, the
    analytic model's default for unknown types)."""

    @property
    def described(self) -> str:
        return f"layer type {self.name!r}" + (f" of plugin {self.origin}" if self.origin else "")


_REGISTRY: dict[str, CustomLayerType] = {}
_LOADING: list[str] = []  # the plugin being imported (its registrations name it)


def register_layer_type(name: str, *, cost: Callable, build: Callable | None = None,
                        tensor_parallel: bool = False, like: str = "") -> CustomLayerType:
    """Register (or re-register, e.g. when a plugin is imported twice) a custom layer type."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"custom layer type name must be an identifier, got {name!r}")
    if name in OP_TYPES:
        raise ValueError(f"custom layer type {name!r} would shadow the built-in type of that name")
    if not callable(cost) or (build is not None and not callable(build)):
        raise ValueError(f"custom layer type {name!r}: cost (and build, if given) must be callable")
    if like and like not in OP_TYPES:
        raise ValueError(f"custom layer type {name!r}: like={like!r} is not a built-in type ({', '.join(OP_TYPES)})")
    t = CustomLayerType(name=name, cost=cost, build=build, tensor_parallel=bool(tensor_parallel),
                        origin=_LOADING[-1] if _LOADING else "", like=like)
    _REGISTRY[name] = t
    return t


def custom_layer_type(name: str) -> CustomLayerType | None:
    """The registered custom type of that name, or None."""
    return _REGISTRY.get(name)


def timed_like(op_type: str) -> str:
    """The type whose analytic constants time ``op_type``: itself when built in, a custom type's ``like``."""
    t = _REGISTRY.get(op_type)
    return t.like or op_type if t is not None else op_type


def registered() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def custom_cost(op_type: str, config) -> LayerCost:
    """The registered cost of one layer; a failing or non-finite cost function is a ``ValueError`` naming the
    layer type and its plugin."""
    t = _REGISTRY.get(op_type)
    if t is None:
        raise ValueError(f"no cost formula for op_type {op_type!r} (not built in, not registered)")
    try:
        got = t.cost(config)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a user's function: any failure (exit too) in one line
        raise ValueError(f"the cost function of {t.described} failed: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None
    if not isinstance(got, LayerCost):
        raise ValueError(f"the cost function of {t.described} returned {type(got).__name__}, not a LayerCost")
    return got


def load_plugin(ref: str, base_dir: str = "") -> str | None:
    """Import a plugin that registers layer types: a ``.py`` path (relative to ``base_dir``) or a module name.
    Returns the file it ran (``None`` when this process had imported it already)."""
    if ref.endswith(".py"):
        path = ref if os.path.isabs(ref) else os.path.join(base_dir, ref)
        if not os.path.isfile(path):
            raise FileNotFoundError(path)
        name = "spindle_plugin_" + os.path.splitext(os.path.basename(path))[0]
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == os.path.abspath(path):
            return None
        spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        _LOADING.append(ref)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        finally:
            _LOADING.pop()
        return os.path.abspath(path)
    if ref in sys.modules:
        return None
    _LOADING.append(ref)
    try:
        module = importlib.import_module(ref)
    finally:
        _LOADING.pop()
    return getattr(module, "__file__", None) or ref
