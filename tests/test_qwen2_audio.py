"""Qwen2-Audio end to end on a tiny random checkpoint: greedy tokens equal to transformers (its
own Qwen2AudioProcessor and `generate`) with one and two clips per prompt, under chunked
prefill and prefix hits; the encoder cache; `llm.chat` with `input_audio` and `audio_url`
parts; refusals that leave the engine serving."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from tests.model_factory import make_tiny_model
from tests.multimodal_family import (
    check_preemption_and_graphs,
    engine_state,
    family_fixtures,
    greedy,
)
from tests.qwen2_audio_reference import (
    PROMPT,
    RATE,
    TWO,
    audio_url_part,
    chat_messages,
    clip,
    hf_chat_greedy,
    hf_greedy,
    input_audio_part,
    load_reference,
    wav_bytes,
)
from vllm import LLM
from vllm.config import InputKind

pytestmark = pytest.mark.slow


# 24-token steps: a 1 s clip is 25 positions, so clip runs are prefilled in chunks and cross
# chunk and block boundaries.
model_dir, hf, llm = family_fixtures("tiny_qwen2_audio_dir", load_reference, max_model_len=512,
                                     max_num_batched_tokens=24,
                                     limit_mm_per_prompt={"audio": 2})


def test_one_clip_equals_transformers(llm, hf) -> None:
    clips = [clip(1), clip(2, 0.4), clip(3, 2.3)]
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"audio": (c, RATE)}} for c in clips]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    tokens = []
    for output, waveform in zip(outputs, clips, strict=True):
        prompt_ids, expected = hf_greedy(hf, PROMPT, [waveform])
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == expected
        tokens.append(expected)
    assert len({tuple(t) for t in tokens}) > 1  # the clips matter to the output


def test_other_sample_rate_is_resampled(llm, hf) -> None:
    low = clip(4, rate=8000)
    output = llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": (low, 8000)}},
                          greedy(), use_tqdm=False)[0]
    prompt_ids, expected = hf_greedy(hf, PROMPT, [soxr.resample(low, 8000, RATE)])
    assert output.prompt_token_ids == prompt_ids
    assert list(output.outputs[0].token_ids) == expected


def test_two_clips_equal_transformers(llm, hf) -> None:
    pairs = [(clip(5), clip(6, 0.7)), (clip(6, 0.7), clip(5))]
    prompts = [{"prompt": TWO, "multi_modal_data": {"audio": [(c, RATE) for c in pair]}}
               for pair in pairs]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    for output, pair in zip(outputs, pairs, strict=True):
        prompt_ids, expected = hf_greedy(hf, TWO, list(pair))
        assert output.prompt_token_ids == prompt_ids
        assert prompt_ids.count(hf[1].config.audio_token_id) == 25 + 17
        assert list(output.outputs[0].token_ids) == expected


def test_text_only_prompt_equals_transformers(llm, hf) -> None:
    text = "Describe a bird song."
    output = llm.generate(text, greedy(), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(hf, text, [])[1]


def test_same_clip_hits_prefix_and_encoder_caches(llm, hf) -> None:
    waveform = clip(7, 1.5)
    before = engine_state(llm)
    first = llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": (waveform, RATE)}},
                         greedy(), use_tqdm=False)[0]
    # The same clip as a 32-bit float WAV file: the same samples, the same cache entries.
    again = llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": wav_bytes(waveform)}},
                         greedy(), use_tqdm=False)[0]
    after = engine_state(llm)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (first.num_prompt_tokens - 1) // 16 * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert list(first.outputs[0].token_ids) == hf_greedy(hf, PROMPT, [waveform])[1]
    assert after["encoder_cache_misses"] - before["encoder_cache_misses"] == 1
    assert after["encoder_cache_hits"] - before["encoder_cache_hits"] == 1


def test_encoder_cache_hit_without_prefix_hit_equals_the_miss(llm, hf) -> None:
    """The same clip after other text: its rows come from the encoder cache, no prefix
    block is shared, and the tokens are transformers'."""
    waveform = clip(8)
    text = "Listen: " + PROMPT
    llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": (waveform, RATE)}},
                 greedy(), use_tqdm=False)
    hits = engine_state(llm)["encoder_cache_hits"]
    output = llm.generate({"prompt": text, "multi_modal_data": {"audio": (waveform, RATE)}},
                          greedy(), use_tqdm=False)[0]
    assert engine_state(llm)["encoder_cache_hits"] == hits + 1
    assert output.num_cached_tokens == 0
    assert list(output.outputs[0].token_ids) == hf_greedy(hf, text, [waveform])[1]


def test_chat_audio_parts_equal_transformers(llm, hf) -> None:
    clips = [clip(9), clip(10, 0.6)]
    messages = chat_messages([input_audio_part(wav_bytes(clips[0])),
                              audio_url_part(wav_bytes(clips[1]))])
    output = llm.chat(messages, greedy(), use_tqdm=False)[0]
    prompt_ids, expected = hf_chat_greedy(hf, clips)
    assert output.prompt_token_ids == prompt_ids
    assert list(output.outputs[0].token_ids) == expected


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": TWO, "multi_modal_data": {"audio": [(clip(1), RATE)] * 3}},
     r"At most 2 audio clip\(s\) may be provided in one prompt, got 3"),
    ({"prompt": TWO, "multi_modal_data": {"audio": (clip(1), RATE)}},
     r"2 audio clip placeholder\(s\) .* but 1 audio clip\(s\) were given"),
    ({"prompt": PROMPT, "multi_modal_data": {"audio": (clip(1, 30.5), RATE)}},
     r"30\.5 s long; one clip takes at most 30 s"),
    ({"prompt": PROMPT, "multi_modal_data": {"audio": b"not a sound at all"}},
     "could not be decoded as audio"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": np.zeros((8, 8, 3), np.uint8)}},
     "takes audio only, not 'image'"),
])
def test_bad_audio_prompts_are_refused_and_the_engine_serves_on(llm, hf, prompt,
                                                                 message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, greedy(), use_tqdm=False)
    output = llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": (clip(1), RATE)}},
                          greedy(), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(hf, PROMPT, [clip(1)])[1]
    assert engine_state(llm)["num_requests"] == 0


@pytest.mark.parametrize("part, message", [
    (input_audio_part(wav_bytes(clip(1)), "aac"), "input_audio format 'aac' is not supported"),
    (input_audio_part(b"\x89PNG\r\n\x1a\n not audio"), "could not be decoded as audio"),
    (input_audio_part(wav_bytes(clip(1, 31.0))), r"31\.0 s long, over the limit of 30 s"),
    (audio_url_part(b"RIFF", "text/plain"), "holds 'text/plain', not audio"),
])
def test_bad_chat_audio_is_refused_and_the_engine_serves_on(llm, hf, part, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.chat(chat_messages([part]), greedy(), use_tqdm=False)
    clips = [clip(11)]
    output = llm.chat(chat_messages([input_audio_part(wav_bytes(clips[0]))]), greedy(),
                      use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_chat_greedy(hf, clips)[1]


def test_a_model_without_audio_refuses_it(tmp_path) -> None:
    llm = LLM(make_tiny_model(str(tmp_path)), dtype="float32", max_model_len=64,
              enforce_eager=True, kv_cache_memory_bytes=4 * 1024**2)
    try:
        with pytest.raises(ValueError, match="this model takes no audio"):
            llm.chat(chat_messages([input_audio_part(wav_bytes(clip(1)))]), greedy(),
                     use_tqdm=False)
        with pytest.raises(ValueError, match="decoder-only model: it takes one prompt and "
                                             "no media"):
            llm.generate({"prompt": "hi", "multi_modal_data": {"audio": (clip(1), RATE)}},
                         greedy(), use_tqdm=False)
        assert llm.generate("hi", greedy(), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


# ---- engines of their own ----------------------------------------------------------------

def test_under_preemption_and_with_graphs(model_dir, hf) -> None:
    """Preemption (16 blocks of 8 for prompts of about 40 tokens and 12 more each: a
    preempted request keeps its rows and recomputes its KV), then compiled graphs (the
    embeds set, captured for an audio model without enable_prompt_embeds), both equal to
    transformers."""
    cases = [(PROMPT, [clip(30 + i)]) if i % 2 else (TWO, [clip(30 + i, 0.5), clip(40 + i, 0.5)])
             for i in range(4)]
    prompts = [{"prompt": text, "multi_modal_data": {"audio": [(c, RATE) for c in clips]}}
               for text, clips in cases]
    expected = [hf_greedy(hf, text, clips, max_tokens=12)[1] for text, clips in cases]
    runner = check_preemption_and_graphs(model_dir, prompts, expected, num_blocks=16)
    assert any(kind == InputKind.EMBEDS for kind, _ in runner.graphs.replays)  # audio rows


def test_full_window_clips_equal_transformers(model_dir, hf) -> None:
    """Clips that fill the 30 s window (750 positions): the stem's reads past the clip are
    the window's own zero padding."""
    llm = LLM(model_dir, dtype="float32", max_model_len=1024, enforce_eager=True,
              kv_cache_memory_bytes=16 * 1024**2)
    clips = [clip(50, 30.0), clip(51, 29.995)]
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": (c, RATE)}}
                            for c in clips], greedy(), use_tqdm=False)
    for output, waveform in zip(outputs, clips, strict=True):
        prompt_ids, expected = hf_greedy(hf, PROMPT, [waveform])
        assert output.prompt_token_ids == prompt_ids
        assert prompt_ids.count(hf[1].config.audio_token_id) == 750
        assert list(output.outputs[0].token_ids) == expected
    llm.shutdown()


def test_checkpoint_in_the_newer_layout_loads(model_dir, hf, tmp_path) -> None:
    """The same weights under the names transformers' model classes use
    (model.audio_tower.X, model.language_model.X, lm_head.X) give the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    def newer(name: str) -> str:
        if name.startswith("language_model.lm_head."):
            return name.removeprefix("language_model.")
        if name.startswith("language_model.model."):
            return "model.language_model." + name.removeprefix("language_model.model.")
        return "model." + name

    for file in ("config.json", "preprocessor_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{model_dir}/{file}", tmp_path / file)
    weights = load_file(f"{model_dir}/model.safetensors")
    assert any(name.startswith("language_model.model.") for name in weights)
    save_file({newer(k): v for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=8 * 1024**2)
    waveform = clip(52)
    output = llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": (waveform, RATE)}},
                          greedy(), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(hf, PROMPT, [waveform])[1]
    llm.shutdown()
