"""A Hugging Face model directory (``config.json`` + safetensors) as Spindle spec modules. Pure Python.

A directory holds one or two **towers**, each a stack of modules in Spindle's spec (docs/model_spec.md):

* ``clip`` (``CLIPModel``): the ``vision`` tower (``patch_embed`` with CLIP's ``pre_layrnorm`` as its norm,
  ``transformer_layer`` x N with ``quick_gelu``, ``pool_head`` = ``post_layernorm`` + ``visual_projection``,
  class-token pooling) and the ``text`` tower (``token_embed`` with learned positions, causal layers,
  ``pool_head`` = ``final_layer_norm`` + ``text_projection``, pooled at the last token, which must be EOS);
* ``clip_vision_model`` / ``clip_text_model`` (``CLIPVisionModel``, ``CLIPTextModel``, ``...WithProjection``):
  one of those towers; without a projection in the checkpoint the head's projection keeps its initialisation;
* ``llama`` / ``qwen2`` (``LlamaForCausalLM``, ``Qwen2ForCausalLM``): the ``llm`` tower (``token_embed``
  without a position table, ``transformer_layer`` x N with RMSNorm, SwiGLU, grouped-query attention and RoPE,
  ``lm_head`` = ``model.norm`` + ``lm_head``; a tied head starts from the embedding).

What Spindle cannot represent faithfully is refused in one line naming the config key (RoPE scaling, a
head dimension other than hidden / heads, sliding windows, other activations). Errors are ``ValueError``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

#: config.json ``model_type`` -> the towers it holds
FAMILIES = {"clip": ("vision", "text"), "clip_vision_model": ("vision",), "clip_text_model": ("text",),
            "llama": ("llm",), "qwen2": ("llm",)}
_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "silu": "silu", "swish": "silu"}
_PROJECTED = {"CLIPModel", "CLIPVisionModelWithProjection", "CLIPTextModelWithProjection"}


@dataclass(frozen=True)
class Tower:
    """One tower of a checkpoint: its name, Hugging Face name prefix and the spec modules that match it."""

    name: str
    """``vision``, ``text`` or ``llm``."""
    kind: str
    """``clip_vision``, ``clip_text`` or ``decoder``: which name mapping applies (:mod:`.hf_mapping`)."""
    prefix: str
    """Prefix of the tower's tensor names (``vision_model.``, ``text_model.``, ``model.``)."""
    modules: dict = field(default_factory=dict)
    """Spec module part (``embed``, ``layers``, ``head``) -> its keys, in order."""
    projection: str = ""
    """Name of the head's projection tensor, or "" when the checkpoint has none."""
    tied_head: bool = False
    """The LM head shares the embedding's tensor (``tie_word_embeddings``)."""


def read_config(path: str) -> dict:
    """``config.json`` of a model directory, checked to be a family Spindle maps."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory (a Hugging Face model directory: config.json and "
                         f"*.safetensors, made by save_pretrained)")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path!r} has no config.json (a Hugging Face model directory: config.json and "
                         f"*.safetensors, made by save_pretrained)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path}: not readable JSON: {e}") from None
    if cfg.get("model_type") not in FAMILIES:
        raise ValueError(f"{cfg_path}: model_type {cfg.get('model_type')!r} is not supported; Spindle maps "
                         f"{', '.join(FAMILIES)}")
    return cfg


def _need(cfg_path: str, ok: bool, key: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"{cfg_path}: {key} = {value!r}: {why}")


def _activation(where: str, key: str, value) -> str:
    _need(where, value in _ACTIVATIONS, key, value, f"no matching activation (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[value]


def _clip_towers(path: str, cfg: dict) -> list[Tower]:
    where = os.path.join(path, "config.json")
    kind = cfg["model_type"]
    arch = set(cfg.get("architectures") or ())
    projected = bool(arch & _PROJECTED) or (kind == "clip" and not arch)
    out = []
    for name in FAMILIES[kind]:
        sub = cfg.get(f"{name}_config", {}) if kind == "clip" else cfg
        g = lambda k, d=None: sub.get(k, d)  # noqa: E731
        h, heads = g("hidden_size", 768 if name == "vision" else 512), g("num_attention_heads", 12 if name == "vision" else 8)
        eps = float(g("layer_norm_eps", 1e-5))
        layers = {"type": "transformer_layer", "num_layers": g("num_hidden_layers", 12), "hidden_size": h,
                  "num_attention_heads": heads, "ffn_hidden_size": g("intermediate_size", 3072 if name == "vision" else 2048),
                  "activation": _activation(where, f"{name}_config.hidden_act", g("hidden_act", "quick_gelu")),
                  "layernorm_epsilon": eps}
        proj_dim = cfg.get("projection_dim", sub.get("projection_dim", 512))
        if name == "vision":
            patch, image = g("patch_size", 32), g("image_size", 224)
            embed = {"type": "patch_embed", "hidden_size": h, "seq_length": (image // patch) ** 2 + 1,
                     "input_dim": g("num_channels", 3) * patch * patch, "norm": True, "layernorm_epsilon": eps}
            head = {"type": "pool_head", "proj_dim": proj_dim, "pooling": "cls", "layernorm_epsilon": eps}
            proj = "visual_projection.weight"
        else:
            embed = {"type": "token_embed", "hidden_size": h, "vocab_size": g("vocab_size", 49408),
                     "seq_length": g("max_position_embeddings", 77)}
            layers["causal"] = True
            head = {"type": "pool_head", "proj_dim": proj_dim, "pooling": "eos", "layernorm_epsilon": eps}
            proj = "text_projection.weight"
        out.append(Tower(name=name, kind=f"clip_{name}", prefix=f"{name}_model.",
                         modules={"embed": embed, "layers": layers, "head": head}, projection=proj if projected else ""))
    return out


def _rope_base(where: str, cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    _need(where, kind in ("default", None), "rope_type", kind, "only plain RoPE is supported (no scaling)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _decoder_tower(path: str, cfg: dict) -> Tower:
    where = os.path.join(path, "config.json")
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    _need(where, head_dim * heads == h, "head_dim", head_dim, f"Spindle's layers need head_dim = hidden_size / "
                                                             f"num_attention_heads = {h // heads}")
    _need(where, not cfg.get("use_sliding_window"), "use_sliding_window", True, "sliding-window attention is not supported")
    if cfg["model_type"] == "qwen2":  # q, k, v carry biases; o_proj and the MLP none
        bias, qkv_bias = False, True
    else:
        attn, mlp = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
        _need(where, attn == mlp, "mlp_bias", mlp, f"differs from attention_bias = {attn}: megatron's "
                                                   f"add_bias_linear covers both")
        bias = qkv_bias = attn
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    layers = {"type": "transformer_layer", "num_layers": cfg["num_hidden_layers"], "hidden_size": h,
              "num_attention_heads": heads, "ffn_hidden_size": cfg["intermediate_size"], "swiglu": True,
              "causal": True, "normalization": "RMSNorm", "layernorm_epsilon": eps,
              "position_embedding_type": "rope", "rotary_base": _rope_base(where, cfg)}
    if groups != heads:
        layers["num_query_groups"] = groups
    act = _activation(where, "hidden_act", cfg.get("hidden_act", "silu"))
    if act != "silu":
        layers["activation"] = act
    if bias:
        layers["add_bias_linear"] = True
    if not qkv_bias:
        layers["add_qkv_bias"] = False
    embed = {"type": "token_embed", "hidden_size": h, "vocab_size": cfg["vocab_size"],
             "position_embedding_type": "none"}
    head = {"type": "lm_head", "vocab_size": cfg["vocab_size"], "normalization": "RMSNorm", "layernorm_epsilon": eps}
    return Tower(name="llm", kind="decoder", prefix="model.", modules={"embed": embed, "layers": layers, "head": head},
                 tied_head=bool(cfg.get("tie_word_embeddings", False)))


def towers(path: str) -> list[Tower]:
    """The towers of the model in ``path`` with the spec modules that match them."""
    cfg = read_config(path)
    if cfg["model_type"].startswith("clip"):
        return _clip_towers(path, cfg)
    return [_decoder_tower(path, cfg)]


def temperature(path: str, logit_scale: float | None = None) -> float:
    """CLIP's contrastive temperature, ``1 / exp(logit_scale)`` (the trained value when given, else the
    config's initial one)."""
    cfg = read_config(path)
    scale = logit_scale if logit_scale is not None else float(cfg.get("logit_scale_init_value", 2.6592))
    return 1.0 / math.exp(scale)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def modules_toml(ts: list[Tower]) -> str:
    """``[modules.<tower>.<part>]`` tables for ``ts``."""
    lines = []
    for t in ts:
        for part, keys in t.modules.items():
            lines.append(f"[modules.{t.name}.{part}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
        lines.append("")
    return "\n".join(lines)


def model_spec_toml(path: str, ts: list[Tower], *, name: str, batch: int = 8, seq_length: int = 64,
                    temp: float = 0.07) -> str:
    """A complete spec for the towers ``ts`` of ``path``: one task that trains them, ``init`` set to ``path``
    (absolute).

    Two CLIP towers: image-text contrastive; one CLIP tower: the tower against itself (a check, not a
    useful objective); a decoder: next-token prediction over ``seq_length`` tokens.
    """
    by = {t.name: t for t in ts}
    text = by.get("text")
    if text is not None:  # a learned position table: at most the checkpoint's positions
        seq_length = min(seq_length, text.modules["embed"]["seq_length"])
        embed = {**text.modules["embed"], "seq_length": seq_length}
        text = by["text"] = dataclasses.replace(text, modules={**text.modules, "embed": embed})
        ts = list(by.values())
    where = os.path.abspath(path)  # a spec's relative paths are taken from its own folder, wherever it is written
    init = ", ".join(f"{t.name} = {json.dumps(where)}" for t in ts)
    out = [f"# made by `spindle hf spec {path} --model-spec`", "[model]", f"name = {json.dumps(name)}",
           f"batch = {batch}", f"init = {{ {init} }}", "", modules_toml(ts)]
    if "llm" in by:
        out += ["[tasks.language]",
                f"tokens = {{ text = {seq_length}, labels = {seq_length} }}",
                'flow = ["data:text -> llm.embed -> llm.layers", "llm.layers + data:labels -> llm.head"]']
        return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"
    out += ["[modules.loss]", 'type = "contrastive_loss"', f"temperature = {temp!r}", ""]
    heads = [f"{t}.head" for t in by]
    flows = []
    if "vision" in by:
        flows.append('"data:vision -> vision.embed -> vision.layers -> vision.head"')
    if text is not None:
        flows.append('"data:text -> text.embed -> text.layers -> text.head"')
    pair = " + ".join(heads if len(heads) == 2 else heads * 2)
    task = "image-text" if len(heads) == 2 else f"{heads[0].split('.')[0]}-check"
    out += [f"[tasks.{task}]"] + ([f"tokens = {{ text = {seq_length} }}"] if text is not None else [])
    out.append(f"flow = [{', '.join(flows)}, \"{pair} -> loss\"]")
    return "\n".join(out) + "\n"
