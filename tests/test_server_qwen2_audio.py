"""`/v1/chat/completions` on a tiny Qwen2-Audio, through the openai client: `input_audio`
parts (OpenAI's form) and `audio_url` parts (vLLM's: data: URLs, files under
--allowed-local-media-path, URLs of --allowed-media-domains served by a local HTTP server);
replies equal transformers' greedy tokens; bad audio is a 400 naming the problem, and the
server answers after it."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import soundfile

from tests.llava_reference import serve_directory
from tests.qwen2_audio_reference import (
    MAX_TOKENS,
    audio_url_part,
    chat_messages,
    clip,
    hf_chat_greedy,
    input_audio_part,
    load_reference,
    wav_bytes,
)
from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("served_audio"))


@pytest.fixture(scope="module")
def server(tiny_qwen2_audio_dir, media_dir):
    srv = RemoteServer(tiny_qwen2_audio_dir, [
        *SMALL_ENGINE_ARGS, "--limit-mm-per-prompt", '{"audio": 2}',
        "--allowed-local-media-path", media_dir, "--allowed-media-domains", "127.0.0.1"])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def hf(tiny_qwen2_audio_dir):
    return load_reference(tiny_qwen2_audio_dir)


def _post(server, model: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "messages": messages})


def test_input_audio_reply_equals_transformers(server, tiny_qwen2_audio_dir, hf) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    clips = [clip(21), clip(22, 0.8)]
    messages = chat_messages([input_audio_part(wav_bytes(c)) for c in clips])
    reply = client.chat.completions.create(
        model=tiny_qwen2_audio_dir, messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    prompt_ids, expected = hf_chat_greedy(hf, clips)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids)
    tokenizer = hf[0].tokenizer
    assert reply.choices[0].message.content == tokenizer.decode(expected,
                                                                skip_special_tokens=True)
    # The same clips as audio_url data: URLs (vLLM's form): the same reply, the encoder
    # cache and the prefix cache hit.
    again = _post(server, tiny_qwen2_audio_dir, chat_messages([audio_url_part(wav_bytes(c))
                                                    for c in clips]))
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["message"]["content"] == reply.choices[0].message.content
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_audio_files_and_urls_equal_transformers(server, tiny_qwen2_audio_dir, media_dir,
                                                  hf) -> None:
    """One clip as a file under the allowed path, one fetched from an allowed host."""
    clips = [clip(23), clip(24, 1.2)]
    for name, waveform in zip(("a.wav", "b.flac"), clips, strict=True):
        with open(f"{media_dir}/{name}", "wb") as f:
            f.write(wav_bytes(waveform) if name.endswith(".wav") else _flac(waveform))
    with serve_directory(media_dir) as host:
        r = _post(server, tiny_qwen2_audio_dir, chat_messages([
            {"type": "audio_url", "audio_url": {"url": f"file://{media_dir}/a.wav"}},
            {"type": "audio_url", "audio_url": {"url": f"{host}/b.flac"}}]))
    assert r.status_code == 200, r.text
    # The reference hears the FLAC's 16-bit samples, as the server does.
    flac, _ = soundfile.read(f"{media_dir}/b.flac", dtype="float32")
    prompt_ids, expected = hf_chat_greedy(hf, [clips[0], flac])
    assert r.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    assert r.json()["choices"][0]["message"]["content"] == hf[0].tokenizer.decode(
        expected, skip_special_tokens=True)


def _flac(waveform) -> bytes:
    """A FLAC file of `waveform` (16-bit samples)."""
    buffer = io.BytesIO()
    soundfile.write(buffer, waveform, 16_000, format="FLAC")
    return buffer.getvalue()


def test_bad_audio_is_400_and_the_server_answers_on(server, tiny_qwen2_audio_dir) -> None:
    text = {"type": "text", "text": "Hi"}
    wav = wav_bytes(clip(1))
    bad = {
        "input_audio format 'aac' is not supported (wav, mp3, flac, ogg)":
            [text, input_audio_part(wav, "aac")],
        "could not be decoded as audio": [text, input_audio_part(b"GIF89a not a sound")],
        "over the limit of 30 s": [text, input_audio_part(wav_bytes(clip(1, 31.0)))],
        "At most 2 audio clip(s) may be provided in one prompt, got 3":
            [text] + [input_audio_part(wav)] * 3,
        "input_audio data is not valid base64":
            [text, {"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}],
        "holds 'image/png', not audio": [text, audio_url_part(wav, "image/png")],
        "this model takes no images": [text, {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"x").decode()}}],
    }
    for message, content in bad.items():
        r = _post(server, tiny_qwen2_audio_dir, [{"role": "user", "content": content}])
        assert r.status_code == 400, (message, r.text)
        assert message in r.json()["error"]["message"], (message, r.text)
    ok = _post(server, tiny_qwen2_audio_dir, chat_messages([input_audio_part(wav)]))
    assert ok.status_code == 200, ok.text
