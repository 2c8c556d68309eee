"""`SpecDecodingStats`: what one step's verification accepted (vLLM's spec-decode counters)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """Counts over the requests of a step (or, summed, of a run) that verified drafts.

    `num_accepted_tokens_per_pos[j]`: drafts accepted at position j (j < k); acceptance
    stops at the first rejection, so the counts never grow with j.
    """

    num_spec_tokens: int  # k
    num_drafts: int = 0  # verifications (a request with >= 1 draft in a step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for j in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[j] += 1

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for j, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[j] += n

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (None before any draft)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verification: accepted drafts + the one sampled after."""
        if not self.num_drafts:
            return None
        return 1 + self.num_accepted_tokens / self.num_drafts
