"""The layers of MIMO operators (:mod:`..mimo.graph`), built from the user's own specs (:mod:`.mimo_build`).

Each operator type runs the user's code on its slice of the batch (batch-first in and out, as every layer of
:mod:`.layers`):

* ``mimo_encoder``: the encoder around an empty block. Without an activation input it is the embed part: the
  encoder's own forward, stopped where it calls its block (:func:`stop_at`), returns what the block would get; with
  one (the block's layers' output) it is the post part: the forward again with the block replaced by the received
  hidden states (:func:`replay`, plus the block's final norm), so whatever the encoder does after its block runs;
* ``mimo_layer``: a megatron.core layer of the user's layer spec; the language model's get its RoPE frequencies from
  a ``GPTModel`` built from the user's spec without weights (``rotary_pos_emb``, as ``GPTModel.forward`` computes them);
* ``mimo_module``: the whole encoder; ``mimo_projection``: the projector on ``[b * s, h]`` (as MIMO calls it);
* ``mimo_lm_embed``: ``MimoModel.get_text_embeddings`` and ``MimoModel.align_embeddings_by_token_positions`` (MIMO's
  own methods; they read only the language model's embedding) over this slice's samples;
* ``mimo_lm_head``: the ``GPTModel`` without embedding and layers on the received hidden states (its final norm and
  output layer), then the vocab-parallel cross-entropy over the slice's group where ``loss_mask`` is 1: the sum over
  the local samples over the global count of loss tokens (``batch x loss_tokens``), times the task's weight.

The MIMO model of the process (:func:`set_model`) is the one a graph was built from (:mod:`.mimo_source`).
"""
from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

import torch
with warnings.catch_warnings():  # megatron.core warns when MIMO's config class is defined, in every process
    warnings.filterwarnings("ignore", message=r"MimoModelConfig is experimental")
    from megatron.core.models.mimo import MimoModel
from megatron.core.transformer.spec_utils import build_module
from torch import Tensor, nn

from ..mimo.graph import MIMO_TYPES
from ..planner.workload.graph import DATA_PREFIX
from .blocks import GroupVocabParallelCrossEntropy, LocalGroup
from .custom import TorchLayerType, register_torch_layer
from .data import StreamSpec, parse_data_input
from .layers import OperatorLayer
from .mimo_build import block_name, build_part, empty_block, respec
from .mimo_data import example_inputs, token_streams

_MODEL: list = [None, None, None]  # (the provider's meta MimoModel, its description, the provider)


def set_model(mimo: MimoModel, description, provider=None) -> None:
    """The MIMO model whose parts this process builds (its specs on the meta device, its description, and the
    provider function that made it: the reference calls it again)."""
    if _MODEL[0] is not mimo:
        _ROPE.clear()
    _MODEL[:] = [mimo, description, provider]


def model():
    """``(meta MimoModel, description)`` of this process's MIMO model."""
    if _MODEL[0] is None:
        raise ValueError("no MIMO model loaded in this process (--model-provider / --spindle-model-provider)")
    return _MODEL[0], _MODEL[1]


def provider():
    """The provider function of this process's MIMO model."""
    model()
    return _MODEL[2]


class BlockReached(Exception):
    """Raised where an encoder calls its block: ``hidden`` is what the block would get ([s, b, h])."""

    def __init__(self, hidden: Tensor, extra: list[str]) -> None:
        super().__init__("block reached")
        self.hidden, self.extra = hidden, extra


class _Stop(nn.Module):
    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        extra = (["attention_mask"] if attention_mask is not None else []) + \
                [f"argument {i + 2}" for i, a in enumerate(args) if torch.is_tensor(a)] + \
                [k for k, v in kwargs.items() if torch.is_tensor(v)]
        raise BlockReached(hidden_states, extra)


class _Replay(nn.Module):
    """Stands where the block was: returns the given hidden states (through the block's final norm, if any)."""

    def __init__(self, block, hidden: Tensor, on_call=None) -> None:
        super().__init__()
        object.__setattr__(self, "_norm", block.final_layernorm)
        object.__setattr__(self, "_hidden", hidden)
        object.__setattr__(self, "_on_call", on_call)

    def forward(self, *args, **kwargs):
        if self._on_call is not None:
            self._on_call()
        return self._hidden if self._norm is None else self._norm(self._hidden)


def replay(block, hidden: Tensor, on_call=None) -> nn.Module:
    return _Replay(block, hidden, on_call)


@contextlib.contextmanager
def replaced(encoder: nn.Module, attr: str, module: nn.Module):
    original = getattr(encoder, attr)
    setattr(encoder, attr, module)
    try:
        yield
    finally:
        setattr(encoder, attr, original)


def stop_at(encoder: nn.Module, attr: str):
    return replaced(encoder, attr, _Stop())


def _streams(layer: OperatorLayer, inputs) -> tuple[list[Tensor], dict[str, Tensor]]:
    """(activation inputs, ``{keyword: tensor}`` of the data streams: the stream name's last part)."""
    acts, data = [], {}
    for x, name in zip(inputs, layer.op.inputs):
        if name.startswith(DATA_PREFIX):
            data[parse_data_input(name)[1].rsplit(".", 1)[-1]] = x
        else:
            acts.append(x)
    return acts, data


def _bsh(out, b: int) -> Tensor:
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(b, -1, out.shape[-1]) if out.dim() == 2 else out


def _every_weight(y: Tensor, core: nn.Module) -> Tensor:
    """``y`` depending, with a zero weight, on every trainable parameter of ``core``: the embed and post parts of
    an encoder hold one weight (its key), and each uses only some of it (conv and positions before the block, a
    final norm after it), and a rank may run only one of them; megatron's DDP needs every parameter's gradient
    (zero for an unused one) in every backward, as ``find_unused_parameters`` gives torch's."""
    unused = [p.reshape(-1)[:1] for p in core.parameters() if p.requires_grad]
    if not unused or not torch.is_grad_enabled():
        return y
    return y + torch.cat(unused).sum().to(y.dtype) * 0


def _move_attributes(module: nn.Module, device) -> None:
    """Plain tensor attributes (``CLIPViTModel.position_ids``: neither parameter nor buffer) to ``device``."""
    for m in module.modules():
        for k, v in list(vars(m).items()):
            if torch.is_tensor(v) and not isinstance(v, nn.Parameter) and v.device != device:
                setattr(m, k, v.to(device))


class MimoEncoderLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        acts, kwargs = _streams(self, inputs)
        enc = self.core
        b = next(iter(kwargs.values())).shape[0]
        _move_attributes(enc, next(iter(kwargs.values())).device)
        attr = block_name(enc)
        if not acts:
            with stop_at(enc, attr):
                try:
                    enc(**kwargs)
                except BlockReached as r:
                    return _every_weight(r.hidden.transpose(0, 1), enc)
            raise RuntimeError(f"operator {self.op.name!r}: the encoder's forward did not call its block {attr!r}")
        with replaced(enc, attr, replay(getattr(enc, attr), acts[0].transpose(0, 1))):
            return _every_weight(_bsh(enc(**kwargs), b), enc)


class MimoModuleLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        _, kwargs = _streams(self, inputs)
        b = next(iter(kwargs.values())).shape[0]
        _move_attributes(self.core, next(iter(kwargs.values())).device)
        return _every_weight(_bsh(self.core(**kwargs), b), self.core)  # a wrapper may hold unused weights


class MimoLayerLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, _ = self._split(inputs)
        rope = None
        if self.op.param_key.startswith("language_model.") and _rope_model() is not None:
            rope = _rope_model().rotary_pos_emb(x.shape[1]).to(x.device)
        out = self.core(hidden_states=x.transpose(0, 1), attention_mask=None, rotary_pos_emb=rope)
        return (out[0] if isinstance(out, tuple) else out).transpose(0, 1)


class MimoProjectionLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        x, _ = self._split(inputs)
        b, s, h = x.shape
        return self.core(x.reshape(b * s, h)).reshape(b, s, -1)


class MimoLMEmbedLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        acts, data = _streams(self, inputs)
        ids = data["input_ids"]
        specials = dict(model()[1].special_tokens)
        shim = SimpleNamespace(language_model=SimpleNamespace(embedding=self.core), partition_adapter=None)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        embeddings = {}
        for name, x in zip([n for n in self.op.inputs if not n.startswith(DATA_PREFIX)], acts):
            embeddings[name.split(".")[1]] = x.reshape(-1, x.shape[-1])
        embeddings["text"] = MimoModel.get_text_embeddings(shim, ids, positions, specials)
        combined = MimoModel.align_embeddings_by_token_positions(shim, embeddings, ids, specials)
        return combined.transpose(0, 1)


class MimoLMHeadLayer(OperatorLayer):
    def forward(self, inputs: list[Tensor]) -> Tensor:
        (x,), data = _streams(self, inputs)
        labels, mask = data["labels"], data["loss_mask"]
        c = self.op.layer
        if mask.numel() and int(mask.sum().round()) != mask.shape[0] * c.loss_tokens:
            raise ValueError(f"operator {self.op.name!r}: every sample must have {c.loss_tokens} loss tokens "
                             f"(loss_mask 1), this batch has {float(mask.sum()):g} for {mask.shape[0]} samples")
        gpt = self.core
        gpt.set_input_tensor(x.transpose(0, 1))
        logits = gpt(input_ids=None, position_ids=None, attention_mask=None)
        loss = GroupVocabParallelCrossEntropy.apply(logits, labels, self.tp_group, self.tp_rank, self.tp_size)
        return (loss.float() * mask.float()).sum() * (self.task_weight / (self.op.batch * c.loss_tokens))


_ROPE: list = []


def _rope_model():
    """A ``GPTModel`` from the user's spec with no embedding, layers or head (no weights): its RoPE module."""
    if not _ROPE:
        mimo, _ = model()
        lm = mimo.language_model
        if lm.position_embedding_type != "rope":
            _ROPE.append(None)
        else:
            spec = respec(mimo.mimo_config.language_model_spec, layers=empty_block(lm.decoder), tp_size=1,
                          dtype=torch.float32, tp_group=LocalGroup(), pre_process=False, post_process=False)
            _ROPE.append(build_module(spec))
    return _ROPE[0]


# -- data streams and synthetic batches ---------------------------------------------------------------------
def _stream_spec(op, position: int, task: str = "", stream: str = "") -> StreamSpec:
    c, name = op.layer, op.inputs[position]
    kw = parse_data_input(name)[1]
    if op.op_type in ("mimo_encoder", "mimo_module"):
        enc = next(m.encoder for m in model()[1].modalities if kw.startswith(f"{m.name}.{m.encoder.name}."))
        shape = next(s.shape for s in enc.inputs if kw.endswith("." + s.name))
        return StreamSpec(task=task, stream=stream, shape=tuple(shape), dtype=torch.float32, consumer=op.name)
    if kw == "input_ids":  # special tokens sit outside the vocabulary's range check
        return StreamSpec(task=task, stream=stream, shape=(c.seq_len,), dtype=torch.int64, consumer=op.name)
    if kw == "labels":
        return StreamSpec(task=task, stream=stream, shape=(c.seq_len,), dtype=torch.int64,
                          vocab_size=c.vocab_size, consumer=op.name)
    return StreamSpec(task=task, stream=stream, shape=(c.seq_len,), dtype=torch.float32, consumer=op.name)


def _synthesize(op, specs: dict, z: Tensor, seed: int) -> dict[str, Tensor]:
    """``input_ids``, ``labels``, ``loss_mask`` of one task's batch (:mod:`.mimo_data`)."""
    return token_streams(op, z, seed, model()[1])


def _example(op, batch: int, *, generator=None, dtype=torch.float32, device=None, requires_grad=False, graph=None):
    return example_inputs(op, batch, model()[1], graph=graph, generator=generator, dtype=dtype, device=device,
                          requires_grad=requires_grad)


def _build(op, *, tp_group, tp_rank: int, tp_size: int, dtype) -> nn.Module:
    return build_part(model()[0], op.op_type, op.param_key, tp_group=tp_group, tp_size=tp_size, dtype=dtype)


_CLASSES = {"mimo_encoder": MimoEncoderLayer, "mimo_layer": MimoLayerLayer, "mimo_module": MimoModuleLayer,
            "mimo_projection": MimoProjectionLayer, "mimo_lm_embed": MimoLMEmbedLayer,
            "mimo_lm_head": MimoLMHeadLayer}
assert set(_CLASSES) == set(MIMO_TYPES), "every MIMO operator type needs a layer class"
for _t, _cls in _CLASSES.items():
    register_torch_layer(_t, TorchLayerType(build=_build, layer_class=_cls, loss=_t == "mimo_lm_head",
                                            stream_spec=_stream_spec, example_inputs=_example,
                                            synthesize=_synthesize if _t == "mimo_lm_embed" else None))
