"""The ViT vision encoders of CLIP and SigLIP: patch embedding, learned positions, pre-norm
transformer layers with full (non-causal) attention. Their layers are the same
(`CLIPEncoderLayer`: the activation is the config's, quick_gelu for CLIP, tanh gelu for
SigLIP); what differs:

    CLIPVisionModel    class token first, patch conv without bias, `pre_layrnorm` on the
                       embeddings (its `post_layernorm` is for the pooled output: not built)
    SiglipVisionModel  no class token, patch conv with a bias, `post_layernorm` on the last
                       layer's output (`last_hidden_state`; its pooling `head` is not built)

Parameter names follow transformers' (`embeddings.patch_embedding`, `encoder.layers.N...`),
so a checkpoint loads by name. Images are a few hundred positions each: the layers are plain
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


class VisionEmbeddings(nn.Module):
    """Patches (and CLIP's class token first) plus learned positions."""

    def __init__(self, config, class_token: bool, patch_bias: bool) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        if class_token:
            self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.class_token = class_token
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         config.patch_size, config.patch_size,
                                         bias=patch_bias)
        num_positions = (config.image_size // config.patch_size) ** 2 + int(class_token)
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, (1 +) patches, hidden]: the class token (CLIP), then the
        patches row by row, each plus its learned position."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        if self.class_token:
            cls = self.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat([cls, patches], dim=1)
        return patches + self.position_embedding.weight


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


class VisionTransformer(nn.Module):
    """The vision tower up to its last needed layer; CLIP and SigLIP subclass it with what
    differs (the module docstring's table)."""

    class_token = True
    patch_bias = False
    skipped: tuple[str, ...] = ()  # checkpoint parts not built (pooling)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = VisionEmbeddings(config, self.class_token, self.patch_bias)
        self.encoder = CLIPEncoder(config)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """transformers' `hidden_states[0]`: [n, positions, hidden]."""
        return self.embeddings(pixel_values)

    def hidden_states(self, pixel_values: torch.Tensor, wanted: list[int]
                      ) -> list[torch.Tensor]:
        """The hidden states at `wanted` indices of transformers' `hidden_states` tuple
        (0: the embeddings (after CLIP's `pre_layrnorm`), i: after layer i; negative from
        the end), each [n, positions, hidden]; layers past the last wanted one are not run."""
        num_layers = len(self.encoder.layers)
        indices = [i % (num_layers + 1) for i in wanted]
        states = [self.embed(pixel_values)]
        for layer in self.encoder.layers[:max(indices)]:
            states.append(layer(states[-1]))
        return [states[i] for i in indices]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies the tower's tensors, named as in the tower or as transformers nests them
        in a vision-language checkpoint (`vision_model.X`); returns the names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("vision_model.")
            if name.startswith(self.skipped) or name.endswith("position_ids"):
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


class CLIPVisionModel(VisionTransformer):
    skipped = ("post_layernorm.",)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.pre_layrnorm(self.embeddings(pixel_values))


class SiglipVisionModel(VisionTransformer):
    class_token = False
    patch_bias = True
    skipped = ("head.",)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """transformers' `last_hidden_state`: every layer, then `post_layernorm`;
        [n, patches, hidden]."""
        (last,) = self.hidden_states(pixel_values, [-1])
        return self.post_layernorm(last)


# The towers by `vision_config.model_type`.
VISION_TOWERS: dict[str, type[VisionTransformer]] = {
    "clip_vision_model": CLIPVisionModel,
    "siglip_vision_model": SiglipVisionModel,
}


def vision_tower(config) -> VisionTransformer:
    """The tower of a vision config (CLIP or SigLIP); other kinds are refused by name."""
    kind = getattr(config, "model_type", None)
    if kind not in VISION_TOWERS:
        raise ValueError(f"A {kind!r} vision tower is not supported "
                         f"({', '.join(VISION_TOWERS)}).")
    return VISION_TOWERS[kind](config)
