"""Qwen2-VL's parts against transformers on a tiny random checkpoint, without an engine:
image preprocessing (pixel_values and image_grid_thw exactly), M-RoPE positions
(`get_rope_index`), the language model's three-row rotary, the runner's step positions,
the vision tower (Qwen2-VL's and Qwen2.5-VL's) loaded from the directory (`get_model`),
block hashes that follow the positions, and image embeddings with their grids (the
processor, its refusals, chat parts)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.llava_reference import random_image
from tests.model_factory import make_tiny_qwen2_vl, tiny_model_config
from tests.qwen2_vl_reference import IMAGE, hf_inputs, load_reference
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.rotary_embedding import MRotaryEmbedding, rotary_embedding
from vllm.multimodal.image import load_image
from vllm.multimodal.qwen2_vl import (
    DynamicResolutionConfig,
    mrope_positions,
    patchify,
    preprocess_dynamic,
    smart_resize,
)
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.step_inputs import compute_step_indices, mrope_step_positions


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_vl_dir) -> str:
    return tiny_qwen2_vl_dir


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_reference(model_dir)


@pytest.mark.parametrize("height, width, expected", [
    (40, 52, (56, 84)),  # 28 x 56 is under the minimum area: grown, each side rounded up
    (100, 300, (84, 280)),  # 112 x 308 is over the maximum: shrunk, each side rounded down
    (56, 84, (56, 84)),  # already multiples of 28, within the bounds
    (30, 1000, (28, 1008)),  # rounded to 28 x 1008: the maximum area exactly
])
def test_smart_resize_examples(height, width, expected) -> None:
    assert smart_resize(height, width, 28, 56 * 56, 168 * 168) == expected


def test_smart_resize_equals_transformers() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as hf_smart_resize,
    )

    rng = np.random.default_rng(0)
    for height, width in rng.integers(10, 2000, size=(300, 2)).tolist():
        for bounds in ((56 * 56, 168 * 168), (4 * 28 * 28, 28 * 28 * 1280)):
            assert smart_resize(height, width, 28, *bounds) == hf_smart_resize(
                height, width, 28, *bounds), (height, width, bounds)
    with pytest.raises(ValueError, match="aspect ratio is over 200"):
        smart_resize(10, 2100, 28, 56 * 56, 168 * 168)


def _as(kind: str, array: np.ndarray):
    if kind == "array":
        return array
    image = Image.fromarray(array)
    if kind == "pil":
        return image
    png = io.BytesIO()
    image.save(png, format="PNG")
    return png.getvalue()


@pytest.mark.parametrize("kind", ["array", "pil", "png"])
@pytest.mark.parametrize("shape", [(40, 52, 3), (100, 300, 3), (200, 90, 4), (57, 61),
                                   (170, 170, 3)])
@pytest.mark.parametrize("size", [None, {"shortest_edge": 28 * 28, "longest_edge": 112 * 112}])
def test_pixels_and_grid_equal_transformers(hf, kind, shape, size) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = hf.image_processor if size is None else Qwen2VLImageProcessorPil(size=size)
    config = DynamicResolutionConfig.from_dict(processor.to_dict())
    array = np.random.default_rng(sum(shape)).integers(0, 256, size=shape, dtype=np.uint8)
    expected = processor(images=[Image.fromarray(array)], return_tensors="pt")
    pixels = preprocess_dynamic(load_image(_as(kind, array)), config)
    patches, grid = patchify(pixels, config.patch_size, config.temporal_patch_size,
                             config.merge_size)
    assert grid == tuple(expected["image_grid_thw"][0].tolist())
    assert torch.equal(patches, expected["pixel_values"])


def test_config_area_bounds_in_every_form() -> None:
    """transformers 5's `size` edges, the top-level keys published Qwen2-VL files carry
    (overriding `size`), and older files' `size.min_pixels`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    forms = [{"size": {"shortest_edge": 100, "longest_edge": 9000}},
             {"min_pixels": 100, "max_pixels": 9000,
              "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}},
             {"size": {"min_pixels": 100, "max_pixels": 9000}}]
    for form in forms:
        config = DynamicResolutionConfig.from_dict(form)
        assert (config.min_pixels, config.max_pixels) == (100, 9000), form
    hf_size = Qwen2VLImageProcessorPil(**forms[1]).size
    assert (hf_size.shortest_edge, hf_size.longest_edge) == (100, 9000)


def test_mrope_positions_equal_get_rope_index(hf) -> None:
    images = [random_image(1, (100, 300, 3)), random_image(2), random_image(3, (170, 90, 3))]
    for text, used in [(f"Look {IMAGE} here.", images[:1]),
                       (f"{IMAGE}{IMAGE} two at once, then text", images[1:]),
                       (f"a {IMAGE} b {IMAGE} c {IMAGE} d", images)]:
        inputs = hf_inputs(hf, text, used)
        expected, delta = hf.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
        ids = inputs["input_ids"][0]
        types = inputs["mm_token_type_ids"][0].numpy()
        runs = np.flatnonzero(np.diff(types, prepend=0) == 1).tolist()  # each image's start
        grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
        ours = mrope_positions(len(ids), list(zip(runs, grids, strict=True)), 2)
        assert torch.equal(ours, expected[:, 0])
        assert int(ours.max()) + 1 - len(ids) == int(delta)


def test_module_example_positions() -> None:
    """The example in `vllm/multimodal/qwen2_vl.py`: 2 text tokens, a 4 x 6 patch image
    (2 x 3 rows), 1 text token."""
    positions = mrope_positions(9, [(2, (1, 4, 6))], 2)
    assert positions.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5],
                                  [0, 1, 2, 2, 2, 3, 3, 3, 5],
                                  [0, 1, 2, 3, 4, 2, 3, 4, 5]]


def test_mrope_rotary_equals_transformers(hf) -> None:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    text_config = hf.model.config.text_config
    rotary = rotary_embedding(text_config, 16, 256, torch.float32)
    assert isinstance(rotary, MRotaryEmbedding)
    positions = torch.randint(0, 200, (3, 40), generator=torch.Generator().manual_seed(0))
    cos, sin = rotary.lookup(positions)
    hf_cos, hf_sin = Qwen2VLRotaryEmbedding(text_config)(torch.zeros(1), positions[:, None])
    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], rtol=0, atol=1e-6)
    # One row of positions given three times is the 1-D rotary.
    plain = rotary_embedding(tiny_model_config("qwen2", 100), 16, 256, torch.float32)
    assert not isinstance(plain, MRotaryEmbedding)
    same = rotary.lookup(positions[:1].expand(3, -1))
    assert torch.equal(same[0], rotary.cos[positions[0]].unsqueeze(1))


def _state(req_id: str, prompt_len: int, table: torch.Tensor | None) -> CachedRequestState:
    return CachedRequestState(req_id=req_id, prompt_token_ids=[5] * prompt_len,
                              prompt_embeds=None, sampling_params=SamplingParams(),
                              generator=None, block_ids=[1, 2], num_computed_tokens=0,
                              mrope_positions=None if table is None else table.numpy())


def test_step_positions_take_the_table_then_the_delta() -> None:
    """The example of `mrope_step_positions` (positions 7, 8, 9 of a 9-token prompt with an
    image) beside a text-only request (positions 3, 4: 1-D in every row)."""
    batch = InputBatch(max_num_reqs=2, max_model_len=32, block_size=16, vocab_size=100)
    table = mrope_positions(9, [(2, (1, 4, 6))], 2)
    image_state = _state("image", 9, table)
    assert image_state.mrope_delta == -3
    batch.add_request(image_state)
    batch.add_request(_state("text", 4, None))
    idx = compute_step_indices(np.array([3, 2], dtype=np.int32),
                               np.array([7, 3], dtype=np.int32), 32)
    assert mrope_step_positions(batch, idx).tolist() == [[2, 5, 6, 3, 4],
                                                         [3, 5, 6, 3, 4],
                                                         [4, 5, 6, 3, 4]]


def test_an_mrope_drafter_is_refused(model_dir) -> None:
    from vllm.config import SpeculativeConfig
    from vllm.v1.spec_decode.draft_model import draft_model_config

    target = EngineArgs(model=model_dir, max_model_len=256).create_engine_config().model_config
    spec = SpeculativeConfig("draft_model", 2, model=model_dir)
    with pytest.raises(ValueError, match="uses M-RoPE .* the drafter must be a text model"):
        draft_model_config(spec, target)


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_model_loads_and_its_vision_tower_equals_transformers(tmp_path, version) -> None:
    """Qwen2.5-VL's tower attends within windows of 2 x 2 merge units in block 0: the
    images below (2 x 3, 3 x 10 and 4 x 4 units) span several windows each."""
    from vllm.model_executor.model_loader.loader import get_model
    from vllm.v1.attention.backends import get_attn_backend

    model_dir = make_tiny_qwen2_vl(str(tmp_path), version=version)
    hf = load_reference(model_dir)
    config = EngineArgs(model=model_dir, dtype="float32", max_model_len=256
                        ).create_engine_config().model_config
    model = get_model(config, get_attn_backend(), torch.device("cpu"))
    images = [random_image(4, (100, 300, 3)), random_image(5), random_image(6, (110, 120, 3))]
    pixels = [preprocess_dynamic(load_image(i), DynamicResolutionConfig.from_model_dir(
        model_dir)) for i in images]
    with torch.inference_mode():
        ours = model.embed_media("image", pixels)  # type: ignore[attr-defined]
        inputs = hf.image_processor(images=images, return_tensors="pt")
        expected = hf.model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert [r.shape for r in ours] == [e.shape for e in expected]
    for rows, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(rows, want, rtol=0, atol=1e-4)
    reason = model.fused_decode_spec()  # type: ignore[attr-defined]
    assert isinstance(reason, str) and "M-RoPE" in reason


def test_block_hashes_follow_the_grids_positions() -> None:
    """Block size 4; 4 text ids, an image of 6 rows, 2 text ids. The same rows with grid
    (1, 4, 6) or (1, 2, 12) put the image's 4th row, and all after it, at other positions:
    the blocks from there on differ (no prefix hit across grids). The text block before
    the image sits at its own position in all three rows: any text prompt's block."""
    from tests.core_factories import make_scheduler_request
    from vllm.v1.core.kv_cache_utils import mrope_block_positions
    from vllm.v1.messages import mrope_delta

    rows = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    ids = [10, 11, 12, 13] + [0] * 6 + [14, 15]
    mask = torch.tensor([True] * 4 + [False] * 6 + [True] * 2)
    hashes = [make_scheduler_request("r", ids, prompt_embeds=rows, prompt_is_token_ids=mask,
                                     mrope_positions=mrope_positions(12, [(4, grid)], 2)
                                     ).block_hashes
              for grid in [(1, 4, 6), (1, 2, 12), (1, 4, 6)]]
    assert len(hashes[0]) == 3 and hashes[0] == hashes[2]
    assert hashes[1][0] == hashes[0][0]
    assert hashes[1][1] != hashes[0][1] and hashes[1][2] != hashes[0][2]
    assert make_scheduler_request("t", [10, 11, 12, 13, 1]).block_hashes == hashes[0][:1]
    table = mrope_positions(9, [(2, (1, 4, 6))], 2)  # the module example (delta -3)
    assert mrope_delta(table) == -3
    assert mrope_block_positions(table, -3, 0, 2) is None
    assert mrope_block_positions(table, -3, 6, 10).tolist() == [[2, 2, 5, 6], [3, 3, 5, 6],
                                                                [3, 4, 5, 6]]


# ---- image embeddings with their grids (enable_mm_embeds) ----------------------------------

@pytest.fixture(scope="module")
def embeds_processor(model_dir):
    from vllm.multimodal.qwen2_vl import Qwen2VLPromptProcessor

    config = EngineArgs(model=model_dir, dtype="float32", max_model_len=256,
                        enable_mm_embeds=True, limit_mm_per_prompt={"image": 2}
                        ).create_engine_config().model_config
    return Qwen2VLPromptProcessor(config)


def _rows(n: int, seed: int = 0, hidden: int = 64) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


def _ids(processor, count: int) -> list[int]:
    """A prompt of 3 text ids, then `count` images between text ids."""
    return [1, 2, 3] + [processor.image_token_id, 4] * count


def test_image_embeds_fill_runs_at_the_grids_positions(embeds_processor) -> None:
    """Rows [6 + 18, 64] with grids (1, 4, 6) and (1, 6, 12): two runs of 6 and 18 rows,
    the positions of the pixel path with those grids; one entry or a list of one entry per
    image ([1, 3] or [3]; a tensor, an array or lists) give the same prompt."""
    rows = _rows(24, hidden=embeds_processor.model_config.hidden_size)
    grid = torch.tensor([[1, 4, 6], [1, 6, 12]])
    ids = _ids(embeds_processor, 2)
    prompt = embeds_processor.process(ids, {"image": {"image_embeds": rows,
                                                      "image_grid_thw": grid}})
    assert [(i.offset, i.num_tokens) for i in prompt.items] == [(3, 6), (10, 18)]
    assert all(i.data is None for i in prompt.items)
    assert torch.equal(torch.cat([i.embeds for i in prompt.items]), rows)
    assert torch.equal(prompt.mrope_positions, mrope_positions(
        len(prompt.token_ids), [(3, (1, 4, 6)), (10, (1, 6, 12))], 2))
    split = [{"image_embeds": rows[:6], "image_grid_thw": np.array([[1, 4, 6]])},
             {"image_embeds": rows[6:], "image_grid_thw": [1, 6, 12]}]
    again = embeds_processor.process(ids, {"image": split})
    assert again.token_ids == prompt.token_ids
    assert torch.equal(again.mrope_positions, prompt.mrope_positions)
    assert [i.content_hash for i in again.items] == [i.content_hash for i in prompt.items]
    # The same rows with another grid of as many rows: another key.
    other = embeds_processor.process(ids[:5], {"image": {"image_embeds": rows[:6],
                                                         "image_grid_thw": [[1, 2, 12]]}})
    assert other.items[0].content_hash != prompt.items[0].content_hash


@pytest.mark.parametrize("entry, message", [
    (_rows(6), r"image entry 0: image_embeds for Qwen2VLForConditionalGeneration need "
               "each image's grid"),
    ({"image_embeds": _rows(6)}, "image entry 0: image_embeds for .* need 'image_grid_thw'"),
    ({"image_embeds": _rows(6), "image_grid_thw": [1, 4, 6], "pixel_values": 1},
     "image_embeds takes no 'pixel_values' for Qwen2VLForConditionalGeneration"),
    ({"image_embeds": _rows(6), "image_grid_thw": [[1, 4]]},
     r"image_grid_thw must be \[num_images, 3\] integers .* got \[\[1, 4\]\]"),
    ({"image_embeds": _rows(6), "image_grid_thw": torch.ones(1, 3, 2, dtype=torch.int64)},
     r"must be \[num_images, 3\] integers .* got shape \(1, 3, 2\)"),
    ({"image_embeds": _rows(6), "image_grid_thw": torch.tensor([[1.0, 4.0, 6.0]])},
     "image_grid_thw must hold integers, got dtype torch.float32"),
    ({"image_embeds": _rows(6), "image_grid_thw": [[1, 0, 6]]},
     r"row 0 is \(1, 0, 6\): t, h and w must be >= 1"),
    ({"image_embeds": _rows(6), "image_grid_thw": [[1, 3, 8]]},
     r"row 0 is \(1, 3, 8\): h and w must be multiples of the merge size 2"),
    ({"image_embeds": _rows(12), "image_grid_thw": [[2, 4, 6]]},
     r"row 0 is \(2, 4, 6\): an image has t = 1"),
    ({"image_embeds": _rows(5), "image_grid_thw": [[1, 4, 6]]},
     r"image_embeds has 5 rows, but image_grid_thw \[\[1, 4, 6\]\] expects 6"),
    ({"image_embeds": _rows(6, hidden=32), "image_grid_thw": [[1, 4, 6]]},
     r"image_embeds has shape \(6, 32\), but .* takes \[num_rows, 64\]"),
    ({"image_embeds": torch.ones(6, 64, dtype=torch.int32), "image_grid_thw": [[1, 4, 6]]},
     "image_embeds must be a floating-point tensor .* got torch.int32"),
    ({"image_embeds": torch.full((6, 64), float("nan")), "image_grid_thw": [[1, 4, 6]]},
     "image_embeds of image 0 contains non-finite values"),
    ({"image_embeds": _rows(18), "image_grid_thw": [[1, 4, 6]] * 3},
     r"At most 2 image\(s\) may be provided in one prompt, got 3"),
    ({"image_embeds": _rows(12), "image_grid_thw": [[1, 4, 6]] * 2},
     r"1 image placeholder\(s\) .* but 2 image\(s\) were given"),
])
def test_bad_image_embeds_are_refused(embeds_processor, entry, message) -> None:
    with pytest.raises(ValueError, match=message):
        embeds_processor.process(_ids(embeds_processor, 1), {"image": entry})


def test_image_embeds_need_enable_mm_embeds(model_dir) -> None:
    from vllm.multimodal.qwen2_vl import Qwen2VLPromptProcessor

    config = EngineArgs(model=model_dir, max_model_len=256).create_engine_config().model_config
    processor = Qwen2VLPromptProcessor(config)
    with pytest.raises(ValueError, match="enable_mm_embeds=True"):
        processor.process(_ids(processor, 1), {"image": {"image_embeds": _rows(6),
                                                         "image_grid_thw": [[1, 4, 6]]}})


def test_chat_image_embeds_parts_carry_their_grids(embeds_processor) -> None:
    """`{"image_embeds": {"image_embeds": rows, "image_grid_thw": grid}}` parts: rows as a
    tensor or base64 of torch.save, the grid as a list or base64 (vLLM's form); a part with
    a grid of two images becomes two placeholders. Keys other than those two are refused."""
    from tests.llava_reference import embeds_part
    from vllm.entrypoints.chat_utils import load_media_part, media_parts, with_media_placeholders
    from vllm.multimodal.media import MediaConnector

    rows = _rows(16)
    b64 = embeds_part(rows[:6])["image_embeds"]
    grid_b64 = embeds_part(torch.tensor([[1, 4, 6]]))["image_embeds"]
    parts = [{"type": "image_embeds", "image_embeds": {"image_embeds": b64,
                                                       "image_grid_thw": grid_b64}},
             {"type": "image_embeds", "image_embeds": {
                 "image_embeds": rows[6:], "image_grid_thw": [[1, 4, 6], [1, 4, 4]]}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, *parts]}]
    found = media_parts(messages, ("image",))
    items = [load_media_part(p, MediaConnector(), 1 << 20) for p in found]
    replaced, data = with_media_placeholders(messages, {"image": "<I>"}, found, items)
    assert [p["text"] for p in replaced[0]["content"]] == ["Hi", "<I>", "<I><I>"]
    assert torch.equal(data["image"][0]["image_embeds"], rows[:6])
    assert data["image"][0]["image_grid_thw"].tolist() == [[1, 4, 6]]
    image = embeds_processor.image_token_id
    prompt = embeds_processor.process([1, image, 5, image], {"image": data["image"][1:]})
    assert [(i.offset, i.num_tokens) for i in prompt.items] == [(1, 6), (8, 4)]
    bad = {"type": "image_embeds", "image_embeds": {"image_embeds": b64, "grid": [1, 4, 6]}}
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: image_embeds takes no "
                                         "'grid'"):
        media_parts([{"role": "user", "content": [bad]}], ("image",))
