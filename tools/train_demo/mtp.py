"""The MTP (multi-token prediction) layer trained next to transformers' Qwen3_5ForCausalLM, which
has none. Parameter names match released Qwen3.5 checkpoints under the `mtp.` prefix.

Row t joins the embedding of token t+1 with the main model's final-normed hidden state at t:
    h'_t = fc([norm_e(embed(x_{t+1})) ; norm_h(h_t)])     (embedding first)
then one full-attention decoder layer (causal over the rows, RoPE position t), its own norm and
the shared head, and is trained to predict x_{t+2}."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm


class MultiTokenPredictor(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        attention_layer = config.layer_types.index("full_attention")
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, attention_layer)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        nn.init.normal_(self.fc.weight, std=config.initializer_range)
        for name, param in self.layers.named_parameters():
            if param.dim() == 2:
                nn.init.normal_(param, std=config.initializer_range)
            elif name.endswith("norm.weight"):
                nn.init.zeros_(param)

    def forward(
        self,
        next_embeddings: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """next_embeddings: embed(x_{t+1}) [B, T, H]; hidden: main final-normed h_t [B, T, H];
        position_embeddings: (cos, sin) of positions 0..T-1. Returns mtp.norm output [B, T, H]."""
        joined = torch.cat(
            [self.pre_fc_norm_embedding(next_embeddings), self.pre_fc_norm_hidden(hidden)], dim=-1
        )
        x = self.fc(joined)
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)
