"""Gemma 3 with images end to end on a tiny random checkpoint: greedy tokens equal to
transformers' `generate` (its own `Gemma3Processor`, whose `token_type_ids` make each image's
positions attend to each other both ways) with one and two images, under chunked prefill
whose budget would cut an image's run, prefix-cache and encoder-cache hits, and chat.

The tiny model's images are 16 positions each, its first layer a window of 8: the
bidirectional mask changes the greedy tokens (`test_the_bidirectional_mask_matters`), so
the parity tests fail on an engine that attends causally over the images.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gemma3_reference import (
    blocky_image,
    chat_text,
    gemma3_generate,
    load_gemma3_reference,
)
from tests.llava_reference import chat_messages, random_image
from tests.model_factory import GEMMA3_IMAGE_TOKENS
from tests.multimodal_family import check_preemption_and_graphs, family_fixtures, greedy
from vllm import LLM

pytestmark = pytest.mark.slow

BOI = "<start_of_image>"
PROMPT = f"Describe {BOI} now."
TWO = f"Compare {BOI} and {BOI} please."
# Steps of one image's run (16 tokens): PROMPT's image run is positions 12..27, so the first
# chunk (0..16) would cut it; it ends at 12 and a later step takes the run whole, alone: while
# other requests decode, only a step reserved for it can (`SpanReservation`).
BUDGET = GEMMA3_IMAGE_TOKENS
# Cases of the parity tests whose transformers tokens change when the images attend
# causally (`test_the_bidirectional_mask_matters`).
ONE_IMAGE = random_image(1)
TWO_IMAGES = [blocky_image(4), blocky_image(5)]
CHAT_IMAGES = [random_image(11), random_image(12)]


model_dir, hf, llm = family_fixtures(
    "tiny_gemma3_dir", load_gemma3_reference, max_model_len=256,
    max_num_batched_tokens=BUDGET, limit_mm_per_prompt={"image": 2}, enable_mm_embeds=True)


def _generate(llm: LLM, text: str, images: list[np.ndarray]):
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, greedy(),
                        use_tqdm=False)[0]


def test_the_bidirectional_mask_matters(hf) -> None:
    """transformers with the image positions attending causally (no token_type_ids) gives
    other tokens for the parity tests' cases: an engine attending causally over the images
    fails them."""
    cases = [(PROMPT, [ONE_IMAGE], True), (TWO, TWO_IMAGES, True),
             (chat_text(hf, 2), CHAT_IMAGES, False)]
    for text, images, special in cases:
        _, both_ways = gemma3_generate(hf, text, images, add_special_tokens=special)
        _, causal = gemma3_generate(hf, text, images, add_special_tokens=special,
                                    bidirectional=False)
        assert both_ways != causal


def test_one_image_equals_transformers(llm, hf) -> None:
    images = [ONE_IMAGE, random_image(2, (64, 30, 3)), blocky_image(3, size=40)]
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}
                            for image in images], greedy(), use_tqdm=False)
    tokens = []
    for output, image in zip(outputs, images, strict=True):
        prompt_ids, expected = gemma3_generate(hf, PROMPT, [image])
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == expected
        tokens.append(expected)
    assert len({tuple(t) for t in tokens}) > 1  # the images matter to the output


def test_two_images_equal_transformers(llm, hf) -> None:
    output = _generate(llm, TWO, TWO_IMAGES)
    prompt_ids, expected = gemma3_generate(hf, TWO, TWO_IMAGES)
    assert output.prompt_token_ids == prompt_ids
    assert prompt_ids.count(hf[1].config.image_token_id) == 2 * GEMMA3_IMAGE_TOKENS
    assert list(output.outputs[0].token_ids) == expected


def test_prompt_token_ids_with_a_bare_boi_expand_as_the_text_does(llm, hf) -> None:
    """Ids with boi alone get the image's sequence of ids in its place (the tiny
    tokenizer's "\\n\\n" merges with nothing around it here)."""
    image = random_image(6)
    prompt_ids, expected = gemma3_generate(hf, PROMPT, [image])
    tokenizer = hf[0].tokenizer
    bare = tokenizer(PROMPT)["input_ids"]
    assert len(bare) < len(prompt_ids)
    output = llm.generate({"prompt_token_ids": bare, "multi_modal_data": {"image": image}},
                          greedy(), use_tqdm=False)[0]
    assert output.prompt_token_ids == prompt_ids
    assert list(output.outputs[0].token_ids) == expected


def test_prefix_and_encoder_cache_hits_equal_the_miss(llm, hf) -> None:
    image = random_image(7, (50, 50, 3))
    stage = llm.llm_engine.engine_core.media_rows
    hits = stage.hits
    first = _generate(llm, PROMPT, [image])
    again = _generate(llm, PROMPT, [image])
    assert stage.hits == hits + 1  # the second request's rows came from the encoder cache
    assert first.num_cached_tokens == 0
    # 36 prompt tokens: 2 blocks of 16 hit (the image run, 12..27, wholly inside them)
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert list(first.outputs[0].token_ids) == gemma3_generate(hf, PROMPT, [image])[1]


def test_prefix_hit_ending_inside_an_image_is_rounded_down(llm, hf) -> None:
    """Two prompts sharing their first 29 tokens, the image's run (10..25) among them: the
    hit of one block (16 tokens) would end inside the run, so it is rounded down to
    nothing, and the tokens equal transformers'."""
    image = random_image(8)
    text = f"Look at {BOI}"
    first = _generate(llm, text + " then stop.", [image])
    again = _generate(llm, text + " and go on.", [image])
    assert again.prompt_token_ids is not None and first.prompt_token_ids is not None
    assert again.prompt_token_ids[:29] == first.prompt_token_ids[:29]
    assert again.prompt_token_ids.index(hf[1].config.image_token_id) == 10
    assert again.num_cached_tokens == 0
    assert list(again.outputs[0].token_ids) == gemma3_generate(
        hf, text + " and go on.", [image])[1]


def test_chat_with_image_url_parts_equals_transformers(llm, hf) -> None:
    output = llm.chat(chat_messages(CHAT_IMAGES), greedy(), use_tqdm=False)[0]
    prompt_ids, expected = gemma3_generate(hf, chat_text(hf, 2), CHAT_IMAGES,
                                           add_special_tokens=False)
    assert output.prompt_token_ids == prompt_ids
    assert list(output.outputs[0].token_ids) == expected


def test_an_image_run_longer_than_the_budget_is_refused(model_dir) -> None:
    with pytest.raises(ValueError, match="smaller than one image's run of 16 positions"):
        LLM(model_dir, dtype="float32", max_model_len=256, enforce_eager=True,
            kv_cache_memory_bytes=16 * 1024**2, max_num_batched_tokens=12,
            enable_chunked_prefill=True)


def test_under_preemption_and_with_graphs(model_dir, hf) -> None:
    """Preemption (20 blocks of 8 for both KV groups, four prompts of 36 to 55 tokens: a
    preempted request recomputes its images' runs whole), then compiled graphs (the
    attention op reads each step's key ends from its metadata), both equal to transformers'
    generate."""
    cases = [(PROMPT, [ONE_IMAGE]), (TWO, TWO_IMAGES), (PROMPT, [random_image(13)]),
             (TWO, [blocky_image(13), blocky_image(14)])]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}}
               for text, images in cases]
    expected = [gemma3_generate(hf, text, images, max_tokens=12)[1] for text, images in cases]
    runner = check_preemption_and_graphs(model_dir, prompts, expected, num_blocks=20,
                                         max_num_batched_tokens=BUDGET,
                                         enable_chunked_prefill=True)
    assert runner.graphs.replays  # steps ran through the compiled graphs


@torch.inference_mode()
def test_image_embeds_equal_transformers(llm, hf) -> None:
    """Each image's rows from transformers' tower and projector, sent as image embeddings
    (enable_mm_embeds): the same tokens as the images themselves."""
    processor, model = hf
    pixels = processor.image_processor(images=TWO_IMAGES, return_tensors="pt")["pixel_values"]
    rows = model.get_image_features(pixel_values=pixels).pooler_output
    assert rows.shape == (2, GEMMA3_IMAGE_TOKENS, model.config.text_config.hidden_size)
    output = _generate(llm, TWO, [rows])  # [num_images, feature_size, hidden_size]
    assert list(output.outputs[0].token_ids) == gemma3_generate(hf, TWO, TWO_IMAGES)[1]


def test_text_only_prompt_equals_transformers(llm, hf) -> None:
    text = "Describe a robot in one line."
    output = llm.generate(text, greedy(), use_tqdm=False)[0]
    prompt_ids, expected = gemma3_generate(hf, text, [])
    assert output.prompt_token_ids == prompt_ids
    assert list(output.outputs[0].token_ids) == expected
