"""Long-form transcription (vllm/entrypoints/longform.py) on synthesized speech (espeak-ng,
tests/longform_audio.py) with the default Whisper tiny.en: no sentence dropped, a WER bound,
repeated speech counted right, long silences skipped, word timings near the synthesizer's.

Every file goes through one `transcribe_offline` call (all windows batched); the server runs
the same `WindowDecoder`s (tests/test_server_transcription.py checks its formats).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.longform_audio import (
    SENTENCES,
    Recording,
    mostly_silence,
    recording,
    silence,
    synthesize,
    word_clip,
)
from tests.wer import normalize_words, word_error_rate
from vllm import LLM, SamplingParams
from vllm.entrypoints.longform import (
    FALLBACK_TEMPERATURES,
    DecodeSetup,
    LongSegment,
    WindowDecoder,
    decode_async,
    decode_in_order,
    make_setup,
    plan_windows,
    transcribe_offline,
    word_timings,
)
from vllm.entrypoints.word_alignment import WhisperAligner, WordTiming, dtw, snap_to_pauses
from vllm.inputs.vad import Piece, WindowMap, pack_windows, speech_regions
from vllm.inputs.whisper import WhisperTokens, decoder_prompt, join_texts
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import BeamSearchParams
from vllm.transformers_utils.default_model import default_whisper_model_path
from vllm.v1.outputs import Logprob

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

RATE = 16_000
WORDS = [str(w) for w in "the green garden needs water every morning before breakfast".split()]
WORD_GAPS = [0.25, 0.4, 0.2, 0.6, 0.3, 0.35, 0.5, 0.3, 0.2]


# ---- no model: VAD, windows, clocks, DTW ----------------------------------------------


def test_speech_regions_and_windows() -> None:
    speech = synthesize(SENTENCES[0])
    audio = np.concatenate([silence(1.0), speech, silence(12.0), speech, silence(0.3),
                            speech, silence(2.0)])
    regions = speech_regions(audio)
    # Two regions: the 0.3 s pause stays inside speech; 0.2 s of padding on each side.
    first = 1.0 * RATE, (1.0 + speech.shape[0] / RATE) * RATE
    assert len(regions) == 2
    assert abs(regions[0].start - (first[0] - 0.2 * RATE)) <= 320
    assert abs(regions[0].end - (first[1] + 0.2 * RATE)) <= 320
    assert speech_regions(silence(5.0)) == []
    # Both fit one 30 s window, the 12 s pause left out, unless the gap is too long to join.
    assert pack_windows(audio, regions, max_gap=13 * RATE) == [regions]
    assert pack_windows(audio, regions) == [[regions[0]], [regions[1]]]
    assert pack_windows(audio, regions, window=regions[1].end - regions[1].start,
                        max_gap=13 * RATE) == [[regions[0]], [regions[1]]]


def test_window_map_clock_and_reseek() -> None:
    window = WindowMap([Piece(0, 2 * RATE), Piece(10 * RATE, 11 * RATE)])
    assert window.seconds == 3.0
    assert window.file_seconds(1.0) == 1.0 and window.file_seconds(2.5) == 10.5
    assert window.file_seconds(2.0) == 10.0 and window.file_seconds(2.0, end=True) == 2.0
    assert window.file_seconds(9.0) == 11.0  # clamped to the window
    rest = window.after(1.5)
    assert rest.pieces == [Piece(int(1.5 * RATE), 2 * RATE), Piece(10 * RATE, 11 * RATE)]
    assert window.after(2.5).pieces == [Piece(int(10.5 * RATE), 11 * RATE)]
    audio = np.arange(12 * RATE, dtype=np.float32)
    assert np.array_equal(window.audio(audio), np.concatenate([audio[:2 * RATE],
                                                               audio[10 * RATE:11 * RATE]]))


def test_dtw_and_pause_snapping() -> None:
    rows, cols = dtw(np.array([[0.0, 9.0, 9.0], [9.0, 0.0, 0.0]]))
    assert rows.tolist() == [0, 1, 1] and cols.tolist() == [0, 1, 2]
    rows, cols = dtw(np.array([[0.0, 0.0, 9.0, 9.0], [9.0, 9.0, 0.0, 9.0],
                               [9.0, 9.0, 9.0, 0.0]]))
    assert rows.tolist() == [0, 0, 1, 2] and cols.tolist() == [0, 1, 2, 3]
    loud = np.array([0, 1, 1, 0, 0, 1, 1, 0], bool)
    words = [WordTiming("a", 0.0, 0.45), WordTiming("b", 0.45, 0.8)]
    snapped = snap_to_pauses(words, loud, 0.1)
    assert [w.word for w in snapped] == ["a", "b"]
    assert np.allclose([(w.start, w.end) for w in snapped], [(0.1, 0.3), (0.5, 0.7)])


# ---- WindowDecoder on hand-made outputs ------------------------------------------------

TOKENS = WhisperTokens(start_of_transcript=50257, start_of_prev=50360, no_timestamps=50362,
                       timestamp_begin=50363, end_of_text=50256)
NO_SPEECH = 50361


class _Letters:
    """A tokenizer whose token i < 26 is the letter 'a' + i."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def _ts(seconds: float) -> int:
    return TOKENS.timestamp_begin + round(seconds / 0.02)


def _output(token_ids: list[int], logprob: float = -0.1,
            probe: dict[int, float] | None = None) -> RequestOutput:
    entries = [{t: Logprob(logprob)} for t in token_ids] if probe is None else \
        [{t: Logprob(lp) for t, lp in probe.items()}]
    return RequestOutput("r", None, None, None, [CompletionOutput(
        0, "", token_ids, None, entries, "stop")], True)


def _decoder(seconds: float, pieces: list[Piece] | None = None) -> WindowDecoder:
    setup = DecodeSetup(_Letters(), TOKENS, [TOKENS.start_of_transcript, _ts(0.0)],
                        SamplingParams(temperature=0.0, max_tokens=224),
                        FALLBACK_TEMPERATURES, NO_SPEECH)
    audio = np.ones(int(seconds * RATE), np.float32)
    return WindowDecoder(audio, WindowMap(pieces or [Piece(0, audio.shape[0])]), setup)


def _probe(no_speech: float) -> RequestOutput:
    return _output([TOKENS.no_timestamps], probe={TOKENS.no_timestamps: np.log(0.5),
                                                  NO_SPEECH: np.log(no_speech)})


def test_window_decoder_accepts_reseeks_and_falls_back() -> None:
    decoder = _decoder(10.0)
    requests = decoder.requests()
    assert [p["decoder_prompt"]["prompt_token_ids"] for p, _ in requests] == \
        [[TOKENS.start_of_transcript, _ts(0.0)], [TOKENS.start_of_transcript]]
    assert requests[0][1].logprobs == 0 and requests[0][1].max_tokens == 16 + 70
    # Two segments, the second cut off at 4.0 s: the first is kept, the rest re-decoded.
    decoder.feed([_output([0, 1, 2, _ts(2.0), _ts(4.0), 3, 4, TOKENS.end_of_text]),
                  _probe(0.01)])
    assert not decoder.done and decoder.window.pieces == [Piece(4 * RATE, 10 * RATE)]
    assert [(s.start, s.end, s.token_ids) for s in decoder.segments] == [(0.0, 2.0, [0, 1, 2])]
    assert decoder.segments[0].no_speech_prob == pytest.approx(0.01)
    assert decoder.segments[0].avg_logprob == pytest.approx(-0.1)
    assert len(decoder.requests()) == 2  # the re-seek's own probe
    # A repetitive text fails the compression ratio; the window is short: temperature 0.2.
    decoder.feed([_output([0, 1] * 60 + [_ts(6.0), TOKENS.end_of_text]), _probe(0.01)])
    (request,) = decoder.requests()
    assert request[1].temperature == 0.2 and not decoder.done
    decoder.feed([_output([5, 6, _ts(5.9), TOKENS.end_of_text])])
    assert decoder.done
    last = decoder.segments[-1]
    assert (last.start, last.end, last.token_ids, last.temperature) == (4.0, 9.9, [5, 6], 0.2)


def test_window_decoder_beam_search_then_sampled_fallback() -> None:
    """use_beam_search: the temperature-0 attempt searches `beam_width` beams under the
    window's token cap; a fallback attempt samples (no beams), as faster-whisper's does."""
    beam = BeamSearchParams(beam_width=5, max_tokens=224)
    setup = DecodeSetup(_Letters(), TOKENS, [TOKENS.start_of_transcript, _ts(0.0)],
                        beam.sampling_params(), FALLBACK_TEMPERATURES, NO_SPEECH)
    audio = np.ones(int(4.0 * RATE), np.float32)
    decoder = WindowDecoder(audio, WindowMap([Piece(0, audio.shape[0])]), setup)
    params = decoder.requests()[0][1]
    assert params.beam_search is not None and params.beam_search.beam_width == 5
    assert params.max_tokens == params.beam_search.max_tokens == 16 + 28
    assert params.temperature == 0.0 and params.logprobs == 0
    decoder.feed([_output([0, 1] * 30 + [_ts(3.0), TOKENS.end_of_text]), _probe(0.01)])
    (request,) = decoder.requests()
    assert request[1].beam_search is None and request[1].temperature == 0.2


def test_window_decoder_no_speech_and_split() -> None:
    quiet = _decoder(5.0)
    quiet.feed([_output([0, _ts(1.0), TOKENS.end_of_text], logprob=-2.0), _probe(0.9)])
    assert quiet.done and quiet.all_segments() == []
    pieces = [Piece(0, 5 * RATE), Piece(8 * RATE, 14 * RATE)]
    loop = _decoder(14.0, pieces)
    loop.feed([_output([0, 1] * 60, logprob=-0.05), _probe(0.01)])
    halves = loop.requests()
    assert len(halves) == 4 and not loop.done  # two halves, each its decode and probe
    loop.feed([_output([0, _ts(4.9), TOKENS.end_of_text]), _probe(0.01),
               _output([1, _ts(5.9), TOKENS.end_of_text]), _probe(0.01)])
    assert loop.done
    assert [(s.start, s.end, s.token_ids) for s in loop.all_segments()] == \
        [(0.0, 4.9, [0]), (8.0, 13.9, [1])]


def test_window_decoder_probes_late_without_report() -> None:
    """report_no_speech=False (json, text): no probe beside the decode; an attempt whose
    avg_logprob passes is judged at once (its no_speech_prob unknown), one that fails waits
    for a probe alone, then is judged as an eager probe would have judged it."""
    def lazy(seconds: float) -> WindowDecoder:
        decoder = _decoder(seconds)
        decoder.setup = dataclasses.replace(decoder.setup, report_no_speech=False)
        return decoder

    good = lazy(5.0)
    assert len(good.requests()) == 1
    good.feed([_output([0, _ts(4.9), TOKENS.end_of_text])])
    assert good.done and [s.no_speech_prob for s in good.segments] == [None]
    quiet = lazy(5.0)
    quiet.feed([_output([0, _ts(1.0), TOKENS.end_of_text], logprob=-2.0)])
    ((prompt, params),) = quiet.requests()
    assert prompt["decoder_prompt"]["prompt_token_ids"] == [TOKENS.start_of_transcript]
    assert params.max_tokens == 1 and not quiet.done
    quiet.feed([_probe(0.9)])
    assert quiet.done and quiet.all_segments() == []
    # Speech after all: the usual fallback, the probe's answer kept for later attempts.
    unsure = lazy(5.0)
    unsure.feed([_output([0, _ts(1.0), TOKENS.end_of_text], logprob=-2.0)])
    unsure.feed([_probe(0.01)])
    ((_, params),) = unsure.requests()
    assert params.temperature == 0.2
    unsure.feed([_output([1, _ts(4.0), TOKENS.end_of_text], logprob=-1.5)])
    assert len(unsure.requests()) == 1 and unsure.requests()[0][1].temperature == 0.4


# ---- tiny.en end to end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(default_whisper_model_path(), dtype="float32",
               kv_cache_memory_bytes=512 * 2**20, seed=0)


@pytest.fixture(scope="module")
def setup(llm: LLM):
    tokenizer = llm.get_tokenizer()
    config = llm.llm_engine.vllm_config.model_config
    prompt_ids = decoder_prompt(tokenizer, config.hf_config, language=None,
                                task="transcribe", previous_text_ids=[], timestamps=True,
                                max_model_len=config.max_model_len)
    return make_setup(tokenizer, prompt_ids, SamplingParams(temperature=0, max_tokens=224))


def _five_second_clip() -> np.ndarray:
    speech = synthesize(SENTENCES[14])
    return np.concatenate([speech, silence(5.0 - speech.shape[0] / RATE)])


@pytest.fixture(scope="module")
def recordings() -> dict[str, Recording]:
    clip = _five_second_clip()
    repeated = Recording(np.tile(clip, 10), [SENTENCES[14]] * 10,
                         [(5.0 * i, 5.0 * i + 2.0) for i in range(10)])
    return {
        "fast, long pauses": recording([SENTENCES[i] for i in (2, 9, 20, 5, 27)],
                                       [0.3, 12.0, 0.6, 6.0, 0.5], voice="en-us+f3",
                                       rate=185),
        "mostly silence": mostly_silence(40.0),
        "repeated 10 times": repeated,
        "28 s of silence": recording([SENTENCES[13], SENTENCES[26]], [28.0, 0.5]),
    }


@pytest.fixture(scope="module")
def transcripts(llm: LLM, setup, recordings: dict[str, Recording]
                ) -> dict[str, list[LongSegment]]:
    results = transcribe_offline(llm, [r.samples for r in recordings.values()], setup)
    return dict(zip(recordings, results))


def _text(setup, segments: list[LongSegment]) -> str:
    return join_texts([setup.tokenizer.decode(s.token_ids) for s in segments])


def _covered(sentence: str, text: str) -> bool:
    """Most of the sentence's words appear, in order, in the text (tiny.en mishears some)."""
    words, heard = normalize_words(sentence), normalize_words(text)
    found, at = 0, 0
    for word in words:
        if word in heard[at:]:
            at = heard.index(word, at) + 1
            found += 1
    return found >= 0.6 * len(words)


def test_no_sentence_dropped_and_wer(setup, recordings: dict[str, Recording],
                                     transcripts: dict[str, list[LongSegment]]) -> None:
    errors, words = 0.0, 0
    for name, rec in recordings.items():
        segments = transcripts[name]
        text = _text(setup, segments)
        # Each sentence appears in the transcript, near its place in time.
        for sentence, (start, end) in zip(rec.sentences, rec.spans):
            near = _text(setup, [s for s in segments if s.end > start - 2 and s.start < end + 2])
            assert _covered(sentence, near), (name, sentence, text)
        starts = [s.start for s in segments]
        assert starts == sorted(starts), name
        assert all(0.0 <= s.start <= s.end <= rec.seconds + 1e-6 for s in segments), name
        errors += word_error_rate(rec.text, text) * len(normalize_words(rec.text))
        words += len(normalize_words(rec.text))
    assert errors / words < 0.2  # tiny.en on espeak-ng voices: 0.16 measured


def test_repeated_clip_and_silences(setup, recordings: dict[str, Recording],
                                    transcripts: dict[str, list[LongSegment]]) -> None:
    repeated = normalize_words(_text(setup, transcripts["repeated 10 times"]))
    assert " ".join(repeated).count("library") == 10
    gap = transcripts["28 s of silence"]
    assert _covered(SENTENCES[13], _text(setup, gap))
    assert _covered(SENTENCES[26], _text(setup, [s for s in gap if s.start > 28.0]))
    # Silence is never decoded: one speech window for the 40 s file.
    quiet = recordings["mostly silence"]
    assert len(plan_windows(quiet.samples)) == 1
    for segments in transcripts.values():
        for s in segments:
            assert s.no_speech_prob is not None and 0.0 <= s.no_speech_prob <= 1.0
            assert s.avg_logprob <= 0.0
            assert s.temperature in setup.temperatures and s.compression_ratio > 0.0


def test_silence_only_window_is_dropped(llm: LLM, setup) -> None:
    """A window of noise: the no-speech probe and the low average logprob drop it."""
    noise = (np.random.default_rng(0).standard_normal(4 * RATE) * 0.05).astype(np.float32)
    decoder = WindowDecoder(noise, WindowMap([Piece(0, noise.shape[0])]), setup)
    requests = decoder.requests()
    assert len(requests) == 2 and requests[1][1].max_tokens == 1  # decode + probe
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests],
                           use_tqdm=False)
    decoder.feed(outputs)
    probe = outputs[1].outputs[0].logprobs
    assert probe is not None and setup.no_speech_id in probe[0]
    assert decoder.done and decoder.all_segments() == []


def test_word_timestamps(llm: LLM, setup) -> None:
    audio, bounds = word_clip(WORDS, WORD_GAPS)
    segments = transcribe_offline(llm, [audio], setup)[0]
    aligner = WhisperAligner.from_model_dir(default_whisper_model_path(), setup.tokenizer)
    per_segment = word_timings(aligner, audio, segments, setup)
    words = [w for ws in per_segment for w in ws]
    for segment, ws in zip(segments, per_segment):
        assert all(segment.start <= w.start <= w.end <= segment.end for w in ws)
    assert [w.start for w in words] == sorted(w.start for w in words)
    assert all(a.end <= b.start + 1e-6 for a, b in zip(words, words[1:]))
    heard = {normalize_words(w.word)[0]: w for w in words if normalize_words(w.word)}
    matched = [(heard[word], bound) for word, bound in zip(WORDS, bounds) if word in heard]
    assert len(matched) >= 6
    for timing, (start, end) in matched:
        assert abs(timing.start - start) <= 0.3 and abs(timing.end - end) <= 0.3, timing


def test_decode_async_batches_windows_and_raises_the_first_error() -> None:
    import asyncio

    rounds: list[int] = []

    async def generate(requests):
        rounds.append(len(requests))
        await asyncio.sleep(0)
        return [_output([0, _ts(4.9), TOKENS.end_of_text]), _probe(0.01)]

    decoders = [_decoder(5.0), _decoder(5.0)]
    asyncio.run(decode_async(decoders, generate))
    assert rounds == [2, 2] and all(d.done for d in decoders)

    async def failing(requests):
        raise ValueError("bad window")

    with pytest.raises(ValueError, match="bad window"):
        asyncio.run(decode_async([_decoder(5.0), _decoder(5.0)], failing))


def test_decode_in_order_hands_windows_back_in_order_and_fails_at_once() -> None:
    """What a stream relies on: a later window that finishes first waits for the earlier
    one; a window that fails ends the decode at once and cancels the ones still running."""
    import asyncio
    import contextlib

    def seconds_of(requests) -> float:
        audio, _ = requests[0][0]["encoder_prompt"]["multi_modal_data"]["audio"]
        return audio.shape[0] / RATE

    async def in_order() -> tuple[list[float], list[WindowDecoder], list[WindowDecoder]]:
        release, finished = asyncio.Event(), []

        async def generate(requests):
            seconds = seconds_of(requests)
            if seconds == 6.0:  # the first window waits until the second is done
                await release.wait()
            finished.append(seconds)
            release.set()
            return [_output([0, _ts(4.9), TOKENS.end_of_text]), _probe(0.01)]

        decoders = [_decoder(6.0), _decoder(5.0)]
        async with contextlib.aclosing(decode_in_order(decoders, generate)) as windows:
            return finished, [d async for d in windows], decoders

    finished, yielded, decoders = asyncio.run(in_order())
    assert finished == [5.0, 6.0] and yielded == decoders and all(d.done for d in decoders)

    async def failing() -> list[str]:
        events = []

        async def generate(requests):
            if seconds_of(requests) == 6.0:
                try:
                    await asyncio.Event().wait()  # never finishes on its own
                except asyncio.CancelledError:
                    events.append("first window cancelled")
                    raise
            raise ValueError("bad window")

        decoders = [_decoder(6.0), _decoder(5.0)]
        with pytest.raises(ValueError, match="bad window"):
            async with contextlib.aclosing(decode_in_order(decoders, generate)) as windows:
                async for _ in windows:
                    events.append("a window was handed back")
        return events

    assert asyncio.run(failing()) == ["first window cancelled"]

