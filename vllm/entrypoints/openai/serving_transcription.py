"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` on Whisper models.

One upload -> decoded and split off the event loop -> one engine request per 30 s window
(run in parallel by continuous batching) -> texts joined in window order:

    file bytes ─► decode_audio_file (soundfile, mono, soxr 16 kHz) ─► split_windows
         window i ─► {"encoder_prompt": audio, "decoder_prompt": Whisper prompt} ─► AsyncLLM
    outputs in window order ─► json | text | verbose_json | srt | vtt, or SSE text deltas

`verbose_json`, `srt` and `vtt` decode with timestamp tokens (the prompt ends in `<|0.00|>`
instead of `<|notimestamps|>`) and read segments from them, as OpenAI's Whisper does;
`json`, `text` and streams decode without, like offline `LLM.generate` by default.

A multilingual model given no `language` first detects it, as Whisper does: one decoder
step over the first audible window from `<|startoftranscript|>` alone, sampled greedily
among the language tokens (the windows' requests then reuse that window's encoder output).

A stream's events are both vLLM's chunks and OpenAI's transcription events:

    {"object": "transcription.chunk", "choices": [{"delta": {"content": " Hi"}}],
     "type": "transcript.text.delta", "delta": " Hi", ...}          one per text piece
    {"object": "transcription.chunk", "choices": [...], "usage": {...},
     "type": "transcript.text.done", "text": " Hi there.", ...}     the last, then [DONE]
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

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
)
from vllm.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    ServedEngine,
    random_id,
    sse,
    stream_error,
)
from vllm.inputs.audio import SAMPLE_RATE
from vllm.inputs.audio_file import AudioWindow, decode_audio_file, is_silent, split_windows
from vllm.inputs.encoder_decoder import is_multilingual_whisper
from vllm.inputs.whisper import (
    WhisperTokens,
    decoder_prompt,
    join_texts,
    language_code,
    language_name,
    language_token_ids,
    timed_segments,
    window_prompt,
)
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import RequestStream

Task = Literal["transcribe", "translate"]
_ENDPOINTS = {"transcribe": "transcriptions", "translate": "translations"}
_TIMED_FORMATS = ("verbose_json", "srt", "vtt")
_FRAMES_PER_SECOND = 100  # Whisper's `seek` counts 10 ms mel frames


@dataclass(slots=True)
class AudioLimits:
    max_file_bytes: int = 25 * 2**20  # OpenAI's limit
    max_seconds: float = 1800.0


class DecodedUpload(NamedTuple):
    waveform: np.ndarray  # [num_samples] float32, 16 kHz mono
    windows: list[AudioWindow]
    audible: list[bool]  # per window; digital silence gets no engine request

    @property
    def duration(self) -> float:
        return self.waveform.shape[0] / SAMPLE_RATE


class Job(NamedTuple):
    """One transcription in flight: its windows and their engine streams (None for a silent
    window, which gets no request)."""

    request_id: str
    request: TranscriptionRequest
    task: Task
    language: str
    upload: DecodedUpload
    streams: list[RequestStream | None]


def decode_upload(data: bytes, max_seconds: float) -> DecodedUpload:
    waveform = decode_audio_file(data, max_seconds)
    windows = split_windows(waveform)
    return DecodedUpload(waveform, windows,
                         [not is_silent(waveform[w.start:w.end]) for w in windows])


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

    async def create_transcription(self, request: TranscriptionRequest, task: Task
                                   ) -> Any:
        """A response model, plain text, or an SSE generator; raises OpenAIError."""
        arrival = time.monotonic()
        try:
            job = await self._submit(request, task)
        except OpenAIError:
            self._record(task, False, 0.0, arrival)
            raise
        if request.stream:
            return self._stream(job, arrival)
        try:
            outputs = await self.final_outputs([s for s in job.streams if s is not None])
        except BaseException:
            self._record(task, False, 0.0, arrival)
            raise
        results = iter(outputs)
        window_outputs = [None if s is None else next(results) for s in job.streams]
        response = self._response(job, window_outputs)
        self._record(task, True, job.upload.duration, arrival)
        return response

    # ---- checks and submission ----------------------------------------------------------

    async def _submit(self, request: TranscriptionRequest, task: Task) -> Job:
        self.check_model(request.model)
        language = self._check_request(request, task)
        data = await self._read_file(request)
        loop = asyncio.get_running_loop()
        try:
            upload = await loop.run_in_executor(self._audio_pool, decode_upload, data,
                                                self.limits.max_seconds)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        request_id = random_id("trsc" if task == "transcribe" else "trsl")
        if language is None and self.is_multilingual:
            language = await self._detect_language(request_id, upload)
        previous = request.prompt.strip()
        previous_ids = (await self.tokenize(" " + previous, add_special_tokens=False)
                        if previous else [])
        prompt_ids = decoder_prompt(
            self.tokenizer, self.model_config.hf_config, language=language, task=task,
            previous_text_ids=previous_ids, max_model_len=self.max_model_len,
            timestamps=request.response_format in _TIMED_FORMATS)
        params = self._sampling_params(request, len(prompt_ids))
        prompts = [window_prompt(upload.waveform, w, prompt_ids)
                   for w, audible in zip(upload.windows, upload.audible) if audible]
        submitted = iter(await self.add_requests(request_id, prompts, params))
        streams = [next(submitted) if audible else None for audible in upload.audible]
        return Job(request_id, request, task, language or "en", upload, streams)

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
        granularities = [g for g in request.timestamp_granularities if g != "segment"]
        if granularities:
            raise OpenAIError(f"timestamp_granularities {granularities} are not supported; "
                              "segment timestamps come with response_format verbose_json.")
        try:
            return language_code(request.language, self.model_config.hf_config)
        except ValueError as e:
            raise OpenAIError(str(e)) from None

    async def _detect_language(self, request_id: str, upload: DecodedUpload) -> str:
        """The language code of the first audible window, from Whisper's language tokens
        (English when nothing is audible)."""
        first = next((w for w, audible in zip(upload.windows, upload.audible) if audible),
                     None)
        if first is None or self.tokens is None:
            return "en"
        prompt = window_prompt(upload.waveform, first, [self.tokens.start_of_transcript])
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

    def _response(self, job: Job, outputs: list[RequestOutput | None]) -> Any:
        upload, fmt = job.upload, job.request.response_format
        usage = TranscriptionUsage(seconds=int(np.ceil(upload.duration)))
        if fmt in ("json", "text"):
            text = join_texts([o.outputs[0].text if o else "" for o in outputs])
            return text if fmt == "text" else TranscriptionResponse(text=text, usage=usage)
        segments = self._segments(job, outputs)
        if fmt == "srt":
            return subtitles(segments, srt=True)
        if fmt == "vtt":
            return subtitles(segments, srt=False)
        return TranscriptionResponseVerbose(
            task=job.task, language=language_name(job.language), duration=upload.duration,
            text=join_texts([s.text for s in segments]), segments=segments, usage=usage)

    def _segments(self, job: Job, outputs: list[RequestOutput | None]
                  ) -> list[TranscriptionSegment]:
        segments: list[TranscriptionSegment] = []
        tokens = self.tokens
        assert tokens is not None  # _check_request refused the request otherwise
        for window, output in zip(job.upload.windows, outputs):
            if output is None:
                continue
            completion = output.outputs[0]
            logprobs = _sampled_logprobs(completion.token_ids, completion.logprobs)
            for seg in timed_segments(completion.token_ids, tokens, window.seconds,
                                      logprobs):
                text = self.tokenizer.decode(seg.token_ids)
                segments.append(TranscriptionSegment(
                    id=len(segments), seek=window.start * _FRAMES_PER_SECOND // SAMPLE_RATE,
                    start=round(window.start_seconds + seg.start, 3),
                    end=round(window.start_seconds + seg.end, 3), text=text,
                    tokens=seg.token_ids, temperature=job.request.temperature,
                    avg_logprob=float(np.mean(seg.logprobs)),
                    compression_ratio=compression_ratio(text), no_speech_prob=0.0))
        return segments

    async def _stream(self, job: Job, arrival: float) -> AsyncGenerator[str, None]:
        """Text deltas in window order: window i streams live while later windows' outputs
        wait in their own queues; a disconnect aborts every unfinished window. The last
        event has the whole text (and the usage when asked for)."""
        request = job.request
        streams = [s for s in job.streams if s is not None]
        events = _StreamEvents(job.request_id, self.model_name,
                               "transcription.chunk" if job.task == "transcribe"
                               else "translation.chunk", request.stream_continuous_usage_stats)
        last_char, finish_reason, stop_reason, ok = "", "stop", None, False
        try:
            if not streams:  # only silence: one empty, finished delta
                yield events.delta("", finish_reason, None)
            for index, stream in enumerate(streams):
                first_output, window_start = True, True
                async for output in self.engine.iterate(stream):
                    completion = output.outputs[0]
                    text = completion.text
                    if first_output:
                        events.prompt_tokens += output.num_prompt_tokens
                        first_output = False
                    if window_start and text:  # the boundary between two windows' texts
                        text = join_texts([last_char, text])[len(last_char):]
                        window_start = False
                    last_char = (last_char + text)[-1:]
                    events.completion_tokens += len(completion.token_ids)
                    if output.finished and completion.finish_reason == "length":
                        finish_reason = "length"
                    done = output.finished and index == len(streams) - 1
                    if done and finish_reason == "stop":
                        stop_reason = completion.stop_reason
                    if text or done:
                        yield events.delta(text, finish_reason if done else None,
                                           stop_reason if done else None)
            yield events.done(finish_reason, stop_reason, request.stream_include_usage)
            ok = True
        except Exception as e:
            yield sse(stream_error(e))
        finally:
            unfinished = [s.request_id for s in streams if not s.finished]
            if unfinished:
                self.engine.abort_nowait(unfinished)
            self._record(job.task, ok, job.upload.duration if ok else 0.0, arrival)
        yield "data: [DONE]\n\n"


class _StreamEvents:
    """Builds one stream's SSE events and keeps its text and token counts."""

    def __init__(self, request_id: str, model: str,
                 kind: Literal["transcription.chunk", "translation.chunk"],
                 continuous_usage: bool) -> None:
        self.request_id, self.model = request_id, model
        self.kind: Literal["transcription.chunk", "translation.chunk"] = kind
        self.continuous_usage = continuous_usage
        self.text = ""
        self.prompt_tokens = 0  # the windows' decoder prompts
        self.completion_tokens = 0

    def usage(self) -> TranscriptionStreamUsage:
        return TranscriptionStreamUsage.of(self.prompt_tokens, self.completion_tokens)

    def delta(self, text: str, finish_reason: str | None, stop_reason: int | str | None
              ) -> str:
        self.text += text
        choice = TranscriptionStreamChoice(delta=DeltaMessage(content=text),
                                           finish_reason=finish_reason,
                                           stop_reason=stop_reason)
        return sse(TranscriptionTextDelta(
            id=self.request_id, object=self.kind, model=self.model, choices=[choice],
            delta=text, usage=self.usage() if self.continuous_usage else None))

    def done(self, finish_reason: str, stop_reason: int | str | None, include_usage: bool
             ) -> str:
        """vLLM's usage chunk (no choices) when the usage was asked for; otherwise a
        chunk whose one choice adds no text, so readers of `choices[0]` need no check."""
        choices = [] if include_usage else [TranscriptionStreamChoice(
            delta=DeltaMessage(content=""), finish_reason=finish_reason,
            stop_reason=stop_reason)]
        usage = self.usage() if include_usage or self.continuous_usage else None
        return sse(TranscriptionTextDone(id=self.request_id, object=self.kind,
                                         model=self.model, choices=choices, text=self.text,
                                         usage=usage))


def _sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    if not logprobs:
        return [0.0] * len(token_ids)
    return [entry[token].logprob for token, entry in zip(token_ids, logprobs)]


def compression_ratio(text: str) -> float:
    """Whisper's repetition measure: text bytes over their zlib-compressed size."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


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
