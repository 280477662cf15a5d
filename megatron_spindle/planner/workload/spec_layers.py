"""The layer types of a model spec: their keys, and how a module applied in a task becomes operators.

:func:`module_operators` infers each layer's :class:`~megatron_spindle.planner.workload.graph.LayerConfig` from the
module's hyper-parameters and the shapes of its inputs (:class:`_Out`: tokens and width, a pooled vector, or
a loss), checks that the shapes chain, and emits the operators with their costs (:mod:`.costs`, or a custom
type's registered cost function). :func:`check_module` checks one module's keys and values. The spec file
format is in ``docs/model_spec.md``; :mod:`.spec` reads files and walks the tasks' flows.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ...log import get_logger
from ..limits import MAX_NAME, SPEC_LIMITS
from . import costs
from .graph import DATA_PREFIX, LayerConfig, Operator, data_input
from .layer_types import OP_TYPES
from .layer_types import custom_layer_type, registered

log = get_logger(__name__)

#: A task name, and each dot-separated part of a module name: they become slice names that parse back.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


class SpecError(ValueError):
    """A bad model spec: one line naming the file, the key and the value."""

    def __init__(self, file: str, key: str, value: Any, problem: str) -> None:
        self.file, self.key, self.value, self.problem = file, key, value, problem
        shown = f" = {value!r}" if value is not NO_VALUE else ""
        super().__init__(f"{file}: {key}{shown}: {problem}")


NO_VALUE = object()

# -- per layer type: allowed keys, required keys ------------------------------------------------------
_COMMON = {"type", "share", "shared", "tensor_parallel", "trainable"}
#: megatron.core's names for what a pretrained checkpoint needs (docs/model_spec.md, "Matching a checkpoint")
_LAYER_MATCH = {"num_query_groups", "activation", "normalization", "layernorm_epsilon", "add_bias_linear",
                "add_qkv_bias", "position_embedding_type", "rotary_base"}
_KEYS: dict[str, tuple[set[str], set[str]]] = {
    # type: (required, optional)
    "patch_embed": ({"hidden_size", "seq_length", "input_dim"}, {"norm", "normalization", "layernorm_epsilon"}),
    "token_embed": ({"hidden_size", "vocab_size"}, {"seq_length", "position_embedding_type"}),
    "transformer_layer": ({"hidden_size", "num_attention_heads", "num_layers"},
                          {"ffn_hidden_size", "swiglu", "causal"} | _LAYER_MATCH),
    "decoder_layer": ({"hidden_size", "num_attention_heads", "num_layers"},
                      {"ffn_hidden_size", "swiglu", "causal"}),
    "pool_head": ({"proj_dim", "pooling"}, {"hidden_size", "normalization", "layernorm_epsilon"}),
    "contrastive_loss": ({"temperature"}, set()),
    "cross_attn_adapter": ({"hidden_size", "num_attention_heads", "seq_length"}, set()),
    "linear_adapter": ({"hidden_size"}, {"pool_factor"}),
    "lm_head": ({"vocab_size"}, {"hidden_size", "normalization", "layernorm_epsilon"}),
}
_CUSTOM_KEYS = ({"hidden_size"}, {"seq_length", "num_layers", "num_attention_heads", "ffn_hidden_size",
                                  "swiglu", "causal"})
_INT_KEYS = {"hidden_size", "seq_length", "input_dim", "vocab_size", "num_attention_heads", "num_layers",
             "ffn_hidden_size", "proj_dim", "pool_factor", "num_query_groups"}
_BOOL_KEYS = {"swiglu", "causal", "shared", "tensor_parallel", "norm", "add_bias_linear", "add_qkv_bias",
              "trainable"}
_CHOICES = {"activation": ("gelu", "quick_gelu", "silu"), "normalization": ("LayerNorm", "RMSNorm")}
#: position_embedding_type per layer type: the first is the default
_POSITIONS = {"token_embed": ("learned_absolute", "none"), "transformer_layer": ("none", "rope")}
_POOLING = ("cls", "eos", "mean")
#: Types whose layers accept tp > 1 (models/layers.py TP_OP_TYPES); the others are tp = 1 only.
_TP_TYPES = {"transformer_layer", "decoder_layer", "cross_attn_adapter", "linear_adapter", "token_embed",
             "lm_head"}
NO_PARAMS = {"contrastive_loss"}

@dataclass(frozen=True)
class _Out:
    """What an operator hands on: ``seq`` tokens of width ``width`` (plus ``carried`` memory tokens after
    them, for a decoder layer), or a pooled vector (``seq == 0``), or a loss."""

    seq: int
    width: int
    carried: int = 0
    loss: bool = False

    @property
    def tokens(self) -> int:
        return self.seq + self.carried


def module_operators(file: str, task: str, name: str, mod: dict, srcs: list, last_op: dict, tokens: dict,
                     batch: int, key: str, line: str) -> tuple[list[Operator], _Out]:
    """The operators of module ``name`` (its keys ``mod``) applied in ``task``, and what they hand on.

    ``srcs`` are its inputs in order, ``(name, _Out)`` for a module output and ``(data:<stream>, None)`` for
    a data stream; ``last_op`` maps a module that ran to its last operator; ``tokens`` the task's stream
    lengths; ``key``/``line`` the flow line, named in errors.
    """
    t = mod["type"]
    custom = custom_layer_type(t)
    data = [s[len(DATA_PREFIX):] for s, o in srcs if o is None]
    acts = [o for s, o in srcs if o is not None]
    act_names = [s for s, o in srcs if o is not None]
    h = mod.get("hidden_size", 0)

    def bad(problem):
        return SpecError(file, key, line, f"module {name!r} ({t}): {problem}")

    def need(n_data, n_acts):
        if len(data) != n_data or len(acts) != n_acts:
            raise bad(f"takes {n_acts} module input(s) and {n_data} data stream(s), got "
                      f"{act_names + ['data:' + d for d in data]}")

    def seqs():
        for s, o in zip(act_names, acts):
            if o.loss or o.seq == 0:
                raise bad(f"input {s!r} is not a token sequence")
            if o.width != h:
                raise bad(f"hidden_size {h} does not match the width {o.width} of input {s!r}")

    def stream_len(stream, fallback=0):
        n = tokens.get(stream, fallback)
        if not n:
            raise SpecError(file, f"tasks.{task}.tokens.{stream}", NO_VALUE,
                            f"missing: the length of token stream {stream!r} (read by {name!r})")
        return n

    tp_ok = t in _TP_TYPES or (custom is not None and custom.tensor_parallel)
    tp = bool(mod.get("tensor_parallel", tp_ok))
    if tp and not tp_ok:
        raise bad("tensor_parallel = true, but this layer type runs on tp = 1 only")
    splittable = t != "contrastive_loss"
    if t == "patch_embed":
        need(1, 0)
        cfg = LayerConfig(hidden=h, seq_len=mod["seq_length"], input_dim=mod["input_dim"], **match_fields(t, mod))
        out = _Out(mod["seq_length"], h)
    elif t == "token_embed":
        need(1, 0)
        n = stream_len(data[0], mod.get("seq_length", 0))
        cfg = LayerConfig(hidden=h, seq_len=n, vocab_size=mod["vocab_size"], **match_fields(t, mod))
        out = _Out(n, h)
    elif t in ("transformer_layer", "decoder_layer"):
        if t == "decoder_layer":
            if len(acts) < 2 or data:
                raise bad(f"takes the target then the memory (2 or more module inputs), got {act_names}")
        elif not acts or data:
            need(0, max(1, len(acts)))
        seqs()
        ffn = mod.get("ffn_hidden_size", 4 * h)
        common = dict(hidden=h, num_heads=mod["num_attention_heads"], ffn_hidden=ffn,
                      causal=mod.get("causal", False), swiglu=mod.get("swiglu", False), **match_fields(t, mod))
        if t == "decoder_layer":
            memory = sum(o.tokens for o in acts[1:])
            cfg = LayerConfig(seq_len=acts[0].seq, memory_seq_len=memory, **common)
            out = _Out(acts[0].seq, h, carried=memory)
        else:
            n = sum(o.tokens for o in acts)
            cfg = LayerConfig(seq_len=n, memory_seq_len=0, **common)
            out = _Out(n, h)
    elif t == "pool_head":
        need(0, 1)
        h = mod.get("hidden_size", acts[0].width)
        seqs()
        cfg = LayerConfig(hidden=h, seq_len=acts[0].tokens, proj_dim=mod["proj_dim"], pooling=mod["pooling"],
                          **match_fields(t, mod))
        out = _Out(0, mod["proj_dim"])
    elif t == "contrastive_loss":
        need(0, 2)
        a, b = acts
        if a.seq or b.seq or a.loss or b.loss or a.width != b.width:
            raise bad(f"needs two pooled embeddings of one width (pool_head outputs), got "
                      f"{act_names[0]!r} ({_describe(a)}) and {act_names[1]!r} ({_describe(b)})")
        cfg = LayerConfig(hidden=a.width, proj_dim=a.width, temperature=float(mod["temperature"]))
        out = _Out(0, 0, loss=True)
    elif t == "cross_attn_adapter":
        need(0, 1)
        if acts[0].seq == 0 or acts[0].loss:
            raise bad(f"input {act_names[0]!r} is not a token sequence")
        cfg = LayerConfig(hidden=h, num_heads=mod["num_attention_heads"], seq_len=mod["seq_length"],
                          input_dim=acts[0].width, input_seq_len=acts[0].tokens)
        out = _Out(mod["seq_length"], h)
    elif t == "linear_adapter":
        need(0, 1)
        if acts[0].seq == 0 or acts[0].loss:
            raise bad(f"input {act_names[0]!r} is not a token sequence")
        pool = mod.get("pool_factor", 1)
        n = acts[0].tokens // pool
        if n < 1:
            raise bad(f"pool_factor {pool} leaves no tokens of the {acts[0].tokens} of {act_names[0]!r}")
        cfg = LayerConfig(hidden=h, seq_len=n, input_dim=acts[0].width, input_seq_len=n * pool)
        out = _Out(n, h)
    elif t == "lm_head":
        need(1, 1)
        if len(srcs) != 2 or srcs[1][1] is not None:
            raise bad(f"takes the hidden states then the labels stream, got {[s for s, _ in srcs]}")
        h = mod.get("hidden_size", acts[0].width)
        seqs()
        n_loss = stream_len(data[0])
        if n_loss > acts[0].seq:
            raise bad(f"{n_loss} label tokens (tokens.{data[0]}) exceed the {acts[0].seq} tokens of "
                      f"{act_names[0]!r}")
        cfg = LayerConfig(hidden=h, seq_len=acts[0].seq, vocab_size=mod["vocab_size"], loss_tokens=n_loss,
                          **match_fields(t, mod))
        out = _Out(0, 0, loss=True)
    elif custom is not None:
        if data or not acts:
            need(0, max(1, len(acts)))
        widths = {o.width for o in acts}
        if len(widths) != 1 or any(o.seq == 0 or o.loss for o in acts):
            raise bad(f"inputs {act_names} must be token sequences of one width, got "
                      f"{[_describe(o) for o in acts]}")
        n_in = sum(o.tokens for o in acts)
        n = mod.get("seq_length", n_in)
        cfg = LayerConfig(hidden=h, seq_len=n, input_dim=widths.pop(), input_seq_len=n_in,
                          num_heads=mod.get("num_attention_heads", 0), ffn_hidden=mod.get("ffn_hidden_size", 0),
                          causal=mod.get("causal", False), swiglu=mod.get("swiglu", False))
        out = _Out(n, h)
    else:  # unreachable: _check_module refused the type
        raise bad("unknown layer type")

    base_key = mod.get("share", name)
    if not mod.get("shared", True):
        base_key = f"{task}.{base_key}"
    layers = mod.get("num_layers", 0)
    frozen = dict(trainable=False) if mod.get("trainable", True) is False else {}
    inputs = [s if o is not None else data_input(task, s[len(DATA_PREFIX):]) for s, o in srcs]
    inputs = [last_op[s] if s in last_op else s for s in inputs]
    component = name.split(".")[0]
    try:
        return _operators(task, t, name, mod, cfg, base_key, layers, inputs, component, batch, tp,
                          splittable, frozen), out
    except ValueError as e:  # a custom type's cost function: named with its plugin, under the module's key
        raise SpecError(file, f"modules.{name}.type", t, str(e)) from None


def _operators(task, t, name, mod, cfg, base_key, layers, inputs, component, batch, tp, splittable, frozen):
    ops = []
    if layers:
        stem = name[:-len(".layers")] if name.endswith(".layers") else name
        for i in range(layers):
            ops.append(_operator(name=f"{task}.{stem}.{i}", task=task, module=component, op_type=t,
                                 batch=batch, layer=cfg, param_key=f"{base_key}.{i}", inputs=inputs,
                                 tp_splittable=tp, batch_splittable=splittable, **frozen))
            inputs = [ops[-1].name]
    else:
        ops.append(_operator(name=f"{task}.{name}", task=task, module=component, op_type=t, batch=batch,
                             layer=cfg, param_key="" if t in NO_PARAMS else base_key, inputs=inputs,
                             tp_splittable=tp, batch_splittable=splittable, **frozen))
    return ops



#: spec key -> LayerConfig field, for the keys that match a pretrained checkpoint
_MATCH_FIELDS = {"num_query_groups": "num_query_groups", "activation": "activation",
                 "normalization": "normalization", "layernorm_epsilon": "norm_epsilon",
                 "add_bias_linear": "add_bias_linear", "add_qkv_bias": "add_qkv_bias",
                 "position_embedding_type": "position_embedding_type", "rotary_base": "rotary_base",
                 "norm": "embed_norm"}


def match_fields(t: str, mod: dict) -> dict:
    """LayerConfig fields of a module's checkpoint-matching keys; a default position type is stored as "" so
    that a spec spelling out the default gives the same graph (and fingerprint) as one that does not."""
    out = {field: mod[key] for key, field in _MATCH_FIELDS.items() if key in mod}
    for name in ("norm_epsilon", "rotary_base"):
        if name in out:
            out[name] = float(out[name])
    if out.get("position_embedding_type") == _POSITIONS.get(t, ("",))[0]:
        del out["position_embedding_type"]
    return out


def _describe(o: _Out) -> str:
    if o.loss:
        return "a loss"
    return f"a [{o.width}] vector" if o.seq == 0 else f"[{o.tokens}, {o.width}] tokens"


def _operator(*, name, task, module, op_type, batch, layer, param_key, inputs, tp_splittable,
              batch_splittable, trainable=True) -> Operator:
    if op_type == "contrastive_loss":
        flops = costs.contrastive_loss_flops(batch, layer.proj_dim)
    else:
        flops = costs.layer_fwd_flops_per_sample(op_type, layer) * batch
    return Operator(name=name, task=task, module=module, op_type=op_type, batch=batch, layer=layer,
                    param_key=param_key, inputs=tuple(inputs), fwd_flops=flops,
                    param_count=costs.layer_params(op_type, layer) if param_key else 0,
                    out_elems_per_sample=costs.out_elems_per_sample(op_type, layer),
                    act_bytes_per_sample=costs.layer_act_bytes_per_sample(op_type, layer),
                    batch_splittable=batch_splittable, tp_splittable=tp_splittable, trainable=trainable)



# -- checks of one module's keys ----------------------------------------------------------------------------------
def check_int(file: str, key: str, name: str, v: Any) -> None:
    """A positive integer within the planner's cap for ``name`` (:data:`..limits.SPEC_LIMITS`)."""
    if type(v) is not int or v <= 0:
        raise SpecError(file, key, v, "must be a positive integer")
    cap, what = SPEC_LIMITS.get(name, (None, ""))
    if cap is not None and v > cap:
        raise SpecError(file, key, v, f"outside what the planner accepts (1 to {cap} {what})")


def check_value(file: str, key: str, name: str, v: Any) -> None:
    if name in _INT_KEYS:
        check_int(file, key, name, v)
    elif name in _BOOL_KEYS:
        if type(v) is not bool:
            raise SpecError(file, key, v, "must be true or false")
    elif name in ("temperature", "layernorm_epsilon", "rotary_base"):
        if type(v) not in (int, float) or not math.isfinite(v) or v <= 0:
            raise SpecError(file, key, v, "must be a positive finite number")
    elif name in _CHOICES:
        if v not in _CHOICES[name]:
            raise SpecError(file, key, v, f"must be one of {', '.join(_CHOICES[name])}")
    elif name == "pooling":
        if v not in _POOLING:
            raise SpecError(file, key, v, f"must be one of {', '.join(_POOLING)}")
    elif name in ("type", "share"):
        if not isinstance(v, str):
            raise SpecError(file, key, v, "must be a string")


def check_module(file: str, key: str, mod: dict) -> None:
    t = mod.get("type")
    if t is None:
        raise SpecError(file, f"{key}.type", NO_VALUE, "missing: every module needs a layer type")
    check_value(file, f"{key}.type", "type", t)
    custom = custom_layer_type(t)
    if t not in _KEYS and custom is None:
        known = ", ".join(OP_TYPES) + (f"; registered: {', '.join(registered())}" if registered() else "")
        raise SpecError(file, f"{key}.type", t, f"unknown layer type (built in: {known}; custom types are "
                                                f"registered by [model].layer_plugins)")
    required, optional = _KEYS.get(t, _CUSTOM_KEYS)
    for k, v in mod.items():
        if k not in required | optional | _COMMON:
            raise SpecError(file, f"{key}.{k}", v, f"not a key of a {t} module; keys: "
                                                   f"{', '.join(sorted(required | optional | _COMMON))}")
        check_value(file, f"{key}.{k}", k, v)
    if t in NO_PARAMS and "trainable" in mod:
        raise SpecError(file, f"{key}.trainable", mod["trainable"], f"a {t} module has no weights to freeze")
    for k in sorted(required - set(mod)):
        raise SpecError(file, f"{key}.{k}", NO_VALUE, f"missing: a {t} module needs {', '.join(sorted(required))}")
    h, heads = mod.get("hidden_size"), mod.get("num_attention_heads")
    if h and heads and h % heads:
        raise SpecError(file, f"{key}.num_attention_heads", heads, f"does not divide hidden_size {h}")
    groups = mod.get("num_query_groups")
    if groups and heads and heads % groups:
        raise SpecError(file, f"{key}.num_query_groups", groups, f"does not divide num_attention_heads {heads}")
    pos = mod.get("position_embedding_type")
    if pos is not None and pos not in _POSITIONS.get(t, ()):
        raise SpecError(file, f"{key}.position_embedding_type", pos,
                        f"must be one of {', '.join(_POSITIONS.get(t, ()))}")
    if "rotary_base" in mod and pos != "rope":
        raise SpecError(file, f"{key}.rotary_base", mod["rotary_base"], "needs position_embedding_type = 'rope'")


# -- checks of names and task tables ---------------------------------------------------------------------
def check_name(file: str, key: str, name: str, what: str) -> None:
    """Task names and module name parts: ASCII letters, digits, ``_``, ``-`` (not first), at most MAX_NAME."""
    parts = name.split(".") if what.startswith("a module") else [name]
    for part in parts:
        if not NAME_RE.match(part) or len(part) > MAX_NAME:
            raise SpecError(file, key, name, f"{what} must be ASCII letters, digits, '_' and '-' (starting with a "
                                             f"letter or digit, at most {MAX_NAME} characters"
                                             + ("; parts joined by '.'" if len(parts) > 1 or "." in what else "")
                                             + ")")


def warn_unused(file: str, modules: dict, tasks: dict) -> None:
    """One warning line naming the modules no task's flow reaches (their weights would never train)."""
    used = set()
    for table in tasks.values():
        for line in table.get("flow", []):
            used |= {p.strip() for p in line.replace("->", "+").split("+")}
    used |= {mod["share"] for m, mod in modules.items() if m in used and "share" in mod}
    unused = [m for m in modules if m not in used]
    if unused:
        log.warning(f"warning: {file}: module{'s' if len(unused) > 1 else ''} {', '.join(unused)} "
                    f"{'are' if len(unused) > 1 else 'is'} used by no task's flow: never trained")


def check_task_values(file: str, key: str, table: dict) -> None:
    if "batch" in table:
        check_int(file, f"{key}.batch", "batch", table["batch"])
    if "weight" in table and (type(table["weight"]) not in (int, float) or not math.isfinite(table["weight"])
                              or table["weight"] < 0):
        raise SpecError(file, f"{key}.weight", table["weight"], "must be a finite non-negative number")
    tokens = table.get("tokens", {})
    if not isinstance(tokens, dict):
        raise SpecError(file, f"{key}.tokens", tokens, "must be a table stream = length")
    for s, n in tokens.items():
        check_int(file, f"{key}.tokens.{s}", "tokens", n)
