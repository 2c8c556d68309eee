"""Qwen2-VL (`Qwen2VLForConditionalGeneration`): a vision transformer over each image's own
grid of patches, with 2-D rotary attention and a patch merger, and a Qwen2 language model
with M-RoPE (`multimodal.MultiModalLanguageModel`; its rotary is `MRotaryEmbedding`).

An image [3, H, W] (`vllm/multimodal/qwen2_vl.py`: resized to multiples of 28) becomes

    patches [h * w, 3 * 2 * 14 * 14] (h = H / 14, w = W / 14; 2 x 2 blocks together)
    --patch embed--> [h * w, embed_dim] --blocks: attention within the image, rotary by
    each patch's (row, column)--> --merger: layer norm, each 2 x 2 block's 4 rows
    concatenated, MLP--> rows [h * w / 4, text hidden size]

which the engine core puts at the image's `<|image_pad|>` run as prompt-embeds rows
(`vllm/v1/engine/media_rows.py`); the language model's forward is the plain decoder's, with
three rotary positions per token (the runner's `mrope_step_positions`).

Checkpoint names (both layouts transformers writes):

    visual.X / model.visual.X                     -> visual.X
    model.X / model.language_model.X              -> language_model.model.X
    lm_head.X                                     -> language_model.lm_head.X

Not supported: videos; graph capture and the fused decoder (their position buffers are
1-D, so the model declares no graph support and the language model refuses fused decode).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.models.clip import vision_activation
from vllm.model_executor.models.interfaces import VllmModel
from vllm.model_executor.models.multimodal import (
    MultiModalLanguageModel,
    load_module_exactly,
)
from vllm.multimodal.qwen2_vl import patchify
from vllm.v1.attention.backends.abstract import AttentionBackend


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionRotary(nn.Module):
    """2-D rotary of the vision tower: a head's first half of pairs turns with the patch's
    row, the second half with its column (the pairs' frequencies over head_dim / 2)."""

    inv_freq: torch.Tensor  # [head_dim / 4] float32

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial = head_dim // 2
        inv_freq = 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, rows_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows_cols [n, 2] int64 -> cos, sin [n, 1, head_dim] float32."""
        freqs = (rows_cols[..., None].float() * self.inv_freq).flatten(1)  # [n, hd / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def patch_rows_cols(h: int, w: int, merge: int) -> torch.Tensor:
    """[h * w, 2] (row, column) of each patch in merge order (2 x 2 blocks together).
    Example: h = w = 4, merge 2: rows [0 0 1 1 0 0 1 1 2 2 3 3 ...], columns
    [0 1 0 1 2 3 2 3 0 1 0 1 ...]."""
    rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
    cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
    return torch.stack((rows.reshape(-1), cols.reshape(-1)), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                lens: list[int]) -> torch.Tensor:
        """x [n, dim] of several images (`lens` patches each): attention within each."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        cos, sin = cos_sin
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(t.dtype) for t in (q, k))
        out = torch.cat([
            F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1),
                                           vi.transpose(0, 1)).transpose(0, 1)
            for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens), strict=True)])
        return self.proj(out.reshape(n, -1))


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = vision_activation(act)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim = config.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = VisionMlp(dim, int(dim * config.mlp_ratio), config.hidden_act)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, lens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A linear map of each flattened [3, T, P, P] patch (transformers' Conv3d with stride
    equal to its kernel: the same weight, `proj.weight` [embed_dim, 3, T, P, P])."""

    def __init__(self, config) -> None:
        super().__init__()
        p, t = config.patch_size, config.temporal_patch_size
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, (t, p, p), (t, p, p),
                              bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1))


class PatchMerger(nn.Module):
    def __init__(self, dim: int, context_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = context_dim * merge**2
        self.ln_q = nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(),
                                 nn.Linear(self.hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """The vision tower; parameter names follow transformers' (`patch_embed.proj`,
    `blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}`, `merger.{ln_q,mlp.0,
    mlp.2}`), so a checkpoint loads by name."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(config.embed_dim // config.num_heads, theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.hidden_size, config.embed_dim, self.merge)

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """Images [3, H, W] (H, W multiples of patch size x merge) -> each one's rows
        [H * W / (patch size x merge)^2, hidden_size]; one batch, attention per image."""
        config = self.config
        pieces = [patchify(image, config.patch_size, config.temporal_patch_size, self.merge)
                  for image in images]
        patches = torch.cat([p for p, _ in pieces])
        rows_cols = torch.cat([patch_rows_cols(h, w, self.merge) for _, (_, h, w) in pieces])
        lens = [p.shape[0] for p, _ in pieces]
        cos_sin = self.rotary(rows_cols.to(patches.device))
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, cos_sin, lens)
        return list(self.merger(x).split([n // self.merge**2 for n in lens]))


class Qwen2VLForConditionalGeneration(MultiModalLanguageModel):
    # The runner's graph buffers hold 1-D positions; M-RoPE steps run eagerly.
    supports_graph_capture = False

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__(config, backend, max_model_len, dtype)
        self.config = config
        self.visual = Qwen2VisionTransformer(config.vision_config)

    def embed_media(self, modality: str, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """Images [3, H, W] -> each one's rows [num_image_tokens, text hidden size]."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {modality}.")
        return self.visual(data)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Routes each checkpoint tensor to its part (see the module's name table)."""
        visual: list[tuple[str, torch.Tensor]] = []
        language: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            rest = name.removeprefix("model.")
            if rest.startswith("visual."):
                visual.append((rest.removeprefix("visual."), tensor))
            elif rest.startswith("language_model."):
                language.append(("model." + rest.removeprefix("language_model."), tensor))
            else:
                language.append((name, tensor))
        loaded = load_module_exactly(self.visual, visual, "visual")
        language_model: VllmModel = self.language_model
        loaded |= {f"language_model.{n}"
                   for n in language_model.load_weights(iter(language))}
        return loaded
