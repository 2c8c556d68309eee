"""Whisper (`WhisperForConditionalGeneration`): a pre-norm encoder/decoder over log-mel audio.

The encoder's stem is two 1-D convolutions (the second with stride 2) with GELU, so a
30 s window of 3000 mel frames becomes 1500 encoder tokens, plus fixed sinusoidal positions
(stored as weights). The decoder has learned positions, no bias on any k projection, and
its output projection tied to the token embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
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

# Mel frames per encoder token: the stride of conv2 (the registry records it for the
# front end: `registry._AUDIO_MODELS`).
FRAMES_PER_ENCODER_TOKEN = 2


class WhisperEncoderLayer(nn.Module):
    def __init__(self, config, backend: type[AttentionBackend], layer_idx: int) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.self_attn = SelfAttention(d, config.encoder_attention_heads, backend, layer_idx,
                                       AttentionType.ENCODER)
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1 = ColumnParallelLinear(d, config.encoder_ffn_dim)
        self.fc2 = RowParallelLinear(config.encoder_ffn_dim, d)
        self.act = activation_fn(config.activation_function)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.self_attn_layer_norm(h))
        return h + self.fc2(self.act(self.fc1(self.final_layer_norm(h))))


class WhisperDecoderLayer(nn.Module):
    def __init__(self, config, backend: type[AttentionBackend], layer_idx: int) -> None:
        super().__init__()
        d, heads = config.d_model, config.decoder_attention_heads
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.self_attn = SelfAttention(d, heads, backend, layer_idx, AttentionType.DECODER)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = CrossAttention(d, heads, backend, layer_idx)
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1 = ColumnParallelLinear(d, config.decoder_ffn_dim)
        self.fc2 = RowParallelLinear(config.decoder_ffn_dim, d)
        self.act = activation_fn(config.activation_function)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.self_attn_layer_norm(h))
        h = h + self.encoder_attn(self.encoder_attn_layer_norm(h))
        return h + self.fc2(self.act(self.fc1(self.final_layer_norm(h))))


class WhisperEncoder(nn.Module):
    def __init__(self, config, backend: type[AttentionBackend]) -> None:
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=FRAMES_PER_ENCODER_TOKEN, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(WhisperEncoderLayer(config, backend, i)
                                    for i in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel features [batch, num_mel_bins, frames] -> [batch * frames / 2, d_model]."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(features))))
        x = x.transpose(1, 2) + self.embed_positions.weight[:x.shape[2]]
        h = x.reshape(-1, x.shape[2])
        for layer in self.layers:
            h = layer(h)
        return self.layer_norm(h)


class WhisperDecoder(nn.Module):
    def __init__(self, config, backend: type[AttentionBackend]) -> None:
        super().__init__()
        d = config.d_model
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.embed_positions = nn.Embedding(config.max_target_positions, d)
        self.layers = nn.ModuleList(WhisperDecoderLayer(config, backend, i)
                                    for i in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = embeds + self.embed_positions(positions)
        for layer in self.layers:
            h = layer(h)
        return self.layer_norm(h)


class WhisperForConditionalGeneration(nn.Module):
    packed_modules_mapping: ClassVar[PackedModulesMapping] = PACKED_MODULES_MAPPING

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.encoder = WhisperEncoder(config, backend)
        self.decoder = WhisperDecoder(config, backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.proj_out = ParallelLMHead(
            config.vocab_size, config.d_model,
            tied_to=self.decoder.embed_tokens if self.tie_word_embeddings else None)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def encode(self, inputs: list[EncoderInput]) -> torch.Tensor:
        """Encoder outputs of several audio windows, concatenated: [batch * 1500, d_model].
        Every input is a full window ([num_mel_bins, 3000]), so they batch as one."""
        weight = self.encoder.conv1.weight
        windows = []
        for item in inputs:
            assert item.features is not None  # Whisper's encoder input is always audio
            windows.append(item.features)
        features = torch.stack(windows)
        return self.encoder(features.to(device=weight.device, dtype=weight.dtype))

    def cross_attention_layers(self) -> list[CrossAttention]:
        layers = cast("Iterable[WhisperDecoderLayer]", self.decoder.layers)  # ModuleList: untyped
        return [layer.encoder_attn for layer in layers]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder hidden states of the scheduled tokens, [num_tokens, d_model]."""
        if inputs_embeds is None:
            assert input_ids is not None  # the runner passes ids or embeds
            inputs_embeds = self.get_input_embeddings(input_ids)
        return self.decoder(inputs_embeds, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.proj_out.compute_logits(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        rename: dict[str, str | None] = {}
        if self.tie_word_embeddings:
            rename["proj_out.weight"] = None
        return load_weights(self, weights, self.packed_modules_mapping, rename=rename)
