"""Llama-family decoder (Llama 2/3, SmolLM, Mistral-style) and Qwen2 (the same with qkv bias).

Forward takes flat token batches: `input_ids` or `inputs_embeds` for the scheduled tokens of
all requests, `positions` for rotary embedding; attention reads its paged-cache metadata
from the forward context.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from vllm.v1.attention.backends.abstract import AttentionBackend


def head_dim_of(config) -> int:
    """`head_dim` where the config sets it (it may differ from hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend],
                 qkv_bias: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size,
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
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend],
                 qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, backend, qkv_bias)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(cos_sin, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    supports_graph_capture = True
    supports_packed_linears = True  # every linear is called as a module (see packed_linear)

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_model_len, dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, self.qkv_bias)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one parameter, two uses

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
        return self.lm_head(hidden_states)  # model dtype: the sampler upcasts

    def fused_target(self, name: str) -> tuple[str, int | None]:
        """(parameter name, row offset) of an HF-named weight in this model."""
        return _fused_target(name, self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies Hugging Face-named tensors in, fusing q/k/v and gate/up projections.

        Returns the names of the parameters that were loaded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, offset = _fused_target(name, self)
            if target not in params:
                raise ValueError(f"Checkpoint tensor {name!r} has no place in the model.")
            param = params[target]
            with torch.no_grad():
                if offset is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"Shape of {name!r} is {tuple(tensor.shape)}, "
                                         f"expected {tuple(param.shape)}.")
                    param.copy_(tensor)
                else:
                    param[offset:offset + tensor.shape[0]].copy_(tensor)
            loaded.add(target)
        return loaded


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _fused_target(name: str, model: LlamaForCausalLM) -> tuple[str, int | None]:
    """Maps a checkpoint name to (parameter name, row offset in the fused parameter)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-2] not in _FUSED:
        return name, None
    fused, index = _FUSED[parts[-2]]
    layer = cast(LlamaDecoderLayer, model.layers[0])  # nn.ModuleList items are untyped
    if fused == "qkv_proj":
        attn = layer.self_attn
        offset = (0, attn.q_size, attn.q_size + attn.kv_size)[index]
    else:
        offset = index * layer.mlp.intermediate_size
    return ".".join([*parts[:-2], fused, parts[-1]]), offset


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
