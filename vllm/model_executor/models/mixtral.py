"""Mixtral: Llama attention with every layer a mixture of `num_local_experts` experts
(`intermediate_size` wide), top `num_experts_per_tok` renormalised; checkpoint names
`block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.moe import SparseMoeBlock
from vllm.v1.attention.backends.abstract import AttentionBackend


class MixtralForCausalLM(LlamaForCausalLM):
    def make_layer(self, config, layer_idx: int, backend: type[AttentionBackend]) -> nn.Module:
        mlp = SparseMoeBlock(config.hidden_size, config.num_local_experts,
                             config.num_experts_per_tok, config.intermediate_size,
                             renormalize=True)
        return LlamaDecoderLayer(config, layer_idx, backend, self.qkv_bias, mlp=mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), tensor)
                                    for name, tensor in weights)
