"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` on Whisper models.

Every request, streamed or not, goes through the long-form pipeline
(vllm/entrypoints/longform.py):

    file bytes ─► decode_audio_file ─► VAD speech windows (≤ 30 s, silences left out)
         every window ─► WindowDecoder (timestamps, no-speech probe, fallback, re-seek) ─► AsyncLLM
    segments in the file's clock ─► json | text | verbose_json (+ words) | srt | vtt
                                 or ─► a stream: each window's segments as soon as it and
                                       every earlier window are final (`decode_in_order`)

A stream sends no text before its window is final: a window's text can still change (a
failed attempt is decoded again at a higher temperature, or split), and sent text is never
taken back. So the first text arrives when the first window is done, not token by token.

A multilingual model given no `language` first detects it, as Whisper does: one decoder
step over the first speech window from `<|startoftranscript|>` alone, sampled greedily
among the language tokens (the windows' requests then reuse that window's encoder output).

A stream's events are both vLLM's chunks and OpenAI's transcription events:

    {"object": "transcription.chunk", "choices": [{"delta": {"content": " Hi"}}],
     "type": "transcript.text.delta", "delta": " Hi", ...}          one per text piece
    {"object": "transcription.chunk", "choices": [...], "usage": {...},
     "type": "transcript.text.done", "text": " Hi there.", ...}     the last, then [DONE]
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.longform import (
    DecodeSetup,
    EngineRequest,
    LongSegment,
    WindowDecoder,
    collect,
    decode_async,
    decode_in_order,
    make_setup,
    plan_windows,
    word_timings,
)
from vllm.entrypoints.openai.protocol import (
    DeltaMessage,
    TranscriptionRequest,
    TranscriptionResponse,
    TranscriptionResponseVerbose,
    TranscriptionSegment,
    TranscriptionStreamChoice,
    TranscriptionStreamUsage,
    TranscriptionTextDelta,
    TranscriptionTextDone,
    TranscriptionUsage,
    TranscriptionWord,
)
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServedEngine,
    random_id,
    sse,
    stream_error,
)
from vllm.entrypoints.word_alignment import WhisperAligner
from vllm.inputs.audio import SAMPLE_RATE
from vllm.inputs.audio_file import decode_audio_file
from vllm.inputs.encoder_decoder import is_multilingual_whisper
from vllm.inputs.vad import WindowMap
from vllm.inputs.whisper import (
    WhisperTokens,
    decoder_prompt,
    join_texts,
    language_code,
    language_name,
    language_token_ids,
)
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

Task = Literal["transcribe", "translate"]
_ENDPOINTS = {"transcribe": "transcriptions", "translate": "translations"}
_TIMED_FORMATS = ("verbose_json", "srt", "vtt")


@dataclass(slots=True)
class AudioLimits:
    max_file_bytes: int = 25 * 2**20  # OpenAI's limit
    max_seconds: float = 1800.0


@dataclass(slots=True)
class Job:
    """One transcription in flight: its speech windows' decoders and what its engine
    requests have used so far (the stream's token usage)."""

    request_id: str
    request: TranscriptionRequest
    task: Task
    language: str
    waveform: np.ndarray  # [num_samples] float32, 16 kHz mono
    setup: DecodeSetup
    decoders: list[WindowDecoder]
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def duration(self) -> float:
        return self.waveform.shape[0] / SAMPLE_RATE


def _decode_and_plan(data: bytes, max_seconds: float) -> tuple[np.ndarray, list[WindowMap]]:
    waveform = decode_audio_file(data, max_seconds)
    return waveform, plan_windows(waveform)


class OpenAIServingTranscription(OpenAIServing):
    """Audio uploads -> Whisper requests on the shared engine; answers in OpenAI's formats."""

    def __init__(self, engine: ServedEngine, served_model_names: list[str],
                 limits: AudioLimits | None = None, metrics: Any = None) -> None:
        super().__init__(engine, served_model_names)
        self.limits = limits or AudioLimits()
        self.metrics = metrics  # PrometheusStatLogger or None
        hf_config = self.model_config.hf_config
        self.is_whisper = getattr(hf_config, "model_type", None) == "whisper"
        self.is_multilingual = self.is_whisper and is_multilingual_whisper(hf_config)
        self.tokens = (WhisperTokens.from_tokenizer(self.tokenizer)
                       if self.is_whisper and self.tokenizer is not None else None)
        # Language token id -> code, for detecting the language of multilingual models.
        self.language_ids = (language_token_ids(self.tokenizer, hf_config.vocab_size)
                             if self.is_multilingual and self.tokens is not None else {})
        self._audio_pool = ThreadPoolExecutor(2, thread_name_prefix="audio-decode")
        self._aligner: WhisperAligner | None = None  # for word timestamps, loaded on first use
        self._aligner_lock = asyncio.Lock()

    async def create_transcription(self, request: TranscriptionRequest, task: Task
                                   ) -> Any:
        """A response model, plain text, or an SSE generator; raises OpenAIError."""
        arrival = time.monotonic()
        try:
            job = await self._start(request, task)
        except BaseException:
            self._record(task, False, 0.0, arrival)
            raise
        if request.stream:
            return self._stream(job, arrival)
        return await self._answer(job, arrival)

    async def _start(self, request: TranscriptionRequest, task: Task) -> Job:
        """Checks the request, decodes the upload and plans its speech windows (VAD), and
        detects the language when it is needed and not given; nothing is decoded yet."""
        self.check_model(request.model)
        language = self._check_request(request, task)
        data = await self._read_file(request)
        loop = asyncio.get_running_loop()
        try:
            waveform, windows = await loop.run_in_executor(
                self._audio_pool, _decode_and_plan, data, self.limits.max_seconds)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        request_id = random_id("trsc" if task == "transcribe" else "trsl")
        if language is None and self.is_multilingual:
            language = await self._detect_language(
                request_id, windows[0].audio(waveform) if windows else None)
        setup = await self._long_form_setup(request, task, language)
        decoders = [WindowDecoder(waveform, w, setup) for w in windows]
        return Job(request_id, request, task, language or "en", waveform, setup, decoders)

    def _generate(self, job: Job
                  ) -> Callable[[list[EngineRequest]], Awaitable[list[RequestOutput]]]:
        """The long-form pipeline's engine call for `job`: its requests on the shared engine,
        their finished outputs (aborted if cancelled), their tokens added to the job's."""
        numbers = itertools.count()

        async def generate(requests: list[EngineRequest]) -> list[RequestOutput]:
            streams = [(await self.add_requests(f"{job.request_id}-{next(numbers)}",
                                                [prompt], params))[0]
                       for prompt, params in requests]
            outputs = await self.final_outputs(streams)
            for output in outputs:
                job.prompt_tokens += output.num_prompt_tokens
                job.completion_tokens += len(output.outputs[0].token_ids)
            return outputs

        return generate

    async def _answer(self, job: Job, arrival: float) -> Any:
        """The whole file through the long-form pipeline (vllm/entrypoints/longform.py):
        speech windows of this and every other request share the engine."""
        ok = False
        try:
            await decode_async(job.decoders, self._generate(job))
            segments = collect(job.decoders)
            words = (await self._word_timings(job.waveform, segments, job.setup)
                     if "word" in job.request.timestamp_granularities else None)
            response = self._long_form_response(job.request, job.task, job.language,
                                                job.duration, segments, words)
            ok = True
            return response
        finally:
            self._record(job.task, ok, job.duration if ok else 0.0, arrival)

    async def _long_form_setup(self, request: TranscriptionRequest, task: Task,
                               language: str | None) -> DecodeSetup:
        previous = request.prompt.strip()
        previous_ids = (await self.tokenize(" " + previous, add_special_tokens=False)
                        if previous else [])
        prompt_ids = decoder_prompt(
            self.tokenizer, self.model_config.hf_config, language=language, task=task,
            previous_text_ids=previous_ids, max_model_len=self.max_model_len, timestamps=True)
        # json and text answers show no no_speech_prob: windows are probed only where the
        # no-speech rule needs it (see longform.DecodeSetup.report_no_speech).
        return make_setup(self.tokenizer, prompt_ids,
                          self._sampling_params(request, len(prompt_ids)),
                          report_no_speech=request.response_format not in ("json", "text"))

    # ---- checks ---------------------------------------------------------------------

    def _check_request(self, request: TranscriptionRequest, task: Task) -> str | None:
        """Everything that needs no audio; returns the language code (None: not given)."""
        if not self.is_whisper:
            raise OpenAIError(f"The model `{self.model_name}` is not a speech-to-text model: "
                              "the audio endpoints need a Whisper model.", "NotFoundError",
                              404)
        if self.tokens is None:
            raise OpenAIError("The audio endpoints need the tokenizer (skip_tokenizer_init "
                              "is set).")
        if task == "translate" and not self.is_multilingual:
            raise OpenAIError(f"The model `{self.model_name}` is English-only (a .en Whisper "
                              "model): it cannot translate. Use /v1/audio/transcriptions, or "
                              "serve a multilingual Whisper model.")
        for option in ("stream_include_usage", "stream_continuous_usage_stats"):
            if getattr(request, option) and not request.stream:
                raise OpenAIError(f"{option} can only be given with stream=true.")
        if request.max_completion_tokens is not None and request.max_completion_tokens < 1:
            raise OpenAIError("max_completion_tokens must be at least 1, got "
                              f"{request.max_completion_tokens}.")
        if request.stream and request.response_format not in ("json", "text"):
            raise OpenAIError("stream is supported with response_format json or text, not "
                              f"{request.response_format}.")
        unknown = [g for g in request.timestamp_granularities if g not in ("segment", "word")]
        if unknown:
            raise OpenAIError(f"timestamp_granularities {unknown} are not supported: give "
                              "'segment' and/or 'word'.")
        if request.timestamp_granularities and request.response_format != "verbose_json":
            raise OpenAIError("timestamp_granularities need response_format verbose_json, "
                              f"not {request.response_format}.")
        try:
            return language_code(request.language, self.model_config.hf_config)
        except ValueError as e:
            raise OpenAIError(str(e)) from None

    async def _detect_language(self, request_id: str, audio: np.ndarray | None) -> str:
        """The language code of `audio` (the first speech window), from Whisper's language
        tokens (English when nothing is audible)."""
        if audio is None or self.tokens is None:
            return "en"
        prompt = {"encoder_prompt": {"prompt": "",
                                     "multi_modal_data": {"audio": (audio, SAMPLE_RATE)}},
                  "decoder_prompt": {"prompt_token_ids": [self.tokens.start_of_transcript]}}
        params = SamplingParams(temperature=0.0, max_tokens=1,
                                allowed_token_ids=list(self.language_ids),
                                output_kind=RequestOutputKind.FINAL_ONLY)
        streams = await self.add_requests(f"{request_id}-language", [prompt], params)
        (output,) = await self.final_outputs(streams)
        return self.language_ids[output.outputs[0].token_ids[0]]

    async def _read_file(self, request: TranscriptionRequest) -> bytes:
        """The upload's bytes; its size is checked first, so nothing too large is decoded."""
        limit = self.limits.max_file_bytes
        upload = request.file
        if upload.size is not None and upload.size > limit:
            raise OpenAIError(f"The audio file is {upload.size} bytes, over the limit of "
                              f"{limit} bytes (--max-audio-file-size).")
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise OpenAIError(f"The audio file is over the limit of {limit} bytes "
                              "(--max-audio-file-size).")
        if not data:
            raise OpenAIError("The audio file is empty (0 bytes).")
        return data

    def _sampling_params(self, request: TranscriptionRequest, num_prompt_tokens: int):
        # Whisper's own cap on the sampled length of a window: half the decoder context;
        # a larger max_completion_tokens is capped at what the context has room for.
        room = self.max_model_len - num_prompt_tokens
        max_tokens = min(request.max_completion_tokens or self.max_model_len // 2, room)
        logprobs = 0 if request.response_format == "verbose_json" else None
        try:
            return request.to_sampling_params(max(max_tokens, 1), logprobs)
        except ValueError as e:
            raise OpenAIError(str(e)) from None

    def _record(self, task: Task, ok: bool, audio_seconds: float, arrival: float) -> None:
        if self.metrics is not None:
            self.metrics.record_audio_request(_ENDPOINTS[task], ok, audio_seconds,
                                              time.monotonic() - arrival)

    # ---- answers --------------------------------------------------------------------

    async def _word_timings(self, waveform: np.ndarray, segments: list[LongSegment],
                            setup: DecodeSetup) -> list[TranscriptionWord]:
        """Word timings from a second pass (word_alignment.py) off the event loop; its model
        is loaded on the first request that asks for words."""
        loop = asyncio.get_running_loop()
        async with self._aligner_lock:
            if self._aligner is None:
                self._aligner = await loop.run_in_executor(
                    self._audio_pool, WhisperAligner.from_model_dir, self.model_config.model,
                    self.tokenizer)
        per_segment = await loop.run_in_executor(self._audio_pool, word_timings,
                                                 self._aligner, waveform, segments, setup)
        return [TranscriptionWord(word=w.word.strip(), start=round(w.start, 3),
                                  end=round(w.end, 3)) for ws in per_segment for w in ws]

    def _long_form_response(self, request: TranscriptionRequest, task: Task, language: str,
                            duration: float, segments: list[LongSegment],
                            words: list[TranscriptionWord] | None) -> Any:
        fmt = request.response_format
        texts = [self.tokenizer.decode(s.token_ids) for s in segments]
        usage = TranscriptionUsage(seconds=int(np.ceil(duration)))
        if fmt in ("json", "text"):
            text = join_texts(texts)
            return text if fmt == "text" else TranscriptionResponse(text=text, usage=usage)
        answer = []
        for i, (s, text) in enumerate(zip(segments, texts)):
            assert s.no_speech_prob is not None  # timed formats probe every window
            answer.append(TranscriptionSegment(
                id=i, seek=s.seek, start=round(s.start, 3), end=round(s.end, 3), text=text,
                tokens=s.token_ids, temperature=s.temperature, avg_logprob=s.avg_logprob,
                compression_ratio=s.compression_ratio, no_speech_prob=s.no_speech_prob))
        if fmt == "srt":
            return subtitles(answer, srt=True)
        if fmt == "vtt":
            return subtitles(answer, srt=False)
        return TranscriptionResponseVerbose(
            task=task, language=language_name(language), duration=duration,
            text=join_texts(texts), segments=answer, words=words, usage=usage)

    async def _stream(self, job: Job, arrival: float) -> AsyncGenerator[str, None]:
        """The long-form pipeline's text in window order: every window decodes at once, and
        each one's segments are sent as soon as it and every earlier window are final (after
        their re-seeks, splits and fallbacks, so no sent text is ever taken back). A
        disconnect aborts every unfinished window. The last delta carries the finish reason;
        the done event has the whole text (and the usage when asked for)."""
        request = job.request
        events = _StreamEvents(job.request_id, self.model_name,
                               "transcription.chunk" if job.task == "transcribe"
                               else "translation.chunk", request.stream_continuous_usage_stats,
                               job)
        finish_reason, ok = "stop", False
        try:
            async with contextlib.aclosing(
                    decode_in_order(job.decoders, self._generate(job))) as finished:
                index = -1
                async for decoder in finished:
                    index += 1
                    if decoder.cut_off():
                        finish_reason = "length"
                    last = index == len(job.decoders) - 1
                    pieces = stream_pieces(events.text, [self.tokenizer.decode(s.token_ids)
                                                         for s in collect([decoder])])
                    if last and not pieces:
                        pieces = [""]  # the finishing delta has no text of its own
                    for i, piece in enumerate(pieces):
                        done = last and i == len(pieces) - 1
                        yield events.delta(piece, finish_reason if done else None)
            if not job.decoders:  # only silence: one empty, finished delta
                yield events.delta("", finish_reason)
            yield events.done(finish_reason, request.stream_include_usage)
            ok = True
        except Exception as e:
            yield sse(stream_error(e))
        finally:
            self._record(job.task, ok, job.duration if ok else 0.0, arrival)
        yield "data: [DONE]\n\n"


class _StreamEvents:
    """Builds one stream's SSE events and keeps its text; the token counts are the job's
    (every engine request so far: the windows' attempts and no-speech probes)."""

    def __init__(self, request_id: str, model: str,
                 kind: Literal["transcription.chunk", "translation.chunk"],
                 continuous_usage: bool, job: Job) -> None:
        self.request_id, self.model = request_id, model
        self.kind: Literal["transcription.chunk", "translation.chunk"] = kind
        self.continuous_usage = continuous_usage
        self.job = job
        self.text = ""

    def usage(self) -> TranscriptionStreamUsage:
        return TranscriptionStreamUsage.of(self.job.prompt_tokens, self.job.completion_tokens)

    def delta(self, text: str, finish_reason: str | None) -> str:
        self.text += text
        choice = TranscriptionStreamChoice(delta=DeltaMessage(content=text),
                                           finish_reason=finish_reason)
        return sse(TranscriptionTextDelta(
            id=self.request_id, object=self.kind, model=self.model, choices=[choice],
            delta=text, usage=self.usage() if self.continuous_usage else None))

    def done(self, finish_reason: str, include_usage: bool) -> str:
        """vLLM's usage chunk (no choices) when the usage was asked for; otherwise a
        chunk whose one choice adds no text, so readers of `choices[0]` need no check."""
        choices = [] if include_usage else [TranscriptionStreamChoice(
            delta=DeltaMessage(content=""), finish_reason=finish_reason)]
        usage = self.usage() if include_usage or self.continuous_usage else None
        return sse(TranscriptionTextDone(id=self.request_id, object=self.kind,
                                         model=self.model, choices=choices, text=self.text,
                                         usage=usage))


def stream_pieces(sent: str, texts: list[str]) -> list[str]:
    """The non-empty `texts` (segments) as they continue the `sent` text, with `join_texts`'
    space rule, so that a stream's deltas add up to the non-streamed text. Example: sent
    " Hi.", texts ["Bye.", "", " Go."] -> [" Bye.", " Go."]."""
    pieces, tail = [], sent[-1:]
    for text in texts:
        piece = join_texts([tail, text])[len(tail):]
        if piece:
            pieces.append(piece)
            tail = piece[-1]
    return pieces


def subtitles(segments: list[TranscriptionSegment], srt: bool) -> str:
    """SRT (numbered cues, `00:00:01,500`) or WebVTT (`WEBVTT` header, `00:00:01.500`)."""
    lines = [] if srt else ["WEBVTT", ""]
    for number, seg in enumerate(segments, start=1):
        if srt:
            lines.append(str(number))
        start, end = _clock(seg.start, srt), _clock(seg.end, srt)
        lines += [f"{start} --> {end}", seg.text.strip(), ""]
    return "\n".join(lines) + ("\n" if lines else "")


def _clock(seconds: float, srt: bool) -> str:
    millis = int(round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{',' if srt else '.'}{millis:03d}"
