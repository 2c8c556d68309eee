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

With `enable_mm_embeds`, an image may come as the vision tower's output with its grid
(vLLM's form): `{"image_embeds": rows [sum of the images' rows, hidden_size],
"image_grid_thw": [num_images, 3]}`. The rows fill the runs as the tower's would, and the
positions follow the grids exactly as for pixels.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm.config import ModelConfig
from vllm.multimodal.image import ImageProcessorConfig, load_image, preprocess
from vllm.multimodal.processing import (
    MediaPrompt,
    check_dense,
    check_limit,
    check_mm_embeds_enabled,
    expand_placeholders,
    finite_rows,
    image_embeds_tensor,
    image_token_id,
    is_image_embeds,
    media_items,
    placeholder_starts,
    tensor_hash,
)
from vllm.v1.messages import MediaInput

GRID_KEY = "image_grid_thw"  # vLLM's name (and transformers' processor's)


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


class ImageEmbeds(NamedTuple):
    """One image given as the vision tower's output (with `enable_mm_embeds`)."""

    rows: torch.Tensor  # [t * h * w / merge_size**2, hidden_size], as the user gave them
    grid: tuple[int, int, int]  # (t, h, w) in patches, before merging


def image_grids(grid: Any, merge_size: int, what: str) -> list[tuple[int, int, int]]:
    """`image_grid_thw` ([num_images, 3], or [3] for one image; a tensor, an array or
    lists of ints) as one (t, h, w) per image; raises ValueError naming `what` unless each
    is an image's grid: integers >= 1, t = 1, h and w multiples of `merge_size`."""
    if isinstance(grid, (torch.Tensor, np.ndarray)):
        integral = (np.issubdtype(grid.dtype, np.integer) if isinstance(grid, np.ndarray)
                    else not (grid.dtype.is_floating_point or grid.dtype.is_complex
                              or grid.dtype == torch.bool))
        if not integral:
            raise ValueError(f"{what} must hold integers, got dtype {grid.dtype}.")
        if isinstance(grid, torch.Tensor):
            check_dense(grid, what)
        shape = f"shape {tuple(grid.shape)}"
        grid = grid.tolist()
    else:
        shape = repr(grid)[:80]
    rows = [grid] if isinstance(grid, (list, tuple)) and len(grid) == 3 and all(
        _is_int(v) for v in grid) else grid
    if not (isinstance(rows, (list, tuple)) and rows and all(
            isinstance(row, (list, tuple)) and len(row) == 3 and all(_is_int(v) for v in row)
            for row in rows)):
        raise ValueError(f"{what} must be [num_images, 3] integers (each image's t, h, w in "
                         f"patches; [3] for one image), got {shape}.")
    grids = [(int(t), int(h), int(w)) for t, h, w in rows]
    for i, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1:
            raise ValueError(f"{what} row {i} is {(t, h, w)}: t, h and w must be >= 1.")
        if t != 1:
            raise ValueError(f"{what} row {i} is {(t, h, w)}: an image has t = 1 (videos "
                             "are not supported).")
        if h % merge_size or w % merge_size:
            raise ValueError(f"{what} row {i} is {(t, h, w)}: h and w must be multiples of "
                             f"the merge size {merge_size}.")
    return grids


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def split_grid_embeds(entry: Any, model_config: ModelConfig, merge_size: int, what: str
                      ) -> list[ImageEmbeds]:
    """A `multi_modal_data` image entry of embeddings, `{"image_embeds": rows [sum of the
    images' rows, hidden_size], "image_grid_thw": [num_images, 3]}` (vLLM's form), as one
    `ImageEmbeds` per image; raises ValueError naming `what` (the entry).

    Example (merge 2): rows [18, H] with grid [[1, 4, 6], [1, 6, 8]] -> rows 0..5 with
    (1, 4, 6) (2 x 3 merged rows) and rows 6..17 with (1, 6, 8) (3 x 4); rows [30, H] with
    that grid are refused (30 rows given, 18 expected).
    """
    arch = model_config.architecture
    if not isinstance(entry, dict):
        raise ValueError(f"{what}: image_embeds for {arch} need each image's grid, since "
                         "its positions follow it: pass {'image_embeds': rows [num_rows, "
                         "hidden_size], 'image_grid_thw': [[t, h, w], ...]}.")
    extra = sorted(k for k in entry if k not in ("image_embeds", GRID_KEY))
    if extra:
        raise ValueError(f"{what}: image_embeds takes no {extra[0]!r} for {arch} (only "
                         f"'image_embeds' and '{GRID_KEY}').")
    if entry.get(GRID_KEY) is None:
        raise ValueError(f"{what}: image_embeds for {arch} need '{GRID_KEY}', each image's "
                         "(t, h, w) in patches as the image processor gives it, "
                         "[num_images, 3].")
    grids = image_grids(entry[GRID_KEY], merge_size, f"{what}: {GRID_KEY}")
    rows = image_embeds_tensor(entry.get("image_embeds"), "[num_rows, hidden_size]", what)
    check_dense(rows, f"{what}: image_embeds")
    sizes = [t * h * w // merge_size**2 for t, h, w in grids]
    hidden = model_config.hidden_size
    if rows.dim() != 2 or rows.shape[1] != hidden:
        raise ValueError(f"{what}: image_embeds has shape {tuple(rows.shape)}, but "
                         f"{arch} takes [num_rows, {hidden}] (its hidden size).")
    if rows.shape[0] != sum(sizes):
        raise ValueError(f"{what}: image_embeds has {rows.shape[0]} rows, but {GRID_KEY} "
                         f"{[list(g) for g in grids]} expects {sum(sizes)} (t * h * w / "
                         f"{merge_size}^2 per image: {sizes}).")
    return [ImageEmbeds(r, g) for r, g in zip(rows.split(sizes), grids, strict=True)]


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
        """`token_ids`: the prompt, one image token per image; `data`: multi_modal_data
        (images, and with `enable_mm_embeds` entries of embeddings with their grids)."""
        entries = media_items(data, "image", self.model_config.architecture)
        images = [image for e, entry in enumerate(entries) for image in self._split(e, entry)]
        check_limit(len(images), "image", self.limit)
        placeholder_starts(token_ids, self.image_token_id, len(images), "image")
        inputs = [self._image_input(k, image) for k, image in enumerate(images)]
        prompt = expand_placeholders(token_ids, self.image_token_id,
                                     [item for item, _ in inputs], "image",
                                     self.model_config.max_model_len)
        spans = [(item.offset, grid) for item, grid in inputs]
        positions = mrope_positions(len(prompt.token_ids), spans, self.image_config.merge_size)
        return prompt._replace(mrope_positions=positions)

    def _split(self, e: int, entry: Any) -> list[Any]:
        """Image entry e as images: an entry of embeddings (a dict, or a float tensor,
        refused for its missing grid) as its `ImageEmbeds`, anything else as itself."""
        if not isinstance(entry, dict) and not is_image_embeds(entry):
            return [entry]
        check_mm_embeds_enabled(self.model_config)
        return split_grid_embeds(entry, self.model_config, self.image_config.merge_size,
                                 f"image entry {e}")

    def _image_input(self, k: int, image: Any) -> tuple[MediaInput, tuple[int, int, int]]:
        """Image k of the prompt and its grid: pixels for the vision tower, or the user's
        rows (in the model's dtype, keyed by their bytes and their grid)."""
        merge = self.image_config.merge_size
        if isinstance(image, ImageEmbeds):
            rows = finite_rows(image.rows, self.model_config.dtype, f"image_embeds of image {k}")
            key = tensor_hash(b"E", rows, np.array(image.grid, dtype=np.int64).tobytes())
            return MediaInput("image", None, 0, rows.shape[0], key, embeds=rows), image.grid
        patch = self.image_config.patch_size
        pixels = preprocess_dynamic(load_image(image), self.image_config)
        grid = (1, pixels.shape[1] // patch, pixels.shape[2] // patch)
        return (MediaInput("image", pixels, 0, grid[1] * grid[2] // merge**2,
                           tensor_hash(b"P", pixels)), grid)
