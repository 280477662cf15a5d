"""Graph contraction into MetaOps, MetaLevels, and each MetaOp's parallel mode and valid device counts.

Contraction (the paper's rule). Walk the operators in topological order and merge ``i → j`` when

1. ``i`` has exactly one consumer and ``j`` exactly one producing operator (``out_deg(i) = in_deg(j) = 1``,
   data streams do not count as producers), and
2. both are the same workload: equal ``op_type``, global batch and :class:`LayerConfig`
   (so equal input shape ``[batch, seq, hidden]``), and both frozen or both trained.

Two tasks that share weights but process their own data stay separate MetaOps (shared parameters,
separate workloads), because their operators are never joined by an edge.

Levels. ``level(m) = 0`` for a MetaOp without producing MetaOps, else ``1 + max(level(p))`` over its
producers (the BFS layering of a DAG by longest path, so that every producer lies in an earlier level and
MetaOps in one level are independent).

Parallel mode (our choice; the paper leaves it to the user). A MetaOp runs data-parallel over its global
batch, with a fixed tensor-parallel degree ``tp`` inside every data-parallel replica:

* ``tp = 1`` unless its layer type can be sharded and its model states (``BYTES_PER_PARAM_STATE`` bytes per
  parameter, 2 for a frozen weight, all of its layers) exceed ``TP_MEMORY_FRACTION`` of a device's memory; then the smallest power
  of two that brings them under, at most the island size. This is what a Megatron-LM user does: tensor
  parallelism only when the weights do not fit, kept inside one NVLink island.
* MetaOps that share any ``param_key`` get the largest of their degrees, so a shared layer has one
  sharding and one parameter device group per shard.
* Valid device counts are ``n = tp · d`` with ``d`` dividing the global batch (each data-parallel replica
  takes an equal, whole share of the samples); a MetaOp that cannot split its batch (a contrastive loss
  needs every pair) has the single count ``n = tp``.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from .graph import DATA_PREFIX, LayerConfig, TaskGraph, read_token
from ..limits import divisors

#: Bytes of model state per parameter for mixed-precision Adam in Megatron-LM without the distributed
#: optimizer: bf16 weight (2) + fp32 main gradient (4) + fp32 master weight (4) + Adam moments (8).
BYTES_PER_PARAM_STATE = 18
#: A frozen weight keeps only its bf16 copy (no gradient, no optimizer state; :mod:`.memory`).
FROZEN_BYTES_PER_PARAM = 2
#: Share of a device's memory that one MetaOp's model states may take before tensor parallelism is used.
TP_MEMORY_FRACTION = 0.25
#: Activation recompute modes of a MetaOp (:mod:`.recompute`).
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class MetaOp:
    """A maximal chain of identical operators; the unit the allocator and the scheduler work with."""

    name: str
    """``<task>.<module>.layers`` for a contracted stack, else the single operator's name."""
    op_type: str
    task: str
    module: str
    batch: int
    """Global batch of the task (samples per step)."""
    layer: LayerConfig
    operators: tuple[str, ...]
    """Operator names, layer ``i`` of the MetaOp is ``operators[i]``."""
    param_keys: tuple[str, ...]
    """Weights of each layer (``""`` for parameter-free layers)."""
    inputs: tuple[str, ...]
    """Producing MetaOps or ``data:`` streams of the first layer, in the order the layer consumes them."""
    level: int
    fwd_flops_per_layer: float
    """Forward FLOPs of one layer over the global batch."""
    params_per_layer: int
    out_elems_per_sample: int
    act_bytes_per_sample: float
    """Bytes one layer stashes for backward per sample."""
    tp: int = 1
    """Tensor-parallel degree inside each data-parallel replica."""
    batch_splittable: bool = True
    tp_splittable: bool = True
    recompute: str = "none"
    """Activation recompute of every layer (:mod:`.recompute`): ``none``, ``selective`` or ``full``; chosen by
    the planner where memory binds, executed by the runtime."""
    trainable: bool = True
    """Whether its weights train (``False``: a frozen module; no gradient, sync or optimizer state). A MetaOp
    without weights (a loss) counts as trainable exactly when ``input_grad``: its backward runs only then."""
    input_grad: bool = True
    """Whether its backward must produce its input's gradient: some MetaOp before it (transitively through
    its producers) trains. ``trainable`` and ``input_grad`` both false: no backward at all (forward only,
    nothing stashed, no gradient sent back to it)."""

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"MetaOp {self.name!r}: recompute={self.recompute!r} is not one of {RECOMPUTE}")

    @property
    def num_layers(self) -> int:
        return len(self.operators)

    @property
    def signature(self) -> dict:
        """What makes two MetaOps the same workload (used to key scaling curves)."""
        return {"op_type": self.op_type, "batch": self.batch, "seq_len": self.layer.seq_len,
                "hidden": self.layer.hidden, "tp": self.tp}

    @property
    def label(self) -> str:
        """Short label for grids: module and op kind, e.g. ``vision``, ``vision.embed``, ``loss``."""
        return self.name.split(".", 1)[1].replace(".layers", "") if "." in self.name else self.name

    @property
    def producers(self) -> tuple[str, ...]:
        return tuple(i for i in self.inputs if not i.startswith(DATA_PREFIX))

    def valid_counts(self, num_devices: int) -> tuple[int, ...]:
        """Device counts this MetaOp may run on: ``tp · d`` with ``d | batch`` (or ``d = 1``), ``≤ N``
        (ascending; remembered per ``N``: the MetaOp is frozen)."""
        cache = self.__dict__.setdefault("_valid_counts", {})
        out = cache.get(num_devices)
        if out is None:
            if not self.batch_splittable:
                out = (self.tp,) if self.tp <= num_devices else ()
            else:
                out = tuple(self.tp * d for d in divisors(self.batch) if self.tp * d <= num_devices)
            cache[num_devices] = out
        return out

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["layer"] = self.layer.to_json()
        for k in ("operators", "param_keys", "inputs"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_json(cls, obj: Mapping) -> "MetaOp":
        d = dict(obj)
        d["layer"] = LayerConfig.from_json(d["layer"])
        for k in ("operators", "param_keys", "inputs"):
            d[k] = tuple(d[k])
        return cls(**d)


_LAYER_INDEX = re.compile(r"^(.*)\.(\d+)$")


def _chain_name(ops: Sequence, used: set[str]) -> str:
    if len(ops) > 1:
        m = _LAYER_INDEX.match(ops[0].name)
        if m and all(_LAYER_INDEX.match(o.name) and _LAYER_INDEX.match(o.name).group(1) == m.group(1)
                     for o in ops):
            name = f"{m.group(1)}.layers"
            if name not in used:
                return name
        return f"{ops[0].name}+{len(ops) - 1}"
    return ops[0].name


def edge_token(src: MetaOp, dst: MetaOp) -> int | None:
    """The one token per sample of ``src``'s output that an edge into ``dst``'s first layer moves
    (:func:`.graph.read_token`: a ``cls`` or ``eos`` pool head reading this one input of more than one token),
    or ``None``: the whole output (a continuation, ``dst`` being ``src`` from a later layer on, among them)."""
    if src is dst or len(dst.producers) != 1 or dst.layer.seq_len <= 1:
        return None
    return read_token(dst.op_type, dst.layer)


def edge_elems_per_sample(src: MetaOp, dst: MetaOp) -> int:
    """Elements per sample that an edge from ``src``'s last layer into ``dst``'s first layer moves: ``src``'s
    whole output, or the one token of it that ``dst`` reads (:func:`edge_token`)."""
    if edge_token(src, dst) is None:
        return src.out_elems_per_sample
    return src.out_elems_per_sample // dst.layer.seq_len


def tp_divides(layer: LayerConfig, tp: int) -> bool:
    """Whether a layer can be split ``tp`` ways: heads, widths and vocabulary must divide evenly."""
    return all(v % tp == 0 for v in (layer.num_heads, layer.hidden, layer.ffn_hidden, layer.vocab_size) if v)


def choose_tp(params: int, *, memory_bytes: float, max_tp: int, layer: LayerConfig | None = None,
              bytes_per_param: int = BYTES_PER_PARAM_STATE) -> int:
    """Smallest power-of-two TP degree ≤ ``max_tp`` bringing ``params``' states under the memory share
    (among the degrees that divide the layer's heads, widths and vocabulary)."""
    tp = 1
    while params * bytes_per_param / tp > TP_MEMORY_FRACTION * memory_bytes:
        nxt = tp * 2
        if nxt > max_tp or (layer is not None and not tp_divides(layer, nxt)):
            break
        tp = nxt
    return tp


def contract(graph: TaskGraph, *, memory_bytes: float = 80 * 2**30, max_tp: int = 8) -> tuple[MetaOp, ...]:
    """Contract ``graph`` into MetaOps (in a topological order) with levels and TP degrees.

    ``memory_bytes`` is one device's memory and ``max_tp`` the island size; both only decide ``tp``.
    """
    succ = graph.successors()
    in_deg = {op.name: len(graph.predecessors(op.name)) for op in graph.operators}
    chain_of: dict[str, int] = {}
    chains: list[list] = []
    for op in graph.operators:
        preds = graph.predecessors(op.name)
        if len(preds) == 1 and in_deg[op.name] == 1:
            p = graph[preds[0]]
            if (len(succ[p.name]) == 1 and p.op_type == op.op_type and p.batch == op.batch
                    and p.layer == op.layer and p.task == op.task and p.trainable == op.trainable
                    and chains[chain_of[p.name]][-1].name == p.name):
                chain_of[op.name] = chain_of[p.name]
                chains[chain_of[p.name]].append(op)
                continue
        chain_of[op.name] = len(chains)
        chains.append([op])

    used: set[str] = set()
    names = []
    for ops in chains:
        name = _chain_name(ops, used)
        used.add(name)
        names.append(name)

    metaops: list[MetaOp] = []
    level: dict[str, int] = {}
    grad_out: dict[str, bool] = {}  # MetaOp -> its backward runs (it trains, or one before it does)
    for ops, name in zip(chains, names):
        first = ops[0]
        inputs = tuple(i if i.startswith(DATA_PREFIX) else names[chain_of[i]] for i in first.inputs)
        producers = [i for i in inputs if not i.startswith(DATA_PREFIX)]
        level[name] = 1 + max((level[p] for p in producers), default=-1)
        input_grad = any(grad_out[p] for p in producers)
        trainable = first.trainable if any(o.param_key for o in ops) else input_grad
        grad_out[name] = trainable or input_grad
        metaops.append(MetaOp(
            name=name, op_type=first.op_type, task=first.task, module=first.module, batch=first.batch,
            layer=first.layer, operators=tuple(o.name for o in ops),
            param_keys=tuple(o.param_key for o in ops), inputs=inputs, level=level[name],
            fwd_flops_per_layer=first.fwd_flops, params_per_layer=first.param_count,
            out_elems_per_sample=first.out_elems_per_sample,
            act_bytes_per_sample=first.act_bytes_per_sample,
            batch_splittable=first.batch_splittable, tp_splittable=first.tp_splittable,
            trainable=trainable, input_grad=input_grad))
    return _assign_tp(metaops, memory_bytes=memory_bytes, max_tp=max_tp)


def _assign_tp(metaops: list[MetaOp], *, memory_bytes: float, max_tp: int) -> tuple[MetaOp, ...]:
    want = {m.name: (choose_tp(m.params_per_layer * m.num_layers, memory_bytes=memory_bytes, max_tp=max_tp,
                               layer=m.layer, bytes_per_param=BYTES_PER_PARAM_STATE if m.trainable else
                               FROZEN_BYTES_PER_PARAM) if m.tp_splittable else 1) for m in metaops}
    # Union-find over shared parameter keys: one sharding per shared layer.
    parent = {m.name: m.name for m in metaops}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[str, str] = {}
    for m in metaops:
        for k in m.param_keys:
            if not k:
                continue
            if k in owner:
                parent[find(m.name)] = find(owner[k])
            else:
                owner[k] = m.name
    best: dict[str, int] = {}
    for m in metaops:
        r = find(m.name)
        best[r] = max(best.get(r, 1), want[m.name])
    for m in metaops:  # the shared degree must also divide every member's layer
        r = find(m.name)
        while best[r] > 1 and m.tp_splittable and not tp_divides(m.layer, best[r]):
            best[r] //= 2
    out = []
    for m in metaops:
        tp = best[find(m.name)] if m.tp_splittable else 1
        out.append(dataclasses.replace(m, tp=tp))
    return tuple(out)


def levels(metaops: Sequence[MetaOp]) -> list[list[MetaOp]]:
    """MetaOps grouped by level, in level order."""
    out: dict[int, list[MetaOp]] = {}
    for m in metaops:
        out.setdefault(m.level, []).append(m)
    return [out[k] for k in sorted(out)]
