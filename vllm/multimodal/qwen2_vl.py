"""Qwen2-VL's prompts (also Qwen2.5-VL's): images at their own resolution, and the language
model's M-RoPE positions.

An image is resized so that both sides are multiples of `patch_size * merge_size` (28) and
its area lies within [min_pixels, max_pixels] (`smart_resize`), then rescaled and normalised
as the CLIP processor does (`image.preprocess`). The vision tower cuts it into 14 x 14
patches and merges each 2 x 2 of them into one row, so an image of H x W pixels is

    grid (t, h, w) = (1, H / 14, W / 14) patches -> h * w / 4 rows

Example: 40 x 52 pixels -> smart_resize 56 x 84 (grown to the minimum area of 56 x 56) ->
grid (1, 4, 6) patches -> 2 x 3 = 6 rows; its `<|image_pad|>` becomes 6 of them.

M-RoPE: each prompt position has three rotary positions (temporal, height, width). Text
positions count up together; an image's rows take (start, start + row, start + column) over
its merged grid; the text after it continues from start + max(rows, columns). Example: 2
text tokens, the image above (2 x 3 rows), 1 text token:

    t: 0 1  2 2 2 2 2 2  5
    h: 0 1  2 2 2 3 3 3  5
    w: 0 1  2 3 4 2 3 4  5

Generated tokens (and anything past the prompt) take position p + delta in all three rows,
delta = (max prompt position + 1) - prompt length (here 6 - 9 = -3: the 10th token is at 6).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np
import torch

from vllm.config import ModelConfig
from vllm.multimodal.image import ImageProcessorConfig, load_image, preprocess
from vllm.multimodal.processing import (
    MediaPrompt,
    check_limit,
    expand_placeholders,
    image_token_id,
    is_image_embeds,
    media_items,
    placeholder_starts,
    tensor_hash,
)
from vllm.v1.messages import MediaInput


@dataclasses.dataclass(frozen=True, slots=True)
class DynamicResolutionConfig:
    """A Qwen2-VL image processor's settings (`preprocessor_config.json`)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    # rescale / normalise / resample as the CLIP processor (no crop: the size is computed)
    pixels: ImageProcessorConfig = ImageProcessorConfig(shortest_edge=None, size=(0, 0),
                                                        do_center_crop=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DynamicResolutionConfig:
        """The area bounds: top-level `min_pixels` / `max_pixels` (they override `size`, as
        in transformers), else `size`'s `shortest_edge` / `longest_edge` (older files:
        `size.min_pixels` / `size.max_pixels`)."""
        size = d.get("size") or {}
        pixels = ImageProcessorConfig.from_dict({**d, "do_center_crop": False})
        return cls(
            min_pixels=int(d.get("min_pixels") or size.get("shortest_edge")
                           or size.get("min_pixels") or 56 * 56),
            max_pixels=int(d.get("max_pixels") or size.get("longest_edge")
                           or size.get("max_pixels") or 28 * 28 * 1280),
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            merge_size=int(d.get("merge_size", 2)),
            pixels=dataclasses.replace(pixels, shortest_edge=None, size=(0, 0)))

    @classmethod
    def from_model_dir(cls, path: str) -> DynamicResolutionConfig:
        file = os.path.join(path, "preprocessor_config.json")
        if not os.path.isfile(file):
            return cls()
        with open(file) as f:
            return cls.from_dict(json.load(f))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """(height, width) both multiples of `factor`, the area within [min_pixels, max_pixels],
    the aspect ratio kept as near as may be. Examples (factor 28, 3136 .. 28224):
    40 x 52 -> 56 x 84 (28 x 56 is under the minimum: 40 x 52 * sqrt(3136 / 2080), each
    side ceiled to a multiple of 28), 100 x 300 -> 84 x 280 (112 x 308 is over the
    maximum: 100 x 300 / sqrt(30000 / 28224), each side floored to a multiple of 28)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"The image's aspect ratio is over 200 ({width}x{height}).")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def preprocess_dynamic(image: Any, config: DynamicResolutionConfig) -> torch.Tensor:
    """A loaded image (`load_image`) -> pixel values [3, H, W] float32, H and W multiples of
    `config.factor` (`smart_resize`); what the vision tower patches (`patchify`)."""
    width, height = image.size
    size = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    return preprocess(image, dataclasses.replace(config.pixels, size=size))


def patchify(pixels: torch.Tensor, patch_size: int, temporal_patch_size: int,
             merge_size: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Pixels [3, H, W] -> (patches [h * w, 3 * T * P * P], grid (1, h, w)), h = H / P:
    transformers' `pixel_values` and `image_grid_thw` of one image. Patches come in merge
    order (each 2 x 2 block of patches together, blocks row by row); an image is one
    frame repeated T times."""
    channels, height, width = pixels.shape
    h, w, m, p = height // patch_size, width // patch_size, merge_size, patch_size
    x = pixels.reshape(channels, h // m, m, p, w // m, m, p)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # (h/m, w/m, m, m, C, P, P)
    x = x.unsqueeze(5).expand(*x.shape[:5], temporal_patch_size, p, p)
    return x.reshape(h * w, channels * temporal_patch_size * p * p), (1, h, w)


def mrope_positions(num_tokens: int, images: list[tuple[int, tuple[int, int, int]]],
                    merge_size: int) -> torch.Tensor:
    """[3, num_tokens] int64 rotary positions of a prompt whose images are `images`
    ((offset of the image's run, its grid (t, h, w) in patches), in prompt order; see the
    module's example)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    current = previous = 0  # the next position; the first prompt index not yet placed
    for offset, (t, h, w) in [*images, (num_tokens, (0, 0, 0))]:
        out[:, previous:offset] = current + np.arange(offset - previous)  # text
        current += offset - previous
        rows, cols = h // merge_size, w // merge_size
        end = offset + t * rows * cols
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols),
                                 indexing="ij")
        out[:, offset:end] = current + np.stack([tt.reshape(-1), hh.reshape(-1),
                                                 ww.reshape(-1)])
        current += max(rows, cols)
        previous = end
    return torch.from_numpy(out)


class Qwen2VLPromptProcessor:
    """Turns `{"prompt" | "prompt_token_ids", "multi_modal_data": {"image": ...}}` into a
    `MediaPrompt` for Qwen2-VL: each `<|image_pad|>` (written between `<|vision_start|>` and
    `<|vision_end|>`, as the chat template does) becomes its image's run of rows, and the
    prompt's M-RoPE positions come with it."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any = None) -> None:
        """`tokenizer`: unused (the placeholder is one token, written as the user did)."""
        config = model_config.hf_config
        self.model_config = model_config
        self.image_token_id = image_token_id(config)
        self.image_config = DynamicResolutionConfig.from_model_dir(model_config.model)
        vision = config.vision_config
        if (self.image_config.patch_size, self.image_config.merge_size,
                self.image_config.temporal_patch_size) != (
                vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
            raise ValueError("The image processor's patch, merge and temporal patch sizes "
                             f"({self.image_config.patch_size}, {self.image_config.merge_size}"
                             f", {self.image_config.temporal_patch_size}) differ from the "
                             f"vision tower's ({vision.patch_size}, {vision.spatial_merge_size}"
                             f", {vision.temporal_patch_size}).")
        self.limit = model_config.mm_limit("image")

    def expand_text(self, text: str) -> str:
        """A text prompt before tokenization: placeholders stay as written."""
        return text

    def process(self, token_ids: list[int], data: Any) -> MediaPrompt:
        """`token_ids`: the prompt, one image token per image; `data`: multi_modal_data."""
        images = media_items(data, "image", self.model_config.architecture)
        if any(is_image_embeds(image) for image in images):
            raise ValueError(f"image_embeds are not supported for "
                             f"{self.model_config.architecture}: its positions need each "
                             "image's grid; send the image.")
        check_limit(len(images), "image", self.limit)
        placeholder_starts(token_ids, self.image_token_id, len(images), "image")
        inputs, grids = [], []
        patch, merge = self.image_config.patch_size, self.image_config.merge_size
        for image in images:
            pixels = preprocess_dynamic(load_image(image), self.image_config)
            grid = (1, pixels.shape[1] // patch, pixels.shape[2] // patch)
            grids.append(grid)
            inputs.append(MediaInput("image", pixels, 0, grid[1] * grid[2] // merge**2,
                                     tensor_hash(b"P", pixels)))
        prompt = expand_placeholders(token_ids, self.image_token_id, inputs, "image",
                                     self.model_config.max_model_len)
        spans = [(item.offset, grid) for item, grid in zip(inputs, grids, strict=True)]
        positions = mrope_positions(len(prompt.token_ids), spans, merge)
        return prompt._replace(mrope_positions=positions)
