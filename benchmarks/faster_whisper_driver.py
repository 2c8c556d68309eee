"""faster-whisper on a directory of 16 kHz mono 16-bit WAV clips; run by
benchmark_transcription.py in faster-whisper's own environment (numpy, faster_whisper and the
standard library only).

    FW_PYTHON faster_whisper_driver.py MODEL_DIR CLIP_DIR MODE [MODE ...] --threads 2

MODE is `sequential:COMPUTE_TYPE` (`WhisperModel.transcribe`, one clip after another) or
`batched:COMPUTE_TYPE:BATCH` (`BatchedInferencePipeline` over all clips at once: they are
joined into one array and each clip is one chunk, given as `clip_timestamps`). Decoding is
greedy (`beam_size=1`, temperature 0 only), without timestamps, without VAD or conditioning on
previous text: the same work as this engine's `json` transcription.

Long-form modes run faster-whisper's own long-audio defaults, file after file:
`long:COMPUTE_TYPE:BEAM` (`WhisperModel.transcribe`: timestamps, temperature fallback,
conditioning on previous text, no VAD) and `longbatched:COMPUTE_TYPE:BATCH`
(`BatchedInferencePipeline.transcribe`: Silero VAD chunks decoded in batches).

Prints one JSON line: {MODE: {"seconds": wall time, "texts": [one per clip]}}, the
fastest of `--repeats` timed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import wave

import numpy as np

RATE = 16_000
GREEDY = dict(beam_size=1, temperature=0.0, without_timestamps=True, vad_filter=False,
              condition_on_previous_text=False)


def read_clips(clip_dir: str) -> list[np.ndarray]:
    clips = []
    for name in sorted(os.listdir(clip_dir)):
        with wave.open(os.path.join(clip_dir, name)) as file:
            assert (file.getnchannels(), file.getframerate()) == (1, RATE)
            raw = file.readframes(file.getnframes())
        clips.append(np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0)
    return clips


def sequential(model, clips: list[np.ndarray]) -> list[str]:
    texts = []
    for clip in clips:
        segments, _ = model.transcribe(clip, language="en", **GREEDY)
        texts.append("".join(s.text for s in segments))
    return texts


def batched(model, clips: list[np.ndarray], batch_size: int) -> list[str]:
    from faster_whisper import BatchedInferencePipeline

    pipeline = BatchedInferencePipeline(model)
    bounds = np.cumsum([0] + [len(c) for c in clips])
    spans = [{"start": bounds[i] / RATE, "end": bounds[i + 1] / RATE}
             for i in range(len(clips))]
    options = {k: v for k, v in GREEDY.items() if k != "condition_on_previous_text"}
    segments, _ = pipeline.transcribe(np.concatenate(clips), language="en",
                                      clip_timestamps=spans, batch_size=batch_size, **options)
    texts = [""] * len(clips)
    for segment in segments:  # the clip its start lies in (start is rounded to 1 ms)
        index = int(np.searchsorted(bounds, segment.start * RATE + RATE // 100)) - 1
        texts[max(index, 0)] += segment.text
    return texts


def long_form(model, clips: list[np.ndarray], beam_size: int) -> list[str]:
    texts = []
    for clip in clips:
        segments, _ = model.transcribe(clip, language="en", beam_size=beam_size)
        texts.append("".join(s.text for s in segments))
    return texts


def long_form_batched(model, clips: list[np.ndarray], batch_size: int) -> list[str]:
    from faster_whisper import BatchedInferencePipeline

    pipeline = BatchedInferencePipeline(model)
    texts = []
    for clip in clips:
        segments, _ = pipeline.transcribe(clip, language="en", batch_size=batch_size)
        texts.append("".join(s.text for s in segments))
    return texts


def run(model, kind: str, rest: list[str], clips: list[np.ndarray]) -> list[str]:
    if kind == "long":
        return long_form(model, clips, int(rest[0]))
    if kind == "longbatched":
        return long_form_batched(model, clips, int(rest[0]))
    return sequential(model, clips) if kind == "sequential" else \
        batched(model, clips, int(rest[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("clip_dir")
    parser.add_argument("modes", nargs="+")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from faster_whisper import WhisperModel

    clips = read_clips(args.clip_dir)
    results = {}
    for mode in args.modes:
        kind, compute_type, *rest = mode.split(":")
        model = WhisperModel(args.model_dir, device="cpu", compute_type=compute_type,
                             cpu_threads=args.threads)
        warm_up = [c[:30 * RATE] for c in clips[:2]] if kind.startswith("long") else clips[:2]
        run(model, kind, rest, warm_up)
        for _ in range(args.repeats):  # the fastest run is reported
            start = time.perf_counter()
            texts = run(model, kind, rest, clips)
            seconds = time.perf_counter() - start
            if mode not in results or seconds < results[mode]["seconds"]:
                results[mode] = {"seconds": seconds, "texts": texts}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
