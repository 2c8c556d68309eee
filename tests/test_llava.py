"""LLaVA end to end on a tiny random checkpoint: greedy tokens equal to transformers (its
own `LlavaProcessor` and model) with one and two images per prompt, under chunked prefill
and prefix hits; the encoder cache; refusals that leave the engine serving."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.llava_reference import (
    chat_messages,
    embeds_part,
    hf_chat_greedy,
    hf_greedy,
    hf_image_embeds,
    load_reference,
    random_image,
    save_png,
    serve_directory,
)
from tests.model_factory import TINY_IMAGE_SIZE, TINY_PATCH_SIZE, make_tiny_llava
from tests.multimodal_family import (
    FromFixture,
    check_preemption_and_graphs,
    engine_state,
    family_fixtures,
    greedy,
)
from vllm import LLM
from vllm.config import InputKind

pytestmark = pytest.mark.slow

PROMPT = "USER: <image>\nWhat is this?\nASSISTANT:"
TWO = "USER: <image> and <image>\nCompare them.\nASSISTANT:"
IMAGE_TOKENS = (TINY_IMAGE_SIZE // TINY_PATCH_SIZE) ** 2


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> str:
    """Images `file:` URLs may name (and the local HTTP server serves)."""
    return str(tmp_path_factory.mktemp("llava_media"))


# 24-token steps: a prompt with two images (32 image positions) is prefilled in chunks, and
# image runs cross chunk and block boundaries; three images encoded per step.
model_dir, hf, llm = family_fixtures(
    "tiny_llava_dir", load_reference, max_model_len=256, max_num_batched_tokens=24,
    max_num_encoder_input_tokens=3 * IMAGE_TOKENS, limit_mm_per_prompt={"image": 2},
    enable_mm_embeds=True, allowed_local_media_path=FromFixture("media_dir"),
    allowed_media_domains=["127.0.0.1"])


def test_one_image_equals_transformers(llm, hf) -> None:
    images = [random_image(1), random_image(2, (64, 30, 3)), random_image(3, (33, 33, 4))]
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": image}} for image in images]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    tokens = []
    for output, image in zip(outputs, images, strict=True):
        prompt_ids, expected = hf_greedy(hf, PROMPT, [image])
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == expected
        tokens.append(expected)
    assert len({tuple(t) for t in tokens}) > 1  # the images matter to the output


def test_two_images_equal_transformers(llm, hf) -> None:
    pairs = [(random_image(4), random_image(5)), (random_image(5), random_image(4))]
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": list(pair)}} for pair in pairs]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    for output, pair in zip(outputs, pairs, strict=True):
        prompt_ids, expected = hf_greedy(hf, TWO, list(pair))
        assert output.prompt_token_ids == prompt_ids
        assert prompt_ids.count(hf[1].config.image_token_index) == 2 * IMAGE_TOKENS
        assert list(output.outputs[0].token_ids) == expected


def test_text_only_prompt_equals_transformers(llm, hf) -> None:
    text = "USER: Describe a robot.\nASSISTANT:"
    output = llm.generate(text, greedy(), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(hf, text, [])[1]


def test_same_image_hits_prefix_and_encoder_caches(llm, hf) -> None:
    image = random_image(6, (90, 70, 3))
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
    assert again.num_cached_tokens == (first.num_prompt_tokens - 1) // 16 * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert list(first.outputs[0].token_ids) == hf_greedy(hf, PROMPT, [image])[1]
    assert after["encoder_cache_misses"] - before["encoder_cache_misses"] == 1
    assert after["encoder_cache_hits"] - before["encoder_cache_hits"] == 1


def test_same_text_other_image_is_no_prefix_hit(llm, hf) -> None:
    llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": random_image(7)}}, greedy(),
                 use_tqdm=False)
    other = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": random_image(8)}},
                         greedy(), use_tqdm=False)[0]
    # Only the text block before the image may be shared (the prompt starts with 4 text
    # tokens: no full block), never the image's rows.
    assert other.num_cached_tokens == 0
    assert list(other.outputs[0].token_ids) == hf_greedy(hf, PROMPT, [random_image(8)])[1]


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": TWO, "multi_modal_data": {"image": [random_image(1)] * 3}},
     r"At most 2 image\(s\) may be provided in one prompt, got 3 \(limit_mm_per_prompt\)"),
    ({"prompt": TWO, "multi_modal_data": {"image": random_image(1)}},
     r"2 image placeholder\(s\) .* but 1 image\(s\) were given"),
    ({"prompt": "USER: no placeholder", "multi_modal_data": {"image": random_image(1)}},
     r"0 image placeholder\(s\)"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": b"not an image"}}, "not an image"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": np.zeros((9000, 9000, 3), np.uint8)}},
     "over the limit"),
    ({"prompt": PROMPT, "multi_modal_data": {"audio": random_image(1)}}, "images only"),
    ({"prompt": PROMPT, "multi_modal_data": [random_image(1)]}, "must be a dict"),
])
def test_bad_image_prompts_are_refused_and_the_engine_serves_on(llm, hf, prompt,
                                                               message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, greedy(), use_tqdm=False)
    state = engine_state(llm)
    assert state["num_requests"] == 0 and state["num_runner_requests"] == 0
    image = random_image(9)
    output = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}},
                          greedy(), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(hf, PROMPT, [image])[1]


def test_truncated_image_bytes_are_refused(llm) -> None:
    png = io.BytesIO()
    Image.fromarray(random_image(10, (64, 64, 3))).save(png, format="PNG")
    data = png.getvalue()[:200]
    with pytest.raises(ValueError, match="truncated or corrupt"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": data}}, greedy(),
                     use_tqdm=False)


def test_chat_with_image_url_parts_equals_transformers(llm, hf) -> None:
    images = [random_image(11), random_image(12, (50, 20, 3))]
    output = llm.chat(chat_messages(images), greedy(), use_tqdm=False)[0]
    prompt_ids, expected = hf_chat_greedy(hf, images)
    assert output.prompt_token_ids == prompt_ids
    assert list(output.outputs[0].token_ids) == expected


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "host 'example.com' is not in the allowed media domains"),
    ("file:///etc/passwd", "outside the allowed local media path"),
    ("{media}/../outside.png", "outside the allowed local media path"),
    ("{server}/missing.png", "HTTP 404"),
    ("{server}/not-an-image.png", "not an image"),
    ("data:image/png;base64,aGVsbG8=", "not an image"),
])
def test_chat_refuses_bad_image_urls(llm, media_dir, url, message) -> None:
    with open(f"{media_dir}/not-an-image.png", "wb") as f:
        f.write(b"hello")
    with serve_directory(media_dir) as server:
        url = url.format(media=f"file://{media_dir}", server=server)
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": url}}]}]
        with pytest.raises(ValueError, match=message):
            llm.chat(messages, greedy(), use_tqdm=False)


def test_chat_reads_allowed_files_and_fetches_allowed_hosts(llm, hf, media_dir) -> None:
    images = [random_image(13), random_image(14, (30, 44, 3))]
    save_png(images[0], f"{media_dir}/first.png")
    save_png(images[1], f"{media_dir}/second.png")
    with serve_directory(media_dir) as server:
        messages = chat_messages([])
        messages[0]["content"] += [
            {"type": "image_url", "image_url": {"url": f"file://{media_dir}/first.png"}},
            {"type": "image_url", "image_url": {"url": f"{server}/second.png"}}]
        output = llm.chat(messages, greedy(), use_tqdm=False)[0]
    prompt_ids, expected = hf_chat_greedy(hf, images)
    assert output.prompt_token_ids == prompt_ids
    assert list(output.outputs[0].token_ids) == expected


def test_image_embeds_equal_transformers(llm, hf) -> None:
    """transformers' own rows of two images, given as embeddings: the same tokens as the
    images themselves; [2, F, H] in one entry, two [F, H] entries, and chat parts (a tensor
    offline, base64 of torch.save as the server takes it) alike."""
    images = [random_image(15), random_image(16, (60, 36, 3))]
    rows = hf_image_embeds(hf, images)
    prompt_ids, expected = hf_greedy(hf, TWO, images)
    outputs = llm.generate([{"prompt": TWO, "multi_modal_data": {"image": rows}},
                            {"prompt": TWO, "multi_modal_data": {"image": list(rows)}}],
                           greedy(), use_tqdm=False)
    for output in outputs:
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == expected
    messages = chat_messages([])
    messages[0]["content"] += [{"type": "image_embeds", "image_embeds": rows[0]},
                               embeds_part(rows[1])]
    chat = llm.chat(messages, greedy(), use_tqdm=False)[0]
    chat_ids, chat_expected = hf_chat_greedy(hf, images)
    assert chat.prompt_token_ids == chat_ids
    assert list(chat.outputs[0].token_ids) == chat_expected
    # One part holding both images: two placeholders where the part stood.
    messages[0]["content"][1:] = [embeds_part(rows)]
    text = hf[0].tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compare these.\n<image><image>"}], tokenize=False,
        add_generation_prompt=True)
    joint = llm.chat(messages, greedy(), use_tqdm=False)[0]
    assert (joint.prompt_token_ids, list(joint.outputs[0].token_ids)) \
        == hf_greedy(hf, text, images, add_special_tokens=False)


@pytest.mark.parametrize("value, message", [
    (torch.zeros(3, 64), r"image_embeds item 0 has shape \(3, 64\), but one image of "
                         r"LlavaForConditionalGeneration is \(16, 64\)"),
    (torch.zeros(16, 8), r"has shape \(16, 8\)"),
    (torch.zeros(16, 64, dtype=torch.int64), "must be a floating-point tensor"),
    (torch.full((16, 64), float("inf")), "non-finite"),
    ("bm90IGEgdGVuc29y", "image_embeds must be the bytes of torch.save"),
    (torch.zeros(3, 16, 64), r"At most 2 image\(s\)"),
])
def test_bad_image_embeds_are_refused_and_the_engine_serves_on(llm, hf, value,
                                                               message) -> None:
    messages = chat_messages([])
    messages[0]["content"].append({"type": "image_embeds", "image_embeds": value})
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, greedy(), use_tqdm=False)
    assert engine_state(llm)["num_requests"] == 0
    image = random_image(17)
    output = llm.chat(chat_messages([image]), greedy(), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_chat_greedy(hf, [image])[1]


# ---- engines of their own ----------------------------------------------------------------

def _cases(n: int) -> list[tuple[str, list]]:
    return [(TWO, [random_image(30 + i), random_image(40 + i)]) if i % 2 else
            (PROMPT, [random_image(30 + i)]) for i in range(n)]


def test_under_preemption_and_with_graphs(model_dir, hf) -> None:
    """Preemption (16 blocks of 8 for prompts of 41 and 61 tokens: a preempted request
    keeps its rows and recomputes its KV), then compiled graphs (the embeds set, captured
    for an image model without enable_prompt_embeds), both equal to transformers."""
    cases = _cases(4)
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}}
               for text, images in cases]
    expected = [hf_greedy(hf, text, images, max_tokens=12)[1] for text, images in cases]
    runner = check_preemption_and_graphs(model_dir, prompts, expected, num_blocks=16)
    assert any(kind == InputKind.EMBEDS for kind, _ in runner.graphs.replays)  # image rows


@pytest.mark.parametrize("tower, overrides", [
    ("clip", {"vision_feature_layer": [-3, -1], "vision_feature_select_strategy": "default"}),
    ("clip", {"vision_feature_layer": 1, "vision_feature_select_strategy": "full"}),
    ("siglip", {"vision_feature_layer": -1, "vision_feature_select_strategy": "full"}),
    ("siglip", {"vision_feature_layer": [0, -2], "vision_feature_select_strategy": "default"}),
])
def test_feature_layers_and_strategies_equal_transformers(tmp_path, tower, overrides) -> None:
    path = make_tiny_llava(str(tmp_path), seed=1, tower=tower, **overrides)
    reference = load_reference(path, overrides["vision_feature_select_strategy"],
                               class_token=tower == "clip")
    llm = LLM(path, dtype="float32", max_model_len=128, enforce_eager=True,
              kv_cache_memory_bytes=8 * 1024**2)
    cases = _cases(2)
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}
                            for text, images in cases], greedy(), use_tqdm=False)
    for output, (text, images) in zip(outputs, cases, strict=True):
        prompt_ids, expected = hf_greedy(reference, text, images)
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == expected
    llm.shutdown()


def test_images_arriving_together_share_one_encoder_call(llm, hf, monkeypatch) -> None:
    stage = llm.llm_engine.engine_core.media_rows
    calls: list[int] = []

    def counted(modality, pixels):
        calls.append(len(pixels))
        return embed(modality, pixels)

    embed = stage.embed
    monkeypatch.setattr(stage, "embed", counted)
    images = [random_image(60 + i) for i in range(3)]
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}
                            for image in images], greedy(), use_tqdm=False)
    assert calls == [3]
    for output, image in zip(outputs, images, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf, PROMPT, [image])[1]


def test_a_burst_under_a_small_encoder_budget_equals_transformers(llm, hf,
                                                                  monkeypatch) -> None:
    """An encoder budget of one image a step: a burst of four requests (one with two images,
    over the budget: encoded alone, never split) is encoded one request a step, each image
    once, and every request answers as transformers does."""
    core = llm.llm_engine.engine_core
    monkeypatch.setattr(core.scheduler.config, "max_num_encoder_input_tokens", IMAGE_TOKENS)
    stage = core.media_rows
    calls: list[int] = []

    def counted(modality, pixels):
        calls.append(len(pixels))
        return embed(modality, pixels)

    embed = stage.embed
    monkeypatch.setattr(stage, "embed", counted)
    cases = [(PROMPT, [random_image(70)]), (TWO, [random_image(71), random_image(72)]),
             (PROMPT, [random_image(73)]), (PROMPT, [random_image(74)])]
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}
                            for text, images in cases], greedy(), use_tqdm=False)
    assert calls == [1, 2, 1, 1]
    for output, (text, images) in zip(outputs, cases, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf, text, images)[1]


def test_encoder_failure_fails_only_its_request(llm, hf, monkeypatch) -> None:
    """The batch fails, then each request runs alone: only the one whose image breaks the
    tower finishes with "error", the others are answered."""
    stage = llm.llm_engine.engine_core.media_rows
    bad = random_image(50)
    embed = stage.embed

    def broken(modality, pixels):
        if any(torch.equal(p, bad_pixels) for p in pixels):
            raise RuntimeError("vision tower out of memory")
        return embed(modality, pixels)

    from vllm.multimodal.image import load_image, preprocess

    bad_pixels = preprocess(load_image(bad), llm.llm_engine.processor.media_processor
                            .image_config)
    monkeypatch.setattr(stage, "embed", broken)
    good = random_image(51)
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}
                            for image in (good, bad)], greedy(), use_tqdm=False)
    assert outputs[1].outputs[0].finish_reason == "error"
    assert list(outputs[0].outputs[0].token_ids) == hf_greedy(hf, PROMPT, [good])[1]
    assert not llm.llm_engine.has_unfinished_requests()
    assert engine_state(llm)["num_requests"] == 0
    monkeypatch.undo()
    output = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": bad}},
                          greedy(), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(hf, PROMPT, [bad])[1]
