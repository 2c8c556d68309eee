"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower (`clip.py`), a
two-layer projector, and any registered decoder as the language model
(`multimodal.MultiModalLanguageModel`).

An image becomes `num_image_tokens` rows (`vllm.multimodal.processing`) in the language
model's embedding space (`embed_media`); the engine core puts them at the prompt's image
placeholder positions as prompt-embeds rows (`vllm/v1/engine/media_rows.py`), so the
language model's forward is the plain decoder's: image positions reach it as embeds rows.

Features: `vision_feature_layer` picks the tower's hidden state(s) (an index into
transformers' `hidden_states`, or a list of them, concatenated); the `default` strategy drops
the first position (CLIP's class token; SigLIP has none, and loses its first patch, as in
transformers), `full` keeps it. Checkpoint names: `multimodal.split_checkpoint_name`, and
`vision_tower.vision_model.X` -> `vision_tower.X`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.model_executor.models.clip import vision_activation, vision_tower
from vllm.model_executor.models.multimodal import (
    MultiModalLanguageModel,
    load_multimodal_weights,
)
from vllm.multimodal.processing import check_vision_tower
from vllm.v1.attention.backends.abstract import AttentionBackend


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, out_features: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, out_features, bias=bias)
        self.act = vision_activation(act)
        self.linear_2 = nn.Linear(out_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(MultiModalLanguageModel):
    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        check_vision_tower(config)
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported "
                             "(default, full).")
        super().__init__(config, backend, max_model_len, dtype)
        self.config = config
        layer = config.vision_feature_layer
        self.feature_layers: list[int] = list(layer) if isinstance(layer, list) else [layer]
        self.vision_tower = vision_tower(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(
            config.vision_config.hidden_size * len(self.feature_layers),
            config.text_config.hidden_size, config.projector_hidden_act,
            getattr(config, "multimodal_projector_bias", True))

    # ---- images ---------------------------------------------------------------------

    def embed_media(self, modality: str, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """Images [3, H, W] -> each one's rows [num_image_tokens, text hidden size]."""
        if modality != "image":
            raise ValueError(f"LLaVA takes images, not {modality}.")
        return list(self.embed_images(torch.stack(data)).unbind(0))

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, num_image_tokens, text hidden size]."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        states = self.vision_tower.hidden_states(pixel_values.to(dtype), self.feature_layers)
        features = torch.cat(states, dim=-1)
        if self.config.vision_feature_select_strategy == "default":
            features = features[:, 1:]  # CLIP's class token is not an image row
        return self.multi_modal_projector(features)

    # ---- loading --------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Routes each checkpoint tensor to its part (see the module's name table)."""
        return load_multimodal_weights(self, weights, "vision_tower",
                                       self.vision_tower.load_weights, "LLaVA")
