"""Voice-activity segmentation of long audio, and speech packed into Whisper windows.

An energy detector of our own (no model, no dependency, CPU numpy): 20 ms frames are speech
when their level is well above the file's noise floor. It is tuned to lose no speech rather
than to drop every noise: regions are padded, and short gaps inside speech are kept.

    level (dB) per 20 ms frame ─► speech frames ─► regions (gaps < MIN_GAP merged, PAD added)
        ─► windows: regions packed in order, their silences left out, at most 30 s of audio

A window is a list of pieces of the file; its audio is the pieces concatenated, so a 12 s
pause costs nothing and never reaches the model. `WindowMap` turns a time in the window's
clock (what Whisper's timestamp tokens say) back into the file's clock::

    file:   |--speech A--|.......12 s silence.......|--speech B--|
    window: |--speech A--|--speech B--|      (pieces [(a0, a1), (b0, b1)])
            0            a1-a0        (a1-a0)+(b1-b0)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vllm.inputs.audio import MAX_AUDIO_SECONDS, SAMPLE_RATE

FRAME = SAMPLE_RATE // 50  # 20 ms
PAD = int(0.2 * SAMPLE_RATE)  # kept on both sides of every region
MIN_GAP = int(0.6 * SAMPLE_RATE)  # quieter stretches shorter than this stay inside speech
MIN_SPEECH = int(0.1 * SAMPLE_RATE)  # louder stretches shorter than this are clicks
SPEECH_OVER_FLOOR_DB = 12.0  # a frame is speech this far above the noise floor
MAX_BELOW_PEAK_DB = 35.0  # ... and the threshold never rises above the peak minus this
ABSOLUTE_FLOOR_DB = -60.0  # frames below this (dBFS) are never speech
WINDOW_SAMPLES = int(MAX_AUDIO_SECONDS * SAMPLE_RATE)
# Regions further apart than this start a new window: the model's timestamps then place the
# text on the right side of a long pause (tiny models often write one segment per window).
MAX_JOINED_GAP = int(3.0 * SAMPLE_RATE)
# A region longer than a window is cut at the quietest 100 ms of the last 5 s before each end.
SPLIT_SEARCH = int(5.0 * SAMPLE_RATE)
_ENERGY_FRAME = SAMPLE_RATE // 10  # 100 ms: the stretch whose energy is compared
_ENERGY_HOP = SAMPLE_RATE // 100  # 10 ms between compared stretches


class Piece(NamedTuple):
    start: int  # first sample in the file (16 kHz)
    end: int  # one past the last


def speech_frames(waveform: np.ndarray) -> np.ndarray:
    """[ceil(num_samples / FRAME)] bool: the 20 ms frames loud enough to be speech.

    The noise floor is the 10th percentile of frame levels; the threshold is the floor plus
    SPEECH_OVER_FLOOR_DB, capped at the loudest frame minus MAX_BELOW_PEAK_DB and never
    under ABSOLUTE_FLOOR_DB. Example: frames at -90 dB (digital silence) and -20 dB (speech):
    floor -90, threshold max(-78, -60) = -60 -> the -20 dB frames are speech.
    """
    num_frames = waveform.shape[0] // FRAME + (waveform.shape[0] % FRAME > 0)
    if num_frames == 0:
        return np.zeros(0, bool)
    padded = np.zeros(num_frames * FRAME, np.float64)
    padded[:waveform.shape[0]] = waveform
    power = (padded.reshape(num_frames, FRAME) ** 2).mean(axis=1)
    level = 10.0 * np.log10(power + 1e-12)  # [num_frames] dBFS
    floor, peak = float(np.percentile(level, 10)), float(level.max())
    threshold = max(min(floor + SPEECH_OVER_FLOOR_DB, peak - MAX_BELOW_PEAK_DB),
                    ABSOLUTE_FLOOR_DB)
    return level > threshold


def speech_regions(waveform: np.ndarray) -> list[Piece]:
    """Padded speech regions of `waveform` (runs of `speech_frames`, gaps under MIN_GAP
    merged, runs under MIN_SPEECH dropped), in order, non-overlapping; [] for silence."""
    regions = _runs(speech_frames(waveform), FRAME)
    regions = _merge_close(regions, MIN_GAP)
    regions = [r for r in regions if r.end - r.start >= MIN_SPEECH]
    total = waveform.shape[0]
    padded_regions = [Piece(max(0, r.start - PAD), min(total, r.end + PAD)) for r in regions]
    return _merge_close(padded_regions, 0)


def _runs(mask: np.ndarray, frame: int) -> list[Piece]:
    """Sample ranges of the runs of True frames. Example: [F, T, T, F, T], frame 10 ->
    [(10, 30), (40, 50)]."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [Piece(int(s) * frame, int(e) * frame) for s, e in zip(starts, ends)]


def _merge_close(regions: list[Piece], gap: int) -> list[Piece]:
    merged: list[Piece] = []
    for region in regions:
        if merged and region.start - merged[-1].end <= gap:
            merged[-1] = Piece(merged[-1].start, max(merged[-1].end, region.end))
        else:
            merged.append(region)
    return merged


def pack_windows(waveform: np.ndarray, regions: list[Piece],
                 window: int = WINDOW_SAMPLES, max_gap: int = MAX_JOINED_GAP
                 ) -> list[list[Piece]]:
    """Regions packed in order into windows of at most `window` samples of audio each,
    never joining two regions more than `max_gap` apart; a region longer than a window is
    first cut at quiet points (`split_region`).

    Example (window 30 s, regions 1 s apart): 10 s, 15 s, 8 s -> [[10 s, 15 s], [8 s]];
    with 12 s of silence before the 15 s one -> [[10 s], [15 s, 8 s]].
    """
    pieces: list[Piece] = []
    for region in regions:
        pieces += split_region(waveform, region, window)
    windows: list[list[Piece]] = []
    length = 0
    for piece in pieces:
        size = piece.end - piece.start
        if windows and length + size <= window \
                and piece.start - windows[-1][-1].end <= max_gap:
            windows[-1].append(piece)
            length += size
        else:
            windows.append([piece])
            length = size
    return windows


def split_region(waveform: np.ndarray, region: Piece, window: int = WINDOW_SAMPLES,
                 search: int = SPLIT_SEARCH) -> list[Piece]:
    """`region` in pieces of at most `window` samples, in order, each cut at the quietest
    point of the last `search` samples before its end::

        |<--------------- 30 s window --------------->|
        |                              |<- search 5 s ->|
        start                          quietest 100 ms: cut at its centre, the next starts there

    Example (window 30 s, search 5 s): 70 s of speech with pauses near 27 s and 55 s ->
    [(0, 27.x s), (27.x s, 55.x s), (55.x s, 70 s)].
    """
    pieces = []
    start = region.start
    while region.end - start > window:
        cut = quietest_point(waveform, start + window - search, start + window)
        pieces.append(Piece(start, cut))
        start = cut
    pieces.append(Piece(start, region.end))
    return pieces


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


class WindowMap:
    """A window's audio (its pieces concatenated) and its clock -> the file's clock."""

    def __init__(self, pieces: list[Piece]) -> None:
        self.pieces = pieces
        sizes = [p.end - p.start for p in pieces]
        self.offsets = np.cumsum([0, *sizes])  # [num_pieces + 1] window sample of each start

    @property
    def num_samples(self) -> int:
        return int(self.offsets[-1])

    @property
    def seconds(self) -> float:
        return self.num_samples / SAMPLE_RATE

    def audio(self, waveform: np.ndarray) -> np.ndarray:
        if len(self.pieces) == 1:
            return waveform[self.pieces[0].start:self.pieces[0].end]
        return np.concatenate([waveform[p.start:p.end] for p in self.pieces])

    def file_seconds(self, seconds: float, end: bool = False) -> float:
        """A window time in the file's clock. At a joint between two pieces, a start
        (end=False) maps to the later piece's start, an end to the earlier piece's end.

        Example: pieces [(0 s, 2 s), (10 s, 11 s)]: 1.0 -> 1.0; 2.5 -> 10.5;
        2.0 -> 10.0 as a start, 2.0 as an end."""
        sample = min(max(seconds, 0.0), self.seconds) * SAMPLE_RATE
        side = "left" if end else "right"
        index = int(np.searchsorted(self.offsets, sample, side=side)) - 1
        index = min(max(index, 0), len(self.pieces) - 1)
        return (self.pieces[index].start + sample - self.offsets[index]) / SAMPLE_RATE

    def after(self, seconds: float) -> WindowMap:
        """The rest of the window from `seconds` on (in its clock): a re-seek."""
        sample = int(round(seconds * SAMPLE_RATE))
        rest = []
        for piece, offset in zip(self.pieces, self.offsets[:-1]):
            start = piece.start + max(0, sample - int(offset))
            if start < piece.end:
                rest.append(Piece(start, piece.end))
        return WindowMap(rest)
