"""The text side shared by `LLMEngine` and `AsyncLLM`: tokenizer, processor, output
processor, and the fan-out of an n > 1 request into child requests. Imports nothing of the
engine core, so the API process does not load the scheduler, the runner or the models."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from vllm.config import LoRAConfig, ModelConfig
from vllm.inputs.parse import ParsedPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.output_processor import OutputProcessor, ParentRequest
from vllm.v1.engine.processor import Processor


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params of the index-th of n samples: n=1, and a distinct seed if one was given."""
    child = params.clone()
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    return child


def fan_out(request: EngineCoreRequest, n: int, output_kind: RequestOutputKind
            ) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
    """The engine-core requests for one user request: the request itself when n == 1,
    else n children (ids `{index}_{request_id}`, distinct seeds) under a `ParentRequest`.
    Children share the prompt (embeds included) rather than copying it. A beam-search
    request is never split: its one request returns its n best beams."""
    if n == 1 or request.sampling_params.beam_search is not None:
        return None, [request]
    parent = ParentRequest(request.request_id, n, output_kind)
    children = [dataclasses.replace(request, request_id=f"{index}_{request.request_id}",
                                    sampling_params=child_params(request.sampling_params,
                                                                 index))
                for index in range(n)]
    return parent, children


def register_request(output_processor: OutputProcessor, request: EngineCoreRequest,
                     parsed: ParsedPrompt, parent: ParentRequest | None, index: int,
                     queue: Any = None, external_id: str | None = None) -> None:
    """Registers one engine-core request (a child when n > 1) with the output processor:
    the one registration `LLMEngine` and `AsyncLLM` share."""
    output_processor.add_request(
        request.request_id, parsed.prompt, parsed.prompt_token_ids, request.num_prompt_tokens,
        request.sampling_params, parent, index, queue=queue,
        encoder_prompt=parsed.encoder_prompt,
        encoder_prompt_token_ids=parsed.encoder_prompt_token_ids, external_id=external_id)


class FrontEnd(NamedTuple):
    """The text side of an engine, shared by `LLMEngine` and `AsyncLLM`."""

    tokenizer: Any
    processor: Processor
    output_processor: OutputProcessor


def build_front_end(model_config: ModelConfig,
                    lora_config: LoRAConfig | None = None) -> FrontEnd:
    tokenizer = (None if model_config.skip_tokenizer_init
                 else get_tokenizer(model_config.tokenizer))
    return FrontEnd(tokenizer, Processor(model_config, tokenizer, lora_config),
                    OutputProcessor(tokenizer))
