"""Audio files -> a mono 16 kHz waveform (speech windows: `vllm/inputs/vad.py`).

Decoding is `soundfile` (libsndfile: WAV, FLAC, OGG/Vorbis/Opus, MP3 and more), read in
blocks that are mixed down to mono and resampled with a streaming `soxr` resampler, so that
memory stays near the size of the 16 kHz result whatever the file's rate and channels. The
length in the file's header is checked against the limit before anything is decoded.
"""

from __future__ import annotations

import io
import math

import numpy as np

from vllm.inputs.audio import SAMPLE_RATE

_DECODE_BLOCK_SECONDS = 10


def decode_audio_file(data: bytes, max_seconds: float,
                      limit_name: str = "--max-audio-seconds") -> np.ndarray:
    """An audio file's bytes -> float32 mono samples at 16 kHz, [num_samples].

    Raises ValueError naming the problem: no bytes, not a decodable audio file, no samples,
    longer than `max_seconds` (named `limit_name` in the error), non-finite samples.
    """
    import soundfile

    if not data:
        raise ValueError("The audio file is empty (0 bytes).")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as file:
            rate, frames = file.samplerate, file.frames
            if rate <= 0:
                raise ValueError(f"The audio file has an invalid sample rate ({rate}).")
            if frames / rate > max_seconds:
                raise ValueError(f"The audio is {frames / rate:.1f} s long, over the limit "
                                 f"of {max_seconds:g} s ({limit_name}).")
            waveform = _read_mono_16k(file, rate, math.floor(max_seconds * rate) + 1)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        detail = getattr(e, "error_string", None) or str(e)
        raise ValueError("The file could not be decoded as audio (WAV, FLAC, OGG or MP3 "
                         f"expected): {detail}") from None
    if waveform.shape[0] == 0:
        raise ValueError("The audio has no samples (zero length).")
    if waveform.shape[0] > max_seconds * SAMPLE_RATE + 1:  # a header that understated it
        raise ValueError(f"The audio is longer than the limit of {max_seconds:g} s "
                         f"({limit_name}).")
    if not np.isfinite(waveform).all():
        raise ValueError("The audio contains non-finite samples (NaN or inf).")
    return waveform


def _read_mono_16k(file, rate: int, max_frames: int) -> np.ndarray:
    """Reads at most `max_frames` frames block by block: channel mean, then resampled."""
    import soxr

    resampler = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32") \
        if rate != SAMPLE_RATE else None
    parts: list[np.ndarray] = []
    remaining = max_frames
    while remaining > 0:
        block = file.read(min(remaining, _DECODE_BLOCK_SECONDS * rate), dtype="float32",
                          always_2d=True)  # [frames, channels]
        if block.shape[0] == 0:
            break
        remaining -= block.shape[0]
        mono = block.mean(axis=1, dtype=np.float32)
        parts.append(mono if resampler is None else resampler.resample_chunk(mono))
    if resampler is not None:
        parts.append(resampler.resample_chunk(np.zeros(0, np.float32), last=True))
    if not parts:
        return np.zeros(0, np.float32)
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)
