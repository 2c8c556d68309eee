"""Metric snapshots for offline use (`LLM.get_metrics()`), with vLLM v1's reader types."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.spec_decode.metrics import SpecDecodingStats


@dataclass(slots=True)
class Metric:
    name: str  # vLLM's metric name, e.g. "vllm:spec_decode_num_drafts" (no `_total`)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Counter(Metric):
    value: int = 0


@dataclass(slots=True)
class Vector(Metric):
    """A counter per position: `values[i]` for position i."""

    values: list[int] = field(default_factory=list)


def spec_decode_metrics(stats: SpecDecodingStats, labels: dict[str, str]) -> list[Metric]:
    """vLLM's spec-decode counters over `stats` (a run's sum)."""
    return [
        Counter("vllm:spec_decode_num_drafts", dict(labels), stats.num_drafts),
        Counter("vllm:spec_decode_num_draft_tokens", dict(labels), stats.num_draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", dict(labels),
                stats.num_accepted_tokens),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
               list(stats.num_accepted_tokens_per_pos)),
    ]
