"""`NgramProposer`: prompt-lookup drafts copied from a request's own context, through an
`NgramIndex` per request kept current as its tokens grow."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramIndex:
    """One request's n-grams (min_n <= n <= max_n), each mapped to the end position of its
    latest occurrence that another token follows, extended as tokens arrive.

    A draft is then a dictionary lookup per n instead of a scan of the context: the
    longest suffix n-gram found, and the tokens after its latest earlier occurrence.
    Positions that hold prompt embeds (None) are in no n-gram and are never drafted.

    Example (min_n 1, max_n 3): tokens [1 2 3 4 1 2 3] -> the suffix (1, 2, 3) was last
    followed at end position 2, so with k 2 the drafts are tokens[3:5] = [4, 1]. Building
    costs a tuple per position and n (once per request); each step then adds only its new
    tokens' n-grams.
    """

    __slots__ = ("min_n", "max_n", "tokens", "tables", "owner")

    def __init__(self, min_n: int, max_n: int, owner: object = None) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int | None] = []  # None at prompt-embeds positions
        # n -> {n-gram: end position of its latest occurrence with a token after it}
        self.tables: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.owner = owner  # whose tokens these are (the runner's request state)

    def extend(self, tokens: Sequence[int | None]) -> None:
        """Appends tokens; the n-grams ending where a token now follows join the tables."""
        first = max(len(self.tokens) - 1, 0)  # the old last position gains a follower
        self.tokens += tokens
        seq = self.tokens
        for end in range(first, len(seq) - 1):
            for n, table in self.tables.items():
                start = end - n + 1
                if start < 0:
                    break
                gram = tuple(seq[start:end + 1])
                if None in gram:
                    break  # a longer n-gram holds the same embeds position
                table[gram] = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of the longest suffix
        n-gram (cut before any embeds position); [] without one."""
        seq = self.tokens
        length = len(seq)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            gram = tuple(seq[length - n:])
            if None in gram:
                continue
            end = self.tables[n].get(gram)
            if end is None:
                continue
            drafts = seq[end + 1:end + 1 + k]
            if None in drafts:
                drafts = drafts[:drafts.index(None)]
            return drafts  # type: ignore[return-value]  # None cut off above
        return []


class NgramProposer:
    """Drafts up to `k` tokens for a request from its known tokens: the longest suffix
    n-gram (n from `max_n` down to `min_n`) that occurs earlier in the context, and the
    tokens that followed its most recent earlier occurrence."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def index(self, owner: object = None) -> NgramIndex:
        """An empty index for one request (`owner`: whose tokens it will hold)."""
        return NgramIndex(self.min_n, self.max_n, owner)

    def propose(self, tokens: np.ndarray, is_token: np.ndarray | None = None) -> list[int]:
        """tokens: [L] the request's known ids; is_token: [L] bool (None: all tokens).
        One-off (a fresh index): the runner keeps an index per request instead.

        Example: tokens [1 2 3 4 1 2 3], min_n 1, max_n 3, k 2: the suffix [1 2 3] (n 3)
        ends earlier at position 2, so the drafts are tokens[3:5] = [4, 1].
        """
        if self.k < 1:
            return []
        index = self.index()
        ids: list[int | None] = np.asarray(tokens).tolist()
        if is_token is not None:
            ids = [t if ok else None for t, ok in zip(ids, np.asarray(is_token).tolist())]
        index.extend(ids)
        return index.propose(self.k)
