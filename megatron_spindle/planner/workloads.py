"""The built-in multi-task models as plain configuration, and the task graphs built from it.

One source of truth: the sizes and task lists below are read by :func:`build_graph` (for the planner) and,
through the graph's :class:`LayerConfig` of every operator, by the runtime that builds the torch model.

* ``multitask-clip``: ImageBind structure. One transformer encoder per modality (vision, text, audio, depth,
  thermal, IMU) with a patch/token embedding, a pool head (CLS, or EOS for text) with a projection, and one
  symmetric InfoNCE loss per task pairing two modalities. 4, 7 or 10 tasks (first K of :data:`CLIP_TASKS`).
* ``qwen-val``: ViT-bigG-style vision encoder, one-layer cross-attention adapter (256 queries), Whisper-large
  style audio encoder with a pooling projection, Qwen-7B-style decoder LLM. Tasks vision-language,
  audio-language, language; next-token loss on the text tokens.
* ``ofasys``: light modality adaptors (ViT adaptor 768 × 9 layers for images and video, a 6-layer audio
  adaptor, embeddings for text and boxes) feeding a shared 12-layer encoder and a 12-layer decoder, with a
  next-token loss. 4 or 7 tasks (first K of :data:`OFASYS_TASKS`).

``size="tiny"`` scales every model down (same structure, same task list) for CPU tests and the demo.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from . import costs
from .graph import LayerConfig, Operator, TaskGraph, data_input


@dataclass(frozen=True, kw_only=True)
class EncoderSpec:
    """One transformer stack of a modality (or the LLM / shared encoder-decoder)."""

    name: str
    hidden: int
    num_layers: int
    num_heads: int
    seq_len: int
    """Tokens per sample, class token included."""
    ffn_hidden: int = 0
    """MLP width; 0 means ``4 × hidden``."""
    input_dim: int = 0
    """Patch/frame width of a ``patches`` input."""
    vocab_size: int = 0
    """Vocabulary of a ``tokens`` input."""
    input: str = "patches"
    """``patches`` (continuous, pre-cut) or ``tokens``."""
    pooling: str = "cls"
    swiglu: bool = False
    causal: bool = False

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden


# --------------------------------------------------------------------------------------------------
# Multitask-CLIP
# --------------------------------------------------------------------------------------------------
CLIP_ENCODERS = (
    EncoderSpec(name="vision", hidden=1280, num_layers=32, num_heads=16, seq_len=257, input_dim=588),
    EncoderSpec(name="text", hidden=1024, num_layers=24, num_heads=16, seq_len=77, vocab_size=49408,
                input="tokens", pooling="eos", causal=True),
    EncoderSpec(name="audio", hidden=768, num_layers=12, num_heads=12, seq_len=229, input_dim=256),
    EncoderSpec(name="depth", hidden=384, num_layers=12, num_heads=8, seq_len=197, input_dim=256),
    EncoderSpec(name="thermal", hidden=768, num_layers=12, num_heads=12, seq_len=197, input_dim=256),
    EncoderSpec(name="imu", hidden=512, num_layers=6, num_heads=8, seq_len=251, input_dim=48),
)
#: Modality pairs, one contrastive task each; ``--tasks K`` takes the first K.
CLIP_TASKS = (
    ("vision", "text"), ("audio", "text"), ("vision", "depth"), ("vision", "thermal"),
    ("vision", "imu"), ("audio", "vision"), ("depth", "text"), ("thermal", "text"),
    ("imu", "text"), ("audio", "imu"),
)
CLIP_PROJ_DIM = 1024
CLIP_TEMPERATURE = 0.07

# --------------------------------------------------------------------------------------------------
# Qwen-VAL
# --------------------------------------------------------------------------------------------------
QWEN_VISION = EncoderSpec(name="vision", hidden=1664, num_layers=48, num_heads=16, seq_len=1024,
                          input_dim=588, pooling="")
QWEN_AUDIO = EncoderSpec(name="audio", hidden=1280, num_layers=32, num_heads=20, seq_len=1500,
                         input_dim=160, pooling="")
QWEN_LLM = EncoderSpec(name="llm", hidden=4096, num_layers=32, num_heads=32, seq_len=512,
                       ffn_hidden=11008, vocab_size=151936, input="tokens", swiglu=True, causal=True,
                       pooling="")
QWEN_ADAPTER_QUERIES = 256
QWEN_AUDIO_POOL = 4  # Whisper frames averaged 4:1 before the projection into the LLM (1500 -> 375)
#: task -> (modality feeding the LLM or "", text tokens with a next-token loss)
QWEN_TASKS = (("vision-language", "vision", 256), ("audio-language", "audio", 137),
              ("language", "", 512))

# --------------------------------------------------------------------------------------------------
# OFASys
# --------------------------------------------------------------------------------------------------
OFASYS_ADAPTORS = (
    EncoderSpec(name="image", hidden=768, num_layers=9, num_heads=12, seq_len=197, input_dim=588),
    EncoderSpec(name="video", hidden=768, num_layers=9, num_heads=12, seq_len=393, input_dim=588),
    EncoderSpec(name="audio", hidden=768, num_layers=6, num_heads=12, seq_len=251, input_dim=160),
)
OFASYS_VOCAB = 59520  # OFA's 59457 padded to a multiple of 128, as Megatron pads vocabularies
OFASYS_ENCODER = EncoderSpec(name="encoder", hidden=1024, num_layers=12, num_heads=16, seq_len=0,
                             vocab_size=OFASYS_VOCAB, input="tokens")
OFASYS_DECODER = EncoderSpec(name="decoder", hidden=1024, num_layers=12, num_heads=16, seq_len=0,
                             vocab_size=OFASYS_VOCAB, input="tokens", causal=True)
#: task -> (input streams with their token counts for text-like ones, target tokens). Streams named
#: after an adaptor use it; "text"/"box" streams are embedded tokens.
OFASYS_TASKS = (
    ("caption", (("image", 0),), 32),
    ("vqa", (("image", 0), ("text", 32)), 8),
    ("summary", (("text", 512),), 64),
    ("asr", (("audio", 0),), 64),
    ("video-caption", (("video", 0),), 32),
    ("grounding", (("image", 0), ("text", 32)), 4),
    ("text2sql", (("text", 128),), 64),
)

#: model name -> (allowed task counts, default global batch per task)
WORKLOADS: Mapping[str, tuple[tuple[int, ...], int]] = {
    "multitask-clip": ((4, 7, 10), 128),
    "qwen-val": ((3,), 8),
    "ofasys": ((4, 7), 64),
}
SIZES = ("full", "tiny")


def _tiny_encoder(e: EncoderSpec) -> EncoderSpec:
    """Same structure, a few layers of width 32-64: trains in milliseconds per step on one core."""
    heads = 4 if e.num_heads else 0
    hidden = max(32, min(64, e.hidden // 24 // heads * heads)) if heads else 32
    return dataclasses.replace(
        e, hidden=hidden, num_layers=max(2, min(4, e.num_layers // 6)), num_heads=heads,
        seq_len=max(4, min(16, e.seq_len // 32)) if e.seq_len else 0,
        ffn_hidden=2 * hidden if e.ffn_hidden else 0,
        input_dim=min(e.input_dim, 24), vocab_size=min(e.vocab_size, 128) if e.vocab_size else 0)


def _flops(op_type: str, c: LayerConfig, batch: int) -> float:
    if op_type == "contrastive_loss":
        return costs.contrastive_loss_flops(batch, c.proj_dim)
    return costs.layer_fwd_flops_per_sample(op_type, c) * batch


class _Builder:
    """Appends operators in topological order, computing their costs from their layer config."""

    def __init__(self) -> None:
        self.ops: list[Operator] = []

    def add(self, *, name: str, task: str, module: str, op_type: str, batch: int, layer: LayerConfig,
            param_key: str, inputs: Sequence[str], batch_splittable: bool = True,
            tp_splittable: bool = True) -> str:
        self.ops.append(Operator(
            name=name, task=task, module=module, op_type=op_type, batch=batch, layer=layer,
            param_key=param_key, inputs=tuple(inputs), fwd_flops=_flops(op_type, layer, batch),
            param_count=costs.layer_params(op_type, layer) if param_key else 0,
            out_elems_per_sample=costs.out_elems_per_sample(op_type, layer),
            act_bytes_per_sample=costs.layer_act_bytes_per_sample(op_type, layer),
            batch_splittable=batch_splittable, tp_splittable=tp_splittable))
        return name

    def stack(self, *, task: str, e: EncoderSpec, batch: int, first_input: Sequence[str],
              seq_len: int, prefix: str = "", op_type: str = "transformer_layer",
              memory_seq_len: int = 0) -> str:
        """``e.num_layers`` identical layers; returns the last operator's name."""
        layer = LayerConfig(hidden=e.hidden, num_heads=e.num_heads, ffn_hidden=e.ffn, seq_len=seq_len,
                            causal=e.causal, swiglu=e.swiglu, memory_seq_len=memory_seq_len)
        prev: Sequence[str] = first_input
        module = prefix or e.name
        for i in range(e.num_layers):
            prev = [self.add(name=f"{task}.{module}.{i}", task=task, module=module, op_type=op_type,
                             batch=batch, layer=layer, param_key=f"{module}.layers.{i}", inputs=prev)]
        return prev[0]

    def embed(self, *, task: str, e: EncoderSpec, batch: int, stream: str, seq_len: int,
              module: str = "", param_key: str = "") -> str:
        module = module or e.name
        if e.input == "tokens":
            layer = LayerConfig(hidden=e.hidden, seq_len=seq_len, vocab_size=e.vocab_size)
            op_type = "token_embed"
        else:
            layer = LayerConfig(hidden=e.hidden, seq_len=seq_len, input_dim=e.input_dim)
            op_type = "patch_embed"
        return self.add(name=f"{task}.{module}.embed", task=task, module=module, op_type=op_type,
                        batch=batch, layer=layer, param_key=param_key or f"{module}.embed",
                        inputs=[data_input(task, stream)], tp_splittable=False)


def _clip_graph(k: int, batch: Mapping[str, int], size: str) -> TaskGraph:
    encoders = {e.name: (e if size == "full" else _tiny_encoder(e)) for e in CLIP_ENCODERS}
    proj = CLIP_PROJ_DIM if size == "full" else 16
    b = _Builder()
    tasks = []
    for a_name, b_name in CLIP_TASKS[:k]:
        task = f"{a_name}-{b_name}"
        tasks.append(task)
        heads = []
        for m in (a_name, b_name):
            e = encoders[m]
            x = b.embed(task=task, e=e, batch=batch[task], stream=m, seq_len=e.seq_len)
            x = b.stack(task=task, e=e, batch=batch[task], first_input=[x], seq_len=e.seq_len)
            heads.append(b.add(
                name=f"{task}.{m}.head", task=task, module=m, op_type="pool_head", batch=batch[task],
                layer=LayerConfig(hidden=e.hidden, seq_len=e.seq_len, proj_dim=proj, pooling=e.pooling),
                param_key=f"{m}.head", inputs=[x], tp_splittable=False))
        b.add(name=f"{task}.loss", task=task, module="loss", op_type="contrastive_loss",
              batch=batch[task], layer=LayerConfig(hidden=proj, proj_dim=proj,
                                                   temperature=CLIP_TEMPERATURE),
              param_key="", inputs=heads, batch_splittable=False, tp_splittable=False)
    return TaskGraph(model="multitask-clip", tasks=tuple(tasks), operators=tuple(b.ops))


def _qwen_graph(batch: Mapping[str, int], size: str) -> TaskGraph:
    tiny = size == "tiny"
    vis, aud, llm = (QWEN_VISION, QWEN_AUDIO, QWEN_LLM) if not tiny else (
        _tiny_encoder(QWEN_VISION), _tiny_encoder(QWEN_AUDIO), _tiny_encoder(QWEN_LLM))
    queries = QWEN_ADAPTER_QUERIES if not tiny else 4
    b = _Builder()
    tasks = []
    for task, modality, text_tokens in QWEN_TASKS:
        if tiny:
            text_tokens = max(4, text_tokens // 64)
        tasks.append(task)
        B = batch[task]
        parts = []
        if modality == "vision":
            x = b.embed(task=task, e=vis, batch=B, stream="vision", seq_len=vis.seq_len + 1)
            x = b.stack(task=task, e=vis, batch=B, first_input=[x], seq_len=vis.seq_len + 1)
            parts.append(b.add(
                name=f"{task}.vision.adapter", task=task, module="vision", op_type="cross_attn_adapter",
                batch=B, layer=LayerConfig(hidden=llm.hidden, num_heads=llm.num_heads, seq_len=queries,
                                           input_dim=vis.hidden, input_seq_len=vis.seq_len + 1),
                param_key="vision.adapter", inputs=[x]))
            prefix = queries
        elif modality == "audio":
            x = b.embed(task=task, e=aud, batch=B, stream="audio", seq_len=aud.seq_len + 1)
            x = b.stack(task=task, e=aud, batch=B, first_input=[x], seq_len=aud.seq_len + 1)
            pooled = (aud.seq_len + 1) // QWEN_AUDIO_POOL
            parts.append(b.add(
                name=f"{task}.audio.adapter", task=task, module="audio", op_type="linear_adapter",
                batch=B, layer=LayerConfig(hidden=llm.hidden, seq_len=pooled, input_dim=aud.hidden,
                                           input_seq_len=pooled * QWEN_AUDIO_POOL),
                param_key="audio.adapter", inputs=[x]))
            prefix = pooled
        else:
            prefix = 0
        seq = prefix + text_tokens
        parts.append(b.add(
            name=f"{task}.llm.embed", task=task, module="llm", op_type="token_embed", batch=B,
            layer=LayerConfig(hidden=llm.hidden, seq_len=text_tokens, vocab_size=llm.vocab_size),
            param_key="llm.embed", inputs=[data_input(task, "text")]))
        x = b.stack(task=task, e=llm, batch=B, first_input=parts, seq_len=seq)
        b.add(name=f"{task}.llm.head", task=task, module="llm", op_type="lm_head", batch=B,
              layer=LayerConfig(hidden=llm.hidden, seq_len=seq, vocab_size=llm.vocab_size,
                                loss_tokens=text_tokens),
              param_key="llm.head", inputs=[x, data_input(task, "labels")])
    return TaskGraph(model="qwen-val", tasks=tuple(tasks), operators=tuple(b.ops))


def _ofasys_graph(k: int, batch: Mapping[str, int], size: str) -> TaskGraph:
    tiny = size == "tiny"
    adaptors = {e.name: (_tiny_encoder(e) if tiny else e) for e in OFASYS_ADAPTORS}
    enc, dec = (OFASYS_ENCODER, OFASYS_DECODER) if not tiny else (
        _tiny_encoder(dataclasses.replace(OFASYS_ENCODER, seq_len=1)),
        _tiny_encoder(dataclasses.replace(OFASYS_DECODER, seq_len=1)))
    b = _Builder()
    tasks = []
    for task, streams, target in OFASYS_TASKS[:k]:
        tasks.append(task)
        B = batch[task]
        if tiny:
            target = max(2, target // 16)
        parts, seq = [], 0
        for stream, tokens in streams:
            if stream in adaptors:
                e = adaptors[stream]
                x = b.embed(task=task, e=e, batch=B, stream=stream, seq_len=e.seq_len)
                x = b.stack(task=task, e=e, batch=B, first_input=[x], seq_len=e.seq_len)
                parts.append(b.add(
                    name=f"{task}.{stream}.adapter", task=task, module=stream, op_type="linear_adapter",
                    batch=B, layer=LayerConfig(hidden=enc.hidden, seq_len=e.seq_len, input_dim=e.hidden,
                                               input_seq_len=e.seq_len),
                    param_key=f"{stream}.adapter", inputs=[x]))
                seq += e.seq_len
            else:
                tokens = max(2, tokens // 16) if tiny else tokens
                parts.append(b.embed(task=task, e=enc, batch=B, stream=stream, seq_len=tokens,
                                     module=stream, param_key="encoder.embed"))
                seq += tokens
        x = b.stack(task=task, e=enc, batch=B, first_input=parts, seq_len=seq)
        y = b.add(name=f"{task}.decoder.embed", task=task, module="decoder", op_type="token_embed",
                  batch=B, layer=LayerConfig(hidden=dec.hidden, seq_len=target, vocab_size=dec.vocab_size),
                  param_key="decoder.embed", inputs=[data_input(task, "target")], tp_splittable=False)
        y = b.stack(task=task, e=dec, batch=B, first_input=[y, x], seq_len=target,
                    op_type="decoder_layer", memory_seq_len=seq)
        b.add(name=f"{task}.decoder.head", task=task, module="decoder", op_type="lm_head", batch=B,
              layer=LayerConfig(hidden=dec.hidden, seq_len=target, vocab_size=dec.vocab_size,
                                loss_tokens=target),
              param_key="decoder.head", inputs=[y, data_input(task, "labels")])
    return TaskGraph(model="ofasys", tasks=tuple(tasks), operators=tuple(b.ops))


def task_counts(model: str) -> tuple[int, ...]:
    if model not in WORKLOADS:
        raise ValueError(f"unknown model {model!r}; built-in models: {', '.join(WORKLOADS)}")
    return WORKLOADS[model][0]


def build_graph(model: str, *, tasks: int | None = None, size: str = "full",
                batch: int | Mapping[str, int] | None = None) -> TaskGraph:
    """The task graph of a built-in model.

    ``tasks`` picks how many tasks (default: the largest allowed); ``batch`` is the global batch per task,
    one number for all tasks or a mapping task -> batch (default: the model's default).
    """
    counts = task_counts(model)
    k = counts[-1] if tasks is None else tasks
    if k not in counts:
        raise ValueError(f"model {model!r} is defined for {counts} tasks, not {k}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {SIZES}")
    names = {
        "multitask-clip": [f"{a}-{b}" for a, b in CLIP_TASKS[:k]],
        "qwen-val": [t for t, _, _ in QWEN_TASKS],
        "ofasys": [t for t, _, _ in OFASYS_TASKS[:k]],
    }[model]
    default = WORKLOADS[model][1]
    if batch is None:
        per_task = {t: default for t in names}
    elif isinstance(batch, int):
        per_task = {t: batch for t in names}
    else:
        unknown = set(batch) - set(names)
        if unknown:
            raise ValueError(f"batch given for unknown tasks {sorted(unknown)} of model {model!r}")
        per_task = {t: batch.get(t, default) for t in names}
    for t, v in per_task.items():
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"global batch of task {t!r} must be a positive integer, got {v!r}")
    if model == "multitask-clip":
        return _clip_graph(k, per_task, size)
    if model == "qwen-val":
        return _qwen_graph(per_task, size)
    return _ofasys_graph(k, per_task, size)
