"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias) with sparse
layers of `num_experts` experts, top `num_experts_per_tok` (renormalised with
`norm_topk_prob`), plus a shared expert behind a sigmoid gate; `decoder_sparse_step` and
`mlp_only_layers` leave some layers dense."""

from __future__ import annotations

from torch import nn

from vllm.model_executor.models.llama import LlamaDecoderLayer, Qwen2ForCausalLM
from vllm.model_executor.models.moe import SparseMoeBlock, is_sparse_layer
from vllm.v1.attention.backends.abstract import AttentionBackend


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    def make_layer(self, config, layer_idx: int, backend: type[AttentionBackend]) -> nn.Module:
        mlp = None
        if is_sparse_layer(config, layer_idx):
            mlp = SparseMoeBlock(config.hidden_size, config.num_experts,
                                 config.num_experts_per_tok, config.moe_intermediate_size,
                                 bool(config.norm_topk_prob),
                                 config.shared_expert_intermediate_size)
        return LlamaDecoderLayer(config, layer_idx, backend, self.qkv_bias, mlp=mlp)
