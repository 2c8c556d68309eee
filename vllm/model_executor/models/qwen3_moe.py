"""Qwen3-MoE (Qwen3-30B-A3B): attention with RMSNorm over each query and key head before
rotary, no q/k/v bias, sparse layers without a shared expert."""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import apply_rotary
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.moe import SparseMoeBlock, is_sparse_layer
from vllm.v1.attention.backends.abstract import AttentionBackend


class HeadNormAttention(LlamaAttention):
    """`q_norm` / `k_norm`: RMSNorm of `head_dim` weights over every head (the same on
    every rank: heads are whole)."""

    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend]) -> None:
        super().__init__(config, layer_idx, backend, qkv_bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor],
                x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(cos_sin, q, k)
        return self.o_proj(self.attn(q, k, v.reshape(n, self.num_kv_heads, self.head_dim)))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def build_layer(self, config, layer_idx: int, backend: type[AttentionBackend]
                    ) -> nn.Module:
        mlp = None
        if is_sparse_layer(config, layer_idx):
            mlp = SparseMoeBlock(config.hidden_size, config.num_experts,
                                 config.num_experts_per_tok, config.moe_intermediate_size,
                                 bool(config.norm_topk_prob))
        return LlamaDecoderLayer(config, layer_idx, backend, self.qkv_bias, mlp=mlp,
                                 self_attn=HeadNormAttention(config, layer_idx, backend))
