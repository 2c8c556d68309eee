"""A thousand hostile image inputs against one tiny LLaVA engine, and a thousand hostile audio
inputs against one tiny Qwen2-Audio engine: every one is refused with a ValueError naming its
problem before it is scheduled, memory (RSS, and live Python objects) stays flat after a
warm-up, and the engine still answers exactly as transformers after."""

from __future__ import annotations

import base64
import gc
import io
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from tests import qwen2_audio_reference as audio
from tests.llava_reference import data_url, hf_greedy, load_reference, random_image
from tests.multimodal_family import MAX_TOKENS
from vllm import LLM, SamplingParams
from vllm.multimodal.audio import MAX_AUDIO_BYTES
from vllm.multimodal.image import MAX_IMAGE_BYTES

pytestmark = pytest.mark.slow

PROMPT = "USER: <image>\nWhat is this?\nASSISTANT:"
TWO = "USER: <image> and <image>\nCompare them.\nASSISTANT:"


def _png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def _bomb() -> bytes:
    """A 100-megapixel PNG of a few KB: refused from its header, never decoded."""
    out = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(out, format="PNG")
    return out.getvalue()


def _hostile_inputs() -> list[tuple[str, Callable[[int], Any], str]]:
    """(kind, input for seed i: a prompt, or chat messages, expected refusal)."""
    good_png = _png(random_image(1, (48, 48, 3)))
    bomb = _bomb()
    oversized = b"\x89PNG\r\n\x1a\n" + bytes(MAX_IMAGE_BYTES)
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 256, 300, dtype=np.uint8).tobytes() for _ in range(16)]

    def image(data: Any, text: str = PROMPT) -> dict:
        return {"prompt": text, "multi_modal_data": {"image": data}}

    def chat(part: dict) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": "Hi"}, part]}]

    return [
        ("noise", lambda i: image(noise[i % 16]), "not an image"),
        ("truncated", lambda i: image(good_png[:40 + i % 200]), "truncated or corrupt"),
        ("too many", lambda i: image([random_image(i)] * 3, TWO), r"At most 2 image\(s\)"),
        ("bomb", lambda i: image(bomb), "decompression bomb"),
        ("oversized", lambda i: image(oversized), f"over the limit of {MAX_IMAGE_BYTES}"),
        ("placeholders", lambda i: image([random_image(i)] * 2), r"1 image placeholder\(s\)"),
        ("float pixels", lambda i: image(np.zeros((8, 8, 3), np.float32)), "must be uint8"),
        ("embeds shape", lambda i: image(torch.zeros(1 + i % 15, 64)), "image_embeds item 0"),
        ("embeds nan", lambda i: image(torch.full((16, 64), float("nan"))), "non-finite"),
        ("bad data url", lambda i: chat({"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(noise[i % 16]).decode()}}),
         "not an image"),
        ("file url", lambda i: chat({"type": "image_url", "image_url": {
            "url": f"file:///etc/passwd{i}"}}), "allowed-local-media-path"),
        ("remote url", lambda i: chat({"type": "image_url", "image_url": {
            "url": f"http://10.0.0.{i % 250}/cat.png"}}), "Remote image URLs are not fetched"),
    ]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _soak(llm: LLM, cases: list[tuple[str, Callable[[int], Any], str]],
          params: SamplingParams) -> None:
    """Ten warm-up rounds of every case, then a thousand inputs: each refused, memory flat,
    nothing left in the engine or its encoder."""

    def attack(count: int, start: int) -> None:
        for i, (_kind, make, message) in zip(range(start, start + count),
                                            itertools.cycle(cases)):
            hostile = make(i)
            call = llm.chat if isinstance(hostile, list) else llm.generate
            with pytest.raises(ValueError, match=message):
                call(hostile, params, use_tqdm=False)

    warm_up = 10 * len(cases)
    attack(warm_up, 0)  # every kind ten times
    gc.collect()
    rss, objects = _rss_bytes(), len(gc.get_objects())
    attack(1000, warm_up)
    gc.collect()
    grown_rss, grown_objects = _rss_bytes() - rss, len(gc.get_objects()) - objects
    # A leak of one small object per input shows as >= 1000 objects; of one decoded image
    # or rows tensor per input, as megabytes.
    assert grown_objects < 500, grown_objects
    assert grown_rss < 16 * 1024**2, grown_rss
    state = llm.llm_engine.engine_core.get_state()
    assert state["num_requests"] == 0 and state["num_runner_requests"] == 0
    assert state["encoder_cache_misses"] == 0  # nothing hostile reached the encoder


def test_a_thousand_hostile_inputs_leave_memory_flat_and_the_engine_serving(
        tiny_llava_dir) -> None:
    path = tiny_llava_dir
    llm = LLM(path, dtype="float32", max_model_len=128, enforce_eager=True,
              kv_cache_memory_bytes=8 * 1024**2, limit_mm_per_prompt={"image": 2},
              enable_mm_embeds=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    _soak(llm, _hostile_inputs(), params)
    hf = load_reference(path)
    image = random_image(3)
    output = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {
            "url": data_url(image)}}]}], params, use_tqdm=False)[0]
    text = hf[0].tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi\n<image>"}], tokenize=False,
        add_generation_prompt=True)
    assert (output.prompt_token_ids, list(output.outputs[0].token_ids)) \
        == hf_greedy(hf, text, [image], add_special_tokens=False)
    llm.shutdown()


def _hostile_audio() -> list[tuple[str, Callable[[int], Any], str]]:
    """(kind, input for seed i, expected refusal) for Qwen2-Audio."""
    good = audio.wav_bytes(audio.clip(1, 0.5))
    # Ten minutes of silence as FLAC: a few KB that would decode to 38 MB of samples,
    # refused from the header's length.
    silence = io.BytesIO()
    soundfile.write(silence, np.zeros(600 * 16_000, np.float32), 16_000, format="FLAC")
    bomb = silence.getvalue()
    oversized = b"RIFF" + bytes(MAX_AUDIO_BYTES)
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 256, 300, dtype=np.uint8).tobytes() for _ in range(16)]

    def clip(data: Any, text: str = audio.PROMPT) -> dict:
        return {"prompt": text, "multi_modal_data": {"audio": data}}

    def chat(part: dict) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": "Hi"}, part]}]

    return [
        ("noise", lambda i: clip(noise[i % 16]), "could not be decoded as audio"),
        ("truncated", lambda i: clip(good[:20 + i % 24]), "could not be decoded as audio"),
        ("too many", lambda i: clip([(audio.clip(i % 7), 16_000)] * 3, audio.TWO),
         r"At most 2 audio clip\(s\)"),
        ("flac bomb", lambda i: clip(bomb), r"600\.0 s long, over the limit of 30 s"),
        ("oversized", lambda i: clip(oversized), f"over the limit of {MAX_AUDIO_BYTES}"),
        ("placeholders", lambda i: clip([(audio.clip(i % 7), 16_000)] * 2),
         r"1 audio clip placeholder\(s\)"),
        ("too long", lambda i: clip((np.zeros(16_000 * 31 + i, np.float32), 16_000)),
         "at most 30 s"),
        ("too short", lambda i: clip((np.zeros(1 + i % 300, np.float32), 16_000)), "too short"),
        ("nan", lambda i: clip((np.full(1600, np.nan, np.float32), 16_000)), "non-finite"),
        ("3-d", lambda i: clip((np.zeros((2, 2, 400), np.float32), 16_000)), "must be 1-D"),
        ("rate", lambda i: clip((np.zeros(1600, np.float32), -i)), "positive number"),
        ("format", lambda i: chat(audio.input_audio_part(good, "aac")),
         "format 'aac' is not supported"),
        ("bad base64", lambda i: chat({"type": "input_audio", "input_audio": {
            "data": "@@" * (1 + i % 5), "format": "wav"}}), "not valid base64"),
        ("file url", lambda i: chat({"type": "audio_url", "audio_url": {
            "url": f"file:///etc/passwd{i}"}}), "allowed-local-media-path"),
        ("remote url", lambda i: chat({"type": "audio_url", "audio_url": {
            "url": f"http://10.0.0.{i % 250}/a.wav"}}), "Remote audio URLs are not fetched"),
    ]


def test_a_thousand_hostile_audio_inputs_leave_memory_flat(tiny_qwen2_audio_dir) -> None:
    path = tiny_qwen2_audio_dir
    llm = LLM(path, dtype="float32", max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=8 * 1024**2, limit_mm_per_prompt={"audio": 2})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    _soak(llm, _hostile_audio(), params)
    hf = audio.load_reference(path)
    waveform = audio.clip(3)
    output = llm.chat(audio.chat_messages([audio.input_audio_part(audio.wav_bytes(waveform))]),
                      params, use_tqdm=False)[0]
    assert (output.prompt_token_ids, list(output.outputs[0].token_ids)) \
        == audio.hf_chat_greedy(hf, [waveform])
    llm.shutdown()
