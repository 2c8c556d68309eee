"""Audio clips in prompts (Qwen2-Audio): a clip -> its log-mel features, as the model's own
`WhisperFeatureExtractor` (its preprocessor_config.json) computes them when transformers'
Qwen2AudioProcessor calls it: the clip padded to the extractor's window (30 s), features of
the whole window, and the clip's frame count from the attention mask.

A clip is `(waveform, sample_rate)` (vLLM's form; resampled where the rate differs from the
extractor's), a bare waveform at the extractor's rate, or the bytes of an audio file (WAV,
FLAC, OGG, MP3; decoded with the length checked from the header first).

Only the clip's frames and the two after it (which the encoder's convolution stem reads)
are kept. Example: 1 s at 16 kHz -> 100 frames of the 3,000 -> features [128, 102].
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from vllm.inputs.audio import SAMPLE_RATE, load_feature_extractor, waveform_from_audio
from vllm.inputs.audio_file import decode_audio_file

# The most bytes of one encoded audio file (OpenAI's upload limit).
MAX_AUDIO_BYTES = 25 * 1024**2
# Frames past a clip that the encoder's convolution stem reads (kernel 3 twice, the
# second with stride 2; `qwen2_audio`).
STEM_EXTRA_FRAMES = 2


def encoder_positions(num_frames: int) -> int:
    """Positions after the stride-2 convolution stem (transformers'
    `_get_feat_extract_output_lengths`, first half). Example: 100 frames -> 50."""
    return (num_frames - 1) // 2 + 1


def num_audio_tokens(num_frames: int) -> int:
    """Rows a clip of `num_frames` log-mel frames becomes (Qwen2AudioProcessor's count):
    pairs of encoder positions, pooled. Example: 100 frames -> 50 positions -> 25 rows;
    3 frames -> 1 row; 2 frames -> 0."""
    return (encoder_positions(num_frames) - 2) // 2 + 1


class ClipFeatures(NamedTuple):
    features: torch.Tensor  # [num_mel_bins, num_frames + STEM_EXTRA_FRAMES] float32
    num_frames: int  # the clip's own frames


class AudioFeatureExtractor:
    """The model's feature extractor, called as Qwen2AudioProcessor calls it, with the
    engine's checks on each clip.

    Args:
        model_dir: the model's directory (preprocessor_config.json, else Whisper's default
            extractor for `num_mel_bins`).
        num_mel_bins: the audio encoder's input channels.
        window_frames: the frames the encoder's positions cover (2 x max_source_positions).
    """

    def __init__(self, model_dir: str, num_mel_bins: int, window_frames: int) -> None:
        self.extractor = load_feature_extractor(model_dir, num_mel_bins)
        fe = self.extractor
        if fe.feature_size != num_mel_bins:
            raise ValueError(f"The feature extractor gives {fe.feature_size} mel bins, but the "
                             f"audio encoder takes {num_mel_bins}.")
        if fe.nb_max_frames != window_frames:
            raise ValueError(f"The feature extractor's window is {fe.nb_max_frames} frames, "
                             f"but the audio encoder's positions cover {window_frames}.")
        self.sample_rate = int(fe.sampling_rate)
        self.max_seconds = fe.n_samples / fe.sampling_rate

    def waveform(self, clip: Any) -> np.ndarray:
        """A clip (any form the module takes) -> float32 mono samples at the extractor's
        rate; ValueError naming what is wrong."""
        if isinstance(clip, (bytes, bytearray, memoryview)):
            data = bytes(clip)
            if len(data) > MAX_AUDIO_BYTES:
                raise ValueError(f"The audio file is {len(data)} bytes, over the limit of "
                                 f"{MAX_AUDIO_BYTES}.")
            samples = decode_audio_file(data, self.max_seconds, "one window of the model's "
                                        "feature extractor")
            clip = (samples, SAMPLE_RATE)  # the decoder's rate; resampled below if needed
        elif isinstance(clip, (np.ndarray, torch.Tensor)):
            clip = (clip, self.sample_rate)
        return waveform_from_audio(clip, self.sample_rate, self.max_seconds)

    def features(self, clip: Any) -> ClipFeatures:
        """A clip's log-mel features (see the module's doc); a clip too short to give one
        row is refused."""
        waveform = self.waveform(clip)
        out = self.extractor(waveform, sampling_rate=self.sample_rate,
                             return_attention_mask=True, padding="max_length",
                             return_tensors="np")
        full = np.asarray(out["input_features"][0], dtype=np.float32)  # [mel, window]
        num_frames = int(np.asarray(out["attention_mask"][0]).sum())
        if num_audio_tokens(num_frames) < 1:
            raise ValueError(f"The audio clip is too short: {waveform.shape[0]} samples "
                             f"({num_frames} frames) give no audio positions; it needs at "
                             f"least 3 frames ({2 * self.extractor.hop_length + 1} samples at "
                             f"{self.sample_rate} Hz).")
        kept = np.zeros((full.shape[0], num_frames + STEM_EXTRA_FRAMES), dtype=np.float32)
        end = min(num_frames + STEM_EXTRA_FRAMES, full.shape[1])
        kept[:, :end] = full[:, :end]  # zeros past the window: the stem's own padding
        return ClipFeatures(torch.from_numpy(kept), num_frames)
