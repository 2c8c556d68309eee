"""`Processor`: user prompt + params -> validated `EngineCoreRequest`."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from vllm.config import ModelConfig
from vllm.inputs.parse import ParsedPrompt, parse_prompt, validate_prompt_embeds
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest

# vLLM's default cap on returned logprobs per token.
MAX_LOGPROBS = 20
# Samples per prompt; each one is a request of its own in the engine core.
MAX_N = 128


class Processor:
    """Tokenizes, validates and stamps requests; errors are `ValueError`s naming the field."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if self.eos_token_id is None:
            self.eos_token_id = getattr(model_config.hf_config, "eos_token_id", None)
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0] if self.eos_token_id else None
        self.generation_stop_ids = _generation_config_eos_ids(model_config.model)

    def process_inputs(self, request_id: str, prompt: Any, params: SamplingParams,
                       arrival_time: float | None = None
                       ) -> tuple[EngineCoreRequest, ParsedPrompt]:
        parsed = parse_prompt(prompt)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"Expected SamplingParams, got {type(params).__name__}.")
        if params.prompt_logprobs is not None:
            if parsed.prompt_embeds is not None:
                raise ValueError("prompt_logprobs is not supported for prompt_embeds prompts: "
                                 "they have no prompt tokens to score.")
            raise ValueError("prompt_logprobs is not supported by this engine yet.")
        self._validate_params(params)
        if params.return_hidden_states and not self.model_config.enable_return_hidden_states:
            raise ValueError("return_hidden_states is set, but this engine does not keep "
                             "hidden states: create it with enable_return_hidden_states=True "
                             "(server: --enable-return-hidden-states).")
        embeds = token_ids = None
        if parsed.prompt_embeds is not None:
            embeds = self._validate_embeds(parsed.prompt_embeds)
        else:
            token_ids = self._tokenize(parsed)
            self._validate_token_ids(token_ids)
        params = params.clone()
        params.eos_token_id = self.eos_token_id
        params.all_stop_token_ids = [t for t in self.generation_stop_ids
                                     if t != self.eos_token_id]
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            prompt_embeds=embeds,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        return request, ParsedPrompt(parsed.prompt, token_ids, embeds)

    def _validate_params(self, params: SamplingParams) -> None:
        """Checks of the params against this model (SamplingParams checks the rest), so that
        no value can fail later inside the engine core."""
        vocab = self.model_config.vocab_size
        max_len = self.model_config.max_model_len
        if params.top_k > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab}, "
                             f"got {params.top_k}.")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are out of the vocabulary (size {vocab}).")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {params.logprobs}.")
        if params.min_tokens > max_len:
            raise ValueError(f"min_tokens must be at most max_model_len={max_len}, "
                             f"got {params.min_tokens}.")
        if params.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {params.n}.")
        if params.seed is not None and not 0 <= params.seed <= 2**63 - 1 - params.n:
            raise ValueError(f"seed must be in [0, 2**63 - 1 - n], got {params.seed}.")

    def _tokenize(self, parsed: ParsedPrompt) -> list[int]:
        if parsed.prompt_token_ids is not None:
            return parsed.prompt_token_ids
        if self.tokenizer is None:
            raise ValueError("A text prompt needs a tokenizer (skip_tokenizer_init is set).")
        return list(self.tokenizer.encode(parsed.prompt))

    def _validate_token_ids(self, token_ids: list[int]) -> None:
        max_len = self.model_config.max_model_len
        if not token_ids:
            raise ValueError("The prompt is empty: it has 0 tokens.")
        if len(token_ids) > max_len:
            raise ValueError(f"The prompt (length {len(token_ids)}) is longer than the "
                             f"maximum model length of {max_len}.")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]!r} in prompt_token_ids is out of the "
                             f"vocabulary (size {vocab}).")

    def _validate_embeds(self, embeds: Any):
        mc = self.model_config
        if not mc.enable_prompt_embeds:
            raise ValueError("prompt_embeds given, but prompt embeds are disabled: create the "
                             "engine with enable_prompt_embeds=True (server: "
                             "--enable-prompt-embeds).")
        return validate_prompt_embeds(embeds, mc.hidden_size, mc.dtype, mc.max_model_len)


def _generation_config_eos_ids(model: str) -> list[int]:
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]
