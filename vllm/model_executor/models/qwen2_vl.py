"""Qwen2-VL (`Qwen2VLForConditionalGeneration`) and Qwen2.5-VL
(`Qwen2_5_VLForConditionalGeneration`): a vision transformer over each image's own grid of
patches, with 2-D rotary attention and a patch merger, and a Qwen2 language model with M-RoPE
(`multimodal.MultiModalLanguageModel`; its rotary is `MRotaryEmbedding`). Qwen2.5-VL's tower
has RMSNorms, a gated MLP and window attention (`Qwen2_5_VisionTransformer`); the rest is
the same.

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

Not supported: videos; CUDA graphs and the fused decoder (their position buffers are 1-D:
the runner keeps CUDA graphs off for M-RoPE models, and the language model refuses fused
decode by name). The CPU graphs keep [3, n] positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.models.clip import vision_activation
from vllm.model_executor.models.interfaces import VllmModel
from vllm.model_executor.models.llama import ACTIVATIONS
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


class VisionGatedMlp(nn.Module):
    """Qwen2.5-VL's: act(gate(x)) * up(x) -> down, each with a bias."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = ACTIVATIONS[act] if act in ACTIVATIONS else vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, norm: Callable[..., nn.Module],
                 mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm(dim, eps=1e-6)
        self.norm2 = norm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, lens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A linear map of each flattened [3, T, P, P] patch (transformers' Conv3d with stride
    equal to its kernel: the same weight, `proj.weight` [dim, 3, T, P, P])."""

    def __init__(self, config, dim: int) -> None:
        super().__init__()
        p, t = config.patch_size, config.temporal_patch_size
        self.proj = nn.Conv3d(config.in_channels, dim, (t, p, p), (t, p, p), bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1))


class PatchMerger(nn.Module):
    def __init__(self, dim: int, context_dim: int, merge: int,
                 norm: Callable[..., nn.Module]) -> None:
        super().__init__()
        self.hidden = context_dim * merge**2
        self.ln_q = norm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(),
                                 nn.Linear(self.hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's vision tower: LayerNorms, a plain MLP, attention within each image.
    Parameter names follow transformers' (`patch_embed.proj`, `blocks.N.{norm1,attn.qkv,
    attn.proj,norm2,mlp.fc1,mlp.fc2}`, `merger.{ln_q,mlp.0,mlp.2}`), so a checkpoint loads
    by name."""

    norm: ClassVar[Callable[..., nn.Module]] = nn.LayerNorm

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        dim, out = self.widths(config)
        self.patch_embed = PatchEmbed(config, dim)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(dim // config.num_heads, theta)
        self.blocks = nn.ModuleList(VisionBlock(dim, config.num_heads, self.norm,
                                                self.make_mlp(config, dim))
                                    for _ in range(config.depth))
        self.merger = PatchMerger(out, dim, self.merge, self.norm)

    @staticmethod
    def widths(config) -> tuple[int, int]:
        """(the tower's width, the rows' width: the language model's)."""
        return config.embed_dim, config.hidden_size

    @staticmethod
    def make_mlp(config, dim: int) -> nn.Module:
        return VisionMlp(dim, int(dim * config.mlp_ratio), config.hidden_act)

    def layout(self, grids: list[tuple[int, int, int]]
               ) -> tuple[torch.Tensor | None, list[list[int]]]:
        """(an order of the patches, or None for theirs; each block's attention spans in
        that order): here every block attends within each image."""
        return None, [[t * h * w for t, h, w in grids]] * len(self.blocks)

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """Images [3, H, W] (H, W multiples of patch size x merge) -> each one's rows
        [H * W / (patch size x merge)^2, out width]; one batch."""
        config = self.config
        pieces = [patchify(image, config.patch_size, config.temporal_patch_size, self.merge)
                  for image in images]
        grids = [grid for _, grid in pieces]
        patches = torch.cat([p for p, _ in pieces])
        rows_cols = torch.cat([patch_rows_cols(h, w, self.merge) for _, h, w in grids])
        x = self.patch_embed(patches)
        order, spans = self.layout(grids)
        if order is not None:  # whole merge units move: each unit's patches stay together
            x, rows_cols = x[order], rows_cols[order]
        cos_sin = self.rotary(rows_cols.to(x.device))
        for block, lens in zip(self.blocks, spans, strict=True):
            x = block(x, cos_sin, lens)
        if order is not None:
            x = x[torch.argsort(order)]
        return list(self.merger(x).split([t * h * w // self.merge**2 for t, h, w in grids]))


class Qwen2_5_VisionTransformer(Qwen2VisionTransformer):
    """Qwen2.5-VL's vision tower: RMSNorms, a gated MLP, and window attention in every
    block but `fullatt_block_indexes` (those attend within each image).

    Windows tile each image's grid of merge units (2 x 2 patches) in squares of
    `window_size / patch_size / merge` units, row by row, the last row and column of
    windows cut short. Example: 4 x 6 units, windows of 2 x 2 -> six windows of 4 units
    (16 patches) each; 5 x 5 units -> windows of 4, 4, 2, 4, 4, 2, 2, 2, 1 units.
    """

    norm = nn.RMSNorm

    @staticmethod
    def widths(config) -> tuple[int, int]:
        return config.hidden_size, config.out_hidden_size

    @staticmethod
    def make_mlp(config, dim: int) -> nn.Module:
        return VisionGatedMlp(dim, config.intermediate_size, config.hidden_act)

    def layout(self, grids: list[tuple[int, int, int]]
               ) -> tuple[torch.Tensor | None, list[list[int]]]:
        config = self.config
        side = config.window_size // self.merge // config.patch_size  # units per window side
        unit = self.merge**2
        order, windows, start = [], [], 0
        for t, h, w in grids:
            rows, cols = h // self.merge, w // self.merge
            units = torch.arange(t * rows * cols).view(t, rows, cols)
            for frame in units:
                for top in range(0, rows, side):
                    for left in range(0, cols, side):
                        cells = frame[top:top + side, left:left + side].reshape(-1)
                        order.append((start + cells[:, None] * unit
                                      + torch.arange(unit)).reshape(-1))
                        windows.append(cells.numel() * unit)
            start += t * h * w
        full = set(config.fullatt_block_indexes)
        images = [t * h * w for t, h, w in grids]
        return torch.cat(order), [images if i in full else windows
                                  for i in range(len(self.blocks))]


class Qwen2VLForConditionalGeneration(MultiModalLanguageModel):
    tower: type[Qwen2VisionTransformer] = Qwen2VisionTransformer

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__(config, backend, max_model_len, dtype)
        self.config = config
        self.visual = self.tower(config.vision_config)

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


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL with `Qwen2_5_VisionTransformer` (the same prompts, positions,
    language model and checkpoint layout)."""

    tower = Qwen2_5_VisionTransformer
