"""Qwen2-VL end to end on a tiny random checkpoint: greedy tokens equal to transformers'
`generate` (its image processor, its M-RoPE positions) with one and two images of their
own resolutions, under chunked prefill, prefix hits, the encoder cache, preemption and
compiled graphs; `llm.chat` with image_url parts; image embeddings (transformers' vision
tower output with the grids) equal to the images; refusals that leave the engine serving."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from tests.llava_reference import chat_messages, embeds_part, random_image
from tests.model_factory import make_tiny_qwen2_vl
from tests.multimodal_family import (
    check_preemption_and_graphs,
    engine_state,
    family_fixtures,
    greedy,
)
from tests.qwen2_vl_reference import (
    IMAGE,
    hf_chat_greedy,
    hf_embeds_greedy,
    hf_greedy,
    hf_image_embeds,
    load_reference,
)
from vllm import LLM
from vllm.config import InputKind

pytestmark = pytest.mark.slow

PROMPT = f"User: {IMAGE}What is this?\nAssistant:"
TWO = f"User: {IMAGE} and {IMAGE}\nCompare them.\nAssistant:"
# Shapes whose runs differ: 56 x 84 (6 rows), 84 x 280 (30 rows), 168 x 84 (18 rows).
SHAPES = [(40, 52, 3), (100, 300, 3), (170, 90, 3)]


# 24-token steps: image runs (6 to 36 rows) are prefilled across chunks and blocks.
model_dir, hf, llm = family_fixtures("tiny_qwen2_vl_dir", load_reference, max_model_len=256,
                                     max_num_batched_tokens=24,
                                     limit_mm_per_prompt={"image": 2}, enable_mm_embeds=True)


def test_one_image_equals_transformers(llm, hf) -> None:
    images = [random_image(i, shape) for i, shape in enumerate(SHAPES)]
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": image}} for image in images]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    tokens = []
    for output, image in zip(outputs, images, strict=True):
        prompt_ids, expected = hf_greedy(hf, PROMPT, [image])
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == expected
        tokens.append(expected)
    assert len({len(o.prompt_token_ids) for o in outputs}) == 3  # three resolutions
    assert len({tuple(t) for t in tokens}) > 1  # the images matter to the output


def test_two_images_and_a_long_decode_equal_transformers(llm, hf) -> None:
    """Two images in one prompt (text between them continues after the first one's
    largest position), then 24 decoded tokens at position + delta."""
    pairs = [(random_image(4, SHAPES[1]), random_image(5)),
             (random_image(5), random_image(4, SHAPES[2]))]
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": list(pair)}} for pair in pairs]
    outputs = llm.generate(prompts, greedy(24), use_tqdm=False)
    for output, pair in zip(outputs, pairs, strict=True):
        prompt_ids, expected = hf_greedy(hf, TWO, list(pair), max_tokens=24)
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == expected


def test_text_only_prompt_equals_transformers(llm, hf) -> None:
    text = "User: Describe a robot.\nAssistant:"
    output = llm.generate(text, greedy(), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(hf, text, [])[1]


def test_same_image_hits_prefix_and_encoder_caches(llm, hf) -> None:
    image = random_image(6, (90, 140, 3))
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    before = engine_state(llm)
    first = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, greedy(),
                         use_tqdm=False)[0]
    # The same picture as PNG bytes: the same pixels, the same cache entries.
    again = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": png.getvalue()}},
                         greedy(), use_tqdm=False)[0]
    after = engine_state(llm)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (first.num_prompt_tokens - 1) // 16 * 16 > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert list(first.outputs[0].token_ids) == hf_greedy(hf, PROMPT, [image])[1]
    assert after["encoder_cache_misses"] - before["encoder_cache_misses"] == 1
    assert after["encoder_cache_hits"] - before["encoder_cache_hits"] == 1


def test_chat_with_image_url_parts_equals_transformers(llm, hf) -> None:
    images = [random_image(11), random_image(12, (50, 120, 3))]
    output = llm.chat(chat_messages(images), greedy(), use_tqdm=False)[0]
    prompt_ids, expected = hf_chat_greedy(hf, images)
    assert output.prompt_token_ids == prompt_ids
    assert list(output.outputs[0].token_ids) == expected


def _embeds_entry(rows: torch.Tensor, grid: torch.Tensor) -> dict:
    return {"image_embeds": rows, "image_grid_thw": grid}


def test_image_embeds_equal_the_images(llm, hf) -> None:
    """transformers' vision tower output of one image (30 rows from position 6: the first
    24-token step ends inside its run) and of two, given as image_embeds with their grids:
    the tokens of the images themselves, in transformers and in the engine; one entry for
    both images or one per image; chat parts (a tensor and a list, or base64 of torch.save
    for both: vLLM's form) alike."""
    for text, images in [(PROMPT, [random_image(50, SHAPES[1])]),
                         (TWO, [random_image(51, SHAPES[2]), random_image(52)])]:
        rows, grid = hf_image_embeds(hf, images)
        prompt_ids, expected = hf_greedy(hf, text, images)
        forms = [_embeds_entry(rows, grid)]
        if len(images) == 2:
            forms.append([_embeds_entry(r, g[None]) for r, g in zip(
                rows.split((grid.prod(-1) // 4).tolist()), grid, strict=True)])
        else:
            run = [i for i, t in enumerate(prompt_ids) if t == hf.model.config.image_token_id]
            assert (run[0], len(run)) == (6, 30)
        for k, form in enumerate(forms):  # the second form: the first's blocks
            output = llm.generate({"prompt": text, "multi_modal_data": {"image": form}},
                                  greedy(), use_tqdm=False)[0]
            assert output.num_cached_tokens == (0 if k == 0 else (len(prompt_ids) - 1) // 16 * 16)
            assert output.prompt_token_ids == prompt_ids
            assert list(output.outputs[0].token_ids) == expected
        pixels = llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                              greedy(), use_tqdm=False)[0]
        assert list(pixels.outputs[0].token_ids) == expected
    images = [random_image(53), random_image(54, (50, 120, 3))]
    rows, grid = hf_image_embeds(hf, images)
    first, second = rows.split((grid.prod(-1) // 4).tolist())
    messages = chat_messages([])
    messages[0]["content"] += [
        {"type": "image_embeds", "image_embeds": _embeds_entry(first, grid[0].tolist())},
        {"type": "image_embeds", "image_embeds": {
            "image_embeds": embeds_part(second)["image_embeds"],
            "image_grid_thw": embeds_part(grid[1:])["image_embeds"]}}]
    chat = llm.chat(messages, greedy(), use_tqdm=False)[0]
    assert (chat.prompt_token_ids, list(chat.outputs[0].token_ids)) == hf_chat_greedy(hf,
                                                                                      images)


def test_same_image_embeds_hit_the_prefix_cache_only_with_their_grid(llm, hf) -> None:
    """The same rows twice: a prefix hit, the same tokens. The same rows with another grid
    of as many rows ((1, 4, 6) -> (1, 2, 12): 6 rows, other positions for them and the
    text after them): no hit, and transformers' tokens for that grid."""
    text = f"User: {IMAGE}What is in this picture? Tell me more.\nAssistant:"
    rows, grid = hf_image_embeds(hf, [random_image(55)])
    assert grid.tolist() == [[1, 4, 6]]
    entry = {"prompt": text, "multi_modal_data": {"image": _embeds_entry(rows, grid)}}
    first, again = (llm.generate(entry, greedy(), use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and first.num_prompt_tokens > 16
    assert again.num_cached_tokens == (first.num_prompt_tokens - 1) // 16 * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert list(first.outputs[0].token_ids) == hf_embeds_greedy(hf, text, rows, grid)[1]
    wide = torch.tensor([[1, 2, 12]])
    other = llm.generate({"prompt": text, "multi_modal_data": {
        "image": _embeds_entry(rows, wide)}}, greedy(), use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    expected = hf_embeds_greedy(hf, text, rows, wide)[1]
    assert list(other.outputs[0].token_ids) == expected != list(first.outputs[0].token_ids)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(6, 64)}},
     "image_embeds for Qwen2VLForConditionalGeneration need each image's grid"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": {"image_embeds": torch.zeros(5, 64),
                                                       "image_grid_thw": [1, 4, 6]}}},
     r"image_embeds has 5 rows, but image_grid_thw \[\[1, 4, 6\]\] expects 6"),
    ({"prompt": TWO, "multi_modal_data": {"image": random_image(1)}},
     r"2 image placeholder\(s\) .* but 1 image\(s\) were given"),
    ({"prompt": TWO, "multi_modal_data": {"image": [random_image(1)] * 3}},
     r"At most 2 image\(s\) may be provided in one prompt, got 3"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": random_image(1, (10, 2100, 3))}},
     "aspect ratio is over 200"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": b"not an image"}}, "not an image"),
])
def test_bad_prompts_are_refused_and_the_engine_serves_on(llm, hf, prompt, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, greedy(), use_tqdm=False)
    state = engine_state(llm)
    assert state["num_requests"] == 0 and state["num_runner_requests"] == 0
    image = random_image(9)
    output = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}},
                          greedy(), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(hf, PROMPT, [image])[1]


def test_under_preemption_and_with_graphs(model_dir, hf) -> None:
    """Preemption (12 blocks of 8 for prompts of 20 to 50 tokens and 12 more: a preempted
    request recomputes its KV at its own M-RoPE positions), then compiled graphs fed [3, n]
    positions (image rows through the embeds set, decode steps through the ids set; the
    fused decoder refuses M-RoPE); both equal to transformers."""
    cases = [(PROMPT, [random_image(30 + i, SHAPES[i % 3])]) for i in range(4)]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}}
               for text, images in cases]
    expected = [hf_greedy(hf, text, images, max_tokens=12)[1] for text, images in cases]
    runner = check_preemption_and_graphs(model_dir, prompts, expected, num_blocks=12,
                                         max_model_len=80)
    assert runner.fused_decode is None
    assert {kind for kind, _ in runner.graphs.replays} == {InputKind.EMBEDS,
                                                           InputKind.TOKEN_IDS}


def test_qwen2_5_vl_equals_transformers(tmp_path) -> None:
    """Qwen2.5-VL (window attention in its tower): one image and two, prefilled in chunks,
    then an image sent again (prefix and encoder cache hits); then the tower's output of
    one image and of two (transformers') as image_embeds with their grids: the same tokens
    as the images."""
    model_dir = make_tiny_qwen2_vl(str(tmp_path), version="2.5")
    hf = load_reference(model_dir)
    engine = LLM(model_dir, dtype="float32", max_model_len=256, enforce_eager=True,
                 kv_cache_memory_bytes=16 * 1024**2, block_size=16,
                 max_num_batched_tokens=24, enable_chunked_prefill=True,
                 enable_prefix_caching=True, enable_mm_embeds=True)
    cases = [(PROMPT, [random_image(40, SHAPES[1])]), (TWO, [random_image(41, SHAPES[2]),
                                                             random_image(42)]),
             (PROMPT, [random_image(40, SHAPES[1])])]
    outputs = [engine.generate({"prompt": text, "multi_modal_data": {"image": images}},
                               greedy(), use_tqdm=False)[0] for text, images in cases]
    for output, (text, images) in zip(outputs, cases, strict=True):
        prompt_ids, expected = hf_greedy(hf, text, images)
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == expected
    assert outputs[2].num_cached_tokens > 0
    assert engine_state(engine)["encoder_cache_hits"] == 1
    for text, images in [(PROMPT, [random_image(43, SHAPES[1])]),
                         (TWO, [random_image(44, SHAPES[2]), random_image(45)])]:
        rows, grid = hf_image_embeds(hf, images)
        output = engine.generate({"prompt": text, "multi_modal_data": {
            "image": _embeds_entry(rows, grid)}}, greedy(), use_tqdm=False)[0]
        assert (output.prompt_token_ids, list(output.outputs[0].token_ids)) == hf_greedy(
            hf, text, images)
    engine.shutdown()
