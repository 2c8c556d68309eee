"""Qwen3-MoE (Qwen3-30B-A3B): attention with RMSNorm over each query and key head before
rotary, no q/k/v bias, sparse layers without a shared expert."""

from __future__ import annotations

from torch import nn

from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.moe import SparseMoeBlock, is_sparse_layer
from vllm.v1.attention.backends.abstract import AttentionBackend


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, config, layer_idx: int, backend: type[AttentionBackend]) -> nn.Module:
        mlp = None
        if is_sparse_layer(config, layer_idx):
            mlp = SparseMoeBlock(config.hidden_size, config.num_experts,
                                 config.num_experts_per_tok, config.moe_intermediate_size,
                                 bool(config.norm_topk_prob))
        return LlamaDecoderLayer(config, layer_idx, backend, self.qkv_bias, qk_norm="head",
                                 mlp=mlp)
