"""An image prompt as the engine takes it: each image's placeholder token expanded to its run
of image positions, and each image preprocessed into an `ImageInput` whose rows the engine
core computes (`vllm/v1/engine/image_rows.py`).

Example (LLaVA, 4 rows per image, `<image>` = 32000):
    "USER: <image>\\nWhat is this?" -> ids [1, 3148, 32000, 13, ...]
    -> ids [1, 3148, 32000, 32000, 32000, 32000, 13, ...], is_token [T, T, F, F, F, F, T, ...],
       one ImageInput(offset=2, num_tokens=4).
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import torch

from vllm.config import ModelConfig
from vllm.multimodal.image import ImageProcessorConfig, load_image, preprocess
from vllm.v1.messages import ImageInput


class ImagePrompt(NamedTuple):
    token_ids: list[int]  # image positions hold the image token id
    is_token: torch.Tensor  # bool [num_tokens]: False at image positions
    images: list[ImageInput]


def num_image_tokens(config: Any) -> int:
    """Rows one image becomes in a LLaVA config: its patches, plus the class token under the
    `full` strategy. Example: 336 px, patch 14 -> 24 * 24 = 576 (`default`)."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (1 if config.vision_feature_select_strategy == "full" else 0)


def check_vision_tower(config: Any) -> None:
    """LLaVA's tower must be CLIP's (SigLIP and others: not yet)."""
    kind = getattr(config.vision_config, "model_type", None)
    if kind != "clip_vision_model":
        raise ValueError(f"LLaVA with a {kind!r} vision tower is not supported yet (CLIP "
                         "only).")


def image_token_id(config: Any) -> int:
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ValueError("The model's config names no image token (image_token_index).")
    return int(token)


class ImagePromptProcessor:
    """Turns `{"prompt" | "prompt_token_ids", "multi_modal_data": {"image": ...}}` into an
    `ImagePrompt`, with the model's own image processor settings and the engine's limits."""

    def __init__(self, model_config: ModelConfig) -> None:
        config = model_config.hf_config
        check_vision_tower(config)
        self.model_config = model_config
        self.image_token_id = image_token_id(config)
        self.num_image_tokens = num_image_tokens(config)
        self.image_config = ImageProcessorConfig.from_model_dir(model_config.model)
        side = config.vision_config.image_size
        if self.image_config.output_size != (side, side):
            raise ValueError(f"The image processor gives {self.image_config.output_size} "
                             f"images, but the vision tower takes {side}x{side}.")
        self.limit = model_config.mm_limit("image")

    def process(self, token_ids: list[int], data: Any) -> ImagePrompt:
        """`token_ids`: the prompt, one image token per image; `data`: multi_modal_data."""
        images = self._images(data)
        starts = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(starts) != len(images):
            raise ValueError(f"The prompt has {len(starts)} image placeholder(s) "
                             f"(image token id {self.image_token_id}) but "
                             f"{len(images)} image(s) were given: put one placeholder "
                             "where each image goes.")
        n = self.num_image_tokens
        ids: list[int] = []
        is_token: list[bool] = []
        inputs: list[ImageInput] = []
        previous = 0
        for start, image in zip(starts, images, strict=True):
            ids += token_ids[previous:start]
            is_token += [True] * (start - previous)
            pixels = preprocess(load_image(image), self.image_config)
            inputs.append(ImageInput(pixels, len(ids), n, _pixels_hash(pixels)))
            ids += [self.image_token_id] * n
            is_token += [False] * n
            previous = start + 1
        ids += token_ids[previous:]
        is_token += [True] * (len(token_ids) - previous)
        max_len = self.model_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"The prompt (length {len(ids)}, with {len(images)} image(s) of "
                             f"{n} positions each) is longer than the maximum model length "
                             f"of {max_len}.")
        return ImagePrompt(ids, torch.tensor(is_token, dtype=torch.bool), inputs)

    def _images(self, data: Any) -> list[Any]:
        if not isinstance(data, dict):
            raise ValueError("multi_modal_data must be a dict such as {'image': image}, got "
                             f"{type(data).__name__}.")
        other = sorted(k for k in data if k != "image")
        if other:
            raise ValueError(f"multi_modal_data: {self.model_config.architecture} takes "
                             f"images only, not {other[0]!r}.")
        images = data.get("image")
        if images is None:
            raise ValueError("multi_modal_data has no 'image'.")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if len(images) > self.limit:
            raise ValueError(f"At most {self.limit} image(s) may be provided in one prompt, "
                             f"got {len(images)} (limit_mm_per_prompt).")
        return images


def _pixels_hash(pixels: torch.Tensor) -> bytes:
    """The encoder cache's key: the preprocessed pixels (an image sent as a PIL image, an
    array or file bytes hashes alike when it decodes alike)."""
    h = hashlib.sha256(str(tuple(pixels.shape)).encode())
    h.update(pixels.numpy().tobytes())
    return h.digest()
