"""`SamplingMetadata`: per-row sampling parameters of one step, as tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Penalties:
    """The penalty inputs of a step's sampling rows: all present, or none (no row uses
    any penalty; `SamplingMetadata.penalties` is None)."""

    presence: torch.Tensor  # [n] float32
    frequency: torch.Tensor  # [n] float32
    repetition: torch.Tensor  # [n] float32
    output_token_counts: torch.Tensor  # [n, vocab] int32
    prompt_token_mask: torch.Tensor  # [n, vocab] bool


@dataclass(slots=True)
class SamplingMetadata:
    """Rows are the requests that sample this step, in logits order."""

    temperature: torch.Tensor  # [n] float32; 0 marks a greedy row
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [n] float32, None when no row uses it
    top_k: torch.Tensor | None  # [n] int64
    min_p: torch.Tensor | None  # [n] float32
    generators: dict[int, torch.Generator]  # row -> per-request seeded generator
    penalties: Penalties | None  # None when no row uses any
    # Rows still below min_tokens, with the token ids they must not produce yet.
    min_tokens_blocked: dict[int, list[int]]
    max_num_logprobs: int | None  # None: no row wants logprobs
    # Rows restricted to some token ids (SamplingParams.allowed_token_ids) -> those ids.
    allowed_token_ids: dict[int, torch.Tensor] = field(default_factory=dict)  # [k] int64
