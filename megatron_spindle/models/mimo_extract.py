"""A user's ``MimoModel``, built on the meta device, described for the planner (:mod:`..mimo.describe`).

Shapes come from the model itself: each ``TransformerConfig`` (width, heads, query groups, FFN, gated MLP, norm,
biases), each layer spec's attention mask (causal or not), ``CLIPViTModel``'s image and patch size, the
``GPTModel``'s vocabulary, ``max_sequence_length`` and position embedding, the projectors' sizes. What no
attribute says is measured by running the module's forward on meta tensors (one sample; nothing is allocated):

* an encoder's forward keywords: ``x`` ``[3, img_h, img_w]`` for ``CLIPViTModel``, else the tasks file's
  ``[inputs.<modality>.<encoder>]``;
* an encoder with one ``TransformerBlock`` child (a megatron.core model) is split (:mod:`.mimo_layers`): the
  forward stops where the block is called (:class:`.mimo_layers.BlockReached`), which gives the tokens and width
  the layers see; modules with weights that run after the block make the ``post`` operator. It stays whole when
  the block is called with a mask or other tensors (the layers would need them on other ranks) or its layer
  spec is not among its spec's params;
* FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over the forward; bytes kept for backward: the distinct
  storages of the tensors autograd saves, parameters left out, 2 bytes per floating element (bf16 training).
  Transformer layers use the formulas of :mod:`..planner.workload.costs` instead (flash attention's stash).

Every refusal is one line naming the model, the module and the value.
"""
from __future__ import annotations

import inspect

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import TransformerBlock
from torch.utils.flop_counter import FlopCounterMode

from ..mimo.describe import Cost, Encoder, Language, MimoDescription, Modality, Projection, Stream
from ..mimo.tasks import MimoTasks, TasksError
from ..planner.workload.graph import LayerConfig
from ..planner.workload.spec_layers import NAME_RE, NO_VALUE
from .mimo_build import block_name, encoder_spec, is_layer_spec
from .mimo_layers import BlockReached, replaced, replay, stop_at

POSITIONS = ("learned_absolute", "rope", "none")


def measure(module: torch.nn.Module, fn, *, until: type | None = None):
    """``(output, forward FLOPs, bytes saved for backward)`` of ``fn()`` on meta tensors (module docstring);
    an ``until`` exception ends the forward there and is the output."""
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            n = st.nbytes() // t.element_size()
            saved[st._cdata] = n * (2 if t.is_floating_point() else t.element_size())
        return t

    with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - only the ``until`` one is an answer
            if until is None or not isinstance(e, until):
                raise
            out = e
    return out, float(counter.get_total_flops()), float(sum(saved.values()))


def _count(module: torch.nn.Module, skip: torch.nn.Module | None = None) -> int:
    skipped = {id(p) for p in skip.parameters()} if skip is not None else set()
    return sum(p.numel() for p in module.parameters() if id(p) not in skipped)


def _trainable(module: torch.nn.Module, what: str, skip=None) -> bool:
    skipped = {id(p) for p in skip.parameters()} if skip is not None else set()
    flags = {p.requires_grad for p in module.parameters() if id(p) not in skipped}
    if len(flags) > 1:
        raise ValueError(f"{what} has trainable and frozen parameters: Spindle freezes whole modules "
                         f"(set requires_grad alike, or --spindle-freeze)")
    return flags != {False}


def layer_config(block: TransformerBlock, tokens: int, what: str) -> LayerConfig:
    """One layer of ``block`` as the planner's LayerConfig (``tokens`` per sample)."""
    c = block.config
    specs = block.submodules.layer_specs
    if getattr(c, "num_moe_experts", None):
        raise ValueError(f"{what}: mixture-of-experts layers (num_moe_experts {c.num_moe_experts}) are not costed by "
                         f"Spindle's planner yet")
    if any(s != specs[0] for s in specs[1:]):
        raise ValueError(f"{what}: its {len(specs)} layers have different specs; Spindle plans blocks of one layer spec")
    attn = getattr(specs[0].submodules, "self_attention", None) if specs else None
    mask = (getattr(attn, "params", None) or {}).get("attn_mask_type", AttnMaskType.padding)
    groups = c.num_query_groups if c.num_query_groups not in (None, c.num_attention_heads) else 0
    return LayerConfig(hidden=c.hidden_size, num_heads=c.num_attention_heads, ffn_hidden=c.ffn_hidden_size,
                       seq_len=tokens, num_query_groups=groups, causal=mask == AttnMaskType.causal,
                       swiglu=bool(c.gated_linear_unit), normalization="" if c.normalization == "LayerNorm" else
                       c.normalization, add_bias_linear=bool(c.add_bias_linear), add_qkv_bias=bool(c.add_qkv_bias))


def encoder_inputs(model, modality: str, name: str, enc, tasks: MimoTasks) -> tuple[Stream, ...]:
    given = tasks.inputs.get(modality, {}).get(name)
    if given:
        return tuple(Stream(name=k, shape=tuple(v)) for k, v in given.items())
    if isinstance(enc, CLIPViTModel):
        return (Stream(name="x", shape=(3, enc.img_h, enc.img_w)),)
    raise TasksError(tasks.file, f"inputs.{modality}.{name}", NO_VALUE,
                     f"missing: the forward keywords of {type(enc).__name__} and each one's per-sample shape, e.g. "
                     f"input_features = [80, 3000] (Spindle reads them off CLIPViTModel only)")


def _flat(out, what: str) -> tuple[int, int]:
    if isinstance(out, tuple):
        out = out[0]
    if out.dim() == 3:
        return out.shape[1], out.shape[2]
    if out.dim() == 2:
        return out.shape[0], out.shape[1]
    raise ValueError(f"{what} returned {list(out.shape)}: MIMO takes [b, s, h] or [b * s, h]")


def describe_encoder(mimo, modality: str, name: str, tasks: MimoTasks) -> Encoder:
    enc = mimo.modality_submodules[modality].encoders[name]
    what = f"modality {modality!r} encoder {name!r} ({type(enc).__name__})"
    inputs = encoder_inputs(mimo, modality, name, enc, tasks)
    args = {s.name: torch.zeros((1, *s.shape), device="meta") for s in inputs}
    cls = f"{type(enc).__module__}.{type(enc).__qualname__}"
    common = dict(modality=modality, name=name, cls=cls, inputs=inputs, trainable=_trainable(enc, what))
    attr = block_name(enc)
    spec = encoder_spec(mimo, modality, name)
    why = ("not a megatron.core model with one TransformerBlock" if attr is None else
           "its layer spec is not among its ModuleSpec's params"
           if not any(is_layer_spec(v) for v in (spec.params or {}).values()) else "")
    if not why:
        block = getattr(enc, attr)
        with stop_at(enc, attr):
            got, fwd, act = measure(enc, lambda: enc(**args), until=BlockReached)
        if not isinstance(got, BlockReached):
            raise ValueError(f"{what}: its forward never called its block {attr!r}")
        if got.extra:
            why = f"its block is called with {', '.join(got.extra)} (the layers would need them on other ranks)"
    if why:
        out, fwd, act = measure(enc, lambda: enc(**args))
        tokens, hidden = _flat(out, what)
        return Encoder(**common, split=False, tokens=tokens, hidden=hidden, note=why,
                       module=Cost(params=_count(enc), fwd_flops=fwd, act_bytes=act))
    tokens, hidden = got.hidden.shape[0], got.hidden.shape[2]
    embed = Cost(params=_count(enc, skip=block.layers), fwd_flops=fwd, act_bytes=act)
    after: list[torch.nn.Module] = []
    hooks = [m.register_forward_hook(lambda m, i, o: after.append(m) if replayed[0] else None)
             for m in enc.modules() if any(True for _ in m.parameters(recurse=False)) and m is not enc]
    replayed = [False]

    def run():
        h = torch.zeros_like(got.hidden)
        with replaced(enc, attr, replay(block, h, lambda: replayed.__setitem__(0, True))):
            return enc(**args)

    try:
        out, post_fwd, post_act = measure(enc, run)
    finally:
        for h in hooks:
            h.remove()
    out_tokens, out_hidden = _flat(out, what)
    post = None
    if after or block.final_layernorm is not None or (out_tokens, out_hidden) != (tokens, hidden):
        post = Cost(params=embed.params, fwd_flops=post_fwd, act_bytes=post_act)
    layer = layer_config(block, tokens, what)
    return Encoder(**common, split=True, tokens=out_tokens, hidden=out_hidden, layer=layer, block=attr,
                   num_layers=len(block.layers), layer_params=_count(block.layers[0]) if len(block.layers) else 0,
                   embed=embed, post=post)


def describe_projection(mimo, modality: str, encoder: Encoder) -> Projection | None:
    projs = mimo.modality_submodules[modality].input_projections
    if not len(projs):
        return None
    proj = projs[0]
    what = f"modality {modality!r} input projection ({type(proj).__name__})"
    x = torch.zeros((1, encoder.hidden), device="meta", requires_grad=True)
    out, fwd, act = measure(proj, lambda: proj(x))
    hidden = out.shape[-1]
    spec = mimo.mimo_config.modality_submodules_spec[modality].submodules["input_projections"][0]
    config = next((v for v in (spec.params or {}).values() if hasattr(v, "ffn_hidden_size")), None)
    tp = isinstance(spec.module, type) and "tp_group" in inspect.signature(spec.module).parameters
    return Projection(modality=modality, input_size=encoder.hidden, hidden=hidden,
                      ffn_hidden=getattr(config, "ffn_hidden_size", 0) or 0, params=_count(proj),
                      flops_per_token=fwd, act_bytes_per_token=act, tensor_parallel=tp,
                      trainable=_trainable(proj, what))


def describe_language(mimo) -> Language:
    lm = mimo.language_model
    what = f"the language model ({type(lm).__name__})"
    if not isinstance(lm, GPTModel):
        raise ValueError(f"{what}: Spindle plans a MimoModel whose language model is megatron.core's GPTModel")
    if lm.share_embeddings_and_output_weights:
        raise ValueError(f"{what}: share_embeddings_and_output_weights=True (one weight in the embedding and the "
                         f"output layer) is not supported yet; build it with share_embeddings_and_output_weights=False")
    if getattr(lm, "mtp_process", False):
        raise ValueError(f"{what}: multi-token prediction (mtp_block_spec) is not supported")
    if lm.position_embedding_type not in POSITIONS:
        raise ValueError(f"{what}: position_embedding_type {lm.position_embedding_type!r}; Spindle runs "
                         f"{', '.join(POSITIONS)}")
    if lm.config.sequence_parallel or lm.config.context_parallel_size > 1:
        raise ValueError(f"{what}: sequence or context parallelism in its config; the plan sets the parallelism")
    head = [lm.output_layer] + ([lm.decoder.final_layernorm] if lm.decoder.final_layernorm is not None else [])
    flags = (_trainable(lm.embedding, f"{what}'s embedding"), _trainable(lm.decoder.layers, f"{what}'s layers"),
             all(_trainable(m, f"{what}'s output layer and final norm") for m in head))
    return Language(vocab_size=lm.vocab_size, hidden=lm.config.hidden_size, max_sequence_length=lm.max_sequence_length,
                    num_layers=len(lm.decoder.layers), layer=layer_config(lm.decoder, 0, what),
                    layer_params=_count(lm.decoder.layers[0]), embed_params=_count(lm.embedding),
                    head_params=sum(_count(m) for m in head), position_embedding_type=lm.position_embedding_type,
                    normalization=lm.config.normalization, trainable=flags)


def describe(mimo, name: str, tasks: MimoTasks) -> MimoDescription:
    """The description of the modalities the tasks use and of the language model (module docstring)."""
    used = [m for m in mimo.modality_submodules if any(m in t.modalities for t in tasks.tasks)]
    mods = []
    for m in used:
        encoders = list(mimo.modality_submodules[m].encoders)
        if len(encoders) != 1:
            raise ValueError(f"modality {m!r} has {len(encoders)} encoders ({', '.join(encoders) or 'none'}): MIMO "
                             f"concatenates several encoders' outputs across the samples of a batch, which does not "
                             f"split by sample; Spindle plans one encoder per modality")
        for part in (m, encoders[0]):
            if not NAME_RE.match(part):
                raise ValueError(f"modality {m!r} encoder {encoders[0]!r}: names become operator names: ASCII "
                                 f"letters, digits, '_' and '-'")
        if m not in mimo.special_token_ids:
            raise ValueError(f"modality {m!r} has no special token id (MimoModelConfig.special_token_ids)")
        e = describe_encoder(mimo, m, encoders[0], tasks)
        p = describe_projection(mimo, m, e)
        mods.append(Modality(name=m, encoder=e, projection=p, special_token_id=int(mimo.special_token_ids[m])))
    lang = describe_language(mimo)
    for mod in mods:
        width = mod.projection.hidden if mod.projection else mod.encoder.hidden
        if width != lang.hidden:
            raise ValueError(f"modality {mod.name!r} hands the language model width {width}, not its hidden size "
                             f"{lang.hidden}")
    return MimoDescription(name=name, modalities=tuple(mods), language=lang,
                           special_tokens=tuple((k, int(v)) for k, v in mimo.special_token_ids.items()))
