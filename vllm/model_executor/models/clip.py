"""CLIP's vision encoder (ViT): patch embedding, class token, learned positions, pre-norm
transformer layers with full (non-causal) attention. Parameter names follow transformers'
`CLIPVisionModel` (`embeddings.patch_embedding`, `pre_layrnorm`, `encoder.layers.N...`), so a
checkpoint loads by name. Images are a few hundred positions each: the layers are plain
replicated torch (no paged cache, no tensor parallel shards)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

VISION_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def vision_activation(name: str):
    if name not in VISION_ACTIVATIONS:
        raise ValueError(f"Vision activation {name!r} is not supported "
                         f"({', '.join(VISION_ACTIVATIONS)}).")
    return VISION_ACTIVATIONS[name]


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         config.patch_size, config.patch_size, bias=False)
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, 1 + patches, hidden]: the class token, then the patches row
        by row, each plus its learned position."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, hidden = x.shape
        q, k, v = (p(x).view(n, length, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, length, hidden))


class CLIPMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = vision_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_norm1 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config)
                                    for _ in range(config.num_hidden_layers))


class CLIPVisionModel(nn.Module):
    """The vision tower up to its last needed layer (`post_layernorm` is for CLIP's pooled
    output, which LLaVA never reads: it is not built)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config)

    def hidden_states(self, pixel_values: torch.Tensor, wanted: list[int]
                      ) -> list[torch.Tensor]:
        """The hidden states at `wanted` indices of transformers' `hidden_states` tuple
        (0: the embeddings after `pre_layrnorm`, i: after layer i; negative from the end),
        each [n, 1 + patches, hidden]; layers past the last wanted one are not run."""
        num_layers = len(self.encoder.layers)
        indices = [i % (num_layers + 1) for i in wanted]
        states = [self.pre_layrnorm(self.embeddings(pixel_values))]
        for layer in self.encoder.layers[:max(indices)]:
            states.append(layer(states[-1]))
        return [states[i] for i in indices]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("post_layernorm.") or name.endswith("position_ids"):
                continue
            if name not in params:
                raise ValueError(f"Checkpoint tensor vision_tower.{name!r} has no place in "
                                 "the vision tower.")
            if params[name].shape != tensor.shape:
                raise ValueError(f"Checkpoint tensor vision_tower.{name!r} has shape "
                                 f"{tuple(tensor.shape)}, expected "
                                 f"{tuple(params[name].shape)}.")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded
