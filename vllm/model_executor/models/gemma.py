"""Gemma 2 and Gemma 3 (text) on the Llama blocks.

What differs from Llama: embeddings scaled by sqrt(hidden_size) (in the model dtype, at
lookup, so prompt embeds are taken as given, as transformers does), GeGLU (tanh gelu),
RMSNorm with (1 + weight), norms before and after both attention and MLP, the attention
scale from `query_pre_attn_scalar`, attention logits soft-capped (Gemma 2) and the final
logits too, and window layers interleaved with global ones (`layer_types`). Gemma 3 adds
q/k RMSNorm and its own rope per layer type (window layers: `rope_local_base_freq`, in
`rope_parameters["sliding_attention"]`).
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import fused_lookups
from vllm.model_executor.models.interfaces import FusedDecodeSpec
from vllm.model_executor.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    fused_decode_layer,
    head_dim_of,
)
from vllm.v1.attention.backends.abstract import AttentionBackend


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back at the end."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(LlamaAttention):
    """Llama attention with Gemma's scale and soft-cap; q/k norms for Gemma 3."""

    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend],
                 qk_norm: bool) -> None:
        super().__init__(config, layer_idx, backend, qkv_bias=False,
                         scale=config.query_pre_attn_scalar**-0.5,
                         logits_soft_cap=getattr(config, "attn_logit_softcapping", None))
        if qk_norm:  # Gemma 3: each head's q and k normed, with (1 + w) weights
            self.qk_norm = "head"
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend],
                 qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_idx, backend, qk_norm)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                            hidden_act=getattr(config, "hidden_activation", "gelu_pytorch_tanh"))
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        # Gemma 3's window layers take the local rope: the second half of the cos/sin rows
        # `Gemma2ForCausalLM.prepare` gives every layer of a model with a local rope.
        self.head_dim = head_dim_of(config)
        self.local_rope = False

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        cos, sin = cos_sin
        if cos.shape[-1] != self.head_dim:  # [global | local] tables side by side
            half = slice(self.head_dim, None) if self.local_rope else slice(0, self.head_dim)
            cos, sin = cos[..., half], sin[..., half]
        a = self.self_attn((cos, sin), self.input_layernorm(h))
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = False

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__(config, backend, max_model_len, dtype)
        self.local_rotary_emb: RotaryEmbedding | None = None
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # sqrt(hidden_size) rounded to the model dtype, as transformers does.
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype).item()
        self.final_soft_cap: float | None = getattr(config, "final_logit_softcapping", None)
        self.activation = getattr(config, "hidden_activation", "gelu_pytorch_tanh")

    def make_layer(self, config, layer_idx: int, backend: type[AttentionBackend]) -> nn.Module:
        return GemmaDecoderLayer(config, layer_idx, backend, self.qk_norm)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def prepare(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if inputs_embeds is None:
            assert input_ids is not None, "input_ids or inputs_embeds"
            h = self.get_input_embeddings(input_ids)
        else:
            h = inputs_embeds
        cos, sin = self.rotary.lookup(positions)
        if self.local_rotary_emb is not None:
            local_cos, local_sin = self.local_rotary_emb.lookup(positions)
            cos, sin = torch.cat([cos, local_cos], -1), torch.cat([sin, local_sin], -1)
        return h, (cos, sin)

    def fused_decode_spec(self) -> FusedDecodeSpec | str:
        """This model as the fused CPU decoder runs it: Gemma layers (four norms with
        (1 + w) weights, tanh GELU, q/k norms for Gemma 3, window layers on the local
        rotary table, the attention soft-cap) on GGUF weights; the embeddings scaled at
        lookup. The final soft-cap stays in `compute_logits`."""
        cls = type(self)
        if any(getattr(cls, name) is not getattr(Gemma2ForCausalLM, name)
               for name in ("forward", "prepare", "finish")):
            return f"{cls.__name__} is not a plain Gemma decoder"
        if type(self.norm) is not GemmaRMSNorm:
            return "final norm is not GemmaRMSNorm"
        ropes = [(self.rotary.cos, self.rotary.sin)]
        if self.local_rotary_emb is not None:
            ropes.append((self.local_rotary_emb.cos, self.local_rotary_emb.sin))
        layers = []
        for i, layer in enumerate(self.layers):
            if (type(layer) is not GemmaDecoderLayer or type(layer.self_attn) is not GemmaAttention
                    or type(layer.mlp) is not LlamaMLP):
                return f"layer {i} is not a plain Gemma layer"
            described = fused_decode_layer(
                i, cast(Any, layer.self_attn), layer.mlp,
                [layer.input_layernorm, layer.post_attention_layernorm,
                 layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm],
                GemmaRMSNorm, self.activation, rope=int(layer.local_rope))
            if isinstance(described, str):
                return described
            layers.append(described)
        attn = cast(GemmaDecoderLayer, self.layers[0]).self_attn
        plain_lookup = cls.get_input_embeddings is Gemma2ForCausalLM.get_input_embeddings
        plain_head = (cls.compute_logits is Gemma2ForCausalLM.compute_logits
                      and self.final_soft_cap is None)  # (the cap's tanh stays torch's)
        return FusedDecodeSpec(
            embed_tokens=self.get_input_embeddings, layers=layers, final_norm=self.norm.weight,
            final_norm_eps=self.norm.eps, ropes=ropes, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, one_plus_norms=True,
            activation=self.activation,
            lookups=fused_lookups(self.embed_tokens if plain_lookup else None,
                                  self.lm_head if plain_head else None, self.embed_scale))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_states)
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text (`Gemma3TextConfig`): Gemma 2 plus q/k norms and a local rope."""

    qk_norm = True

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__(_with_rope(config, "full_attention"), backend, max_model_len, dtype)
        self.config = config
        self.local_rotary_emb = RotaryEmbedding(_with_rope(config, "sliding_attention"),
                                                head_dim_of(config), max_model_len, dtype)
        for layer in self.layers:
            assert isinstance(layer, GemmaDecoderLayer)
            layer.local_rope = layer.self_attn.sliding_window is not None


def _with_rope(config, layer_type: str):
    """A copy of a Gemma 3 config whose `rope_parameters` are those of one layer type."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or layer_type not in params:
        return config
    out = copy.copy(config)
    out.rope_parameters = params[layer_type]
    return out
