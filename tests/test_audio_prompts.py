"""Audio prompts without an engine (Qwen2-Audio): log-mel features and `<|AUDIO|>` runs equal
to transformers' Qwen2AudioProcessor, the clip forms, refusals, and chat audio parts
(`vllm/multimodal/audio.py`, `processing.py`, `entrypoints/chat_utils.py`)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import soxr
import torch

from tests.model_factory import AUDIO_TOKENS, TINY_MEL_BINS, make_tiny_tokenizer
from tests.qwen2_audio_reference import RATE, audio_url_part, clip, input_audio_part, wav_bytes
from vllm.config import ModelConfig
from vllm.entrypoints.chat_utils import (
    chat_placeholders,
    load_media_part,
    media_parts,
    with_media_placeholders,
)
from vllm.multimodal.audio import num_audio_tokens
from vllm.multimodal.media import MediaConnector
from vllm.multimodal.processing import AudioPromptProcessor, media_prompt_processor


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory) -> str:
    """A tokenizer with the audio tokens, a Qwen2-Audio config and a feature extractor."""
    from transformers import (
        AutoTokenizer,
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2Config,
        WhisperFeatureExtractor,
    )

    path = str(tmp_path_factory.mktemp("qwen2_audio_processor"))
    make_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
    tokenizer.save_pretrained(path)
    audio = Qwen2AudioEncoderConfig(num_mel_bins=TINY_MEL_BINS, encoder_layers=1,
                                    encoder_attention_heads=2, encoder_ffn_dim=16, d_model=8)
    text = Qwen2Config(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, vocab_size=len(tokenizer))
    config = Qwen2AudioConfig(audio_config=audio, text_config=text,
                              audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
                              architectures=["Qwen2AudioForConditionalGeneration"])
    config.save_pretrained(path)
    WhisperFeatureExtractor(feature_size=TINY_MEL_BINS).save_pretrained(path)
    return path


def _model_config(path: str, limit: int = 2, max_model_len: int = 1024) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig(model=path, tokenizer=path, hf_config=AutoConfig.from_pretrained(path),
                       dtype=torch.float32, max_model_len=max_model_len,
                       limit_mm_per_prompt={"audio": limit})


def _hf_processor(path: str):
    from transformers import AutoTokenizer, Qwen2AudioProcessor, WhisperFeatureExtractor

    return Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor.from_pretrained(path),
                               tokenizer=AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("seconds", [0.021, 0.5, 1.37, 29.99, 30.0])
def test_features_and_runs_equal_transformers(audio_dir, seconds) -> None:
    """Features of the clip's frames (+ the two the stem reads) and its run length, as
    Qwen2AudioProcessor gives them; the ids equal the processor's expanded prompt."""
    processor = media_prompt_processor(_model_config(audio_dir))
    assert isinstance(processor, AudioPromptProcessor)
    hf = _hf_processor(audio_dir)
    waveform = clip(3, seconds)
    text = "<|audio_bos|><|AUDIO|><|audio_eos|>Say it."
    expected = hf(text=text, audio=[waveform], sampling_rate=RATE, return_tensors="np")
    num_frames = int(expected["feature_attention_mask"][0].sum())
    ids = hf.tokenizer(text)["input_ids"]
    ours = processor.process(ids, {"audio": (waveform, RATE)})
    assert ours.token_ids == expected["input_ids"][0].tolist()
    item = ours.items[0]
    assert item.num_tokens == num_audio_tokens(num_frames) == ours.token_ids.count(
        processor.audio_token_id)
    assert item.offset == 2 and not ours.is_token[2:2 + item.num_tokens].any()
    assert item.data is not None
    window = expected["input_features"][0]
    kept = min(num_frames + 2, window.shape[1])
    assert item.data.shape == (TINY_MEL_BINS, num_frames + 2)
    np.testing.assert_array_equal(item.data[:, :kept].numpy(), window[:, :kept])
    assert not item.data[:, kept:].any()  # past the window: the stem's zero padding


def test_clip_forms_and_resampling(audio_dir) -> None:
    processor = media_prompt_processor(_model_config(audio_dir))
    assert isinstance(processor, AudioPromptProcessor)
    waveform = clip(4)
    ids = [1, processor.audio_token_id, 5]
    pair = processor.process(ids, {"audio": (waveform, RATE)}).items[0]
    bare = processor.process(ids, {"audio": waveform}).items[0]  # at the extractor's rate
    tensor = processor.process(ids, {"audio": [torch.from_numpy(waveform)]}).items[0]
    wav = processor.process(ids, {"audio": wav_bytes(waveform)}).items[0]
    assert pair.content_hash == bare.content_hash == tensor.content_hash == wav.content_hash
    # 8 kHz is resampled to the extractor's 16 kHz (soxr), as a user would do by hand.
    low = clip(5, rate=8000)
    resampled = processor.process(ids, {"audio": (low, 8000)}).items[0]
    by_hand = processor.process(ids, {"audio": (soxr.resample(low, 8000, RATE), RATE)}).items[0]
    assert resampled.content_hash == by_hand.content_hash
    assert resampled.num_tokens == 25  # 1 s: 100 frames -> 50 positions -> 25 rows
    two = processor.process([processor.audio_token_id, 7, processor.audio_token_id],
                            {"audio": [(clip(1), RATE), (clip(2, 0.5), RATE)]})
    # 0.5 s: 50 frames -> 25 positions -> 12 rows
    assert [(i.offset, i.num_tokens) for i in two.items] == [(0, 25), (26, 12)]


@pytest.mark.parametrize("data, message", [
    ({"audio": [(clip(1), RATE)] * 3}, r"At most 2 audio clip\(s\) may be provided in one "
                                       r"prompt, got 3 \(limit_mm_per_prompt\)"),
    ({"audio": [(clip(1), RATE)] * 2}, r"1 audio clip placeholder\(s\) .* 2 audio clip\(s\)"),
    ({"audio": (clip(1, 31.0), RATE)}, r"31\.0 s long; one clip takes at most 30 s"),
    ({"audio": wav_bytes(clip(1, 31.0))}, r"31\.0 s long, over the limit of 30 s"),
    ({"audio": b"RIFF this is not a sound"}, "could not be decoded as audio"),
    ({"audio": (np.zeros(300, np.float32), RATE)}, "too short: 300 samples"),
    ({"audio": (np.full(1600, np.nan, np.float32), RATE)}, "non-finite"),
    ({"audio": (clip(1), 0)}, "positive number"),
    ({"audio": "a sound"}, r"\(waveform, sample_rate\) pair"),
    ({"image": np.zeros((4, 4, 3), np.uint8)}, "takes audio only, not 'image'"),
    ({}, "has no 'audio'"),
])
def test_bad_audio_prompts(audio_dir, data, message) -> None:
    processor = media_prompt_processor(_model_config(audio_dir))
    assert processor is not None
    with pytest.raises(ValueError, match=message):
        processor.process([1, 769, 5], data)  # 769: <|AUDIO|> of the tiny tokenizer


def test_expanded_prompt_must_fit_the_model(audio_dir) -> None:
    processor = media_prompt_processor(_model_config(audio_dir, max_model_len=40))
    assert processor is not None
    with pytest.raises(ValueError, match=r"length 52, with 1 audio clip\(s\) of 50 positions "
                                         r"each\) is longer than the maximum model length of 40"):
        processor.process([1, 769, 5], {"audio": (clip(1, 2.0), RATE)})  # 2 s: 50 rows


def test_chat_audio_parts_become_numbered_placeholders(audio_dir) -> None:
    from transformers import AutoTokenizer

    model_config = _model_config(audio_dir)
    placeholders = chat_placeholders(model_config, AutoTokenizer.from_pretrained(audio_dir))
    assert placeholders == {"audio": "Audio {k}: <|audio_bos|><|AUDIO|><|audio_eos|>"}
    one, two = wav_bytes(clip(1)), wav_bytes(clip(2))
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, input_audio_part(one), audio_url_part(two)]}]
    found = media_parts(messages, tuple(placeholders))
    assert [(p.where, p.kind, p.modality) for p in found] == [
        ("messages[0].content[1]", "input_audio", "audio"),
        ("messages[0].content[2]", "audio_url", "audio")]
    items = [load_media_part(p, MediaConnector(), 1024) for p in found]
    assert items == [one, two]
    replaced, data = with_media_placeholders(messages, placeholders, found, items)
    assert data == {"audio": [one, two]}
    assert [p["text"] for p in replaced[0]["content"]] == [
        "Compare", "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>",
        "Audio 2: <|audio_bos|><|AUDIO|><|audio_eos|>"]


@pytest.mark.parametrize("part, message", [
    (input_audio_part(b"RIFF", "aac"), r"input_audio format 'aac' is not supported \(wav, "
                                       r"mp3, flac, ogg\)"),
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, "needs 'input_audio'"),
    ({"type": "input_audio", "input_audio": "AAAA"}, "needs 'input_audio'"),
    ({"type": "audio_url", "audio_url": {}}, "an audio_url part needs 'audio_url'"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
     "this model takes no images"),
    ({**input_audio_part(b"RIFF"), "uuid": "x"}, "'uuid' on media parts is not supported"),
])
def test_bad_chat_audio_parts(part, message) -> None:
    messages = [{"role": "user", "content": [part]}]
    with pytest.raises(ValueError, match=message):
        media_parts(messages, ("audio",))


def test_chat_audio_to_a_model_without_audio_is_refused() -> None:
    messages = [{"role": "user", "content": [input_audio_part(b"RIFF")]}]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: this model takes no "
                                         "audio"):
        media_parts(messages, ("image",))


@pytest.mark.parametrize("part, message", [
    ({"type": "input_audio", "input_audio": {"data": "@@@@", "format": "wav"}},
     "not valid base64"),
    (audio_url_part(b"RIFF", "image/png"), "holds 'image/png', not audio"),
    ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
     "Remote audio URLs are not fetched"),
])
def test_bad_audio_payloads(part, message) -> None:
    found = media_parts([{"role": "user", "content": [part]}], ("audio",))
    with pytest.raises(ValueError, match=message):
        load_media_part(found[0], MediaConnector(), 1024)


def test_input_audio_over_the_byte_limit_is_refused() -> None:
    data = base64.b64encode(b"\0" * 2000).decode()
    part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    found = media_parts([{"role": "user", "content": [part]}], ("audio",))
    with pytest.raises(ValueError, match="over the limit of 1000 bytes"):
        load_media_part(found[0], MediaConnector(max_audio_bytes=1000), 1024)
