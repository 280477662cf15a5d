"""What the planner needs to know about a user's ``MimoModel``, as plain data (pure Python, JSON that round-trips).

The torch side (:mod:`megatron_spindle.models.mimo_extract`) builds the user's model on the meta device and fills
these dataclasses; :mod:`.graph` turns them and the tasks into the planner's usual task graph. Nothing here needs
torch, so a description saved as JSON plans anywhere.

* :class:`Encoder`: one encoder of a modality. ``split``: a megatron.core model with one ``TransformerBlock`` (as
  ``CLIPViTModel``): its forward up to the block (``embed``), the block's layers (``layer`` x ``num_layers``) and,
  when something with weights runs after the block, the rest of its forward (``post``). Otherwise the whole encoder
  is one operator (``module``: a Hugging Face wrapper, plain torch), data-parallel only, its cost what the meta
  forward counted until ``spindle profile`` measures it.
* :class:`Projection`: the modality's input projection (``input_projections[0]``), costs per token.
* :class:`Language`: the ``GPTModel`` (embedding, decoder layers, final norm + output layer + loss).

Costs are per sample unless named per token: parameters (counted on the meta model), forward FLOPs (the meta
forward under ``torch.utils.flop_counter``, or the transformer-layer formulas of :mod:`..planner.workload.costs`)
and bytes kept for backward (the meta forward's saved tensors at 2 bytes per floating element: bf16).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from ..planner.workload.graph import LayerConfig

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Cost:
    """One operator's cost: its parameters, forward FLOPs and stashed bytes per sample."""

    params: int
    fwd_flops: float
    act_bytes: float


@dataclass(frozen=True, kw_only=True)
class Stream:
    """One forward keyword of an encoder: a float tensor of ``shape`` per sample."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Encoder:
    modality: str
    name: str
    cls: str
    """The encoder's class (``module.Class``), named in ``spindle plan``."""
    split: bool
    inputs: tuple[Stream, ...]
    tokens: int
    """Tokens per sample the encoder hands to the projection."""
    hidden: int
    trainable: bool = True
    layer: LayerConfig | None = None
    """One layer of its block (split only); ``seq_len`` is the block's tokens."""
    block: str = "decoder"
    """The attribute of its ``TransformerBlock`` (split only)."""
    num_layers: int = 0
    layer_params: int = 0
    embed: Cost | None = None
    post: Cost | None = None
    """The forward after the block (split only; None: only a layout change follows the block)."""
    module: Cost | None = None
    """The whole encoder as one operator (not split)."""
    note: str = ""
    """Why it is not split, said by ``spindle plan``."""

    @property
    def key(self) -> str:
        """The encoder's name in ``MimoModel.state_dict()`` (its operators' parameter key)."""
        return f"modality_submodules.{self.modality}.encoders.{self.name}"


@dataclass(frozen=True, kw_only=True)
class Projection:
    modality: str
    input_size: int
    hidden: int
    ffn_hidden: int
    params: int
    flops_per_token: float
    act_bytes_per_token: float
    tensor_parallel: bool = True
    trainable: bool = True

    @property
    def key(self) -> str:
        return f"modality_submodules.{self.modality}.input_projections.0"


@dataclass(frozen=True, kw_only=True)
class Modality:
    name: str
    encoder: Encoder
    projection: Projection | None
    special_token_id: int


@dataclass(frozen=True, kw_only=True)
class Language:
    vocab_size: int
    hidden: int
    max_sequence_length: int
    num_layers: int
    layer: LayerConfig
    """One decoder layer (``seq_len`` 0: each task sets its tokens)."""
    layer_params: int
    embed_params: int
    head_params: int
    position_embedding_type: str
    normalization: str = "LayerNorm"
    trainable: tuple[bool, bool, bool] = (True, True, True)
    """Whether the embedding, the decoder layers and the head (final norm + output layer) train."""


@dataclass(frozen=True, kw_only=True)
class MimoDescription:
    """A user's ``MimoModel`` as the planner sees it."""

    name: str
    """The provider (``MODULE:FUNCTION``)."""
    modalities: tuple[Modality, ...]
    """The modalities the tasks use."""
    language: Language
    special_tokens: tuple[tuple[str, int], ...] = ()
    """Every modality's special token id (``MimoModelConfig.special_token_ids``: text tokens avoid them all)."""

    def modality(self, name: str) -> Modality:
        return next(m for m in self.modalities if m.name == name)

    @property
    def special_token_ids(self) -> dict[str, int]:
        return {m.name: m.special_token_id for m in self.modalities}

    def notes(self) -> list[str]:
        """What ``spindle plan`` says about the model: each encoder that runs whole, and why."""
        return [f"{m.name}.{m.encoder.name} ({m.encoder.cls}): one MetaOp, data-parallel only ({m.encoder.note}); "
                f"timed by the FLOPs of its meta forward until `spindle profile --model-provider` measures it"
                for m in self.modalities if not m.encoder.split]

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **_plain(self)}

    @classmethod
    def from_json(cls, obj: Mapping) -> "MimoDescription":
        if obj.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"MIMO description schema_version {obj.get('schema_version')!r}, expected {SCHEMA_VERSION}")
        lang = dict(obj["language"])
        lang["layer"] = LayerConfig.from_json(lang["layer"])
        lang["trainable"] = tuple(lang["trainable"])
        mods = []
        for m in obj["modalities"]:
            e = dict(m["encoder"])
            e["inputs"] = tuple(Stream(name=s["name"], shape=tuple(s["shape"])) for s in e["inputs"])
            e["layer"] = LayerConfig.from_json(e["layer"]) if e.get("layer") is not None else None
            for part in ("embed", "post", "module"):
                e[part] = Cost(**e[part]) if e.get(part) is not None else None
            proj = Projection(**m["projection"]) if m.get("projection") is not None else None
            mods.append(Modality(name=m["name"], encoder=Encoder(**e), projection=proj,
                                 special_token_id=m["special_token_id"]))
        return cls(name=obj["name"], modalities=tuple(mods), language=Language(**lang),
                   special_tokens=tuple((k, v) for k, v in obj.get("special_tokens", ())))


def _plain(x):
    if isinstance(x, LayerConfig):
        return x.to_json()
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x
