"""Audio files -> a mono 16 kHz waveform, and long audio -> Whisper windows cut at quiet points.

Decoding is `soundfile` (libsndfile: WAV, FLAC, OGG/Vorbis/Opus, MP3 and more), read in
blocks that are mixed down to mono and resampled with a streaming `soxr` resampler, so that
memory stays near the size of the 16 kHz result whatever the file's rate and channels. The
length in the file's header is checked against the limit before anything is decoded.

Splitting (audio longer than one 30 s window): each cut is at the quietest 100 ms of the
last `SPLIT_SEARCH_SECONDS` before the window's end::

    |<--------------- 30 s window --------------->|
    |                              |<- search 5 s ->|
    start                          quietest 100 ms: cut at its centre, next window starts there
"""

from __future__ import annotations

import io
import math
from typing import NamedTuple

import numpy as np

from vllm.inputs.audio import MAX_AUDIO_SECONDS, SAMPLE_RATE

WINDOW_SAMPLES = int(MAX_AUDIO_SECONDS * SAMPLE_RATE)  # 480_000
SPLIT_SEARCH_SECONDS = 5.0
_ENERGY_FRAME = SAMPLE_RATE // 10  # 100 ms: the stretch whose energy is compared
_ENERGY_HOP = SAMPLE_RATE // 100  # 10 ms between compared stretches
_DECODE_BLOCK_SECONDS = 10
# A window whose samples all stay below this is digital silence: nothing to transcribe.
SILENCE_PEAK = 1e-4


class AudioWindow(NamedTuple):
    start: int  # first sample, at 16 kHz
    end: int  # one past the last sample

    @property
    def start_seconds(self) -> float:
        return self.start / SAMPLE_RATE

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / SAMPLE_RATE


def decode_audio_file(data: bytes, max_seconds: float) -> np.ndarray:
    """An audio file's bytes -> float32 mono samples at 16 kHz, [num_samples].

    Raises ValueError naming the problem: no bytes, not a decodable audio file, no samples,
    longer than `max_seconds`, non-finite samples.
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
                                 f"of {max_seconds:g} s (--max-audio-seconds).")
            waveform = _read_mono_16k(file, rate, math.floor(max_seconds * rate) + 1)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        detail = getattr(e, "error_string", None) or str(e)
        raise ValueError("The file could not be decoded as audio (WAV, FLAC, OGG or MP3 "
                         f"expected): {detail}") from None
    if waveform.shape[0] == 0:
        raise ValueError("The audio has no samples (zero length).")
    if waveform.shape[0] > max_seconds * SAMPLE_RATE + 1:  # a header that understated it
        raise ValueError(f"The audio is longer than the limit of {max_seconds:g} s "
                         "(--max-audio-seconds).")
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


def split_windows(waveform: np.ndarray, window: int = WINDOW_SAMPLES,
                  search: int = int(SPLIT_SEARCH_SECONDS * SAMPLE_RATE)) -> list[AudioWindow]:
    """Windows of at most `window` samples covering `waveform` in order, each cut at the
    quietest point of the last `search` samples before its end.

    Example (window 30 s, search 5 s): 70 s of speech with pauses near 27 s and 55 s ->
    [(0, 27.x s), (27.x s, 55.x s), (55.x s, 70 s)].
    """
    windows = []
    start, total = 0, waveform.shape[0]
    while total - start > window:
        cut = quietest_point(waveform, start + window - search, start + window)
        windows.append(AudioWindow(start, cut))
        start = cut
    windows.append(AudioWindow(start, total))
    return windows


def quietest_point(waveform: np.ndarray, lo: int, hi: int) -> int:
    """The centre of the 100 ms stretch in [lo, hi) with the least energy (the earliest one
    on ties); every candidate stretch lies inside [lo, hi), so the cut is in (lo, hi).

    Energies come from one cumulative sum: energy(s) = cumsum[s + frame] - cumsum[s]. With
    lo = 0, hi = 4000, frame 1600, hop 160: stretches start at 0, 160, ..., 2400.
    """
    segment = waveform[lo:hi].astype(np.float64)
    cumsum = np.concatenate([[0.0], np.cumsum(segment * segment)])
    starts = np.arange(0, hi - lo - _ENERGY_FRAME + 1, _ENERGY_HOP)
    energy = cumsum[starts + _ENERGY_FRAME] - cumsum[starts]
    return lo + int(starts[int(np.argmin(energy))]) + _ENERGY_FRAME // 2


def is_silent(samples: np.ndarray) -> bool:
    return samples.shape[0] == 0 or float(np.abs(samples).max()) < SILENCE_PEAK
