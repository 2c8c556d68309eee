"""Qwen3: the Llama decoder with each query and key head RMS-normed before rope (q/k/v
biases only where `attention_bias` says so)."""

from __future__ import annotations

from torch import nn

from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.v1.attention.backends.abstract import AttentionBackend


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, config, layer_idx: int, backend: type[AttentionBackend]) -> nn.Module:
        return LlamaDecoderLayer(config, layer_idx, backend, self.qkv_bias, qk_norm="head")
