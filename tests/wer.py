"""Word error rate for speech-recognition tests."""

from __future__ import annotations

import re

_NON_WORD = re.compile(r"[^\w\s']|_")


def normalize_words(text: str) -> list[str]:
    """Lower-case words with punctuation dropped, so "Dog." and "dog" count as the same word."""
    return _NON_WORD.sub(" ", text.lower()).replace("'", "").split()


def word_error_rate(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / number of reference words.

    Levenshtein distance over normalized words; an empty reference gives 0.0 for an empty
    hypothesis and 1.0 otherwise. Example: "the cat sat" vs "the cat sat down" -> 1 / 3.
    """
    ref, hyp = normalize_words(reference), normalize_words(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    # previous[j]: edits turning the first i-1 reference words into the first j hypothesis words
    previous = list(range(len(hyp) + 1))
    for i, ref_word in enumerate(ref, start=1):
        current = [i]
        for j, hyp_word in enumerate(hyp, start=1):
            substitution = previous[j - 1] + (ref_word != hyp_word)
            current.append(min(substitution, previous[j] + 1, current[j - 1] + 1))
        previous = current
    return previous[-1] / len(ref)
