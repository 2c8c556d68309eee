"""A synthesized long-form speech set (espeak-ng): recordings of known sentences with varied
voices, rates and pauses, for the long-form tests and benchmark.

Every utterance is synthesized once and cached under the system temp directory by a hash of
(voice, rate, text), so a session pays for each at most once. Needs the `espeak-ng` program
(`apt-get install espeak-ng`).
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import soundfile

RATE = 16_000
VOICES = ("en-us", "en-gb", "en-us+f3", "en-gb-x-rp+m4", "en-029+f2")
SENTENCES = (
    "The morning meeting will start at nine.",
    "Please send the report to the finance team.",
    "We need three more chairs in the big room.",
    "The new printer on the second floor is broken.",
    "Our customers asked for a faster delivery.",
    "She will call the bank after lunch.",
    "The garden behind the house needs water.",
    "He parked the blue car near the old bridge.",
    "The children played football in the park.",
    "Remember to lock the door when you leave.",
    "The train to the city leaves every hour.",
    "My brother bought a small boat last summer.",
    "The kitchen smells of fresh bread and coffee.",
    "We should plant the tomatoes before the weekend.",
    "The library closes early on Fridays.",
    "A strong wind blew the leaves across the road.",
    "The doctor said that I should rest for a week.",
    "Our team won the game in the last minute.",
    "The museum has a famous painting of the sea.",
    "They moved to a quiet town in the mountains.",
    "The price of apples went up again this month.",
    "Please write your name at the top of the page.",
    "The cat is sleeping on the warm window sill.",
    "We watched the sun go down over the lake.",
    "The engineer fixed the heating system today.",
    "Bring an umbrella because it may rain later.",
    "The students finished their project on time.",
    "My grandmother tells the best stories at dinner.",
    "The shop around the corner sells good cheese.",
    "The pilot announced that we would land soon.",
)


class Recording(NamedTuple):
    samples: np.ndarray  # [num_samples] float32, 16 kHz
    sentences: list[str]  # in order
    spans: list[tuple[float, float]]  # each sentence's (start, end) in seconds

    @property
    def text(self) -> str:
        return " ".join(self.sentences)

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / RATE


def require_espeak() -> str:
    path = shutil.which("espeak-ng")
    if path is None:
        raise RuntimeError("The long-form speech set needs espeak-ng: apt-get install espeak-ng")
    return path


def synthesize(text: str, voice: str = "en-us", rate: int = 160) -> np.ndarray:
    """`text` spoken by espeak-ng, 16 kHz float32, leading and trailing silence trimmed."""
    key = hashlib.sha256(f"{voice}|{rate}|{text}".encode()).hexdigest()[:24]
    cache = Path(tempfile.gettempdir()) / "vllm-longform-speech" / f"{key}.npy"
    if cache.exists():
        return np.load(cache)
    wav = subprocess.run([require_espeak(), "-v", voice, "-s", str(rate), "--stdout", text],
                         check=True, capture_output=True).stdout
    samples, rate_in = soundfile.read(io.BytesIO(wav), dtype="float32")
    import soxr

    samples = soxr.resample(samples, rate_in, RATE).astype(np.float32)
    loud = np.flatnonzero(np.abs(samples) > 1e-3)
    samples = samples[loud[0]:loud[-1] + 1] if loud.size else samples[:0]
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, samples)
    return samples


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(round(seconds * RATE)), np.float32)


def recording(sentences: list[str], pauses: list[float], voice: str = "en-us",
              rate: int = 160, lead: float = 0.5) -> Recording:
    """The sentences spoken in order, `pauses[i]` seconds after sentence i."""
    parts, spans, at = [silence(lead)], [], lead
    for sentence, pause in zip(sentences, pauses, strict=True):
        speech = synthesize(sentence, voice, rate)
        spans.append((at, at + speech.shape[0] / RATE))
        parts += [speech, silence(pause)]
        at += (speech.shape[0] + silence(pause).shape[0]) / RATE
    return Recording(np.concatenate(parts), list(sentences), spans)


def random_recording(seed: int, seconds: float, max_pause: float = 15.0) -> Recording:
    """About `seconds` of speech and pauses: sentences in a seeded order, one voice and rate
    per recording, pauses of 0.3 s to `max_pause` (mostly short)."""
    rng = np.random.default_rng(seed)
    voice = VOICES[seed % len(VOICES)]
    rate = int(rng.integers(140, 190))
    sentences, pauses, total = [], [], 0.0
    while total < seconds:
        sentences.append(SENTENCES[int(rng.integers(len(SENTENCES)))])
        long_pause = rng.random() < 0.12
        pauses.append(float(rng.uniform(3.0, max_pause) if long_pause else rng.uniform(0.3, 1.2)))
        total += 2.8 + pauses[-1]
    return recording(sentences, pauses, voice, rate)


def mostly_silence(seconds: float, sentence: str = SENTENCES[0]) -> Recording:
    """`seconds` of which all but one sentence (in the middle) is silence."""
    speech = synthesize(sentence)
    before = (seconds - speech.shape[0] / RATE) / 2
    return recording([sentence], [before], lead=before)


def long_form_set(minutes: tuple[float, ...] = (1.0, 2.0, 3.0, 5.0)) -> list[Recording]:
    """The benchmark's set: one recording per entry of `minutes`, plus a mostly silent one."""
    return [*(random_recording(seed, 60 * m) for seed, m in enumerate(minutes)),
            mostly_silence(90.0)]


def word_clip(words: list[str], gaps: list[float], voice: str = "en-us", rate: int = 160
              ) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Words synthesized one by one with known silences between them: the audio and each
    word's exact (start, end) in seconds."""
    parts, bounds, at = [silence(0.4)], [], 0.4
    for word, gap in zip(words, gaps, strict=True):
        speech = synthesize(word, voice, rate)
        bounds.append((at, at + speech.shape[0] / RATE))
        parts += [speech, silence(gap)]
        at += (speech.shape[0] + silence(gap).shape[0]) / RATE
    return np.concatenate(parts), bounds
