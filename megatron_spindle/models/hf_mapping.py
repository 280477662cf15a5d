"""Which checkpoint tensors make each parameter of a Spindle layer, and whether a checkpoint fits a spec.

Pure Python: names, shapes and row ranges only (the reading is :mod:`megatron_spindle.models.pretrained`).

1. :func:`init_targets` resolves ``init`` (``--spindle-init MODULE=DIR`` and the spec's ``[model] init``) to
   one :class:`Target` per parameter key: the directory, the tower (by the component's embedding: a
   ``patch_embed`` is CLIP's vision tower, a ``token_embed`` its text tower), the part and the layer index.
   It also compares the spec's hyper-parameters with the checkpoint's ``config.json`` (:mod:`.hf_config`) and
   refuses a difference in one line naming the module, the key and both values.
2. :func:`sources` gives, for each parameter of the layer (megatron.core's names), a :class:`Src`: a
   checkpoint tensor (:class:`Part`, possibly a row range of it), a concatenation (:class:`Cat`) or zeros.
   megatron's fused QKV weight is, per query group, the group's query heads, then its key head, then its
   value head: ``Cat`` of row ranges of ``q_proj``, ``k_proj``, ``v_proj``. A gated MLP's ``linear_fc1`` is
   ``[gate; up]``. A Conv2d patch embedding is a linear layer over patches cut channel first (C, P, P).

Every :class:`Part` carries the shape the spec expects and the keys it follows from, so a checkpoint that
does not match is refused naming the tensor, its shape and the expectation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..planner.workload.graph import LayerConfig, TaskGraph
from ..planner.workload.spec_layers import match_fields
from .hf_config import Tower, towers


@dataclass(frozen=True)
class Part:
    """A checkpoint tensor ``name`` of full shape ``shape`` (the spec's expectation), rows ``rows`` of it."""

    name: str
    shape: tuple[int, ...]
    why: str
    """The spec keys the expected shape follows from."""
    rows: tuple[int, int] | None = None
    flatten: bool = False
    """Compare and use as ``[shape[0], rest]`` (a Conv2d kernel as a linear weight)."""

    @property
    def out_shape(self) -> tuple[int, ...]:
        head = (self.rows[1] - self.rows[0],) if self.rows else self.shape[:1]
        return head + tuple(self.shape[1:])


@dataclass(frozen=True)
class Cat:
    parts: tuple
    dim: int = 0

    @property
    def out_shape(self) -> tuple[int, ...]:
        first = list(self.parts[0].out_shape)
        first[self.dim] = sum(p.out_shape[self.dim] for p in self.parts)
        return tuple(first)


@dataclass(frozen=True)
class Zeros:
    shape: tuple[int, ...]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.shape


@dataclass(frozen=True)
class Target:
    """Where one parameter key's weights come from."""

    path: str
    tower: Tower
    part: str
    """``embed``, ``layers`` or ``head``."""
    index: int
    module: str
    """The spec module (``vision.layers``), named in errors."""


_PART = {"patch_embed": "embed", "token_embed": "embed", "transformer_layer": "layers", "pool_head": "head",
         "lm_head": "head"}
_EMBED_TOWER = {"patch_embed": "vision", "token_embed": "text"}


def _module_of(op) -> tuple[str, int]:
    """(spec module, layer index) of an operator, from its parameter key."""
    key = op.param_key
    if key.startswith(op.task + "."):  # shared = false: keys carry the task
        key = key[len(op.task) + 1:]
    head, _, last = key.rpartition(".")
    if op.op_type == "transformer_layer" and last.isdigit():
        return head, int(last)
    return key, 0


def _effective(c: LayerConfig, op_type: str) -> dict:
    """The spec keys a checkpoint fixes, with the layer type's defaults filled in."""
    if op_type == "transformer_layer":
        bias = (not c.swiglu) if c.add_bias_linear is None else c.add_bias_linear
        out = {"hidden_size": c.hidden, "num_attention_heads": c.num_heads, "ffn_hidden_size": c.ffn_hidden,
               "swiglu": c.swiglu, "causal": c.causal, "num_query_groups": c.num_query_groups or c.num_heads,
               "activation": c.activation or ("silu" if c.swiglu else "gelu"),
               "normalization": c.normalization or "LayerNorm", "layernorm_epsilon": c.norm_epsilon or 1e-5,
               "add_bias_linear": bias,
               "add_qkv_bias": (c.swiglu or bias) if c.add_qkv_bias is None else c.add_qkv_bias,
               "position_embedding_type": c.position_embedding_type or "none"}
        if out["position_embedding_type"] == "rope":
            out["rotary_base"] = c.rotary_base or 10000.0
        return out
    if op_type == "patch_embed":
        out = {"hidden_size": c.hidden, "seq_length": c.seq_len, "input_dim": c.input_dim, "norm": c.embed_norm}
        if c.embed_norm:
            out.update(normalization=c.normalization or "LayerNorm", layernorm_epsilon=c.norm_epsilon or 1e-5)
        return out
    if op_type == "token_embed":
        return {"hidden_size": c.hidden, "vocab_size": c.vocab_size,
                "position_embedding_type": c.position_embedding_type or "learned_absolute"}
    if op_type == "pool_head":
        return {"hidden_size": c.hidden, "pooling": c.pooling, "proj_dim": c.proj_dim,
                "normalization": c.normalization or "LayerNorm", "layernorm_epsilon": c.norm_epsilon or 1e-5}
    return {"hidden_size": c.hidden, "vocab_size": c.vocab_size, "normalization": c.normalization or "LayerNorm",
            "layernorm_epsilon": c.norm_epsilon or 1e-5}


def _expected(tower: Tower, part: str, op_type: str) -> dict:
    keys = dict(tower.modules[part])
    c = LayerConfig(hidden=keys.get("hidden_size", 0), num_heads=keys.get("num_attention_heads", 0),
                    ffn_hidden=keys.get("ffn_hidden_size", 0), vocab_size=keys.get("vocab_size", 0),
                    proj_dim=keys.get("proj_dim", 0), pooling=keys.get("pooling", ""),
                    causal=keys.get("causal", False), swiglu=keys.get("swiglu", False),
                    seq_len=keys.get("seq_length", 0), input_dim=keys.get("input_dim", 0),
                    **match_fields(keys["type"], keys))
    out = _effective(c, op_type)
    if keys["type"] == "pool_head" and not tower.projection:
        out.pop("proj_dim")  # the head's projection is not in the checkpoint: any width
    if "hidden_size" not in keys:
        out.pop("hidden_size", None)
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def init_targets(graph: TaskGraph, init: dict[str, str], *, flag: str = "--spindle-init") -> dict[str, Target]:
    """``{param_key: Target}`` for every operator under an ``init`` entry; checks the checkpoints' configs
    against the spec. Raises ``ValueError`` with one line on a bad name, directory or mismatch."""
    out: dict[str, Target] = {}
    cache: dict[str, list[Tower]] = {}
    ops = [op for op in graph.operators if op.param_key]
    modules = {_module_of(op)[0] for op in ops}
    for sel, path in init.items():
        if not any(m == sel or m.startswith(sel + ".") for m in modules):
            raise ValueError(f"{flag} {sel}={path}: no module {sel!r} with weights in model {graph.model!r}; "
                             f"modules: {', '.join(sorted(modules))}")
        if path not in cache:
            cache[path] = towers(path)
    layers_of: dict[tuple[str, str], set[int]] = {}
    for op in ops:
        module, index = _module_of(op)
        chosen = max((s for s in init if module == s or module.startswith(s + ".")), key=len, default=None)
        if chosen is None:
            continue
        path = init[chosen]
        where = f"{flag} {chosen}={path}: module {module} ({op.op_type})"
        ts = cache[path]
        if len(ts) > 1:
            component = module.split(".")[0]
            kinds = {o.op_type for o in ops if _module_of(o)[0].split(".")[0] == component}
            names = {_EMBED_TOWER[k] for k in kinds if k in _EMBED_TOWER}
            if len(names) != 1:
                raise ValueError(f"{where}: {path} holds towers {', '.join(t.name for t in ts)}; component "
                                 f"{component!r} needs exactly one patch_embed (vision) or token_embed (text) "
                                 f"to tell which")
            ts = [t for t in ts if t.name in names]
        tower, part = ts[0], _PART.get(op.op_type)
        if part is None or tower.modules[part]["type"] != op.op_type:
            have = ", ".join(f"{m['type']}" for m in tower.modules.values())
            raise ValueError(f"{where}: tower {tower.name} of {path} has no {op.op_type} (it has {have})")
        want, got = _expected(tower, part, op.op_type), _effective(op.layer, op.op_type)
        for key, v in want.items():
            if key in got and not _same(got[key], v):
                raise ValueError(f"{where}: {key} = {got[key]!r} in the spec, {v!r} in {path}/config.json "
                                 f"(`spindle hf spec {path}` prints the matching modules)")
        out[op.param_key] = Target(path=path, tower=tower, part=part, index=index, module=module)
        if part == "layers":
            layers_of.setdefault((module, path), set()).add(index)
    for (module, path), idx in layers_of.items():
        n = next(t for t in out.values() if t.module == module).tower.modules["layers"]["num_layers"]
        if len(idx) != n:
            raise ValueError(f"{flag}: module {module}: num_layers = {len(idx)} in the spec, {n} in "
                             f"{path}/config.json (`spindle hf spec {path}` prints the matching modules)")
    return out


# -- the tensors of each parameter -------------------------------------------------------------------------
_CLIP_LAYER = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj",
               "n1": "layer_norm1", "n2": "layer_norm2", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
_DECODER_LAYER = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                  "n1": "input_layernorm", "n2": "post_attention_layernorm", "gate": "mlp.gate_proj",
                  "up": "mlp.up_proj", "fc2": "mlp.down_proj"}


def _norm(out: dict, ours: str, theirs: str, c: LayerConfig, why: str) -> None:
    out[f"{ours}.weight"] = Part(f"{theirs}.weight", (c.hidden,), why)
    if (c.normalization or "LayerNorm") == "LayerNorm":
        out[f"{ours}.bias"] = Part(f"{theirs}.bias", (c.hidden,), why)


def _layer_sources(t: Target, c: LayerConfig) -> dict:
    decoder = t.tower.kind == "decoder"
    n = _DECODER_LAYER if decoder else _CLIP_LAYER
    base = f"{t.tower.prefix}{'' if decoder else 'encoder.'}layers.{t.index}."
    h, heads, f = c.hidden, c.num_heads, c.ffn_hidden
    groups = c.num_query_groups or heads
    hn, qpg = h // heads, heads // groups
    e = _effective(c, "transformer_layer")
    why = f"{t.module}: hidden_size {h}, num_attention_heads {heads}, num_query_groups {groups}"
    why_mlp = f"{t.module}: hidden_size {h}, ffn_hidden_size {f}"

    def qkv(kind: str) -> Cat:
        tail = (h,) if kind == "weight" else ()
        parts = []
        for g in range(groups):
            parts += [Part(f"{base}{n['q']}.{kind}", (heads * hn, *tail), why, rows=(g * qpg * hn, (g + 1) * qpg * hn)),
                      Part(f"{base}{n['k']}.{kind}", (groups * hn, *tail), why, rows=(g * hn, (g + 1) * hn)),
                      Part(f"{base}{n['v']}.{kind}", (groups * hn, *tail), why, rows=(g * hn, (g + 1) * hn))]
        return Cat(tuple(parts))

    def fc1(kind: str):
        tail = (h,) if kind == "weight" else ()
        if c.swiglu:
            return Cat((Part(f"{base}{n['gate']}.{kind}", (f, *tail), why_mlp),
                        Part(f"{base}{n['up']}.{kind}", (f, *tail), why_mlp)))
        return Part(f"{base}{n['fc1']}.{kind}", (f, *tail), why_mlp)

    out = {"self_attention.linear_qkv.weight": qkv("weight"),
           "self_attention.linear_proj.weight": Part(f"{base}{n['o']}.weight", (h, h), why),
           "mlp.linear_fc1.weight": fc1("weight"),
           "mlp.linear_fc2.weight": Part(f"{base}{n['fc2']}.weight", (h, f), why_mlp)}
    if e["add_qkv_bias"]:
        out["self_attention.linear_qkv.bias"] = qkv("bias")
    if e["add_bias_linear"]:
        out["self_attention.linear_proj.bias"] = Part(f"{base}{n['o']}.bias", (h,), why)
        out["mlp.linear_fc1.bias"] = fc1("bias")
        out["mlp.linear_fc2.bias"] = Part(f"{base}{n['fc2']}.bias", (h,), why_mlp)
    _norm(out, "input_layernorm", base + n["n1"], c, f"{t.module}: hidden_size {h}")
    _norm(out, "pre_mlp_layernorm", base + n["n2"], c, f"{t.module}: hidden_size {h}")
    return out


def sources(t: Target, c: LayerConfig, op_type: str, rows: int = 0) -> dict:
    """``{parameter name: Src or None}`` for a layer of type ``op_type`` with config ``c`` (None: not in the
    checkpoint, the parameter keeps its initialisation). ``rows``: rows of the layer's position table."""
    if op_type == "transformer_layer":
        return _layer_sources(t, c)
    p, h, tw = t.tower.prefix, c.hidden, t.tower
    why = f"{t.module}: hidden_size {h}"
    out: dict = {}
    if op_type == "patch_embed":
        e = f"{p}embeddings."
        out = {"proj.weight": Part(f"{e}patch_embedding.weight", (h, c.input_dim),
                                   f"{t.module}: hidden_size {h}, input_dim {c.input_dim}", flatten=True),
               "proj.bias": Zeros((h,)),  # a Conv2d without bias
               "cls_token": Part(f"{e}class_embedding", (h,), why),
               "positions": Part(f"{e}position_embedding.weight", (c.seq_len, h),
                                 f"{t.module}: seq_length {c.seq_len}, hidden_size {h}", rows=(0, rows or c.seq_len))}
        if c.embed_norm:
            _norm(out, "norm", f"{p}pre_layrnorm", c, why)
    elif op_type == "token_embed":
        vocab = f"{t.module}: vocab_size {c.vocab_size}, hidden_size {h}"
        if tw.kind == "decoder":
            out = {"word.weight": Part(f"{p}embed_tokens.weight", (c.vocab_size, h), vocab)}
        else:
            table = tw.modules["embed"]["seq_length"]
            out = {"word.weight": Part(f"{p}embeddings.token_embedding.weight", (c.vocab_size, h), vocab),
                   "positions": Part(f"{p}embeddings.position_embedding.weight", (table, h),
                                     f"{t.module}: at most {table} positions (max_position_embeddings), "
                                     f"hidden_size {h}", rows=(0, rows or c.seq_len))}
    elif op_type == "pool_head":
        _norm(out, "norm", f"{p}{'post_layernorm' if tw.name == 'vision' else 'final_layer_norm'}", c, why)
        out["proj.weight"] = (Part(tw.projection, (c.proj_dim, h), f"{t.module}: proj_dim {c.proj_dim}, hidden_size {h}")
                              if tw.projection else None)
    elif op_type == "lm_head":
        _norm(out, "norm", f"{p}norm", c, why)
        out["output.weight"] = Part(f"{p}embed_tokens.weight" if tw.tied_head else "lm_head.weight",
                                    (c.vocab_size, h), f"{t.module}: vocab_size {c.vocab_size}, hidden_size {h}")
    return out
