"""What `LLM.generate` returns: one `RequestOutput` per prompt."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.outputs import Logprob, SampleLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # Encoder/decoder models: the encoder's prompt (None for audio and prompt embeds);
    # `prompt` / `prompt_token_ids` are then the decoder's.
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None


__all__ = ["CompletionOutput", "RequestOutput", "Logprob"]
