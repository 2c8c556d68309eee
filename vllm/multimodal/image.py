"""Images from users to pixel tensors: decoding with limits, then the model's own CLIP image
processor configuration (resize the shortest edge, center crop, rescale, normalise).

Every image is untrusted input. `load_image` takes a PIL image, a uint8 array or tensor
(H, W), (H, W, C) or (C, H, W) with C in {1, 3, 4}, or encoded bytes (PNG, JPEG, ...), and
refuses with a `ValueError` naming the problem: more than `MAX_IMAGE_PIXELS` pixels (checked
from the header, before any pixel is decoded: a decompression bomb is refused unread), more
than `MAX_IMAGE_BYTES` encoded bytes, bytes that are not an image, a truncated file.

`preprocess` computes exactly what transformers' `CLIPImageProcessor` (its PIL backend)
computes: the same PIL resize, crop offsets and float arithmetic.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# The engine's limits on one image (decoded pixels; encoded bytes).
MAX_IMAGE_PIXELS = 6000 * 6000
MAX_IMAGE_BYTES = 20 * 1024 * 1024

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
# OpenAI CLIP's normalisation, the CLIP image processor's defaults.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class ImageProcessorConfig:
    """A CLIP image processor's settings (`preprocessor_config.json`)."""

    shortest_edge: int | None = 224  # resize so the shorter side is this ...
    size: tuple[int, int] | None = None  # ... or to this (height, width)
    crop_size: tuple[int, int] = (224, 224)  # (height, width)
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    resample: int = _BICUBIC

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageProcessorConfig:
        size = d.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = d.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        mean, std = d.get("image_mean", _CLIP_MEAN), d.get("image_std", _CLIP_STD)
        return cls(
            shortest_edge=size.get("shortest_edge"),
            size=(size["height"], size["width"]) if "height" in size else None,
            crop_size=(crop["height"], crop["width"]),
            do_resize=d.get("do_resize", True), do_center_crop=d.get("do_center_crop", True),
            do_rescale=d.get("do_rescale", True),
            rescale_factor=d.get("rescale_factor", 1 / 255),
            do_normalize=d.get("do_normalize", True),
            image_mean=tuple(mean) if isinstance(mean, (list, tuple)) else (mean,) * 3,
            image_std=tuple(std) if isinstance(std, (list, tuple)) else (std,) * 3,
            resample=int(d.get("resample", _BICUBIC)))

    @classmethod
    def from_model_dir(cls, path: str) -> ImageProcessorConfig:
        """The directory's `preprocessor_config.json` (CLIP defaults where it has none)."""
        file = os.path.join(path, "preprocessor_config.json")
        if not os.path.isfile(file):
            return cls()
        with open(file) as f:
            return cls.from_dict(json.load(f))

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of the pixel tensors `preprocess` returns."""
        if self.do_center_crop:
            return self.crop_size
        if self.size is not None:
            return self.size
        raise ValueError("An image processor without center crop nor a fixed size gives "
                         "images of varying size; this model needs a fixed one.")


def load_image(data: Any, max_pixels: int = MAX_IMAGE_PIXELS,
               max_bytes: int = MAX_IMAGE_BYTES) -> Any:
    """A user's image as a decoded PIL image (any mode), within the limits."""
    from PIL import Image

    if isinstance(data, Image.Image):
        _check_pixels(data.size, max_pixels)
        return data
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    if isinstance(data, np.ndarray):
        array = _hwc_uint8(data, max_pixels)
        if array.ndim == 3 and array.shape[2] == 4:  # onto white, as transformers does
            alpha = array[..., 3:4] / 255
            array = np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
        return Image.fromarray(array)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return decode_image_bytes(bytes(data), max_pixels, max_bytes)
    raise ValueError("An image must be a PIL image, a uint8 array or tensor, or encoded "
                     f"image bytes; got {type(data).__name__}.")


def decode_image_bytes(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS,
                       max_bytes: int = MAX_IMAGE_BYTES) -> Any:
    """Encoded bytes -> a decoded PIL image. The size in the header is checked before any
    pixel is decoded; PIL's own decompression-bomb limit is set to ours for the call."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > max_bytes:
        raise ValueError(f"The image is {len(data)} bytes, over the limit of {max_bytes}.")
    if not data:
        raise ValueError("The image is empty (0 bytes).")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = max_pixels
        try:
            image = Image.open(io.BytesIO(data))
            _check_pixels(image.size, max_pixels)
            image.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ValueError(f"The image is a decompression bomb: {e}") from None
        except UnidentifiedImageError:
            raise ValueError("The image bytes are not an image in a format this engine "
                             "reads (PNG, JPEG, GIF, BMP, WebP, ...).") from None
        except (OSError, SyntaxError) as e:  # PIL's truncated and corrupt-file errors
            raise ValueError(f"The image could not be decoded (truncated or corrupt): "
                             f"{e}.") from None
        finally:
            Image.MAX_IMAGE_PIXELS = saved
    return image


def _check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ValueError(f"The image is empty ({width}x{height}).")
    if width * height > max_pixels:
        raise ValueError(f"The image is {width}x{height} = {width * height} pixels, over "
                         f"the limit of {max_pixels}.")


def _hwc_uint8(array: np.ndarray, max_pixels: int) -> np.ndarray:
    """An image array as (H, W) or (H, W, C) uint8 for PIL; (C, H, W) is moved."""
    if array.dtype != np.uint8:
        raise ValueError(f"An image array must be uint8 (0-255), got {array.dtype}.")
    if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[2] not in (1, 3, 4):
        array = np.moveaxis(array, 0, -1)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise ValueError("An image array must be (H, W), (H, W, C) or (C, H, W) with C in "
                         f"1, 3, 4; got shape {tuple(array.shape)}.")
    _check_pixels((array.shape[1], array.shape[0]), max_pixels)
    return np.ascontiguousarray(array)


def to_rgb(image: Any) -> np.ndarray:
    """(H, W, 3) uint8; transparency composited onto white, as the CLIP processor does."""
    from PIL import Image

    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return np.asarray(image.convert("RGB"))
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))


def preprocess(image: Any, config: ImageProcessorConfig) -> torch.Tensor:
    """A loaded image (`load_image`) -> pixel values [3, H, W] float32."""
    from PIL import Image

    pixels = to_rgb(image)
    if config.do_resize:
        height, width = _resize_size(pixels.shape[0], pixels.shape[1], config)
        resized = Image.fromarray(pixels).resize((width, height), resample=config.resample)
        pixels = np.asarray(resized)
    if config.do_center_crop:
        pixels = _center_crop(pixels, config.crop_size)
    out = pixels.astype(np.float32)
    if config.do_rescale:
        # float64 first, then float32: the same rounding as transformers' rescale
        out = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    if config.do_normalize:
        mean = np.asarray(config.image_mean, dtype=np.float32)
        std = np.asarray(config.image_std, dtype=np.float32)
        out = (out - mean) / std
    return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1)))


def _resize_size(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) after resizing. Shortest edge 224: 480x640 -> 224x298 (the long
    side scaled and truncated: int(224 * 640 / 480) = 298)."""
    if config.shortest_edge is None:
        assert config.size is not None
        return config.size
    size = config.shortest_edge
    if width <= height:
        return int(size * height / width), size
    return size, int(size * width / height)


def _center_crop(pixels: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
    """The centered (crop_h, crop_w) window of an (H, W, C) image, zero-padded (centered)
    where the image is smaller. Example: H=10, crop 4 -> rows 3..6 (top = (10 - 4) // 2)."""
    height, width = pixels.shape[:2]
    crop_h, crop_w = crop
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    padded = np.zeros((new_h, new_w, pixels.shape[2]), dtype=pixels.dtype)
    pad_top, pad_left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
    padded[pad_top:pad_top + height, pad_left:pad_left + width] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]
