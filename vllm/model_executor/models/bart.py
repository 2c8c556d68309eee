"""BART (`BartForConditionalGeneration`): a post-norm encoder/decoder over token ids.

Learned positions with BART's offset of 2, `layernorm_embedding` after the embeddings,
`scale_embedding` (sqrt(d_model)) on token embeddings, and an LM head tied to the shared
embeddings plus `final_logits_bias`. The encoder takes token ids or its input embeddings
(`prompt_embeds`, already scaled, as transformers' `inputs_embeds`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar, cast

import torch
from torch import nn

from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import PackedModulesMapping, load_weights
from vllm.model_executor.models.encoder_decoder import (
    PACKED_MODULES_MAPPING,
    CrossAttention,
    SelfAttention,
    activation_fn,
)
from vllm.v1.attention.backends.abstract import AttentionBackend, AttentionType
from vllm.v1.messages import EncoderInput

# BART's learned position tables have 2 extra leading rows: position p is row p + 2.
_POSITION_OFFSET = 2


class BartEncoderLayer(nn.Module):
    def __init__(self, config, backend: type[AttentionBackend], layer_idx: int) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn = SelfAttention(d, config.encoder_attention_heads, backend, layer_idx,
                                       AttentionType.ENCODER)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = ColumnParallelLinear(d, config.encoder_ffn_dim)
        self.fc2 = RowParallelLinear(config.encoder_ffn_dim, d)
        self.act = activation_fn(config.activation_function)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(h + self.self_attn(h))
        return self.final_layer_norm(h + self.fc2(self.act(self.fc1(h))))


class BartDecoderLayer(nn.Module):
    def __init__(self, config, backend: type[AttentionBackend], layer_idx: int) -> None:
        super().__init__()
        d, heads = config.d_model, config.decoder_attention_heads
        self.self_attn = SelfAttention(d, heads, backend, layer_idx, AttentionType.DECODER)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = CrossAttention(d, heads, backend, layer_idx)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = ColumnParallelLinear(d, config.decoder_ffn_dim)
        self.fc2 = RowParallelLinear(config.decoder_ffn_dim, d)
        self.act = activation_fn(config.activation_function)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(h + self.self_attn(h))
        h = self.encoder_attn_layer_norm(h + self.encoder_attn(h))
        return self.final_layer_norm(h + self.fc2(self.act(self.fc1(h))))


class _BartStack(nn.Module):
    """Positions, `layernorm_embedding` and the layers of one side (encoder or decoder)."""

    def __init__(self, config, backend: type[AttentionBackend], num_layers: int,
                 layer_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_positions = nn.Embedding(config.max_position_embeddings + _POSITION_OFFSET,
                                            config.d_model)
        self.layernorm_embedding = nn.LayerNorm(config.d_model)
        self.layers = nn.ModuleList(layer_cls(config, backend, i) for i in range(num_layers))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.layernorm_embedding(embeds + self.embed_positions(positions + _POSITION_OFFSET))
        for layer in self.layers:
            h = layer(h)
        return h


class BartForConditionalGeneration(nn.Module):
    final_logits_bias: torch.Tensor  # [1, vocab_size] buffer
    packed_modules_mapping: ClassVar[PackedModulesMapping] = PACKED_MODULES_MAPPING

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.shared = VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.encoder = _BartStack(config, backend, config.encoder_layers, BartEncoderLayer)
        self.decoder = _BartStack(config, backend, config.decoder_layers, BartDecoderLayer)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.d_model,
                                      tied_to=self.shared if self.tie_word_embeddings else None)
        self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size))

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.shared(input_ids) * self.embed_scale

    def encode(self, inputs: list[EncoderInput]) -> torch.Tensor:
        """Encoder outputs of several inputs, concatenated: [sum of lengths, d_model]."""
        weight = self.shared.weight  # BART is never a GGUF file: the dense table is kept
        assert weight is not None
        device = weight.device
        embeds = []
        for item in inputs:
            if item.token_ids is not None:
                ids = torch.tensor(item.token_ids, dtype=torch.long, device=device)
                embeds.append(self.get_input_embeddings(ids))
            else:
                assert item.features is not None  # exactly one of the two is set
                embeds.append(item.features.to(device=device, dtype=weight.dtype))
        positions = torch.cat([torch.arange(e.shape[0], device=device) for e in embeds])
        return self.encoder(torch.cat(embeds), positions)

    def cross_attention_layers(self) -> list[CrossAttention]:
        layers = cast("Iterable[BartDecoderLayer]", self.decoder.layers)  # ModuleList: untyped
        return [layer.encoder_attn for layer in layers]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder hidden states of the scheduled tokens, [num_tokens, d_model]."""
        if inputs_embeds is None:
            assert input_ids is not None  # the runner passes ids or embeds
            inputs_embeds = self.get_input_embeddings(input_ids)
        return self.decoder(inputs_embeds, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return (self.lm_head.compute_logits(hidden_states) + self.final_logits_bias).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The encoder's and decoder's embed_tokens are the shared table under other names.
        rename: dict[str, str | None] = {"encoder.embed_tokens.weight": "shared.weight",
                                         "decoder.embed_tokens.weight": "shared.weight"}
        if self.tie_word_embeddings:
            rename["lm_head.weight"] = None
        return load_weights(self, weights, self.packed_modules_mapping, rename=rename)
