"""Pretrained weights from a Hugging Face directory into this rank's layers, each rank reading only its shards.

:func:`load_pretrained` takes the layers a rank built (its slices' layers, each on its tensor-parallel shard),
resolves which checkpoint tensors make each parameter (:mod:`.hf_mapping`), checks every
tensor's shape against the spec before copying anything, and reads with safetensors' ``get_slice`` only the
rows (or columns) of this rank's shard: a column-parallel weight reads its rows, a row-parallel one its
columns, the fused QKV weight its query groups' rows of ``q_proj``, ``k_proj`` and ``v_proj``, a gated
``linear_fc1`` its rows of the gate and of the up projection (megatron's stride-2 layout, as
:func:`.layer_state.shard_tensor` cuts it). No rank holds a full copy of a tensor it shards.

``safetensors`` is an optional dependency (``pip install .[hf]``); it is imported only when weights load.
"""
from __future__ import annotations

import json
import os
from typing import Iterable

import torch
from torch import Tensor

from .hf_files import check_weight_files
from .hf_mapping import Cat, Part, Zeros, init_targets, sources
from ..planner.workload.graph import TaskGraph
from .layer_state import shard_spec

_INDEX = "model.safetensors.index.json"
_PREFIXES = ("vision_model.", "text_model.", "model.")


class Checkpoint:
    """The safetensors files of one directory: tensor names, shapes and slices (memory-mapped)."""

    def __init__(self, path: str) -> None:
        try:
            from safetensors import safe_open  # optional: safetensors (pip install .[hf])
        except ImportError:
            raise ValueError("loading Hugging Face weights needs safetensors: pip install .[hf]") from None
        check_weight_files(path)  # every rank, before the first read: a damaged file is one line naming it
        self.path, self._open, self._files = path, safe_open, {}
        index = os.path.join(path, _INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                stored = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise ValueError(f"{path!r} has no *.safetensors file (save_pretrained writes model.safetensors; "
                                 f"PyTorch .bin checkpoints are not read)")
            stored = {name: fn for fn in files for name in self._file(fn).keys()}
        # a one-tower model saved on its own may drop its tower's prefix (transformers 5's CLIPVisionModel
        # writes embeddings.*, 4.x wrote vision_model.embeddings.*): answer to both names
        self.where, self._real = dict(stored), {n: n for n in stored}
        for name, fn in stored.items():
            for prefix in _PREFIXES:
                self.where.setdefault(prefix + name, fn)
                self._real.setdefault(prefix + name, name)

    def _file(self, fn: str):
        if fn not in self._files:
            try:
                self._files[fn] = self._open(fn, framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - safetensors' own errors: name the file in one line
                raise ValueError(f"cannot read {fn}: {type(e).__name__}: "
                                 f"{(str(e).strip().splitlines() or [''])[0][:200]}") from None
        return self._files[fn]

    def shape(self, name: str) -> tuple[int, ...] | None:
        fn = self.where.get(name)
        return None if fn is None else tuple(self._file(fn).get_slice(self._name(name)).get_shape())

    def _name(self, name: str) -> str:
        """The stored name behind ``name`` (itself, or without its tower prefix)."""
        return self._real[name]

    def read(self, name: str, index) -> Tensor:
        return self._file(self.where[name]).get_slice(self._name(name))[index]


def _check(ckpt: Checkpoint, src, param: str, layer_name: str) -> None:
    """Every checkpoint tensor behind ``src`` exists with the expected shape; one line otherwise."""
    if isinstance(src, Cat):
        for p in src.parts:
            _check(ckpt, p, param, layer_name)
        return
    if not isinstance(src, Part):
        return
    got = ckpt.shape(src.name)
    if got is None:
        raise ValueError(f"checkpoint {ckpt.path}: no tensor {src.name} (for {param} of {layer_name}; "
                         f"{src.why})")
    flat = (got[0], int(torch.Size(got[1:]).numel())) if src.flatten and len(got) > 1 else got
    if tuple(flat) != tuple(src.shape):
        raise ValueError(f"checkpoint {ckpt.path}: tensor {src.name} has shape {list(got)}, the spec expects "
                         f"{list(src.shape)} ({src.why})")


def _read(ckpt: Checkpoint, src, dim: int, a: int, b: int) -> Tensor:
    """Entries ``[a, b)`` along ``dim`` of the full tensor ``src`` stands for (reading only those)."""
    if isinstance(src, Zeros):
        return torch.zeros(src.shape).narrow(dim, a, b - a)
    if isinstance(src, Cat):
        if dim != src.dim:
            return torch.cat([_read(ckpt, p, dim, a, b) for p in src.parts], dim=src.dim)
        pieces, off = [], 0
        for p in src.parts:
            n = p.out_shape[dim]
            lo, hi = max(a, off), min(b, off + n)
            if lo < hi:
                pieces.append(_read(ckpt, p, dim, lo - off, hi - off))
            off += n
        return torch.cat(pieces, dim=dim)
    r0 = src.rows[0] if src.rows else 0
    if dim == 0:
        t = ckpt.read(src.name, slice(r0 + a, r0 + b))
    else:
        r1 = src.rows[1] if src.rows else src.shape[0]
        t = ckpt.read(src.name, (slice(r0, r1), slice(a, b)))
    return t.reshape(t.shape[0], -1) if src.flatten else t


def read_shard(ckpt: Checkpoint, src, spec: tuple[int, int] | None, rank: int, size: int) -> Tensor:
    """This tensor-parallel rank's shard of ``src`` (the whole tensor when it is replicated)."""
    full = src.out_shape
    if spec is None or size == 1:
        return _read(ckpt, src, 0, 0, full[0])
    dim, stride = spec
    chunk = full[dim] // (stride * size)
    return torch.cat([_read(ckpt, src, dim, k * chunk, (k + 1) * chunk) for k in range(rank, stride * size, size)],
                     dim=dim)


@torch.no_grad()
def load_pretrained(layers: Iterable, graph: TaskGraph, init: dict[str, str]) -> list[str]:
    """Fill ``layers`` (:class:`.layers.OperatorLayer`, each once per parameter key and shard) whose modules
    ``init`` names from their checkpoints. Returns what kept its initialisation (``key.param: why``).

    Checks all shapes of all layers first, so a bad checkpoint changes nothing. ``ValueError`` (one line) on
    a name, directory, config or shape that does not match the spec.
    """
    targets = init_targets(graph, init)
    todo, kept = [], []
    ckpts: dict[str, Checkpoint] = {}
    for layer in layers:
        t = targets.get(layer.op.param_key)
        if t is None:
            continue
        if t.path not in ckpts:
            ckpts[t.path] = Checkpoint(t.path)
        ckpt = ckpts[t.path]
        params = dict(layer.core.named_parameters())
        rows = params["positions"].shape[0] if "positions" in params else 0
        srcs = sources(t, layer.op.layer, layer.op.op_type, rows)
        for name in params:
            if name not in srcs:
                raise ValueError(f"{layer.op.name}: parameter {name} has no counterpart in {t.path} "
                                 f"(tower {t.tower.name})")
            if srcs[name] is None:
                kept.append(f"{layer.op.param_key}.{name}: not in {t.path}")
            else:
                _check(ckpt, srcs[name], name, f"{t.module} ({layer.op.param_key})")
        todo.append((layer, ckpt, srcs))
    for layer, ckpt, srcs in todo:
        for name, p in layer.core.named_parameters():
            if srcs[name] is None:
                continue
            spec = shard_spec(p) if layer.tp_size > 1 else None
            t = read_shard(ckpt, srcs[name], spec, layer.tp_rank, layer.tp_size)
            if tuple(t.shape) != tuple(p.shape):  # the spec checks above make this unreachable
                raise ValueError(f"{layer.op.name}: {name} read as {list(t.shape)}, the layer holds {list(p.shape)}")
            p.copy_(t.to(p.dtype))
    return kept
