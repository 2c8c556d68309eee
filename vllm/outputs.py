"""What `LLM.generate` returns: one `RequestOutput` per prompt."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.v1.outputs import Logprob, SampleLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # With return_hidden_states, on the final output: the last hidden state (the LM head's
    # input) of every position the model processed, the prompt and every generated token
    # but the last: [num_prompt_tokens + len(token_ids) - 1, hidden_size], model dtype.
    hidden_states: torch.Tensor | None = None

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
    # From a `Pipeline`: the outputs of the earlier stages for this prompt, first stage first.
    stage_outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def hidden_states(self) -> torch.Tensor | None:
        """The first sequence's hidden states (the only one when n == 1); see
        `CompletionOutput.hidden_states`."""
        return self.outputs[0].hidden_states if self.outputs else None


__all__ = ["CompletionOutput", "RequestOutput", "Logprob"]
