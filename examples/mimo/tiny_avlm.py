"""A tiny audio-vision-language MIMO model: what a Megatron user writes, small enough for CPU ranks.

``tiny_avlm`` returns a ``MimoModel`` with two modalities, each one encoder and an MLP input projection, and a GPT
language model, all on megatron.core's local layer specs (no TransformerEngine):

* ``images``: ``CLIPViTModel`` (16 x 16 pixels, patches of 8: 4 patches and a class token), 32 wide, 2 layers;
* ``audio``: :class:`audio_encoder.WhisperStyleEncoder` (8 mel bins, 8 frames halved to 4 tokens), 24 wide, 2 layers;
* the language model: ``GPTModel``, 32 wide, 2 layers, grouped queries (4 heads, 2 groups), SwiGLU, RMSNorm,
  RoPE, a vocabulary of 128; the special tokens 126 (images) and 127 (audio) mark where each modality's
  embeddings go.

Dropout is off (so a single process and a Spindle plan see the same numbers). ``tiny_vlm_opaque`` is the same
vision-language model with a plain-torch image encoder (not megatron.core): Spindle runs it as one data-parallel
MetaOp. Tasks: ``tiny_tasks.toml`` beside this file. Plan it without a GPU::

    spindle plan --model-provider examples.mimo.tiny_avlm:tiny_avlm --tasks-file examples/mimo/tiny_tasks.toml --gpus 4
"""
from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.mimo import MimoModel, MimoModelConfig
from megatron.core.models.mimo.submodules.audio import AudioModalitySubmodules
from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from examples.mimo.audio_encoder import WhisperStyleEncoder

IMAGE_TOKEN, AUDIO_TOKEN = 126, 127
NO_FUSION = dict(hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
                 masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                 gradient_accumulation_fusion=False, use_cpu_initialization=True)


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(**{**NO_FUSION, **kw})


def _projection(input_size: int, hidden: int) -> ModuleSpec:
    return ModuleSpec(module=MultimodalProjector, params={
        "config": _config(num_layers=1, hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=2 * hidden,
                          add_bias_linear=True),
        "submodules": MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        "projector_type": "mlp", "input_size": input_size})


def _language_model(pre_process: bool, post_process: bool) -> ModuleSpec:
    config = _config(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                     gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                     normalization="RMSNorm")
    return ModuleSpec(module=GPTModel, params={
        "config": config, "transformer_layer_spec": get_gpt_layer_local_spec(normalization="RMSNorm"),
        "vocab_size": 128, "max_sequence_length": 32, "position_embedding_type": "rope",
        "pre_process": pre_process, "post_process": post_process})


def _images() -> ModuleSpec:
    clip = ModuleSpec(module=CLIPViTModel, params={
        "transformer_config": _config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                      add_bias_linear=True, add_qkv_bias=True),
        "transformer_layer_spec": get_vit_layer_with_local_spec(), "ln_pre_impl": WrappedTorchNorm,
        "ln_post_impl": WrappedTorchNorm, "patch_dim": 8, "img_h": 16, "img_w": 16})
    return ModuleSpec(module=VisionModalitySubmodules, submodules={
        "encoders": {"clip": clip}, "input_projections": [_projection(32, 32)]})


def tiny_avlm(pre_process: bool = True, post_process: bool = True, pg_collection=None, **framework_kwargs):
    """The MIMO model (Megatron's model-provider keywords; ``pg_collection`` as Megatron-LM's MIMO providers use it)."""
    whisper = ModuleSpec(module=WhisperStyleEncoder, params={
        "transformer_config": _config(num_layers=2, hidden_size=24, num_attention_heads=4, ffn_hidden_size=48,
                                      add_bias_linear=True, add_qkv_bias=True),
        "transformer_layer_spec": get_vit_layer_with_local_spec(), "num_mel_bins": 8, "frames": 8})
    audio = ModuleSpec(module=AudioModalitySubmodules, submodules={
        "encoders": {"whisper": whisper}, "input_projections": [_projection(24, 32)]})
    config = MimoModelConfig(language_model_spec=_language_model(pre_process, post_process),
                             modality_submodules_spec={"images": _images(), "audio": audio},
                             special_token_ids={"images": IMAGE_TOKEN, "audio": AUDIO_TOKEN})
    return MimoModel(config)


class PatchMLPEncoder(torch.nn.Module):
    """A plain-torch image encoder (not megatron.core, like Megatron-LM's Hugging Face wrappers): 8 x 8 patches, a
    two-layer MLP per patch. ``x`` ``[b, 3, 16, 16]`` -> ``[b, 4, 32]``."""

    def __init__(self, hidden: int = 32, patch: int = 8) -> None:
        super().__init__()
        self.patch = patch
        self.fc1 = torch.nn.Linear(3 * patch * patch, 2 * hidden)
        self.fc2 = torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch
        b, c, h, w = x.shape
        x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def tiny_vlm_opaque(pre_process: bool = True, post_process: bool = True, **framework_kwargs):
    """A vision-language MIMO model whose image encoder is not megatron.core (one MetaOp, data parallel only)."""
    images = ModuleSpec(module=VisionModalitySubmodules, submodules={
        "encoders": {"patch_mlp": ModuleSpec(module=PatchMLPEncoder, params={"hidden": 32})},
        "input_projections": [_projection(32, 32)]})
    lm = _language_model(pre_process, post_process)
    lm.params["position_embedding_type"] = "learned_absolute"
    config = MimoModelConfig(language_model_spec=lm, modality_submodules_spec={"images": images},
                             special_token_ids={"images": IMAGE_TOKEN})
    return MimoModel(config)
