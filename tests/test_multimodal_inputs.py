"""Image prompts without an engine: placeholder expansion, image embeddings, the engine core's
media stage and its encoder cache (`vllm/multimodal/`, `vllm/v1/engine/media_rows.py`)."""

from __future__ import annotations

import io
from typing import Literal

import numpy as np
import pytest
import torch
from PIL import Image

from vllm.config import ModelConfig
from vllm.multimodal.processing import ImagePromptProcessor, num_image_tokens
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.media_rows import MediaRows
from vllm.v1.messages import MediaInput

IMAGE = 50  # the image token id of the configs below


def _llava_config(strategy: Literal["default", "full"] = "default"):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                              num_attention_heads=2, image_size=14, patch_size=7)
    text = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, vocab_size=64)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE,
                       vision_feature_select_strategy=strategy,
                       architectures=["LlavaForConditionalGeneration"])


def _processor(tmp_path, limit: int | None = None, max_model_len: int = 64,
               strategy: Literal["default", "full"] = "default",
               mm_embeds: bool = False) -> ImagePromptProcessor:
    from transformers import CLIPImageProcessorPil

    CLIPImageProcessorPil(size={"shortest_edge": 14},
                          crop_size={"height": 14, "width": 14}).save_pretrained(tmp_path)
    config = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path),
                         hf_config=_llava_config(strategy), dtype=torch.float32,
                         max_model_len=max_model_len,
                         limit_mm_per_prompt={} if limit is None else {"image": limit},
                         enable_mm_embeds=mm_embeds)
    return ImagePromptProcessor(config)


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (20, 30, 3), dtype=np.uint8)


def test_num_image_tokens_by_strategy() -> None:
    assert num_image_tokens(_llava_config()) == 4  # (14 / 7)^2 patches
    assert num_image_tokens(_llava_config("full")) == 5  # and the class token


def test_placeholders_expand_to_runs(tmp_path) -> None:
    processor = _processor(tmp_path)
    prompt = processor.process([1, 7, IMAGE, 8, IMAGE, 9], {"image": [_image(0), _image(1)]})
    assert prompt.token_ids == [1, 7] + [IMAGE] * 4 + [8] + [IMAGE] * 4 + [9]
    assert prompt.is_token.tolist() == [True, True] + [False] * 4 + [True] + [False] * 4 + [True]
    assert [(i.offset, i.num_tokens) for i in prompt.items] == [(2, 4), (7, 4)]
    assert prompt.items[0].data.shape == (3, 14, 14)
    assert prompt.items[0].content_hash != prompt.items[1].content_hash
    # One picture as an array and as PNG bytes: the same pixels, the same key.
    png = io.BytesIO()
    Image.fromarray(_image(0)).save(png, format="PNG")
    again = processor.process([IMAGE], {"image": png.getvalue()})
    assert again.items[0].content_hash == prompt.items[0].content_hash


@pytest.mark.parametrize("ids, data, message", [
    ([IMAGE, IMAGE], {"image": [_image(0)] * 3}, r"At most 2 image\(s\) .* got 3"),
    ([IMAGE, IMAGE], {"image": _image(0)}, r"2 image placeholder\(s\) .* 1 image\(s\)"),
    ([1, 2], {"image": _image(0)}, r"0 image placeholder\(s\)"),
    ([IMAGE], {"video": _image(0)}, "images only, not 'video'"),
    ([IMAGE], {}, "has no 'image'"),
    ([IMAGE], "picture", "must be a dict"),
])
def test_bad_image_prompts(tmp_path, ids, data, message) -> None:
    with pytest.raises(ValueError, match=message):
        _processor(tmp_path, limit=2).process(ids, data)


def test_siglip_tower_counts_patches_only() -> None:
    from transformers import LlavaConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(image_size=14, patch_size=7)
    assert num_image_tokens(LlavaConfig(vision_config=vision, image_token_index=IMAGE,
                                        vision_feature_select_strategy="full")) == 4
    # `default` drops the first position, a patch here (as transformers does)
    assert num_image_tokens(LlavaConfig(vision_config=vision, image_token_index=IMAGE)) == 3


def test_other_vision_tower_is_refused(tmp_path) -> None:
    from transformers import Dinov2Config, LlavaConfig

    config = LlavaConfig(vision_config=Dinov2Config(), image_token_index=IMAGE)
    model_config = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path),
                               hf_config=config, dtype=torch.float32, max_model_len=64)
    with pytest.raises(ValueError, match="'dinov2' vision tower is not supported"):
        ImagePromptProcessor(model_config)


def test_expanded_prompt_must_fit_the_model(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"length 9, with 2 image\(s\) of 4 positions"):
        _processor(tmp_path, max_model_len=8).process([1, IMAGE, IMAGE],
                                                      {"image": [_image(0), _image(1)]})


# ---- image embeddings --------------------------------------------------------------------

def _embeds(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_image_embeds_fill_their_runs(tmp_path) -> None:
    processor = _processor(tmp_path, mm_embeds=True)
    one, pair = _embeds(0, 4, 8).double(), _embeds(1, 2, 4, 8)  # [4, 8]; [2, 4, 8]
    prompt = processor.process([1, IMAGE, 7, IMAGE, IMAGE], {"image": [one, pair]})
    assert prompt.token_ids == [1] + [IMAGE] * 4 + [7] + [IMAGE] * 8
    assert [(i.offset, i.data) for i in prompt.items] == [(1, None), (6, None), (10, None)]
    rows = [i.embeds for i in prompt.items]
    assert all(r is not None and r.dtype == torch.float32 for r in rows)
    assert torch.equal(rows[0], one.float())  # cast to the model's dtype
    assert torch.equal(rows[1], pair[0]) and torch.equal(rows[2], pair[1])
    assert len({i.content_hash for i in prompt.items}) == 3
    as_dict = processor.process([IMAGE], {"image": {"image_embeds": one}})  # vLLM's form
    assert torch.equal(as_dict.items[0].embeds, rows[0])
    # Embeddings and a picture in one prompt.
    mixed = processor.process([IMAGE, IMAGE], {"image": [_image(0), one]})
    assert mixed.items[0].embeds is None and mixed.items[0].data is not None
    assert mixed.items[1].embeds is not None


@pytest.mark.parametrize("data, message", [
    (_embeds(0, 3, 8), r"image_embeds item 0 has shape \(3, 8\), but one image of "
                       r"LlavaForConditionalGeneration is \(4, 8\)"),
    (_embeds(0, 4, 6), r"has shape \(4, 6\)"),
    (_embeds(0, 4), r"must be \[feature_size, hidden_size\] or \[num_images"),
    (_embeds(0, 1, 1, 4, 8), r"got shape \(1, 1, 4, 8\)"),
    (torch.full((4, 8), float("nan")), "non-finite"),
    (torch.full((4, 8), 1e39, dtype=torch.float64), r"non-finite .* torch.float32"),
    ([_embeds(0, 4, 8)] * 3, r"At most 2 image\(s\)"),
    (_embeds(0, 2, 4, 8), r"1 image placeholder\(s\) .* 2 image\(s\)"),
    # vLLM's dict form: the rows alone (a grid is Qwen2-VL's).
    ({"image_embeds": _embeds(0, 4, 8), "image_grid_thw": [1, 2, 2]},
     "image_embeds takes no 'image_grid_thw' for this model: send the embeddings alone"),
    ({"image_embeds": torch.zeros(4, 8, dtype=torch.int64)}, "must be a floating-point"),
])
def test_bad_image_embeds(tmp_path, data, message) -> None:
    with pytest.raises(ValueError, match=message):
        _processor(tmp_path, limit=2, mm_embeds=True).process([1, IMAGE], {"image": data})


def test_image_embeds_need_enable_mm_embeds(tmp_path) -> None:
    with pytest.raises(ValueError, match="enable_mm_embeds=True"):
        _processor(tmp_path).process([IMAGE], {"image": _embeds(0, 4, 8)})


# ---- the engine core's image stage ------------------------------------------------------

class _Encoder:
    """Rows [n, 2, 3] made from each image's first pixel value; counts its calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, modality: str, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        assert modality == "image"
        self.calls.append(len(pixels))
        return [p[0, 0, :1].expand(2, 3).clone() for p in pixels]


def _input(value: float, offset: int = 1) -> MediaInput:
    return MediaInput("image", torch.full((3, 2, 2), float(value)), offset, 2,
                      bytes([int(value)]) * 32)


def _request(*images: MediaInput) -> EngineCoreRequest:
    from vllm import SamplingParams

    n = 1 + 2 * len(images)
    mask = torch.ones(n, dtype=torch.bool)
    mask[1:] = False
    return EngineCoreRequest("r", [1] + [IMAGE] * (n - 1), None, SamplingParams(), None,
                             prompt_is_token_ids=mask, mm_inputs=list(images))


def test_image_rows_fill_in_prompt_order_and_cache() -> None:
    encoder = _Encoder()
    stage = MediaRows(encoder)
    request = _request(_input(5), _input(7, 3), _input(5, 5))
    stage.fill([request])
    assert request.mm_inputs is None
    assert request.prompt_embeds is not None
    assert request.prompt_embeds[:, 0].tolist() == [5, 5, 7, 7, 5, 5]
    assert encoder.calls == [2]  # one call, each distinct image once
    assert stage.stats() == {"encoder_cache_hits": 0, "encoder_cache_misses": 2,
                             "encoder_cache_entries": 2, "encoder_cache_bytes": 48}
    again = _request(_input(7))
    stage.fill([again])
    assert encoder.calls == [2] and stage.hits == 1
    assert again.prompt_embeds is not None and again.prompt_embeds[:, 0].tolist() == [7, 7]


def test_image_rows_take_given_embeds_without_the_encoder() -> None:
    encoder = _Encoder()
    stage = MediaRows(encoder)
    given = MediaInput("image", None, 3, 2, b"E" * 32, embeds=torch.full((2, 3), 9.0))
    request = _request(_input(5), given)
    stage.fill([request])
    assert request.prompt_embeds is not None
    assert request.prompt_embeds[:, 0].tolist() == [5, 5, 9, 9]
    assert encoder.calls == [1]  # only the picture
    assert stage.stats()["encoder_cache_entries"] == 1  # given rows are not cached
    only = _request(MediaInput("image", None, 1, 2, b"F" * 32, embeds=torch.ones(2, 3)))
    stage.fill([only])
    assert encoder.calls == [1] and only.prompt_embeds is not None


def test_pending_requests_share_one_encoder_batch() -> None:
    encoder = _Encoder()
    stage = MediaRows(encoder, max_batch=2)
    first, second = _request(_input(1), _input(2, 3)), _request(_input(2), _input(3, 3))
    aborted = _request(_input(4))
    for request_id, request in zip("abc", (first, aborted, second)):
        request.request_id = request_id
        stage.admit(request)
    stage.drop(["b"])  # aborted before the step
    filled, failed = stage.take(list(stage.pending))
    assert filled == [first, second] and failed == [] and stage.pending == []
    assert encoder.calls == [2, 1]  # images 1, 2 | 3: batches of at most max_batch, each once
    assert aborted.prompt_embeds is None
    assert second.prompt_embeds is not None
    assert second.prompt_embeds[:, 0].tolist() == [2, 2, 3, 3]


def test_a_failing_batch_fails_only_the_request_that_breaks_it() -> None:
    def encoder(modality: str, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        if any((p == 6).any() for p in pixels):
            raise RuntimeError("vision tower out of memory")
        return _Encoder()(modality, pixels)

    stage = MediaRows(encoder)
    good, bad, other = _request(_input(1)), _request(_input(6)), _request(_input(2))
    for request in (good, bad, other):
        stage.admit(request)
    filled, failed = stage.take(list(stage.pending))
    assert filled == [good, other] and failed == [bad] and stage.pending == []
    assert bad.prompt_embeds is None and bad.mm_inputs is not None
    stage.admit(bad)
    assert stage.take([bad]) == ([], [bad])


def test_image_rows_cache_is_bounded_lru() -> None:
    encoder = _Encoder()
    stage = MediaRows(encoder, budget_bytes=48)  # two images' rows (2 x 3 float32 each)
    for value in (1, 2, 1, 3):  # 1 is used again before 3 arrives: 2 is the oldest
        stage.fill([_request(_input(value))])
    assert stage.cached_bytes == 48 and stage.stats()["encoder_cache_entries"] == 2
    stage.fill([_request(_input(1))])
    assert stage.hits == 2
    stage.fill([_request(_input(2))])  # evicted: computed again
    assert stage.misses == 4
    tiny = MediaRows(encoder, budget_bytes=10)  # rows larger than the budget: not kept
    tiny.fill([_request(_input(1))])
    assert tiny.stats()["encoder_cache_entries"] == 0 and tiny.cached_bytes == 0


def test_lora_on_an_image_model_is_refused(tmp_path) -> None:
    from vllm import EngineArgs

    _processor(tmp_path)  # writes the image processor config
    _llava_config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="LoRA adapters are not supported on "
                                         "LlavaForConditionalGeneration"):
        EngineArgs(model=str(tmp_path), enable_lora=True, max_model_len=64,
                   device="cpu").create_engine_config()
