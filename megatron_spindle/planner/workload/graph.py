"""The task graph: operators (one layer applied to one task's data) and the edges between them.

This module is pure Python. The graph is the single description of a multi-task model that both the
planner and the runtime read: the planner contracts it into MetaOps, the runtime builds each operator's
layer from its :class:`LayerConfig` (so the trained model and the planned model never disagree).

Vocabulary (see ``shared/DESIGN.md``):

* an **operator** is one layer applied to one task's data. Its *signature* is
  ``(op_type, batch, seq, hidden)``; its ``param_key`` names the weights it uses, so two operators with the
  same ``param_key`` share parameters (a text encoder used by two tasks, an LLM used by all tasks);
* an operator with several inputs takes them in the order of :attr:`Operator.inputs`; the runtime
  concatenates them along the sequence dimension unless the layer type says otherwise (a contrastive
  loss takes a pair, an encoder-decoder layer takes ``(target, memory)``);
* an input named ``data:<task>:<stream>`` comes from the task's data iterator.

Data-flow conventions shared by the planner's byte counts and the runtime:

1. every activation that leaves an operator is ONE tensor with the batch first (``[b, ...]``), so
   data-parallel sharding is a split along dim 0;
2. an operator with several operator inputs concatenates them along dim 1 (the sequence) in input order;
3. a ``decoder_layer`` carries its cross-attention memory along: its input and output are
   ``concat([target (seq_len tokens), memory (memory_seq_len tokens)], dim=1)``;
4. an ``lm_head`` keeps the first ``seq_len`` tokens of its input and puts the loss on the last
   ``loss_tokens`` of those; its second input is ``data:<task>:labels`` (``[b, loss_tokens]`` token ids);
5. a ``contrastive_loss`` takes the two pooled embeddings ``[b, proj_dim]`` of its task, whole batch;
6. every task's loss is a mean over its global batch (over loss tokens for ``lm_head``); the total loss is
   the weighted sum over tasks (``TaskGraph.task_weights``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Mapping

from .layer_types import OP_TYPES, custom_layer_type, registered

DATA_PREFIX = "data:"


def read_token(op_type: str, layer: LayerConfig) -> int | None:
    """The index of the one token per sample a layer reads of its input, counted from the end when negative
    (``-1``: the last, whatever the sequence's length), or ``None`` when it reads them all.

    A ``pool_head`` pooling ``cls`` reads the first token (0), ``eos`` the last (-1): its norm works token by
    token, so norming that token alone gives what norming all and pooling gives. An edge into such a layer
    moves that token only (:attr:`..assembly.plan.Transfer.token`); ``mean`` pooling reads every token.
    """
    if op_type == "pool_head" and layer.pooling in ("cls", "eos"):
        return 0 if layer.pooling == "cls" else -1
    return None


def data_input(task: str, stream: str) -> str:
    """Name of a data stream consumed by a source operator, e.g. ``data:vision-text:vision``."""
    return f"{DATA_PREFIX}{task}:{stream}"


@dataclass(frozen=True, kw_only=True)
class LayerConfig:
    """Hyper-parameters of one layer: everything the runtime needs to build it and the planner to cost it.

    Fields that a layer type does not use stay at their zero default.
    """

    hidden: int
    """Model width of the layer's output (and of its input unless ``input_dim`` says otherwise)."""
    num_heads: int = 0
    """Attention heads (self- or cross-attention)."""
    ffn_hidden: int = 0
    """MLP inner width (for swiglu the width of each of the two input projections)."""
    seq_len: int = 0
    """Tokens per sample at the layer's output."""
    input_dim: int = 0
    """Width of the input when it differs from ``hidden`` (patch size, encoder width of an adapter)."""
    input_seq_len: int = 0
    """Tokens per sample at the input when they differ from ``seq_len`` (adapters, pooling heads)."""
    memory_seq_len: int = 0
    """Tokens of the cross-attention memory (decoder layers)."""
    vocab_size: int = 0
    """Vocabulary of token embeddings and language-model heads."""
    proj_dim: int = 0
    """Output width of a contrastive projection head."""
    causal: bool = False
    """Causal self-attention (decoder LLMs)."""
    swiglu: bool = False
    """Gated SiLU MLP (Qwen) instead of GELU (ViT, CLIP)."""
    pooling: str = ""
    """``cls`` (first token), ``eos`` (last token) or ``mean`` for pool heads."""
    loss_tokens: int = 0
    """Tokens per sample that carry a next-token loss (the text part of a multi-modal sequence)."""
    temperature: float = 0.0
    """InfoNCE temperature of a contrastive loss."""
    # -- what a pretrained model needs beyond the defaults (docs/model_spec.md, "Matching a checkpoint") --
    num_query_groups: int = 0
    """Key/value heads of grouped-query attention (0: as many as ``num_heads``)."""
    activation: str = ""
    """MLP activation: ``gelu``, ``quick_gelu``, ``silu`` ("": gelu, silu for ``swiglu``)."""
    normalization: str = ""
    """``LayerNorm`` or ``RMSNorm`` ("": LayerNorm)."""
    norm_epsilon: float = 0.0
    """The norms' epsilon (0: 1e-5)."""
    add_bias_linear: bool | None = None
    """Biases of the linear layers (None: without ``swiglu``)."""
    add_qkv_bias: bool | None = None
    """Bias of the fused QKV projection (None: as ``add_bias_linear``, true for ``swiglu``)."""
    position_embedding_type: str = ""
    """Embeddings: ``learned_absolute`` ("") or ``none``; transformer layers: ``none`` ("") or ``rope``."""
    rotary_base: float = 0.0
    """RoPE base period (0: 10000)."""
    embed_norm: bool = False
    """A norm after a patch embedding (CLIP's ``pre_layrnorm``)."""

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}

    @classmethod
    def from_json(cls, obj: Mapping) -> "LayerConfig":
        return cls(**obj)


@dataclass(frozen=True, kw_only=True)
class Operator:
    """One layer applied to one task's data."""

    name: str
    """Unique name, ``<task>.<module>.<layer index>`` for stacks, e.g. ``vision-text.vision.7``."""
    task: str
    """The task whose data this operator processes."""
    module: str
    """The model component it belongs to (``vision``, ``llm``, ``loss``): used in short labels."""
    op_type: str
    """One of :data:`OP_TYPES`."""
    batch: int
    """Global batch (samples of this task per training step)."""
    layer: LayerConfig
    """Hyper-parameters of the layer."""
    param_key: str
    """Name of the weights; equal keys share parameters. Empty for parameter-free operators."""
    inputs: tuple[str, ...]
    """Producing operators (or ``data:`` streams), in the order the layer consumes them."""
    fwd_flops: float
    """Forward FLOPs for the whole global batch (backward is counted as twice this)."""
    param_count: int
    """Number of parameters of the layer (0 for a parameter-free operator)."""
    out_elems_per_sample: int
    """Elements of the output activation per sample (what crosses a wave boundary)."""
    act_bytes_per_sample: float
    """Bytes stashed for the backward pass per sample (bf16 activations, no recomputation)."""
    tp_splittable: bool = True
    """Whether tensor parallelism applies (attention heads / MLP columns can be sharded)."""
    batch_splittable: bool = True
    """Whether data parallelism applies; a contrastive loss needs the whole batch on one device."""
    trainable: bool = True
    """``False``: a frozen weight (spec ``trainable = false``, ``--spindle-freeze``): no gradient, sync or
    optimizer state. Serialized only when ``False``, so graphs without frozen weights keep their
    fingerprints."""

    def __post_init__(self) -> None:
        if self.op_type not in OP_TYPES:
            if custom_layer_type(self.op_type) is None:
                raise ValueError(f"operator {self.name!r}: unknown op_type {self.op_type!r}; known: {OP_TYPES}"
                                 f"{', registered: ' + str(registered()) if registered() else ''}")
        if self.batch <= 0:
            raise ValueError(f"operator {self.name!r}: batch must be positive, got {self.batch}")
        if not self.trainable and not self.param_key:
            raise ValueError(f"operator {self.name!r} has no weights to freeze (trainable=False)")

    @property
    def signature(self) -> tuple:
        """(op_type, batch, seq, hidden): operators with equal signatures are the same workload."""
        return (self.op_type, self.batch, self.layer.seq_len, self.layer.hidden)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["layer"] = self.layer.to_json()
        d["inputs"] = list(self.inputs)
        if self.trainable:
            del d["trainable"]
        return d

    @classmethod
    def from_json(cls, obj: Mapping) -> "Operator":
        d = dict(obj)
        d["layer"] = LayerConfig.from_json(d["layer"])
        d["inputs"] = tuple(d["inputs"])
        return cls(**d)


@dataclass(frozen=True)
class TaskGraph:
    """A multi-task model as a DAG of operators, in a topological order."""

    model: str
    """Workload name, e.g. ``multitask-clip``."""
    tasks: tuple[str, ...]
    operators: tuple[Operator, ...]
    task_weights: tuple[float, ...] = ()
    """Weight of each task's loss in the total loss (default 1 each)."""
    _index: dict = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        index = {}
        for op in self.operators:
            if op.name in index:
                raise ValueError(f"graph {self.model!r}: duplicate operator name {op.name!r}")
            for src in op.inputs:
                if not src.startswith(DATA_PREFIX) and src not in index:
                    raise ValueError(f"graph {self.model!r}: operator {op.name!r} reads {src!r}, "
                                     f"which is not an earlier operator or a data: stream")
            if op.task not in self.tasks:
                raise ValueError(f"graph {self.model!r}: operator {op.name!r} has unknown task {op.task!r}")
            index[op.name] = op
        object.__setattr__(self, "_index", index)
        if not self.task_weights:
            object.__setattr__(self, "task_weights", tuple(1.0 for _ in self.tasks))
        if len(self.task_weights) != len(self.tasks):
            raise ValueError(f"graph {self.model!r}: {len(self.task_weights)} task weights for "
                             f"{len(self.tasks)} tasks")

    def __getitem__(self, name: str) -> Operator:
        return self._index[name]

    def successors(self) -> dict[str, list[str]]:
        succ: dict[str, list[str]] = {op.name: [] for op in self.operators}
        for op in self.operators:
            for src in op.inputs:
                if src in succ:
                    succ[src].append(op.name)
        return succ

    def predecessors(self, name: str) -> list[str]:
        return [s for s in self._index[name].inputs if not s.startswith(DATA_PREFIX)]

    def param_counts(self) -> dict[str, int]:
        """Parameters per distinct ``param_key`` (shared weights counted once)."""
        out: dict[str, int] = {}
        for op in self.operators:  # tables shared by operators of different lengths: the largest
            if op.param_key:
                out[op.param_key] = max(out.get(op.param_key, 0), op.param_count)
        return out

    def frozen_param_keys(self) -> set[str]:
        """The ``param_key`` of every frozen weight."""
        return {op.param_key for op in self.operators if not op.trainable}

    def total_params(self) -> int:
        return sum(self.param_counts().values())

    def subset(self, tasks) -> "TaskGraph":
        """The graph of some of the tasks (a task joining or leaving); same operators and weights."""
        wanted = set(tasks)
        unknown = sorted(wanted - set(self.tasks))
        if unknown or not wanted:
            raise ValueError(f"graph {self.model!r}: cannot keep tasks {unknown or []}; tasks: {list(self.tasks)}")
        tasks = tuple(t for t in self.tasks if t in wanted)
        return TaskGraph(model=self.model, tasks=tasks,
                         task_weights=tuple(w for t, w in zip(self.tasks, self.task_weights) if t in tasks),
                         operators=tuple(op for op in self.operators if op.task in tasks))

    def to_json(self) -> dict:
        return {"model": self.model, "tasks": list(self.tasks), "task_weights": list(self.task_weights),
                "operators": [op.to_json() for op in self.operators]}

    @classmethod
    def from_json(cls, obj: Mapping) -> "TaskGraph":
        return cls(model=obj["model"], tasks=tuple(obj["tasks"]),
                   task_weights=tuple(obj.get("task_weights", ())),
                   operators=tuple(Operator.from_json(o) for o in obj["operators"]))

    def fingerprint(self) -> str:
        """A short stable hash of the graph, stored in plans so a plan for another model is refused (computed
        once per graph: the graph is frozen)."""
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            blob = json.dumps(self.to_json(), sort_keys=True).encode()
            fp = self.__dict__["_fingerprint"] = hashlib.sha256(blob).hexdigest()[:16]
        return fp

