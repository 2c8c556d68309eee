"""Llama-family decoder (Llama 2/3, SmolLM, Mistral-style) and Qwen2 (the same with qkv bias).

Forward takes flat token batches: `input_ids` or `inputs_embeds` for the scheduled tokens of
all requests, `positions` for rotary embedding; attention reads its paged-cache metadata
from the forward context.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import load_weights
from vllm.v1.attention.backends.abstract import AttentionBackend


def head_dim_of(config) -> int:
    """`head_dim` where the config sets it (it may differ from hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend],
                 qkv_bias: bool) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        bias = qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads,
                                          total_kv_heads, bias=bias)
        # This rank's heads (all of them with one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False))
        self.attn = Attention(backend, layer_idx, self.num_heads, self.head_dim,
                              self.num_kv_heads, self.head_dim**-0.5)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor],
                x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(cos_sin, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        self.intermediate_size = self.gate_up_proj.out_features // 2  # this rank's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals; a family may pass its own attention
    (`self_attn`, q/k norms) or feed-forward block (`mlp`, a mixture of experts)."""

    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend],
                 qkv_bias: bool, self_attn: nn.Module | None = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = (LlamaAttention(config, layer_idx, backend, qkv_bias)
                          if self_attn is None else self_attn)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(cos_sin, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    supports_graph_capture = True
    # checkpoint projections -> the fused layer holding them, in order (`load_weights`)
    packed_modules_mapping = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_model_len, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.build_layer(config, i, backend)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size,
            tied_to=self.embed_tokens if self.tie_word_embeddings else None)

    def build_layer(self, config, layer_idx: int, backend: type[AttentionBackend]
                    ) -> nn.Module:
        """Decoder layer `layer_idx` (families on these blocks override it)."""
        return LlamaDecoderLayer(config, layer_idx, backend, self.qkv_bias)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the final hidden states, [num_tokens, hidden_size]."""
        h, cos_sin = self.prepare(input_ids, positions, inputs_embeds)
        for layer in self.layers:
            h = layer(cos_sin, h)
        return self.finish(h)

    # The forward's pieces, compiled one by one by `graph_capture` (every layer shares
    # one graph): prepare -> layers -> finish.
    def prepare(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return h, self.rotary.lookup(positions)

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)  # model dtype: the sampler upcasts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face-named tensors in (q/k/v and gate/up into their fused layers, each
        rank its slice); returns the names of the parameters loaded."""
        skip = ["rotary_emb.inv_freq"]
        if self.tie_word_embeddings:
            skip.append("lm_head.weight")
        return load_weights(self, weights, skip=skip)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
