"""A Whisper-style audio encoder built from megatron.core blocks (a user's own encoder class, for the examples).

Two 1-d convolutions over the log-mel frames (the second halves the frames), learned positions, a
``TransformerBlock`` of the user's layer spec, and a final norm: the structure of Whisper's encoder (Radford et al.,
"Robust Speech Recognition via Large-Scale Weak Supervision", 2022, section 2.2) with learned instead of sinusoidal
positions; ``pool`` > 1 average-pools the output tokens (Qwen-Audio pools Whisper's 1500 frames by 2, Chu et al.,
arXiv 2311.07919, section 2.1). Input ``input_features`` ``[b, num_mel_bins, frames]``, output
``[b, frames / (2 pool), hidden]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock


class WhisperStyleEncoder(MegatronModule):
    """Whisper's encoder shape on megatron.core: conv front end, positions, ``decoder`` (a TransformerBlock), ``ln_post``."""

    def __init__(self, transformer_config, transformer_layer_spec, num_mel_bins: int = 80, frames: int = 3000,
                 pool: int = 1, pg_collection=None) -> None:
        super().__init__(config=transformer_config)
        h = transformer_config.hidden_size
        self.conv1 = torch.nn.Conv1d(num_mel_bins, h, kernel_size=3, padding=1)
        self.conv2 = torch.nn.Conv1d(h, h, kernel_size=3, stride=2, padding=1)
        self.seq_length = (frames + 1) // 2
        self.position_embeddings = torch.nn.Embedding(self.seq_length, h)
        self.decoder = TransformerBlock(config=transformer_config, spec=transformer_layer_spec, pre_process=True,
                                        post_process=False, pg_collection=pg_collection)
        self.ln_post = WrappedTorchNorm(config=transformer_config, hidden_size=h,
                                        eps=transformer_config.layernorm_epsilon)
        self.pool = pool

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(input_features))
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)          # [b, frames / 2, h]
        x = x + self.position_embeddings.weight[: x.shape[1]]
        x = self.decoder(x.transpose(0, 1).contiguous(), None)  # [s, b, h]
        x = self.ln_post(x.transpose(0, 1).contiguous())      # [b, s, h]
        if self.pool > 1:
            x = F.avg_pool1d(x.transpose(1, 2), self.pool).transpose(1, 2)
        return x
