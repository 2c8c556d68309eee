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

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Folds the next output of the same request into this one (its reader fell
        behind): with `aggregate` (DELTA outputs) each sequence's new text, tokens and
        logprobs are appended; otherwise the newer sequence replaces the older."""
        self.finished = next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        self.stage_outputs = next_output.stage_outputs
        for new in next_output.outputs:
            index = next((i for i, c in enumerate(self.outputs) if c.index == new.index), None)
            if index is None:
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[index] = new
            else:
                _append_delta(self.outputs[index], new)


def _append_delta(old: CompletionOutput, new: CompletionOutput) -> None:
    old.text += new.text
    old.token_ids = [*old.token_ids, *new.token_ids]
    if new.logprobs is not None:
        old.logprobs = [*(old.logprobs or []), *new.logprobs]
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason
    if new.hidden_states is not None:
        old.hidden_states = new.hidden_states


__all__ = ["CompletionOutput", "RequestOutput", "Logprob"]
