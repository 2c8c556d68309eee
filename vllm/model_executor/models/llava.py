"""LLaVA (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector, and
any registered decoder as the language model.

An image becomes `num_image_tokens` rows (`vllm.multimodal.processing`) in the language
model's embedding space (`embed_images`); the engine core puts them at the prompt's image
placeholder positions as prompt-embeds rows (`vllm/v1/engine/image_rows.py`), so the
language model's forward is the plain decoder's: image positions reach it as embeds rows.

Features: `vision_feature_layer` picks the tower's hidden state(s) (an index into
transformers' `hidden_states`, or a list of them, concatenated); the `default` strategy drops
the class token, `full` keeps it. Checkpoint names, both layouts transformers writes:

    vision_tower[.vision_model].X            -> vision_tower.X
    multi_modal_projector.X                  -> multi_modal_projector.X
    language_model.model.X / model.language_model.X -> language_model.X
    language_model.lm_head.X / lm_head.X     -> language_model.lm_head.X
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.model_loader.weight_utils import PackedModulesMapping
from vllm.model_executor.models.clip import CLIPVisionModel, vision_activation
from vllm.model_executor.models.interfaces import FusedDecodeSpec, VllmModel
from vllm.multimodal.processing import check_vision_tower
from vllm.v1.attention.backends.abstract import AttentionBackend

# The language model's class, from its `model_type` (a text_config carries no architecture).
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}


def text_architecture(text_config: Any) -> str:
    archs = getattr(text_config, "architectures", None)
    if archs:
        return archs[0]
    model_type = getattr(text_config, "model_type", None)
    if model_type not in TEXT_ARCHITECTURES:
        raise ValueError(f"LLaVA's language model type {model_type!r} is not supported "
                         f"({', '.join(TEXT_ARCHITECTURES)}).")
    return TEXT_ARCHITECTURES[model_type]


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, out_features: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, out_features, bias=bias)
        self.act = vision_activation(act)
        self.linear_2 = nn.Linear(out_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    supports_graph_capture = True
    # The language model fuses its own projections (its `load_weights`); none fused here.
    packed_modules_mapping: ClassVar[PackedModulesMapping] = {}

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        from vllm.model_executor.models.registry import resolve_model_cls

        self.config = config
        check_vision_tower(config)
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported "
                             "(default, full).")
        layer = config.vision_feature_layer
        self.feature_layers: list[int] = list(layer) if isinstance(layer, list) else [layer]
        self.vision_tower = CLIPVisionModel(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(
            config.vision_config.hidden_size * len(self.feature_layers),
            config.text_config.hidden_size, config.projector_hidden_act,
            getattr(config, "multimodal_projector_bias", True))
        text_cls = resolve_model_cls(text_architecture(config.text_config))
        self.language_model: Any = text_cls(config.text_config, backend, max_model_len, dtype)

    # ---- images ---------------------------------------------------------------------

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, num_image_tokens, text hidden size]."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        states = self.vision_tower.hidden_states(pixel_values.to(dtype), self.feature_layers)
        features = torch.cat(states, dim=-1)
        if self.config.vision_feature_select_strategy == "default":
            features = features[:, 1:]  # the class token is not an image row
        return self.multi_modal_projector(features)

    # ---- the language model's forward, as the runner and graph capture call it --------

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.get_input_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)

    def prepare(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return self.language_model.prepare(input_ids, positions, inputs_embeds)

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.language_model.finish(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def row_switch_tokens(self) -> int:
        return self.language_model.row_switch_tokens()

    def fused_decode_spec(self) -> FusedDecodeSpec | str:
        spec = getattr(self.language_model, "fused_decode_spec", None)
        return spec() if spec is not None else "the language model has no fused decoder"

    # ---- loading --------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Routes each checkpoint tensor to its part (see the module's name table)."""
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {
            "vision_tower": [], "multi_modal_projector": [], "language_model": []}
        for name, tensor in weights:
            part, rest = _route(name)
            parts[part].append((rest, tensor))
        loaded = {f"vision_tower.{n}" for n in self.vision_tower.load_weights(
            parts["vision_tower"])}
        projector = dict(self.multi_modal_projector.named_parameters())
        for name, tensor in parts["multi_modal_projector"]:
            if name not in projector or projector[name].shape != tensor.shape:
                raise ValueError(f"Checkpoint tensor multi_modal_projector.{name!r} does not "
                                 "fit the projector.")
            with torch.no_grad():
                projector[name].copy_(tensor)
            loaded.add(f"multi_modal_projector.{name}")
        language_model: VllmModel = self.language_model
        loaded |= {f"language_model.{n}"
                   for n in language_model.load_weights(iter(parts["language_model"]))}
        return loaded


def _route(name: str) -> tuple[str, str]:
    """(part, name inside it) of a checkpoint tensor's name."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        return "vision_tower", name.removeprefix("vision_tower.").removeprefix("vision_model.")
    if name.startswith("multi_modal_projector."):
        return "multi_modal_projector", name.removeprefix("multi_modal_projector.")
    if name.startswith("lm_head."):
        return "language_model", name
    if name.startswith("language_model."):
        return "language_model", name.removeprefix("language_model.")
    raise ValueError(f"Checkpoint tensor {name!r} has no place in LLaVA (vision_tower, "
                     "multi_modal_projector, language_model).")
