"""An image prompt as the engine takes it: each image's placeholder token expanded to its run
of image positions, and each image preprocessed into an `ImageInput` whose rows the engine
core computes (`vllm/v1/engine/image_rows.py`), or, for image embeddings (a float tensor
[feature_size, hidden_size] in place of an image, with `enable_mm_embeds`), whose rows the
user gave.

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
        for k, (start, image) in enumerate(zip(starts, images, strict=True)):
            ids += token_ids[previous:start]
            is_token += [True] * (start - previous)
            inputs.append(self._image_input(k, image, len(ids)))
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

    def _image_input(self, k: int, image: Any, offset: int) -> ImageInput:
        """Image k of the prompt: pixels for the vision encoder, or the user's rows."""
        if is_image_embeds(image):
            embeds = self._check_embeds(k, image)
            return ImageInput(None, offset, self.num_image_tokens, _tensor_hash(b"E", embeds),
                              embeds=embeds)
        pixels = preprocess(load_image(image), self.image_config)
        return ImageInput(pixels, offset, self.num_image_tokens, _tensor_hash(b"P", pixels))

    def _check_embeds(self, k: int, embeds: torch.Tensor) -> torch.Tensor:
        """image_embeds item k as [num_image_tokens, hidden_size] in the model's dtype."""
        mc = self.model_config
        if not mc.enable_mm_embeds:
            raise ValueError("image_embeds given, but image embeddings are disabled: create "
                             "the engine with enable_mm_embeds=True (server: "
                             "--enable-mm-embeds).")
        want = (self.num_image_tokens, mc.hidden_size)
        if embeds.layout != torch.strided or embeds.is_meta:
            raise ValueError(f"image_embeds item {k} must be a dense tensor with data, got "
                             f"layout {embeds.layout}.")
        if tuple(embeds.shape) != want:
            raise ValueError(f"image_embeds item {k} has shape {tuple(embeds.shape)}, but one "
                             f"image of {mc.architecture} is {want} [feature_size, "
                             "hidden_size] (several images: [num_images, feature_size, "
                             "hidden_size]).")
        embeds = embeds.detach().to(device="cpu", dtype=mc.dtype).contiguous()
        if not torch.isfinite(embeds).all():
            raise ValueError(f"image_embeds item {k} contains non-finite values (NaN or inf), "
                             f"after the cast to {mc.dtype}.")
        return embeds

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
        images = [item for image in (images if isinstance(images, (list, tuple))
                                     else [images]) for item in _embeds_items(image)]
        if len(images) > self.limit:
            raise ValueError(f"At most {self.limit} image(s) may be provided in one prompt, "
                             f"got {len(images)} (limit_mm_per_prompt).")
        return images


def is_image_embeds(item: Any) -> bool:
    """A floating-point tensor stands for image embeddings (uint8 tensors are pixels)."""
    return isinstance(item, torch.Tensor) and item.is_floating_point()


def _embeds_items(item: Any) -> list[Any]:
    """One `multi_modal_data` image entry as images: embeddings [num_images, feature_size,
    hidden_size] are num_images of them (vLLM's form), anything else is one."""
    if is_image_embeds(item) and item.dim() == 3:
        return list(item.unbind(0))
    if is_image_embeds(item) and item.dim() != 2:
        raise ValueError("image_embeds must be [feature_size, hidden_size] or [num_images, "
                         f"feature_size, hidden_size], got shape {tuple(item.shape)}.")
    return [item]


def _tensor_hash(tag: bytes, tensor: torch.Tensor) -> bytes:
    """An image's key (tag P: preprocessed pixels, the encoder cache's key, so an image
    sent as a PIL image, an array or file bytes hashes alike when it decodes alike; E: the
    user's embeddings, never cached)."""
    h = hashlib.sha256(tag + str((tensor.dtype, tuple(tensor.shape))).encode())
    h.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()
