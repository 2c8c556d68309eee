"""Long-form Whisper transcription: speech windows decoded with timestamps, checked, re-decoded
where they fail, and read back as segments in the file's clock.

    waveform ─► speech_regions (vad) ─► pack_windows: ≤ 30 s of speech each, silence left out
    every window of every file at once ─► WindowDecoder:
        attempt at temperature T: the window's decode (timestamps on) + a one-step no-speech
        probe (the <|nospeech|> probability right after <|startoftranscript|>); where no
        caller reads `no_speech_prob` (json, text), the probe runs only after an attempt
        whose avg_logprob is under -1.0 (otherwise the rule below cannot drop the window)
          no_speech_prob > 0.6 and avg_logprob < -1.0      -> silence: no segments
          compression ratio > 2.4 or avg_logprob < -1.0   -> a window of 8 s or more: split
                                                               in two, each decoded anew;
                                                               a shorter one: again at the
                                                               next temperature (seeded)
          the last segment not closed by a timestamp, or ≥ 2 s of audio after the last
          timestamp                                         -> keep the closed segments and
                                                               re-seek from the last timestamp
    segments in order ─► text | verbose_json | srt | vtt (+ word timings: word_alignment.py)

A `WindowDecoder` is a small state machine (`requests()` then `feed(outputs)`) so that the
server (`decode_in_order`: every window its own task on the shared AsyncLLM, the finished
windows handed back in order, which is what a stream sends) and offline callers
(`decode_rounds`: one `LLM.generate` per round over all windows still running) share it.
Windows are decoded independently (no previous-window text), so all of them batch together.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from vllm.entrypoints.word_alignment import WordTiming, snap_to_pauses, split_words
from vllm.inputs.audio import SAMPLE_RATE
from vllm.inputs.encoder_decoder import special_token_id
from vllm.inputs.vad import (
    FRAME,
    Piece,
    WindowMap,
    pack_windows,
    quietest_point,
    speech_frames,
    speech_regions,
)
from vllm.inputs.whisper import TIME_PRECISION, WhisperTokens, timed_segments
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
_MAX_RESEEKS = 16  # per window; every re-seek moves forward by at least one timestamp step
_FRAMES_PER_SECOND = 100  # Whisper's `seek` counts 10 ms mel frames
_PROBE_LOGPROBS = 20
# Fast speech is ~4 tokens a second with timestamps: a window never needs more than this.
_TOKENS_BASE, _TOKENS_PER_SECOND = 16, 7.0
# A failing window at least this long is split in two before any temperature fallback.
_MIN_SPLIT_SECONDS = 8.0

EngineRequest = tuple[dict[str, Any], SamplingParams]


@dataclass(frozen=True, slots=True)
class LongformOptions:
    """OpenAI's and faster-whisper's thresholds."""

    compression_ratio_threshold: float = 2.4
    log_prob_threshold: float = -1.0
    no_speech_threshold: float = 0.6
    # Audio left after the last timestamp of a finished window that is decoded again.
    reseek_min_seconds: float = 2.0


class LongSegment(NamedTuple):
    """One segment; times in the file's clock, `window` and `window_start`/`window_end` in
    the clock of the audio that was decoded (for word alignment)."""

    start: float
    end: float
    token_ids: list[int]  # text tokens only
    seek: int  # 10 ms frame of the file where the decoded audio starts
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float | None  # None: not probed (`DecodeSetup.report_no_speech` off)
    temperature: float
    window: WindowMap
    window_start: float
    window_end: float


def compression_ratio(text: str) -> float:
    """Whisper's repetition measure: text bytes over their zlib-compressed size."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def temperatures_for(temperature: float) -> tuple[float, ...]:
    """0 (OpenAI's meaning: "automatic") -> the fallback ladder; anything else -> itself."""
    return FALLBACK_TEMPERATURES if temperature == 0.0 else (temperature,)


def no_speech_token_id(tokenizer: Any) -> int | None:
    """<|nospeech|> (large-v3 and later) or <|nocaptions|> (earlier vocabularies)."""
    for name in ("<|nospeech|>", "<|nocaptions|>"):
        try:
            return special_token_id(tokenizer, name)
        except ValueError:
            continue
    return None


@dataclass(slots=True)
class DecodeSetup:
    """What every window of one transcription shares."""

    tokenizer: Any
    tokens: WhisperTokens
    prompt_ids: list[int]  # ends with <|0.00|> (timestamps on)
    params: SamplingParams  # the caller's; temperature comes from `temperatures`
    temperatures: tuple[float, ...]
    no_speech_id: int | None
    options: LongformOptions = dataclasses.field(default_factory=LongformOptions)
    # Probe every window for its no_speech_prob (verbose_json, srt, vtt show it). False: only
    # a window whose attempt's avg_logprob fails is probed, since the no-speech rule needs
    # both; the others skip a request and its log-mel features.
    report_no_speech: bool = True

    def probe_prompt(self) -> list[int]:
        """The prompt up to and including <|startoftranscript|>: the probe's one sampled
        step is where OpenAI reads the no-speech probability."""
        end = self.prompt_ids.index(self.tokens.start_of_transcript) + 1
        return self.prompt_ids[:end]


def make_setup(tokenizer: Any, prompt_ids: list[int], params: SamplingParams,
               report_no_speech: bool = True) -> DecodeSetup:
    """The setup of one transcription: its timestamped prompt (`decoder_prompt(...,
    timestamps=True)`), the fallback ladder of `params.temperature`, the no-speech token;
    `report_no_speech=False` where no segment's `no_speech_prob` is read."""
    return DecodeSetup(tokenizer, WhisperTokens.from_tokenizer(tokenizer), prompt_ids, params,
                       temperatures_for(params.temperature), no_speech_token_id(tokenizer),
                       report_no_speech=report_no_speech)


class _Attempt(NamedTuple):
    token_ids: list[int]
    avg_logprob: float
    compression_ratio: float
    finish_reason: str | None


class WindowDecoder:
    """One window from first attempt to its final segments (see the module docstring)."""

    def __init__(self, waveform: np.ndarray, window: WindowMap, setup: DecodeSetup) -> None:
        self.waveform = waveform
        self.window = window
        self.setup = setup
        self.segments: list[LongSegment] = []
        self._temperature_index = 0
        self._no_speech_prob: float | None = None  # of the current window, once probed
        self._unjudged: _Attempt | None = None  # an attempt waiting for its late probe
        self._reseeks = 0
        self._failed: list[_Attempt] = []  # this window's failed attempts, in order
        self._halves: list[WindowDecoder] = []  # once split (see _split)
        self._cut_off = False  # an accepted attempt ended at its token cap, not re-seeked
        self._done = window.num_samples == 0

    @property
    def done(self) -> bool:
        return self._done

    def requests(self) -> list[EngineRequest]:
        """The next attempt's engine requests: the decode, and the probe on a window's first
        attempt where `report_no_speech` (or those of its halves, once split); the probe
        alone for an attempt waiting to be judged. [] when done."""
        if self._halves:
            return [r for half in self._halves for r in half.requests()]
        if self._done:
            return []
        setup = self.setup
        audio = {"audio": (self.window.audio(self.waveform), SAMPLE_RATE)}
        encoder_prompt = {"prompt": "", "multi_modal_data": audio}
        probe = ({"encoder_prompt": encoder_prompt,
                  "decoder_prompt": {"prompt_token_ids": setup.probe_prompt()}},
                 SamplingParams(temperature=0.0, max_tokens=1, logprobs=_PROBE_LOGPROBS))
        if self._unjudged is not None:
            return [probe]
        temperature = setup.temperatures[self._temperature_index]
        # The automatic fallback is seeded (0 unless the caller gave a seed), so the same
        # upload gets the same answer.
        seed = setup.params.seed
        if seed is None and setup.params.temperature == 0.0 and temperature > 0.0:
            seed = 0
        params = self._params(temperature, seed)
        requests = [({"encoder_prompt": encoder_prompt,
                      "decoder_prompt": {"prompt_token_ids": setup.prompt_ids}}, params)]
        if (self._no_speech_prob is None and setup.no_speech_id is not None
                and setup.report_no_speech):
            requests.append(probe)
        return requests

    def _params(self, temperature: float, seed: int | None) -> SamplingParams:
        """One attempt's params: the caller's at `temperature` with this window's token cap,
        its output read once final (streamed requests too: see serving_transcription).
        A beam search (`use_beam_search`) runs at temperature 0; its fallback attempts sample,
        as faster-whisper's and OpenAI's do."""
        params = self.setup.params
        beam = params.beam_search
        if beam is not None and temperature == 0.0:
            beam = dataclasses.replace(beam, max_tokens=self._max_tokens())
            return beam.sampling_params(logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY,
                                        skip_special_tokens=params.skip_special_tokens)
        return dataclasses.replace(params, temperature=temperature, logprobs=0,
                                   max_tokens=self._max_tokens(), seed=seed, beam_search=None,
                                   output_kind=RequestOutputKind.FINAL_ONLY)

    def _max_tokens(self) -> int:
        """The caller's cap, lowered to what speech of this length can need, so that a
        window caught in a loop stops early (a cut-off text re-seeks, so none is lost)."""
        cap = int(_TOKENS_BASE + _TOKENS_PER_SECOND * self.window.seconds)
        return min(self.setup.params.max_tokens or cap, cap)

    def feed(self, outputs: list[RequestOutput]) -> None:
        """The finished outputs of `requests()`, in its order."""
        if self._halves:
            rest = iter(outputs)
            for half in self._halves:
                if not half.done:
                    half.feed([next(rest) for _ in half.requests()])
            self._done = all(half.done for half in self._halves)
            return
        setup, options = self.setup, self.setup.options
        if self._unjudged is not None:  # the late probe's answer
            attempt, self._unjudged = self._unjudged, None
            self._no_speech_prob = _token_prob(outputs[0], setup.no_speech_id)
        else:
            attempt = self._read(outputs[0])
            if len(outputs) > 1:
                self._no_speech_prob = _token_prob(outputs[1], setup.no_speech_id)
            elif setup.no_speech_id is None:
                self._no_speech_prob = 0.0
            elif (self._no_speech_prob is None
                  and attempt.avg_logprob < options.log_prob_threshold):
                self._unjudged = attempt  # judged once its probe is back (see requests)
                return
        quiet = (self._no_speech_prob is not None
                 and self._no_speech_prob > options.no_speech_threshold
                 and attempt.avg_logprob < options.log_prob_threshold)
        if quiet:
            self._done = True
            return
        failed = (attempt.compression_ratio > options.compression_ratio_threshold
                  or attempt.avg_logprob < options.log_prob_threshold)
        if not failed:
            self._accept(attempt)
        elif self.window.seconds >= _MIN_SPLIT_SECONDS:
            self._split()
        elif self._temperature_index + 1 < len(self.setup.temperatures):
            self._failed.append(attempt)
            self._temperature_index += 1
        else:  # every temperature failed: the likeliest attempt, as faster-whisper keeps
            self._failed.append(attempt)
            best = max(range(len(self._failed)), key=lambda i: self._failed[i].avg_logprob)
            self._temperature_index = best
            self._accept(self._failed[best])

    def _split(self) -> None:
        """A long window that failed at temperature 0 (typically a loop over repeated
        speech): its two halves decoded on their own, split between pieces, or for one
        piece at its quietest 100 ms in the middle half."""
        pieces = self.window.pieces
        if len(pieces) > 1:
            middle = len(pieces) // 2
            parts = [pieces[:middle], pieces[middle:]]
        else:
            piece = pieces[0]
            quarter = (piece.end - piece.start) // 4
            cut = quietest_point(self.waveform, piece.start + quarter, piece.end - quarter)
            parts = [[Piece(piece.start, cut)], [Piece(cut, piece.end)]]
        self._halves = [WindowDecoder(self.waveform, WindowMap(part), self.setup)
                        for part in parts]

    def all_segments(self) -> list[LongSegment]:
        return self.segments + [s for half in self._halves for s in half.all_segments()]

    def cut_off(self) -> bool:
        """Whether some text of this window was cut by the token cap (finish reason
        `length`) rather than closed by the model or re-seeked."""
        return self._cut_off or any(half.cut_off() for half in self._halves)

    def _read(self, output: RequestOutput) -> _Attempt:
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = _sampled_logprobs(token_ids, completion.logprobs)
        avg = float(np.mean(logprobs)) if logprobs else 0.0
        text_ids = [t for t in token_ids if t < self.setup.tokens.end_of_text]
        ratio = compression_ratio(self.setup.tokenizer.decode(text_ids))
        return _Attempt(token_ids, avg, ratio, completion.finish_reason)

    def _accept(self, attempt: _Attempt) -> None:
        """Keeps the attempt's segments; re-seeks from the last timestamp when its last
        segment is cut off or much audio is left after it."""
        tokens, window = self.setup.tokens, self.window
        ids = [t for t in attempt.token_ids if t != tokens.end_of_text]
        last_time = _last_timestamp(ids, tokens) or 0.0  # 0.0: no timestamp
        open_tail = bool(ids) and ids[-1] < tokens.timestamp_begin and any(
            t < tokens.timestamp_begin for t in ids[_last_timestamp_index(ids, tokens) + 1:])
        segments = timed_segments(ids, tokens, window.seconds)
        reseek = (last_time > 0.0
                  and self._reseeks < _MAX_RESEEKS
                  and window.seconds - last_time > TIME_PRECISION
                  and (open_tail or window.seconds - last_time
                       >= self.setup.options.reseek_min_seconds))
        if reseek and open_tail:
            segments = [s for s in segments if s.end <= last_time]
        temperature = self.setup.temperatures[self._temperature_index]
        seek = int(round(window.file_seconds(0.0) * _FRAMES_PER_SECOND))
        for seg in segments:
            self.segments.append(LongSegment(
                window.file_seconds(seg.start), window.file_seconds(seg.end, end=True),
                seg.token_ids, seek, attempt.avg_logprob, attempt.compression_ratio,
                self._no_speech_prob, temperature, window, seg.start, seg.end))
        self._cut_off |= attempt.finish_reason == "length" and not reseek
        if reseek:
            self.window = window.after(last_time)
            self._reseeks += 1
            self._temperature_index = 0
            self._failed = []
            self._no_speech_prob = None
            self._done = self.window.num_samples == 0
        else:
            self._done = True


def _last_timestamp_index(ids: list[int], tokens: WhisperTokens) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] >= tokens.timestamp_begin:
            return i
    return -1


def _last_timestamp(ids: list[int], tokens: WhisperTokens) -> float | None:
    index = _last_timestamp_index(ids, tokens)
    return None if index < 0 else (ids[index] - tokens.timestamp_begin) * TIME_PRECISION


def _sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    if not logprobs:
        return [0.0] * len(token_ids)
    return [entry[token].logprob for token, entry in zip(token_ids, logprobs)]


def _token_prob(output: RequestOutput, token_id: int | None) -> float:
    """The probability of `token_id` at the output's first step; 0.0 when it is not among
    the returned top logprobs (then it is below the 20th likeliest token's)."""
    logprobs = output.outputs[0].logprobs
    if token_id is None or not logprobs or token_id not in logprobs[0]:
        return 0.0
    return float(np.exp(logprobs[0][token_id].logprob))


def plan_windows(waveform: np.ndarray) -> list[WindowMap]:
    """The speech of `waveform` packed into windows (none for silence)."""
    return [WindowMap(pieces) for pieces in pack_windows(waveform, speech_regions(waveform))]


def collect(decoders: list[WindowDecoder]) -> list[LongSegment]:
    """Every decoder's segments in the file's order."""
    segments = [s for d in decoders for s in d.all_segments()]
    return sorted(segments, key=lambda s: (s.start, s.end))


# ---- drivers --------------------------------------------------------------------------


async def decode_in_order(decoders: list[WindowDecoder],
                          generate: Callable[[list[EngineRequest]],
                                             Awaitable[list[RequestOutput]]]
                          ) -> AsyncGenerator[WindowDecoder, None]:
    """Each window on its own task (its attempts follow each other while every other
    window's run beside it on the engine); yields the decoders in window order, each as soon
    as it and every earlier one are final, so a stream can send window i's text while later
    windows still run. The first window to fail raises its error at once; a failure, or
    closing the generator early, cancels every window still running (and `generate` aborts
    its requests when cancelled). Use it inside `contextlib.aclosing`."""
    async def run(decoder: WindowDecoder) -> None:
        while requests := decoder.requests():
            decoder.feed(await generate(requests))

    tasks = [asyncio.ensure_future(run(decoder)) for decoder in decoders]
    try:
        for decoder, task in zip(decoders, tasks):
            while not task.done():
                await asyncio.wait([t for t in tasks if not t.done()],
                                   return_when=asyncio.FIRST_COMPLETED)
                failed = next((t for t in tasks if t.done() and not t.cancelled()
                               and t.exception() is not None), None)
                if failed is not None:
                    failed.result()  # raises the window's error
            task.result()
            yield decoder
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def decode_async(decoders: list[WindowDecoder],
                       generate: Callable[[list[EngineRequest]], Awaitable[list[RequestOutput]]]
                       ) -> None:
    """Every window decoded (see `decode_in_order`); the first failure is raised."""
    async with contextlib.aclosing(decode_in_order(decoders, generate)) as finished:
        async for _ in finished:
            pass


def decode_rounds(decoders: list[WindowDecoder],
                  generate: Callable[[list[EngineRequest]], list[RequestOutput]]) -> None:
    """Offline: one batch per round over every window still running."""
    while True:
        batches = [(d, d.requests()) for d in decoders if not d.done]
        if not batches:
            return
        outputs = iter(generate([r for _, requests in batches for r in requests]))
        for decoder, requests in batches:
            decoder.feed([next(outputs) for _ in requests])


def transcribe_offline(llm: Any, waveforms: list[np.ndarray], setup: DecodeSetup
                       ) -> list[list[LongSegment]]:
    """`vllm.LLM` over many files at once: their segments, one list per file."""
    decoders = [[WindowDecoder(w, window, setup) for window in plan_windows(w)]
                for w in waveforms]

    def generate(requests: list[EngineRequest]) -> list[RequestOutput]:
        return llm.generate([p for p, _ in requests], [s for _, s in requests],
                            use_tqdm=False)

    decode_rounds([d for file in decoders for d in file], generate)
    return [collect(file) for file in decoders]


def word_timings(aligner: Any, waveform: np.ndarray, segments: list[LongSegment],
                 setup: DecodeSetup) -> list[list[WordTiming]]:
    """Each segment's words (see word_alignment.py) in the file's clock: one alignment pass
    per decoded window; boundaries snapped to the VAD's pauses, each word kept inside its
    segment."""
    tokens = setup.tokens
    start = setup.prompt_ids.index(tokens.start_of_transcript)
    prefix = [*setup.prompt_ids[start:-1], tokens.no_timestamps]
    loud = speech_frames(waveform)
    words: list[list[WordTiming]] = [[] for _ in segments]
    index = 0
    while index < len(segments):  # the segments of one window are consecutive
        window = segments[index].window
        group = [index]
        while group[-1] + 1 < len(segments) and segments[group[-1] + 1].window is window:
            group.append(group[-1] + 1)
        index = group[-1] + 1
        text_ids = [t for i in group for t in segments[i].token_ids]
        owners = [i for i in group for _ in segments[i].token_ids]  # token -> its segment
        timings = aligner.words(window.audio(waveform), prefix, text_ids, tokens.end_of_text)
        in_file = [WordTiming(t.word, window.file_seconds(t.start),
                              window.file_seconds(t.end, end=True)) for t in timings]
        in_file = snap_to_pauses(in_file, loud, FRAME / SAMPLE_RATE)
        _, bounds = split_words(setup.tokenizer, text_ids)
        for timing, (first, _) in zip(in_file, bounds):
            seg = segments[owners[first]]
            lo = min(max(timing.start, seg.start), seg.end)
            words[owners[first]].append(WordTiming(timing.word, lo,
                                                   min(max(timing.end, lo), seg.end)))
    return words
