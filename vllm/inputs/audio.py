"""Audio in (a waveform and its sample rate) -> Whisper's log-mel features.

Checked here, before anything reaches the engine core: the shape (mono, or channels mixed
down), a float or integer sample type, finite values, a positive sample rate, and a length
of at most one 30 s window. Other rates are resampled to 16 kHz with soxr.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

SAMPLE_RATE = 16_000
MAX_AUDIO_SECONDS = 30.0


def load_feature_extractor(model_dir: str, num_mel_bins: int) -> Any:
    """The model's `WhisperFeatureExtractor`: from preprocessor_config.json when the
    directory has one, else the standard one for `num_mel_bins` (16 kHz, 30 s windows)."""
    import os

    from transformers import WhisperFeatureExtractor

    if os.path.isfile(os.path.join(model_dir, "preprocessor_config.json")):
        return WhisperFeatureExtractor.from_pretrained(model_dir, local_files_only=True)
    return WhisperFeatureExtractor(feature_size=num_mel_bins)


def waveform_from_audio(audio: Any, target_rate: int = SAMPLE_RATE,
                        max_seconds: float = MAX_AUDIO_SECONDS) -> np.ndarray:
    """`(waveform, sample_rate)` (vLLM's form) -> a float32 mono waveform at `target_rate`
    (16 kHz: Whisper's and Qwen2-Audio's), at most `max_seconds` long."""
    if not isinstance(audio, (tuple, list)) or len(audio) != 2:
        raise ValueError("audio must be a (waveform, sample_rate) pair, got "
                         f"{type(audio).__name__}.")
    waveform, sample_rate = audio
    if isinstance(waveform, torch.Tensor):
        waveform = waveform.detach().cpu().numpy()
    if not isinstance(waveform, np.ndarray):
        raise ValueError("The audio waveform must be a numpy array or torch tensor, got "
                         f"{type(waveform).__name__}.")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) \
            or not sample_rate > 0:
        raise ValueError(f"The audio sample rate must be a positive number, got "
                         f"{sample_rate!r}.")
    waveform = _to_mono_float(waveform)
    seconds = waveform.shape[0] / sample_rate
    if seconds > max_seconds:
        raise ValueError(f"The audio is {seconds:.1f} s long; one clip takes at most "
                         f"{max_seconds:g} s (one window of the model's feature extractor). "
                         "Split it.")
    if sample_rate != target_rate:
        import soxr

        waveform = soxr.resample(waveform, sample_rate, target_rate).astype(np.float32)
    return waveform


def _to_mono_float(waveform: np.ndarray) -> np.ndarray:
    if waveform.ndim == 2:
        # [channels, samples] or [samples, channels]: the shorter axis is the channels.
        channel_axis = 0 if waveform.shape[0] <= waveform.shape[1] else 1
        if waveform.shape[channel_axis] > 8:
            raise ValueError(f"The audio waveform has shape {waveform.shape}: expected "
                             "[num_samples] or [num_channels, num_samples].")
        waveform = waveform.astype(np.float32).mean(axis=channel_axis)
    if waveform.ndim != 1:
        raise ValueError(f"The audio waveform must be 1-D [num_samples] (or 2-D with "
                         f"channels), got shape {waveform.shape}.")
    if waveform.shape[0] == 0:
        raise ValueError("The audio waveform is empty: it has 0 samples.")
    if np.issubdtype(waveform.dtype, np.integer):
        waveform = waveform.astype(np.float32) / np.iinfo(waveform.dtype).max
    elif not np.issubdtype(waveform.dtype, np.floating):
        raise ValueError(f"The audio waveform must hold float or integer samples, got "
                         f"{waveform.dtype}.")
    waveform = np.ascontiguousarray(waveform, dtype=np.float32)
    if not np.isfinite(waveform).all():
        raise ValueError("The audio waveform contains non-finite values (NaN or inf).")
    return waveform


def audio_to_features(audio: Any, feature_extractor: Any) -> torch.Tensor:
    """Log-mel features of one 30 s window: [num_mel_bins, 3000] float32."""
    waveform = waveform_from_audio(audio)
    features = feature_extractor(waveform, sampling_rate=SAMPLE_RATE,
                                 return_tensors="np").input_features[0]
    return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
