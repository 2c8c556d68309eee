"""Word timestamps for Whisper transcripts: the cross-attention of the model's alignment heads
over the decoded tokens, aligned to audio frames by dynamic time warping (as OpenAI's Whisper
and faster-whisper do).

A second forward pass, in the serving process, over the final text of one decoded window:

    [<|startoftranscript|> (<|en|> <|transcribe|>) <|notimestamps|>] text tokens <|endoftext|>
      └─ cross-attention weights of the alignment heads: [heads, tokens, audio frames]
         frames kept: the window's audio (20 ms each); normalized per head over the tokens,
         median-filtered over time (width 7), averaged over the heads ─► [tokens, frames]
      └─ DTW on the negated matrix: a monotonic path token ↔ frame; each token starts at the
         frame where the path first reaches its row
    words = runs of tokens, a new word at every token that begins with a space.

The pass runs on transformers' `WhisperForConditionalGeneration` (eager attention, the only
kind that returns weights) loaded from the served directory (HF or CTranslate2) on first
use; the alignment heads come from the CTranslate2 `config.json` (`alignment_heads`) or HF's
`generation_config.json`, else the last half of the decoder's layers, every head.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm.inputs.audio import SAMPLE_RATE

FRAMES_PER_SECOND = 50  # encoder frames: 20 ms each
MEDIAN_FILTER_WIDTH = 7
SNAP_SECONDS = 0.4  # how far a word boundary may move to reach a pause
MIN_PAUSE_SECONDS = 0.1  # shorter quiet runs are stop consonants inside words


class WordTiming(NamedTuple):
    word: str
    start: float  # seconds, in the decoded audio's clock
    end: float


def alignment_heads(model_dir: str, num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """(decoder layer, head) pairs: from the directory's config files, else the last half
    of the layers with every head."""
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                heads = json.load(f).get("alignment_heads")
            if heads:
                return [(int(layer), int(head)) for layer, head in heads]
    return [(layer, head) for layer in range(num_layers // 2, num_layers)
            for head in range(num_heads)]


def load_hf_whisper(model_dir: str) -> Any:
    """transformers' Whisper (float32, eager attention) on the weights of `model_dir`."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from vllm.model_executor.model_loader.ct2_loader import (
        is_ct2_model_dir,
        load_ct2_config,
        load_ct2_state_dict,
    )

    if is_ct2_model_dir(model_dir):
        config = WhisperConfig(**load_ct2_config(model_dir))
        config._attn_implementation = "eager"
        model = WhisperForConditionalGeneration(config)
        model.load_state_dict(load_ct2_state_dict(model_dir, torch.float32))
    else:
        model = WhisperForConditionalGeneration.from_pretrained(
            model_dir, torch_dtype=torch.float32, attn_implementation="eager",
            local_files_only=True)
    return model.eval()


class WhisperAligner:
    """Token and word timings of a decoded window's text (see the module docstring)."""

    def __init__(self, model: Any, feature_extractor: Any, heads: list[tuple[int, int]],
                 tokenizer: Any) -> None:
        self.model = model
        self.feature_extractor = feature_extractor
        self.heads = heads
        self.tokenizer = tokenizer

    @classmethod
    def from_model_dir(cls, model_dir: str, tokenizer: Any) -> WhisperAligner:
        from vllm.inputs.audio import load_feature_extractor

        model = load_hf_whisper(model_dir)
        config = model.config
        return cls(model, load_feature_extractor(model_dir, config.num_mel_bins),
                   alignment_heads(model_dir, config.decoder_layers,
                                   config.decoder_attention_heads), tokenizer)

    @torch.inference_mode()
    def token_starts(self, audio: np.ndarray, prefix_ids: list[int], text_ids: list[int],
                     end_of_text: int) -> np.ndarray:
        """[len(text_ids) + 1] seconds: where each text token starts, then where the text
        ends (the <|endoftext|> row)."""
        features = self.feature_extractor(audio, sampling_rate=SAMPLE_RATE,
                                          return_tensors="pt").input_features
        ids = torch.tensor([[*prefix_ids, *text_ids, end_of_text]])
        whisper = self.model.model
        encoded = whisper.encoder(features.float()).last_hidden_state
        out = whisper.decoder(input_ids=ids, encoder_hidden_states=encoded,
                              output_attentions=True)
        num_frames = max(1, int(np.ceil(audio.shape[0] * FRAMES_PER_SECOND / SAMPLE_RATE)))
        weights = torch.stack([out.cross_attentions[layer][0, head] for layer, head
                               in self.heads])  # [heads, tokens, 1500]
        # Row i is the query at input i, which predicts token i + 1: keep the rows that
        # predict the text tokens and <|endoftext|>.
        weights = weights[:, len(prefix_ids) - 1:-1, :num_frames].double()
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
        weights = (weights - mean) / std.clamp_min(1e-12)
        matrix = median_filter(weights.numpy(), MEDIAN_FILTER_WIDTH).mean(axis=0)
        rows, frames = dtw(-matrix)
        jumps = np.concatenate([[True], np.diff(rows) > 0])
        return frames[jumps] / FRAMES_PER_SECOND

    def words(self, audio: np.ndarray, prefix_ids: list[int], text_ids: list[int],
              end_of_text: int) -> list[WordTiming]:
        if not text_ids:
            return []
        starts = self.token_starts(audio, prefix_ids, text_ids, end_of_text)
        words, bounds = split_words(self.tokenizer, text_ids)
        return [WordTiming(word, float(starts[a]), float(starts[b]))
                for word, (a, b) in zip(words, bounds)]


def snap_to_pauses(words: list[WordTiming], loud: np.ndarray, frame_seconds: float,
                   reach: float = SNAP_SECONDS) -> list[WordTiming]:
    """Word boundaries moved into the nearest pause (a run of quiet frames of `loud`, the
    VAD's [num_frames] speech mask, of at least MIN_PAUSE_SECONDS) within `reach` seconds:
    the word before ends where the pause begins, the word after starts where it ends. A
    first start or last end inside a pause moves out of it. Without a pause nearby a
    boundary stays where DTW put it.

    Example (frames of 0.1 s, loud = [0, 1, 1, 0, 0, 1, 1, 0]): words (0.0, 0.45) and
    (0.45, 0.8) -> (0.1, 0.3) and (0.5, 0.7).
    """
    if not words:
        return words
    quiet = ~loud
    starts = [w.start for w in words]
    ends = [w.end for w in words]
    for i in range(len(words) - 1):
        pause = _nearest_pause(quiet, ends[i], frame_seconds, reach)
        if pause is not None and starts[i] <= pause[0] and pause[1] <= ends[i + 1]:
            ends[i], starts[i + 1] = pause
    first = _pause_at(quiet, starts[0], frame_seconds)
    if first is not None and first[1] < ends[0]:
        starts[0] = first[1]
    last = _pause_at(quiet, ends[-1] - 1e-6, frame_seconds)
    if last is not None and last[0] > starts[-1]:
        ends[-1] = last[0]
    return [WordTiming(w.word, s, max(s, e)) for w, s, e in zip(words, starts, ends)]


def _pause_at(quiet: np.ndarray, seconds: float, frame_seconds: float
              ) -> tuple[float, float] | None:
    """The (start, end) seconds of the quiet run holding `seconds`, or None."""
    frame = int(seconds / frame_seconds)
    if not 0 <= frame < quiet.shape[0] or not quiet[frame]:
        return None
    lo = frame
    while lo > 0 and quiet[lo - 1]:
        lo -= 1
    hi = frame
    while hi + 1 < quiet.shape[0] and quiet[hi + 1]:
        hi += 1
    return lo * frame_seconds, (hi + 1) * frame_seconds


def _nearest_pause(quiet: np.ndarray, seconds: float, frame_seconds: float, reach: float
                   ) -> tuple[float, float] | None:
    """The quiet run nearest to `seconds` within `reach` (the earlier one on ties)."""
    frame = int(round(seconds / frame_seconds))
    steps = int(reach / frame_seconds)
    for distance in range(steps + 1):
        for candidate in (frame - distance, frame + distance):
            pause = _pause_at(quiet, candidate * frame_seconds + frame_seconds / 2,
                              frame_seconds)
            if pause is not None and pause[1] - pause[0] >= MIN_PAUSE_SECONDS:
                return pause
    return None


def split_words(tokenizer: Any, text_ids: list[int]) -> tuple[list[str], list[tuple[int, int]]]:
    """Words and their token ranges: a new word at each token whose text starts with a
    space. Example: [" Hello", ",", " wor", "ld"] -> [" Hello,", " world"], [(0, 2), (2, 4)]."""
    words: list[str] = []
    bounds: list[tuple[int, int]] = []
    for i, token in enumerate(text_ids):
        piece = tokenizer.decode([token])
        if not words or piece.startswith(" "):
            words.append(piece)
            bounds.append((i, i + 1))
        else:
            words[-1] += piece
            bounds[-1] = (bounds[-1][0], i + 1)
    return words, bounds


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """Median over a sliding window of `width` (odd) along the last axis, edges reflected."""
    if x.shape[-1] <= width // 2:
        return x
    pad = width // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.median(windows, axis=-1)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through `cost` [N, M] from (0, 0) to (N-1, M-1), moving
    right, down or diagonally: (row indices, column indices) along it.

    Filled one anti-diagonal at a time (every cell of diagonal d = i + j needs only
    diagonals d-1 and d-2), so each step is one vectorised update. Example: the 2x3 matrix
    [[0, 9, 9], [9, 0, 0]] -> rows [0, 1, 1], columns [0, 1, 2].
    """
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    total[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), np.int8)  # 0 diagonal, 1 from above, 2 from the left
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        options = np.stack([total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]])
        choice = np.argmin(options, axis=0)
        total[i, j] = cost[i - 1, j - 1] + options[choice, np.arange(i.size)]
        trace[i, j] = choice
    rows, cols = [], []
    i, j = n, m
    while i > 0 and j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return np.array(rows[::-1]), np.array(cols[::-1])
