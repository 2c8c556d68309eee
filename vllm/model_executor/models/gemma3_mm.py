"""Gemma 3 with images (`Gemma3ForConditionalGeneration`, pan-and-scan off): a SigLIP vision
tower (`clip.SiglipVisionModel`), the projector, and Gemma 3's text decoder
(`gemma.Gemma3ForCausalLM`, `multimodal.MultiModalLanguageModel`).

An image [3, S, S] becomes

    SigLIP's last_hidden_state [p * p, vision hidden] (p = S / patch size)
    --average pooling of the p x p grid to t x t (t^2 = mm_tokens_per_image)-->
    --RMSNorm with (1 + w) (`mm_soft_emb_norm`)--> --x `mm_input_projection_weight`-->
    rows [t * t, text hidden]

which the engine core puts at the image's run of `<image_soft_token>` positions
(`vllm/multimodal/gemma3.py`) as prompt-embeds rows. They enter the decoder as given: Gemma
scales token embeddings by sqrt(hidden) at lookup (`get_input_embeddings`), never embeds rows,
as transformers scales only the looked-up tokens before it scatters the image features in.

The positions of one image attend to each other both ways (transformers' `token_type_ids`
mask), the rest causally: the model declares it (`registry.bidirectional_media`), each
request carries its images' spans, and the scheduler and the attention backend honour them.

Checkpoint names: `multimodal.split_checkpoint_name`, and `vision_tower.vision_model.X` ->
`vision_tower.X`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.models.clip import SiglipVisionModel
from vllm.model_executor.models.gemma import GemmaRMSNorm
from vllm.model_executor.models.multimodal import (
    MultiModalLanguageModel,
    load_multimodal_weights,
)
from vllm.v1.attention.backends.abstract import AttentionBackend


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        vision = config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image**0.5)
        if tokens_per_side**2 != config.mm_tokens_per_image or (
                self.patches_per_side % tokens_per_side):
            raise ValueError(f"mm_tokens_per_image={config.mm_tokens_per_image} must be the "
                             f"square of a divisor of {self.patches_per_side} (patches per "
                             "side).")
        self.kernel = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, config.text_config.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[n, p * p, vision hidden] -> [n, t * t, text hidden]."""
        n, _, hidden = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(n, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled),
                            self.mm_input_projection_weight).to(features.dtype)


class Gemma3ForConditionalGeneration(MultiModalLanguageModel):
    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        kind = getattr(config.vision_config, "model_type", None)
        if kind != "siglip_vision_model":
            raise ValueError(f"Gemma 3 with a {kind!r} vision tower is not supported "
                             "(siglip_vision_model).")
        super().__init__(config, backend, max_model_len, dtype)
        self.config = config
        self.vision_tower = SiglipVisionModel(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    def embed_media(self, modality: str, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """Images [3, S, S] -> each one's rows [mm_tokens_per_image, text hidden size]."""
        if modality != "image":
            raise ValueError(f"Gemma 3 takes images, not {modality}.")
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        features = self.vision_tower(torch.stack(data).to(dtype))
        return list(self.multi_modal_projector(features).unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Routes each checkpoint tensor to its part (see the module's name table)."""
        return load_multimodal_weights(self, weights, "vision_tower",
                                       self.vision_tower.load_weights, "Gemma 3")
