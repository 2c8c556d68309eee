"""OLMoE: Llama-style attention with RMSNorm over the whole query and key projections
(all heads together, before rotary), optional `clip_qkv`, and every layer a mixture of
`num_experts` experts (`intermediate_size` wide), top-k not renormalised unless
`norm_topk_prob`."""

from __future__ import annotations

from torch import nn

from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.moe import SparseMoeBlock
from vllm.v1.attention.backends.abstract import AttentionBackend


class OlmoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, config, layer_idx: int, backend: type[AttentionBackend]) -> nn.Module:
        mlp = SparseMoeBlock(config.hidden_size, config.num_experts,
                             config.num_experts_per_tok, config.intermediate_size,
                             bool(config.norm_topk_prob))
        attn = LlamaAttention(config, layer_idx, backend, self.qkv_bias, qk_norm="projection",
                              clip_qkv=getattr(config, "clip_qkv", None))
        return LlamaDecoderLayer(config, layer_idx, backend, self.qkv_bias, self_attn=attn,
                                 mlp=mlp)
