"""Audio files, long speech regions cut into 30 s pieces, Whisper prompts and segments: the
pieces of the transcription endpoint that need no model, with exact expectations."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile

from vllm.entrypoints.longform import compression_ratio
from vllm.entrypoints.openai.protocol import TranscriptionSegment
from vllm.entrypoints.openai.serving_transcription import stream_pieces, subtitles
from vllm.inputs.audio_file import decode_audio_file
from vllm.inputs.vad import Piece, split_region
from vllm.inputs.whisper import (
    WhisperTokens,
    decoder_prompt,
    join_texts,
    language_code,
    language_token_ids,
    timed_segments,
)

DATA = Path(__file__).parent / "data"
CLIP = DATA / "call_me.wav"
RATE = 16_000


def encode(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def tone(seconds: float, rate: int = RATE, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


# ---- decoding -------------------------------------------------------------------------


def test_wav_and_flac_decode_to_the_samples_soundfile_reads() -> None:
    expected, rate = soundfile.read(CLIP, dtype="float32")
    assert rate == RATE
    np.testing.assert_array_equal(decode_audio_file(CLIP.read_bytes(), 60), expected)
    flac = encode(expected, RATE, "FLAC", "PCM_16")
    np.testing.assert_array_equal(decode_audio_file(flac, 60), expected)


@pytest.mark.parametrize("fmt, subtype", [("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III")])
def test_lossy_formats_decode_close_to_the_source(fmt: str, subtype: str) -> None:
    source = tone(1.0)
    decoded = decode_audio_file(encode(source, RATE, fmt, subtype), 60)
    assert abs(decoded.shape[0] - source.shape[0]) < 0.1 * RATE  # codec padding at most
    n = min(decoded.shape[0], source.shape[0])
    assert np.abs(decoded[:n]).max() == pytest.approx(0.5, abs=0.1)


def test_stereo_is_mixed_down_and_44k_resampled_to_16k() -> None:
    left, right = tone(2.0, 44_100, 440.0), tone(2.0, 44_100, 440.0) * 0.0
    stereo = np.stack([left, right], axis=1)  # [frames, channels]
    decoded = decode_audio_file(encode(stereo, 44_100, "WAV", "FLOAT"), 60)
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    assert decoded.shape[0] == pytest.approx(2 * RATE, abs=2)
    # The channel mean halves the amplitude; soxr keeps the 440 Hz tone.
    assert np.abs(decoded[RATE // 2:RATE]).max() == pytest.approx(0.25, abs=0.01)
    spectrum = np.abs(np.fft.rfft(decoded[:RATE]))
    assert int(np.argmax(spectrum)) == 440  # 1 Hz bins over one second


def test_bad_files_name_their_problem() -> None:
    with pytest.raises(ValueError, match="empty"):
        decode_audio_file(b"", 60)
    with pytest.raises(ValueError, match="could not be decoded as audio"):
        decode_audio_file(b"this is a text file, not audio\n" * 10, 60)
    with pytest.raises(ValueError, match="no samples"):
        decode_audio_file(encode(np.zeros(0, np.float32), RATE, "WAV"), 60)
    with pytest.raises(ValueError, match="12.0 s long, over the limit of 10 s"):
        decode_audio_file(encode(np.zeros(12 * 8000, np.int16), 8000, "WAV"), 10)
    nan = encode(np.full(100, np.nan, np.float32), RATE, "WAV", "FLOAT")
    with pytest.raises(ValueError, match="non-finite"):
        decode_audio_file(nan, 60)


# ---- windows --------------------------------------------------------------------------


def test_short_region_is_one_piece() -> None:
    audio = np.ones(RATE * 40, np.float32)
    assert split_region(audio, Piece(RATE, RATE * 31)) == [Piece(RATE, RATE * 31)]


def test_long_audio_is_cut_in_the_quietest_stretch_before_each_30_s() -> None:
    """Loud everywhere except silences at 27-28 s and 52-53 s: each cut lands at the centre
    of the first all-silent 100 ms stretch of its search region (the last 5 s before the
    window's end): 27.00-27.10 s -> 27.05 s; the second region starts at 27.05 + 25 =
    52.05 s, inside the silence -> 52.05-52.15 s -> 52.10 s."""
    audio = np.full(70 * RATE, 0.5, np.float32)
    audio[27 * RATE:28 * RATE] = 0.0
    audio[52 * RATE:53 * RATE] = 0.0
    pieces = split_region(audio, Piece(0, audio.shape[0]))
    assert pieces == [Piece(0, 432_800), Piece(432_800, 833_600), Piece(833_600, 70 * RATE)]
    assert all(p.end - p.start <= 30 * RATE for p in pieces)
    assert pieces[1].start / RATE == 27.05


def test_without_pauses_the_cut_stays_inside_the_window() -> None:
    audio = tone(61.0)
    region = Piece(RATE // 2, audio.shape[0])  # a region starting inside the file
    pieces = split_region(audio, region)
    assert [p.start for p in pieces[1:]] == [p.end for p in pieces[:-1]]
    assert (pieces[0].start, pieces[-1].end) == region
    assert all(0 < p.end - p.start <= 30 * RATE for p in pieces)
    assert all(p.end - p.start >= 25 * RATE for p in pieces[:-1])


# ---- Whisper prompts and segments -------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from vllm.transformers_utils.default_model import default_whisper_model_path
    from vllm.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer(default_whisper_model_path())


class EnglishOnly:
    vocab_size = 51864


class Multilingual:
    vocab_size = 51865


def test_tiny_en_special_tokens(tokenizer, tiny_whisper_dir: str) -> None:
    from vllm.transformers_utils.tokenizer import get_tokenizer

    expected = WhisperTokens(start_of_transcript=50257, start_of_prev=50360,
                             no_timestamps=50362, timestamp_begin=50363, end_of_text=50256)
    assert WhisperTokens.from_tokenizer(tokenizer) == expected
    assert tokenizer.convert_tokens_to_ids("<|0.00|>") == expected.timestamp_begin
    # the same tokenizer saved in a Hugging Face directory
    assert WhisperTokens.from_tokenizer(get_tokenizer(tiny_whisper_dir)) == expected


def test_audio_models_are_known_to_the_front_end_without_importing_them(
        tiny_whisper_dir: str, tiny_bart_dir: str) -> None:
    """The registry's record of the encoder's stride (read by the front end) is the one
    the Whisper model runs with; text models have none."""
    import torch

    from vllm.config import ModelConfig
    from vllm.model_executor.models import whisper
    from vllm.transformers_utils.config import get_config

    def config(path: str) -> ModelConfig:
        return ModelConfig(model=path, tokenizer=path, hf_config=get_config(path),
                           dtype=torch.float32, max_model_len=64)

    audio = config(tiny_whisper_dir)
    assert audio.is_audio_model
    assert audio.audio_frames_per_encoder_token == whisper.FRAMES_PER_ENCODER_TOKEN == 2
    text = config(tiny_bart_dir)
    assert not text.is_audio_model and text.audio_frames_per_encoder_token is None


def test_decoder_prompts(tokenizer) -> None:
    def prompt(**kwargs):
        args = dict(language=None, task="transcribe", previous_text_ids=[],
                    timestamps=False, max_model_len=448)
        return decoder_prompt(tokenizer, EnglishOnly, **{**args, **kwargs})

    assert prompt() == [50257, 50362]
    assert prompt(timestamps=True) == [50257, 50363]
    assert prompt(previous_text_ids=[11, 12, 13]) == [50360, 11, 12, 13, 50257, 50362]
    # Whisper keeps the last max_model_len // 2 - 1 previous-text tokens.
    long = prompt(previous_text_ids=list(range(1000)), max_model_len=10)
    assert long == [50360, 996, 997, 998, 999, 50257, 50362]


def test_language_tokens(tokenizer) -> None:
    """The 99 language tokens sit between <|startoftranscript|> and <|translate|>; the
    vocabulary spells Hebrew with its old code `iw`, read and written as `he`."""
    languages = language_token_ids(tokenizer, 51864)
    assert len(languages) == 99 and list(languages)[:3] == [50258, 50259, 50260]
    assert (languages[50258], languages[50259], languages[50356]) == ("en", "zh", "su")
    hebrew = tokenizer.convert_tokens_to_ids("<|iw|>")
    assert languages[hebrew] == "he" and "iw" not in languages.values()
    assert language_token_ids(tokenizer, 50260) == {50258: "en", 50259: "zh"}

    def prompt(language: str, task: str) -> list[int]:
        return decoder_prompt(tokenizer, Multilingual, language=language, task=task,
                              previous_text_ids=[], timestamps=False, max_model_len=448)

    assert prompt("de", "transcribe") == [50257, 50260, 50358, 50362]
    assert prompt("he", "translate") == [50257, hebrew, 50357, 50362]


def test_languages() -> None:
    assert language_code(None, EnglishOnly) is None
    assert language_code("EN", EnglishOnly) == "en"
    assert language_code("english", EnglishOnly) == "en"
    assert language_code("German", Multilingual) == "de"
    with pytest.raises(ValueError, match="English-only.*'fr'"):
        language_code("fr", EnglishOnly)
    with pytest.raises(ValueError, match="Unknown language 'klingon'"):
        language_code("klingon", Multilingual)


TOKENS = WhisperTokens(50257, 50360, 50362, 50363, 50256)


def ts(seconds: float) -> int:
    return TOKENS.timestamp_begin + round(seconds / 0.02)


def test_segments_from_timestamp_tokens() -> None:
    ids = [10, 11, ts(1.0), ts(1.2), 12, ts(2.0), 50256]
    assert timed_segments(ids, TOKENS, 30.0, [-0.1, -0.2, 0, 0, -0.3, 0, 0]) == [
        (0.0, 1.0, [10, 11], [-0.1, -0.2]), (1.2, 2.0, [12], [-0.3])]


def test_unclosed_text_ends_at_the_window_end_and_times_never_go_back() -> None:
    assert timed_segments([10, 11, 50256], TOKENS, 7.5) == [(0.0, 7.5, [10, 11], [0.0, 0.0])]
    ids = [10, ts(3.0), ts(2.0), 11, ts(29.9)]  # backwards, then past a 12 s window
    assert timed_segments(ids, TOKENS, 12.0) == [(0.0, 3.0, [10], [0.0]),
                                                (3.0, 12.0, [11], [0.0])]


def test_join_texts() -> None:
    assert join_texts([" Hello there.", "", "General Kenobi."]) == \
        " Hello there. General Kenobi."
    assert join_texts([" One.", " Two."]) == " One. Two."
    assert join_texts([]) == ""


def test_subtitles_and_compression_ratio() -> None:
    segments = [TranscriptionSegment(id=0, seek=0, start=0.0, end=2.5, text=" Hi there.",
                                     tokens=[1], temperature=0.0, avg_logprob=-0.1,
                                     compression_ratio=1.0, no_speech_prob=0.0),
                TranscriptionSegment(id=1, seek=2650, start=3661.25, end=3662.0, text=" Bye.",
                                     tokens=[2], temperature=0.0, avg_logprob=-0.1,
                                     compression_ratio=1.0, no_speech_prob=0.0)]
    assert subtitles(segments, srt=True) == (
        "1\n00:00:00,000 --> 00:00:02,500\nHi there.\n\n"
        "2\n01:01:01,250 --> 01:01:02,000\nBye.\n\n")
    assert subtitles(segments, srt=False) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHi there.\n\n"
        "01:01:01.250 --> 01:01:02.000\nBye.\n\n")
    assert subtitles([], srt=True) == "" and subtitles([], srt=False) == "WEBVTT\n\n"
    assert compression_ratio("") == 0.0
    assert compression_ratio("ab" * 200) > 10  # repetition compresses well


def test_speech_clip_list_matches_files() -> None:
    names = json.loads((DATA / "speech_clips.json").read_text())
    assert all((DATA / name).is_file() for name in names)


def test_stream_pieces_add_up_to_the_joined_text() -> None:
    assert stream_pieces(" Hi.", ["Bye.", "", " Go."]) == [" Bye.", " Go."]
    assert stream_pieces("", ["Hi.", "Bye."]) == ["Hi.", " Bye."]
    assert stream_pieces("Hi ", ["there", ""]) == ["there"]
    texts = [" A.", "B.", "", "C. ", "D."]
    sent = ""
    for window in (texts[:2], texts[2:4], texts[4:]):
        sent += "".join(stream_pieces(sent, window))
    assert sent == join_texts(texts)



@pytest.mark.parametrize("fields, width", [
    ({}, 5), ({"n": 3}, 3), ({"best_of": 4}, 4), ({"n": 2, "best_of": 4}, 4), ({"n": 1}, 1)])
def test_beam_width_is_n_or_best_of(fields: dict, width: int) -> None:
    """vLLM's convention: n is the beam width (as on completions), best_of may widen it."""
    from vllm.entrypoints.openai.protocol import TranscriptionRequest

    request = TranscriptionRequest.model_construct(use_beam_search=True, **fields)
    params = request.to_sampling_params(max_tokens=10, logprobs=None)
    assert params.beam_search is not None and params.beam_search.beam_width == width
    assert params.n == 1  # one text: the best beam's


@pytest.mark.parametrize("fields, message", [
    ({"n": 2}, "n=2 applies only with use_beam_search"),
    ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of must be at least n=3"),
    ({"use_beam_search": True, "n": 0}, "n must be at least 1"),
])
def test_bad_beam_widths_name_the_field(fields: dict, message: str) -> None:
    from vllm.entrypoints.openai.protocol import TranscriptionRequest

    with pytest.raises(ValueError, match=message):
        TranscriptionRequest.model_construct(**fields).to_sampling_params(10, None)
