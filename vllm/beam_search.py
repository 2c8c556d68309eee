"""What `LLM.beam_search` returns (vLLM's names): the best sequences of each prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.outputs import Logprob


@dataclass
class BeamSearchSequence:
    """One finished hypothesis.

    `tokens` holds the prompt's token ids (the decoder prompt's for encoder/decoder models;
    none for a prompt of embeds) followed by the generated ones; `logprobs` has
    one dict per generated token: the candidates its beam considered at that step (token id
    -> `Logprob` with rank), the chosen token included. `text` is the generated part.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length"
    stop_reason: int | str | None = None
    multi_modal_data: Any = None
    mm_processor_kwargs: dict[str, Any] | None = None


@dataclass
class BeamSearchOutput:
    """The `beam_width` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


__all__ = ["BeamSearchOutput", "BeamSearchSequence"]
