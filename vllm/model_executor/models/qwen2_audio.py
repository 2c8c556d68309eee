"""Qwen2-Audio (`Qwen2AudioForConditionalGeneration`): a Whisper-style audio encoder with an
average pool, a linear projector, and a Qwen2 language model
(`multimodal.MultiModalLanguageModel`).

A clip of L log-mel frames (its part of the 30 s window the feature extractor pads it to)
becomes rows in the language model's embedding space (`embed_media`), which the engine core
puts at the clip's `<|AUDIO|>` run as prompt-embeds rows (`vllm/v1/engine/media_rows.py`):

    frames L --conv stem (stride 2)--> positions P = (L - 1) // 2 + 1
             --Whisper encoder layers, attention within the clip's P positions-->
             --average pool of pairs--> rows N = (P - 2) // 2 + 1 --layer norm, projector-->

Example: a 1 s clip at 16 kHz -> L = 100 frames -> P = 50 -> N = 25 rows.

transformers runs the encoder over the whole padded window with the padding positions
masked as keys; the rows it keeps (the first N pooled ones) read only positions below P,
and those attend only to each other, so running the clip's P positions alone (one
variable-length encoder batch) computes the same rows. The conv stem reads two frames past
the clip (the padding's log-mel values), which `MediaInput.data` carries for that reason.

The audio tower is our Whisper encoder (the same parameters under the same names: conv1,
conv2, embed_positions, layers.N, layer_norm); only the order of its last steps differs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader.weight_utils import load_weights
from vllm.model_executor.models.encoder_decoder import PACKED_MODULES_MAPPING
from vllm.model_executor.models.multimodal import (
    MultiModalLanguageModel,
    load_multimodal_weights,
)
from vllm.model_executor.models.whisper import WhisperEncoder
from vllm.multimodal.audio import STEM_EXTRA_FRAMES, encoder_positions
from vllm.v1.attention.backends.abstract import AttentionBackend, EncoderAttentionMetadata


class Qwen2AudioEncoder(WhisperEncoder):
    """Whisper's encoder with Qwen2-Audio's ending: pool pairs of positions, then the layer
    norm. Clips of different lengths run as one variable-length batch."""

    def encode_clips(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each clip's features [num_mel_bins, frames + 2] -> its rows [num_tokens, d_model]."""
        frames = [f.shape[1] - STEM_EXTRA_FRAMES for f in features]
        lens = [encoder_positions(n) for n in frames]
        width = max(f.shape[1] for f in features)
        # Zero columns past a clip's data are what the convolutions' own padding reads.
        batch = torch.stack([F.pad(f, (0, width - f.shape[1])) for f in features])
        weight = self.conv1.weight
        x = F.gelu(self.conv2(F.gelu(self.conv1(batch.to(weight.dtype)))))
        x = x.transpose(1, 2)  # [clips, positions, d_model]
        h = torch.cat([x[i, :n] + self.embed_positions.weight[:n] for i, n in enumerate(lens)])
        # The layers' attention reads the clips' boundaries from the forward context; only
        # this model knows them (the runner hands it features), so it sets that context.
        metadata = EncoderAttentionMetadata.from_lens(lens)
        with set_forward_context(None, [], encoder_attn_metadata=metadata):
            for layer in self.layers:
                h = layer(h)
        rows = []
        for clip, n in zip(h.split(lens), lens, strict=True):
            tokens = (n - 2) // 2 + 1
            pooled = clip[:2 * tokens].view(tokens, 2, -1).mean(dim=1)  # AvgPool1d(2, 2)
            rows.append(self.layer_norm(pooled))
        return rows

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Whisper's encoder tensors under Whisper's names; q/k/v fuse as Whisper's do."""
        return load_weights(self, weights, PACKED_MODULES_MAPPING)


class Qwen2AudioMultiModalProjector(nn.Module):
    def __init__(self, audio_size: int, text_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(audio_size, text_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioForConditionalGeneration(MultiModalLanguageModel):
    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__(config, backend, max_model_len, dtype)
        self.config = config
        audio = config.audio_config
        self.audio_tower = Qwen2AudioEncoder(audio, backend)
        self.multi_modal_projector = Qwen2AudioMultiModalProjector(
            audio.d_model, config.text_config.hidden_size)

    def embed_media(self, modality: str, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """Clips' log-mel features [num_mel_bins, frames + 2] -> each clip's rows
        [num_audio_tokens, text hidden size]."""
        if modality != "audio":
            raise ValueError(f"Qwen2-Audio takes audio, not {modality}.")
        rows = self.audio_tower.encode_clips(data)
        return [self.multi_modal_projector(r) for r in rows]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Routes each checkpoint tensor to its part (`multimodal.split_checkpoint_name`);
        the audio tower's q/k/v fuse as Whisper's do (no k bias: it stays zero)."""
        return load_multimodal_weights(self, weights, "audio_tower",
                                       self.audio_tower.load_weights, "Qwen2-Audio")
