"""OLMo-2: q and k RMS-normed over the whole projection (across tensor-parallel ranks), and
norms after attention and after the MLP instead of before them:

    h = h + post_attention_layernorm(attn(h))
    h = h + post_feedforward_layernorm(mlp(h))
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from vllm.v1.attention.backends.abstract import AttentionBackend


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, backend, False,
                                        qk_norm="projection")
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                            hidden_act=config.hidden_act)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(cos_sin, h))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Olmo2ForCausalLM(LlamaForCausalLM):
    def make_layer(self, config, layer_idx: int, backend: type[AttentionBackend]) -> nn.Module:
        return Olmo2DecoderLayer(config, layer_idx, backend)
