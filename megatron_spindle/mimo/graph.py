"""A MIMO model and its tasks as the planner's task graph (pure Python), and the MIMO operator types.

Each task is a chain of operators per modality it names, feeding the language model (``<task>.`` before every
name; ``module`` is the modality, or ``language``, the key of MIMO's ``module_to_grid_map``):

* a split encoder (:class:`.describe.Encoder`): ``<m>.<enc>.embed`` (its forward up to its ``TransformerBlock``,
  reading the encoder's keywords as data streams ``data:<task>:<m>.<enc>.<keyword>``), ``<m>.<enc>.0 ... L-1``
  (the block's layers: one MetaOp, sliceable, tensor-parallel) and, when weights follow the block,
  ``<m>.<enc>.post`` (the rest of its forward); any other encoder is one operator ``<m>.<enc>``, data-parallel;
* ``<m>.proj``: the modality's input projection, per token;
* ``language.embed``: the text tokens' embedding and every modality's projected tokens placed at the positions
  of its special token (``data:<task>:input_ids``), as ``MimoModel`` does;
* ``language.0 ... L-1``: the decoder layers; ``language.head``: final norm, output layer and the next-token
  loss over ``data:<task>:labels`` where ``data:<task>:loss_mask`` is 1.

Each sample of a task holds its modalities' tokens first, in the order the task names them, then its text
(``seq_length`` tokens in all); the loss is on every text position but the last (``loss_tokens``). Parameter
keys are the modules' names in ``MimoModel.state_dict()``: a core's parameter ``name`` is the model's
``<key>.<name>`` (``language_model.decoder.layers.3`` + ``self_attention.linear_qkv.weight``), so checkpoints can
speak MIMO's names.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ..planner.workload import costs
from ..planner.workload.graph import LayerConfig, Operator, TaskGraph, data_input
from ..planner.workload.layer_types import register_layer_type
from ..planner.workload.spec_layers import NO_VALUE
from ..planner.limits import MAX_OPERATORS
from .describe import Cost, MimoDescription
from .tasks import MimoTasks, TasksError

#: MIMO operator types: (tensor parallel, the built-in type whose analytic latency times it).
MIMO_TYPES = {
    "mimo_encoder": (False, "patch_embed"),     # a split encoder's forward before (embed) or after (post) its block
    "mimo_layer": (True, "transformer_layer"),  # one layer of the user's layer spec
    "mimo_module": (False, ""),                 # a whole encoder that is not split
    "mimo_projection": (True, "linear_adapter"),
    "mimo_lm_embed": (True, "token_embed"),
    "mimo_lm_head": (True, "lm_head"),
}
LANGUAGE = "language"
"""The language model's module name (MIMO's ``MIMO_LANGUAGE_MODULE_KEY``)."""


def _only_from_a_provider(config):
    raise ValueError("a MIMO operator type: only a MimoModel provider (--model-provider) makes these operators")


for _name, (_tp, _like) in MIMO_TYPES.items():
    register_layer_type(_name, cost=_only_from_a_provider, tensor_parallel=_tp, like=_like)


def is_mimo_graph(graph: TaskGraph) -> bool:
    return any(op.op_type in MIMO_TYPES for op in graph.operators)


def sequence(desc: MimoDescription, modalities: Sequence[str], seq_length: int) -> tuple[int, int]:
    """``(tokens per sample, loss tokens per sample)`` of a task: its modalities' tokens first, then text."""
    S = seq_length or desc.language.max_sequence_length
    text = S - sum(desc.modality(m).encoder.tokens for m in modalities)
    return S, text - 1


def _cost_op(name, task, module, op_type, batch, layer, key, inputs, cost: Cost, *, tp, trainable):
    return Operator(name=name, task=task, module=module, op_type=op_type, batch=batch, layer=layer, param_key=key,
               inputs=tuple(inputs), fwd_flops=cost.fwd_flops * batch, param_count=cost.params,
               out_elems_per_sample=layer.seq_len * layer.hidden, act_bytes_per_sample=cost.act_bytes,
               tp_splittable=tp, trainable=trainable)


def _layers(task, prefix, module, layer: LayerConfig, n: int, params: int, key, inputs, batch, trainable):
    ops = []
    fwd = costs.layer_fwd_flops_per_sample("transformer_layer", layer)
    act = costs.layer_act_bytes_per_sample("transformer_layer", layer)
    for i in range(n):
        ops.append(Operator(name=f"{task}.{prefix}.{i}", task=task, module=module, op_type="mimo_layer", batch=batch,
                       layer=layer, param_key=f"{key}.layers.{i}", inputs=tuple(inputs),
                       fwd_flops=fwd * batch, param_count=params, out_elems_per_sample=layer.seq_len * layer.hidden,
                       act_bytes_per_sample=act, trainable=trainable))
        inputs = [ops[-1].name]
    return ops


def _task_ops(desc: MimoDescription, t, batch: int, frozen) -> list[Operator]:
    S, loss_tokens = sequence(desc, t.modalities, t.seq_length)
    lang = desc.language
    ops: list[Operator] = []
    feeds = []
    for mname in t.modalities:
        mod = desc.modality(mname)
        e = mod.encoder
        data = [data_input(t.name, f"{mname}.{e.name}.{s.name}") for s in e.inputs]
        train = lambda part, default: default and not frozen(f"{mname}.{e.name}.{part}" if part else f"{mname}.{e.name}")  # noqa: E731
        if e.split:
            c = e.layer
            embed = LayerConfig(hidden=c.hidden, seq_len=c.seq_len)
            ops.append(_cost_op(f"{t.name}.{mname}.{e.name}.embed", t.name, mname, "mimo_encoder", batch, embed, e.key,
                                data, e.embed, tp=False, trainable=train("embed", e.trainable)))
            ops += _layers(t.name, f"{mname}.{e.name}", mname, c, e.num_layers, e.layer_params, f"{e.key}.{e.block}",
                           [ops[-1].name],
                           batch, train("layers", e.trainable))
            if e.post is not None:
                post = LayerConfig(hidden=e.hidden, seq_len=e.tokens, input_seq_len=c.seq_len, input_dim=c.hidden)
                ops.append(_cost_op(f"{t.name}.{mname}.{e.name}.post", t.name, mname, "mimo_encoder", batch, post,
                                    e.key, [ops[-1].name, *data], e.post, tp=False,
                                    trainable=train("embed", e.trainable)))  # one weight with the embed part
        else:
            ops.append(_cost_op(f"{t.name}.{mname}.{e.name}", t.name, mname, "mimo_module", batch,
                                LayerConfig(hidden=e.hidden, seq_len=e.tokens), e.key, data, e.module, tp=False,
                                trainable=train("", e.trainable)))
        p = mod.projection
        if p is not None:
            cost = Cost(params=p.params, fwd_flops=p.flops_per_token * e.tokens,
                        act_bytes=p.act_bytes_per_token * e.tokens)
            layer = LayerConfig(hidden=p.hidden, seq_len=e.tokens, input_dim=p.input_size, input_seq_len=e.tokens,
                                ffn_hidden=p.ffn_hidden)
            ops.append(_cost_op(f"{t.name}.{mname}.proj", t.name, mname, "mimo_projection", batch, layer, p.key,
                                [ops[-1].name], cost, tp=p.tensor_parallel,
                                trainable=p.trainable and not frozen(f"{mname}.proj")))
        feeds.append(ops[-1].name)
    t_embed, t_layers, t_head = lang.trainable
    embed = LayerConfig(hidden=lang.hidden, seq_len=S, vocab_size=lang.vocab_size,
                        input_seq_len=S - loss_tokens - 1,  # the modalities' tokens
                        position_embedding_type="" if lang.position_embedding_type == "learned_absolute" else
                        lang.position_embedding_type)
    tok = LayerConfig(hidden=lang.hidden, seq_len=S, vocab_size=lang.vocab_size)
    ops.append(_cost_op(f"{t.name}.{LANGUAGE}.embed", t.name, LANGUAGE, "mimo_lm_embed", batch, embed,
                        "language_model.embedding", [*feeds, data_input(t.name, "input_ids")],
                        Cost(params=lang.embed_params, fwd_flops=costs.layer_fwd_flops_per_sample("token_embed", tok),
                             act_bytes=costs.layer_act_bytes_per_sample("token_embed", tok)),
                        tp=True, trainable=t_embed and not frozen(f"{LANGUAGE}.embed")))
    layer = LayerConfig.from_json({**lang.layer.to_json(), "seq_len": S})
    ops += _layers(t.name, LANGUAGE, LANGUAGE, layer, lang.num_layers, lang.layer_params, "language_model.decoder",
                   [ops[-1].name], batch, t_layers and not frozen(f"{LANGUAGE}.layers"))
    head = LayerConfig(hidden=lang.hidden, seq_len=S, vocab_size=lang.vocab_size, loss_tokens=loss_tokens,
                       normalization="" if lang.normalization == "LayerNorm" else lang.normalization)
    logits = LayerConfig(hidden=lang.hidden, seq_len=S, vocab_size=lang.vocab_size, loss_tokens=S,
                         normalization=head.normalization)  # MIMO's GPTModel projects every position
    ops.append(Operator(name=f"{t.name}.{LANGUAGE}.head", task=t.name, module=LANGUAGE, op_type="mimo_lm_head",
                   batch=batch, layer=head, param_key="language_model",
                   inputs=(ops[-1].name, data_input(t.name, "labels"), data_input(t.name, "loss_mask")),
                   fwd_flops=costs.layer_fwd_flops_per_sample("lm_head", logits) * batch,
                   param_count=lang.head_params, out_elems_per_sample=1,
                   act_bytes_per_sample=costs.layer_act_bytes_per_sample("lm_head", logits),
                   trainable=t_head and not frozen(f"{LANGUAGE}.head")))
    return ops


def freeze_names(desc: MimoDescription) -> list[str]:
    """The names ``--spindle-freeze`` / ``--freeze`` accept for a MIMO model."""
    out = [LANGUAGE, f"{LANGUAGE}.embed", f"{LANGUAGE}.layers", f"{LANGUAGE}.head"]
    for m in desc.modalities:
        e = m.encoder
        parts = (["embed", "layers"] if e.split else [])
        out += [m.name, f"{m.name}.{e.name}", *(f"{m.name}.{e.name}.{p}" for p in parts), f"{m.name}.proj"]
    return out


def mimo_graph(desc: MimoDescription, tasks: MimoTasks, *, task_count: int | None = None,
               batch: int | Mapping[str, int] | None = None, passes: int = 1,
               freeze: Sequence[str] = ()) -> TaskGraph:
    """The task graph of one pass of the first ``task_count`` tasks (default all): each task's ``batch`` (one
    number or task -> number overrides the file's) per step over ``passes`` passes; ``freeze`` names modules whose
    weights do not train (:func:`freeze_names`), as the user's own ``requires_grad = False`` does."""
    chosen = tasks.tasks[:task_count] if task_count else tasks.tasks
    if task_count is not None and not 1 <= task_count <= len(tasks.tasks):
        raise ValueError(f"{tasks.file} has {len(tasks.tasks)} tasks, not {task_count}")
    names = freeze_names(desc)
    for f in freeze:
        if not any(n == f or n.startswith(f + ".") for n in names):
            raise ValueError(f"cannot freeze {f!r}: not a module of model {desc.name!r}; modules: {', '.join(names)}")
    frozen = lambda path: any(path == f or path.startswith(f + ".") for f in freeze)  # noqa: E731
    ops: list[Operator] = []
    for i, t in enumerate(chosen):
        where = f"tasks[{tasks.tasks.index(t)}]"
        for m in t.modalities:
            if m not in {x.name for x in desc.modalities}:
                raise TasksError(tasks.file, f"{where}.modalities", list(t.modalities),
                                 f"{m!r} is not a modality of the model (modalities: "
                                 f"{', '.join(x.name for x in desc.modalities) or 'none'})")
        S, loss_tokens = sequence(desc, t.modalities, t.seq_length)
        if loss_tokens < 1:
            raise TasksError(tasks.file, f"{where}.seq_length", S, f"the modality tokens ("
                             + ", ".join(f"{m} {desc.modality(m).encoder.tokens}" for m in t.modalities)
                             + f") leave {loss_tokens + 1} text tokens; a next-token loss needs 2 or more")
        if desc.language.position_embedding_type == "learned_absolute" and S > desc.language.max_sequence_length:
            raise TasksError(tasks.file, f"{where}.seq_length", S, f"above the language model's "
                             f"max_sequence_length {desc.language.max_sequence_length} (its learned positions)")
        b = t.batch if batch is None else batch if isinstance(batch, int) else batch.get(t.name, t.batch)
        if b % passes:
            raise ValueError(f"task {t.name!r}: global batch {b} is not a multiple of {passes} passes per step")
        ops += _task_ops(desc, t, b // passes, frozen)
        if len(ops) > MAX_OPERATORS:
            raise TasksError(tasks.file, "tasks", NO_VALUE, f"more than {MAX_OPERATORS} operators (layers summed "
                                                            f"over every task): outside what the planner accepts")
    return TaskGraph(model=desc.name, tasks=tuple(t.name for t in chosen), operators=tuple(ops),
                     task_weights=tuple(t.weight for t in chosen))
