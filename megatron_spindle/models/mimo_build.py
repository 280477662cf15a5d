"""A user's MIMO model provider, called as Megatron calls one, and the parts of its model built one key at a time.

* :func:`load_provider`: ``MODULE:FUNCTION`` -> the function; :func:`call_provider` calls it with the keywords
  Megatron-LM's ``get_model`` passes (``pre_process``, ``post_process``, and ``config``, ``pg_collection``,
  ``vp_stage`` where given and accepted) and checks that a ``MimoModel`` comes back. Every failure is one line
  naming the provider.
* :func:`single_process_groups`: megatron.core modules built without explicit groups take megatron's global
  parallel state (``ProcessGroupCollection.use_mpu_process_groups``); a provider run for planning or as the
  one-process reference has none, so while it runs, where megatron's state is not initialised, each group is
  this process alone.
* :func:`build_part`: the module behind one parameter key, from the user's own specs (their layer ``ModuleSpec``,
  local or TransformerEngine as they chose, their ``TransformerConfig``) with this slice's tensor-parallel group:
  ``<encoder>.<block>.layers.<i>`` / ``language_model.decoder.layers.<i>`` a layer of the block's spec (``layer_number``
  ``i + 1``); an encoder key the encoder built around an empty block; ``language_model.embedding`` the
  ``GPTModel``'s embedding (built with ``post_process=False``); ``language_model`` the ``GPTModel`` without
  embedding and layers (``pre_process=False``: final norm and output layer); a projection key the projector.
  Configs are copied with ``tensor_model_parallel_size`` the slice's, ``use_cpu_initialization=True`` (a shard
  then equals the slice of the whole weight, on every device) and the run's dtype.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import os
import sys
import warnings

import torch
from megatron.core import parallel_state
with warnings.catch_warnings():  # megatron.core warns when MIMO's config class is defined, in every process
    warnings.filterwarnings("ignore", message=r"MimoModelConfig is experimental")
    from megatron.core.models.mimo import MimoModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import BaseTransformerLayer

from .blocks import LocalGroup
from .megatron_state import ONE_RANK_DEFAULT

#: megatron.core's warnings on every MIMO construction and config copy (said once, at import, not per part).
_REPEATED = (r".* is experimental and still under active development", r"full scope is deprecated")


@contextlib.contextmanager
def quiet():
    """Building the parts of a MIMO model again and again: without megatron.core's repeated warnings."""
    with warnings.catch_warnings():
        for message in _REPEATED:
            warnings.filterwarnings("ignore", message=message)
        yield


def load_provider(ref: str):
    """``MODULE:FUNCTION`` -> the function (the module imported from ``sys.path``: ``PYTHONPATH`` and the current
    directory, as ``python -m`` would)."""
    module, _, name = ref.partition(":")
    if not module or not name or ":" in name:
        raise ValueError(f"model provider {ref!r}: must be MODULE:FUNCTION (e.g. examples.mimo.tiny_avlm:tiny_avlm)")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - the user's module: any failure in one line
        raise ValueError(f"model provider {ref!r}: cannot import module {module!r} ({type(e).__name__}: "
                         f"{' '.join(str(e).split())}; is it on PYTHONPATH?)") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"model provider {ref!r}: module {module!r} ({getattr(mod, '__file__', '')}) has no "
                         f"function {name!r}")
    return fn


def call_provider(fn, ref: str, **framework) -> MimoModel:
    """``fn`` called as Megatron calls a model provider: ``pre_process``/``post_process`` True, and each of
    ``framework`` (``config``, ``pg_collection``, ``vp_stage``) that the function accepts."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in {"pre_process": True, "post_process": True, **framework}.items()
              if k in params or takes_any}
    try:
        with quiet():
            model = fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's function: any failure in one line
        raise ValueError(f"model provider {ref!r} failed: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if isinstance(model, (list, tuple)) and len(model) == 1:
        model = model[0]
    if not isinstance(model, MimoModel):
        raise ValueError(f"model provider {ref!r} returned {type(model).__name__}, not a MimoModel "
                         f"(megatron.core.models.mimo)")
    return model


@contextlib.contextmanager
def single_process_groups():
    """While megatron's parallel state is not initialised, ``use_mpu_process_groups`` answers one-rank groups, and
    so does a module's missing ``tp_group`` (:data:`.megatron_state.ONE_RANK_DEFAULT`)."""
    original = ProcessGroupCollection.__dict__["use_mpu_process_groups"]

    def use_mpu_process_groups(cls, required_pgs=None):
        if parallel_state.model_parallel_is_initialized():
            return original.__func__(cls, required_pgs)
        names = required_pgs or [f.name for f in dataclasses.fields(cls)]
        one = LocalGroup()
        return cls(**{n: (None if n == "hcp" else one) for n in names})

    ProcessGroupCollection.use_mpu_process_groups = classmethod(use_mpu_process_groups)
    ONE_RANK_DEFAULT[0] = True
    try:
        yield
    finally:
        ProcessGroupCollection.use_mpu_process_groups = original
        ONE_RANK_DEFAULT[0] = False


def groups(tp_group) -> ProcessGroupCollection:
    """A slice's groups for megatron.core modules: ``tp_group``; every other group this rank alone: the
    runtime's one-rank group when ``tp_group`` is it (a slice at TP 1), else a :class:`.blocks.LocalGroup`
    stand-in (megatron asks a size-1 group only its size and rank; no layer creates a process group)."""
    one = tp_group if tp_group is not None and tp_group.size() == 1 else LocalGroup()
    names = [f.name for f in dataclasses.fields(ProcessGroupCollection)]
    given = {"tp": tp_group, "tp_cp": tp_group, "mp": tp_group}
    return ProcessGroupCollection(**{n: given.get(n, None if n == "hcp" else one) for n in names})


def core_config(config: TransformerConfig, tp_size: int, dtype: torch.dtype, *,
                attention: bool = True) -> TransformerConfig:
    """The user's config for one slice: its tensor-parallel size, CPU initialisation, the run's dtype. A module
    without attention (a projector) keeps a config whose heads megatron checks against the tensor-parallel size
    (Megatron-LM's MIMO examples give projectors one head): its heads are raised to a multiple of it."""
    heads = {}
    if not attention and config.num_attention_heads % tp_size:
        heads = dict(num_attention_heads=tp_size, num_query_groups=None, kv_channels=config.kv_channels)
    return dataclasses.replace(config, tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=1,
                               context_parallel_size=1, sequence_parallel=False, use_cpu_initialization=True,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, **heads)


def is_layer_spec(v) -> bool:
    """A layer spec a ``TransformerBlock`` takes: block submodules, or a ModuleSpec of a block or a layer."""
    return isinstance(v, TransformerBlockSubmodules) or (
        isinstance(v, ModuleSpec) and isinstance(v.module, type)
        and issubclass(v.module, (TransformerBlock, BaseTransformerLayer)))


def empty_block(block: TransformerBlock) -> TransformerBlockSubmodules:
    """The spec of ``block`` without its layers (its final norm kept)."""
    return TransformerBlockSubmodules(layer_specs=[], layer_norm=block.submodules.layer_norm)


def respec(spec: ModuleSpec, *, tp_size: int, dtype: torch.dtype, tp_group, layers=None, attention: bool = True,
           **params) -> ModuleSpec:
    """A copy of ``spec`` with every ``TransformerConfig`` in its params set for the slice (:func:`core_config`),
    a layer spec replaced by ``layers`` (when given), ``params`` set, and its groups (``pg_collection`` /
    ``tp_group``) where the module takes them."""
    out = copy.copy(spec)
    new = {}
    for k, v in (spec.params or {}).items():
        if isinstance(v, TransformerConfig):
            v = core_config(v, tp_size, dtype, attention=attention)
        elif layers is not None and is_layer_spec(v):
            v = layers
        new[k] = v
    accepted = inspect.signature(spec.module).parameters if isinstance(spec.module, type) else {}
    if "pg_collection" in accepted:
        new["pg_collection"] = groups(tp_group)
    if "tp_group" in accepted:
        new["tp_group"] = tp_group
    out.params = {**new, **params}
    return out


def encoder_spec(mimo: MimoModel, modality: str, encoder: str) -> ModuleSpec:
    return mimo.mimo_config.modality_submodules_spec[modality].submodules["encoders"][encoder]


def build_part(mimo: MimoModel, op_type: str, key: str, *, tp_group, tp_size: int, dtype: torch.dtype) -> torch.nn.Module:
    """The module behind parameter key ``key`` (module docstring); ``mimo`` is the provider's model (on the meta
    device: only its specs and its blocks' layer specs are read)."""
    with quiet():
        return _build_part(mimo, op_type, key, tp_group=tp_group, tp_size=tp_size, dtype=dtype)


def _build_part(mimo, op_type: str, key: str, *, tp_group, tp_size: int, dtype: torch.dtype) -> torch.nn.Module:
    parts = key.split(".")
    one = dict(tp_size=tp_size, dtype=dtype, tp_group=tp_group)
    if op_type == "mimo_layer":
        owner, i = key.rsplit(".layers.", 1)
        block = mimo.get_submodule(owner)
        config = core_config(block.config, tp_size, dtype)
        return build_module(block.submodules.layer_specs[int(i)], config=config, layer_number=int(i) + 1,
                            pg_collection=groups(tp_group))
    if op_type in ("mimo_encoder", "mimo_module"):
        _, modality, _, encoder = parts
        spec = encoder_spec(mimo, modality, encoder)
        if op_type == "mimo_module":
            return build_module(respec(spec, **one))
        block = block_of(mimo.get_submodule(key))
        return build_module(respec(spec, layers=empty_block(block), **one))
    if op_type == "mimo_projection":
        _, modality, _, index = parts
        spec = mimo.mimo_config.modality_submodules_spec[modality].submodules["input_projections"][int(index)]
        return build_module(respec(spec, attention=False, **one))
    lm = mimo.mimo_config.language_model_spec
    block = empty_block(mimo.language_model.decoder)
    if op_type == "mimo_lm_embed":
        return build_module(respec(lm, layers=block, pre_process=True, post_process=False, **one)).embedding
    if op_type == "mimo_lm_head":
        return build_module(respec(lm, layers=block, pre_process=False, post_process=True, **one))
    raise ValueError(f"no MIMO part for operator type {op_type!r} (key {key!r})")


def block_name(encoder: torch.nn.Module) -> str | None:
    """The attribute of the encoder's one ``TransformerBlock`` child (None: none, or several)."""
    blocks = [name for name, m in encoder.named_children() if isinstance(m, TransformerBlock)]
    return blocks[0] if len(blocks) == 1 else None


def block_of(encoder: torch.nn.Module) -> TransformerBlock | None:
    name = block_name(encoder)
    return getattr(encoder, name) if name else None
