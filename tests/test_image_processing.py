"""Image preprocessing equal to transformers' CLIP image processor, bit for bit, and hostile
images refused with errors that name the problem (`vllm/multimodal/image.py`)."""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CLIPImageProcessorPil

from vllm.multimodal.image import (
    ImageProcessorConfig,
    decode_image_bytes,
    load_image,
    preprocess,
)

PROCESSORS = [
    {},  # CLIP's defaults: shortest edge 224, crop 224
    {"size": {"shortest_edge": 30}, "crop_size": {"height": 28, "width": 28}},
    {"size": {"shortest_edge": 40}, "crop_size": {"height": 56, "width": 48}},  # pads
    {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32},
     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2},
]
SHAPES = [(480, 640, 3), (77, 33, 3), (50, 50, 4), (20, 91, 3)]


def _array(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _inputs(array: np.ndarray) -> dict[str, Any]:
    pil = Image.fromarray(array)
    return {"array": array, "pil": pil, "pil_L": pil.convert("L"), "pil_P": pil.convert("P"),
            "tensor": torch.from_numpy(array)}


@pytest.mark.parametrize("kwargs", PROCESSORS)
@pytest.mark.parametrize("shape", SHAPES)
def test_preprocess_equals_clip_image_processor(kwargs, shape) -> None:
    hf = CLIPImageProcessorPil(**kwargs)
    config = ImageProcessorConfig.from_dict(hf.to_dict())
    for kind, image in _inputs(_array(shape)).items():
        reference = image.numpy() if isinstance(image, torch.Tensor) else image
        expected = hf(images=reference, return_tensors="np")["pixel_values"][0]
        ours = preprocess(load_image(image), config)
        assert ours.dtype == torch.float32, kind
        assert ours.shape == expected.shape, kind
        assert np.array_equal(ours.numpy(), expected), kind


def test_encoded_bytes_equal_the_decoded_image() -> None:
    config = ImageProcessorConfig.from_dict(CLIPImageProcessorPil().to_dict())
    pil = Image.fromarray(_array((64, 96, 4)))
    expected = CLIPImageProcessorPil()(images=pil, return_tensors="np")["pixel_values"][0]
    assert np.array_equal(preprocess(load_image(_png(pil)), config).numpy(), expected)


def test_config_from_model_dir(tmp_path) -> None:
    CLIPImageProcessorPil(size={"shortest_edge": 30},
                          crop_size={"height": 28, "width": 26}).save_pretrained(tmp_path)
    config = ImageProcessorConfig.from_model_dir(str(tmp_path))
    assert (config.shortest_edge, config.crop_size, config.output_size) == (30, (28, 26),
                                                                            (28, 26))
    assert ImageProcessorConfig.from_model_dir(str(tmp_path / "none")) == ImageProcessorConfig()


# ---- hostile input ----------------------------------------------------------------------

def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height grey pixels and whose data is one tiny
    compressed row: a decompression bomb as far as its header goes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\x00" * (width + 1))) + chunk(b"IEND", b""))


def test_header_over_the_pixel_limit_is_refused_before_decoding() -> None:
    # PIL's own check, its limit set to ours, refuses at open: an error past twice the
    # limit, a warning (turned into the same refusal) past the limit.
    with pytest.raises(ValueError, match=r"decompression bomb.*2500000000 pixels"):
        decode_image_bytes(_png_header_only(50_000, 50_000))
    with pytest.raises(ValueError, match=r"decompression bomb.*64000000 pixels"):
        decode_image_bytes(_png_header_only(8000, 8000), max_pixels=40_000_000)


def test_decompression_bomb_is_refused_and_pil_limit_restored() -> None:
    before = Image.MAX_IMAGE_PIXELS
    bomb = _png(Image.new("L", (3000, 3000)))  # 9 M pixels in a few kB
    assert len(bomb) < 100_000
    with pytest.raises(ValueError, match="decompression bomb.*9000000 pixels"):
        decode_image_bytes(bomb, max_pixels=1_000_000)
    assert Image.MAX_IMAGE_PIXELS == before
    assert decode_image_bytes(bomb).size == (3000, 3000)  # within the default limit


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"this is not an image at all", "not an image"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "not an image|truncated or corrupt"),
])
def test_non_image_bytes_are_refused(data, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_image(data)


def test_truncated_image_is_refused() -> None:
    png = _png(Image.fromarray(_array((64, 64, 3))))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_image(png[: len(png) // 2])


def test_byte_limit() -> None:
    png = _png(Image.fromarray(_array((64, 64, 3))))
    with pytest.raises(ValueError, match=f"{len(png)} bytes, over the limit of 100"):
        load_image(png, max_bytes=100)


@pytest.mark.parametrize("image, message", [
    (np.zeros((8, 8, 3), dtype=np.float32), "must be uint8"),
    (np.zeros((8, 8, 2), dtype=np.uint8), r"got shape \(8, 8, 2\)"),
    (np.zeros((2, 8, 8, 3), dtype=np.uint8), "got shape"),
    (np.zeros((0, 8, 3), dtype=np.uint8), "empty"),
    ("picture.png", "must be a PIL image"),
])
def test_bad_arrays_and_types_are_refused(image, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_image(image)


def test_array_pixel_limit() -> None:
    with pytest.raises(ValueError, match="100x100 = 10000 pixels, over the limit of 9999"):
        load_image(np.zeros((100, 100, 3), dtype=np.uint8), max_pixels=9999)
    with pytest.raises(ValueError, match="over the limit of 9999"):
        load_image(Image.new("RGB", (100, 100)), max_pixels=9999)
