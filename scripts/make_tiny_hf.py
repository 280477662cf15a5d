"""Write tiny Hugging Face models with random weights (``save_pretrained``: config.json + model.safetensors).

No download: each model is built from a config on the spot. ``python scripts/make_tiny_hf.py OUT`` writes
``OUT/tiny-clip`` (CLIPModel: vision 48 wide, 2 layers; text 32 wide, 2 layers, causal; projection 24),
``OUT/tiny-llama`` (LlamaForCausalLM: 64 wide, 2 layers, 8 heads in 2 query groups, RoPE, SwiGLU) and
``OUT/tiny-qwen2`` (Qwen2ForCausalLM: the same with QKV biases and a tied head). The tests build the same
models (``make(kind, dir)``), so docs/pretrained.md's figures come from these exact configurations.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

KINDS = ("tiny-clip", "tiny-clip-vision", "tiny-clip-text", "tiny-llama", "tiny-qwen2")


def _clip_text():
    # eos_token_id inside the vocabulary: the text tower pools at the EOS token (the last one in our data)
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=96,
                max_position_embeddings=16, eos_token_id=95, bos_token_id=94, pad_token_id=1)


def _clip_vision():
    return dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                patch_size=4)


def build(kind: str, seed: int = 0):
    """The ``transformers`` model of ``kind`` with random weights drawn from ``seed``."""
    import transformers as tf  # optional: transformers (pip install .[hf])

    torch.manual_seed(seed)
    if kind == "tiny-clip":
        cfg = tf.CLIPConfig(text_config=_clip_text(), vision_config=_clip_vision(), projection_dim=24)
        model = tf.CLIPModel(cfg)
    elif kind == "tiny-clip-vision":
        model = tf.CLIPVisionModel(tf.CLIPVisionConfig(**_clip_vision()))
    elif kind == "tiny-clip-text":
        model = tf.CLIPTextModel(tf.CLIPTextConfig(**_clip_text()))
    elif kind == "tiny-llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1,
            eos_token_id=2, pad_token_id=0))
    elif kind == "tiny-qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64, tie_word_embeddings=True))
    else:
        raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    with torch.no_grad():  # random norms and biases too, so that a wrong mapping of any tensor shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def make(kind: str, path: str, seed: int = 0) -> str:
    build(kind, seed).save_pretrained(path)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder to write the models into")
    p.add_argument("--kinds", default="tiny-clip,tiny-llama,tiny-qwen2", help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for kind in args.kinds.split(","):
        print(make(kind, os.path.join(args.out, kind), args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
