"""Phi-3 / Phi-4-mini: the Llama decoder whose checkpoint fuses q/k/v (`qkv_proj`) and
gate/up (`gate_up_proj`); rope often `longrope` over part of each head
(`partial_rotary_factor`).

The fused checkpoint tensors are cut into their parts before loading, so each part is
sliced for its tensor-parallel rank like a separate projection's (a rank's q heads, its KV
heads, its half of gate and of up):

    qkv_proj [(H + 2 KV) * d, hidden] -> q_proj [H d], k_proj [KV d], v_proj [KV d]
    gate_up_proj [2 I, hidden]        -> gate_proj [I], up_proj [I]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.transformers_utils.config import head_dim_of, num_kv_heads_of


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        config = self.config
        d = head_dim_of(config)
        q = config.num_attention_heads * d
        kv = num_kv_heads_of(config) * d
        parts = {"qkv_proj": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
                 "gate_up_proj": [("gate_proj", 0, config.intermediate_size),
                                  ("up_proj", config.intermediate_size,
                                   config.intermediate_size)]}
        for name, tensor in weights:
            fused = next((f for f in parts if f".{f}." in name), None)
            if fused is None:
                yield name, tensor
                continue
            expected = sum(size for _, _, size in parts[fused])
            if tensor.shape[0] != expected:
                raise ValueError(f"Checkpoint tensor {name!r}: {tensor.shape[0]} rows, "
                                 f"expected {expected}.")
            for part, start, size in parts[fused]:
                yield name.replace(f".{fused}.", f".{part}."), tensor.narrow(0, start, size)
