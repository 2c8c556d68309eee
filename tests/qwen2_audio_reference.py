"""Tiny Qwen2-Audio test helpers: clips, WAV files and data: URLs, chat parts, and
transformers' own processor and model as the reference (greedy tokens with the KV cache)."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

from tests.multimodal_family import MAX_TOKENS, hf_generate

RATE = 16_000
PROMPT = "<|audio_bos|><|AUDIO|><|audio_eos|>What is this sound?"
TWO = "<|audio_bos|><|AUDIO|><|audio_eos|> then <|audio_bos|><|AUDIO|><|audio_eos|>Compare."


def clip(seed: int, seconds: float = 1.0, rate: int = RATE) -> np.ndarray:
    """A float32 waveform: a tone plus noise, different for every seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate), dtype=np.float32) / rate
    tone = 0.4 * np.sin(2 * np.pi * (200 + 50 * seed) * t)
    return (tone + 0.1 * rng.standard_normal(t.shape[0])).astype(np.float32)


def wav_bytes(waveform: np.ndarray, rate: int = RATE, subtype: str = "FLOAT") -> bytes:
    """A WAV file of `waveform` (32-bit float samples: decodes to the same floats)."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, waveform, rate, format="WAV", subtype=subtype)
    return buffer.getvalue()


def input_audio_part(data: bytes, audio_format: str = "wav") -> dict:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": audio_format}}


def audio_url_part(data: bytes, media_type: str = "audio/wav") -> dict:
    return {"type": "audio_url", "audio_url": {
        "url": f"data:{media_type};base64," + base64.b64encode(data).decode()}}


def load_reference(path: str):
    """(Qwen2AudioProcessor, Qwen2AudioForConditionalGeneration) of a tiny directory."""
    from transformers import (
        AutoTokenizer,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor.from_pretrained(path),
                                    tokenizer=AutoTokenizer.from_pretrained(path))
    model = Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return processor, model.eval()


def hf_greedy(hf, text: str, clips: list[np.ndarray], max_tokens: int = MAX_TOKENS,
              add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) from transformers: its processor expands the
    placeholders by each clip's length, its model runs the audio tower and the language
    model (`generate`, greedy)."""
    processor, model = hf
    inputs = processor(text=text, audio=clips or None, sampling_rate=RATE,
                       return_tensors="pt", add_special_tokens=add_special_tokens)
    return hf_generate(model, inputs, max_tokens)


def hf_chat_greedy(hf, clips: list[np.ndarray], text: str = "Describe these."
                   ) -> tuple[list[int], list[int]]:
    """transformers on the conversation our chat path renders (`chat_text`)."""
    return hf_greedy(hf, chat_text(hf, len(clips), text), clips, add_special_tokens=False)


def chat_messages(parts: list[dict], text: str = "Describe these.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def chat_text(hf, num_clips: int, text: str = "Describe these.") -> str:
    """The conversation as our chat path renders it (each audio part its "Audio k: ..."
    placeholder, the parts joined by newlines) through the model's chat template."""
    processor, _ = hf
    content = "\n".join([text] + [f"Audio {k + 1}: <|audio_bos|><|AUDIO|><|audio_eos|>"
                                  for k in range(num_clips)])
    return processor.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                   tokenize=False, add_generation_prompt=True)
