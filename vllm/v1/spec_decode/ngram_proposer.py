"""`NgramProposer`: prompt-lookup drafts copied from a request's own context."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Drafts up to `k` tokens for a request from its known tokens: the longest suffix
    n-gram (n from `max_n` down to `min_n`) that occurs earlier in the context, and the
    tokens that followed its most recent earlier occurrence. Positions that hold prompt
    embeds (not real tokens) never match and are never drafted.
    """

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: np.ndarray, is_token: np.ndarray | None = None) -> list[int]:
        """tokens: [L] the request's known ids; is_token: [L] bool (None: all tokens).

        Example: tokens [1 2 3 4 1 2 3], min_n 1, max_n 3, k 2: the suffix [1 2 3] (n 3)
        ends earlier at position 2, so the drafts are tokens[3:5] = [4, 1].

        Vectorised: run[j] counts how many tokens ending at position j (j < L - 1, so that
        a token follows) equal the suffix read backwards, stopping at max_n:
            run[j] = #consecutive t >= 0 with tokens[j - t] == tokens[L - 1 - t].
        The best j has the largest run (>= min_n), the latest among equals.
        """
        length = len(tokens)
        if length < 2 or self.k < 1:
            return []
        tokens = np.asarray(tokens)
        ok = np.ones(length - 1, dtype=bool)
        run = np.zeros(length - 1, dtype=np.int64)
        ends = np.arange(length - 1)
        for t in range(min(self.max_n, length - 1)):
            last = length - 1 - t
            if is_token is not None and not is_token[last]:
                break
            starts = ends - t
            valid = starts >= 0
            match = np.zeros(length - 1, dtype=bool)
            match[valid] = tokens[starts[valid]] == tokens[last]
            if is_token is not None:
                match[valid] &= is_token[starts[valid]]
            ok &= match
            if not ok.any():
                break
            run += ok
        best = int(run.max()) if run.size else 0
        if best < self.min_n:
            return []
        j = int(np.flatnonzero(run == best)[-1])
        drafts = tokens[j + 1:j + 1 + self.k]
        if is_token is not None:
            embedded = np.flatnonzero(~is_token[j + 1:j + 1 + self.k])
            if embedded.size:
                drafts = drafts[:embedded[0]]
        return drafts.tolist()
