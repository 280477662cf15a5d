"""A Qwen-VAL-sized MIMO model (vision, audio, a 7B language model) as a Megatron user would write its provider.

``qwen_val`` returns a ``MimoModel`` of the sizes of the Qwen-VAL reference model (``megatron_spindle/specs/
qwen-val.toml``), in MIMO's own structure (each modality's encoder output projected per token into the language
model at its special tokens, as LLaVA does, where Qwen-VL resamples to 256 queries):

* ``images``: ``CLIPViTModel``, ViT-bigG/14 sizes (1664 wide, 48 layers, 16 heads, MLP 8192; Cherti et al.,
  OpenCLIP scaling, arXiv 2212.07143) on 448 x 448 images: 1024 patches and a class token; an MLP projection to
  4096;
* ``audio``: :class:`audio_encoder.WhisperStyleEncoder` of Whisper-large sizes (1280 wide, 32 layers, 20 heads,
  128 mel bins over 3000 frames, halved to 1500; Radford et al. 2022, table 1), pooled by 2 as Qwen-Audio does (750
  tokens), then an MLP projection to 4096;
* the language model: ``GPTModel`` of Qwen-7B's sizes (4096 wide, 32 layers, 32 heads, FFN 11008, SwiGLU, RMSNorm,
  bias on QKV only, RoPE, vocabulary 151936, 2048 positions; Bai et al., Qwen technical report, arXiv 2309.16609,
  table 1).

megatron.core's local layer specs (the planner only reads the model; a GPU run would pick TransformerEngine's specs,
``get_gpt_layer_with_transformer_engine_spec``, here). Tasks: ``qwen_val_tasks.toml``. Built on the meta device by
``spindle plan|compare --model-provider examples.mimo.qwen_val:qwen_val``: nothing is allocated.
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
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from examples.mimo.audio_encoder import WhisperStyleEncoder

IMAGE_TOKEN, AUDIO_TOKEN = 151655, 151646
LLM = 4096


def _encoder_layer_spec() -> ModuleSpec:
    """megatron's local ViT layer, with bidirectional attention (its spec defaults to a causal mask)."""
    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.no_mask}
    return spec


def _projection(input_size: int) -> ModuleSpec:
    config = TransformerConfig(num_layers=1, hidden_size=LLM, num_attention_heads=1, ffn_hidden_size=LLM,
                               add_bias_linear=True, bias_activation_fusion=False)
    return ModuleSpec(module=MultimodalProjector, params={
        "config": config, "submodules": MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        "projector_type": "mlp", "input_size": input_size})


def qwen_val(pre_process: bool = True, post_process: bool = True, **framework_kwargs):
    vit = TransformerConfig(num_layers=48, hidden_size=1664, num_attention_heads=16, ffn_hidden_size=8192,
                            add_bias_linear=True, add_qkv_bias=True, bias_activation_fusion=False)
    clip = ModuleSpec(module=CLIPViTModel, params={
        "transformer_config": vit, "transformer_layer_spec": _encoder_layer_spec(), "ln_pre_impl": WrappedTorchNorm,
        "ln_post_impl": WrappedTorchNorm, "patch_dim": 14, "img_h": 448, "img_w": 448})
    whisper_config = TransformerConfig(num_layers=32, hidden_size=1280, num_attention_heads=20, ffn_hidden_size=5120,
                                       add_bias_linear=True, add_qkv_bias=True, bias_activation_fusion=False)
    whisper = ModuleSpec(module=WhisperStyleEncoder, params={
        "transformer_config": whisper_config, "transformer_layer_spec": _encoder_layer_spec(), "num_mel_bins": 128,
        "frames": 3000, "pool": 2})
    llm = TransformerConfig(num_layers=32, hidden_size=LLM, num_attention_heads=32, ffn_hidden_size=11008,
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            add_qkv_bias=True, normalization="RMSNorm", bias_activation_fusion=False)
    language = ModuleSpec(module=GPTModel, params={
        "config": llm, "transformer_layer_spec": get_gpt_layer_local_spec(normalization="RMSNorm"),
        "vocab_size": 151936, "max_sequence_length": 2048, "position_embedding_type": "rope",
        "pre_process": pre_process, "post_process": post_process})
    images = ModuleSpec(module=VisionModalitySubmodules, submodules={"encoders": {"vit": clip},
                                                                     "input_projections": [_projection(1664)]})
    audio = ModuleSpec(module=AudioModalitySubmodules, submodules={"encoders": {"whisper": whisper},
                                                                   "input_projections": [_projection(1280)]})
    return MimoModel(MimoModelConfig(language_model_spec=language, modality_submodules_spec={"images": images,
                                                                                             "audio": audio},
                                     special_token_ids={"images": IMAGE_TOKEN, "audio": AUDIO_TOKEN}))
