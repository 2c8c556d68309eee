"""`LLMEngine`: processor -> in-process engine core -> output processor, stepped by the caller."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from vllm.config import ModelConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core import EngineCore
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
    Children share the prompt (embeds included) rather than copying it."""
    if n == 1:
        return None, [request]
    parent = ParentRequest(request.request_id, n, output_kind)
    children = [dataclasses.replace(request, request_id=f"{index}_{request.request_id}",
                                    sampling_params=child_params(request.sampling_params,
                                                                 index))
                for index in range(n)]
    return parent, children


class FrontEnd(NamedTuple):
    """The text side of an engine, shared by `LLMEngine` and `AsyncLLM`."""

    tokenizer: Any
    processor: Processor
    output_processor: OutputProcessor


def build_front_end(model_config: ModelConfig) -> FrontEnd:
    tokenizer = (None if model_config.skip_tokenizer_init
                 else get_tokenizer(model_config.tokenizer))
    return FrontEnd(tokenizer, Processor(model_config, tokenizer), OutputProcessor(tokenizer))


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.tokenizer, self.processor, self.output_processor = build_front_end(
            vllm_config.model_config)
        self.engine_core = EngineCore(vllm_config)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validates and queues one prompt; raises ValueError, touching nothing, if bad."""
        self.output_processor.check_request_id(request_id)
        request, parsed = self.processor.process_inputs(request_id, prompt, params,
                                                        arrival_time)
        parent, requests = fan_out(request, params.n, params.output_kind)
        for index, core_request in enumerate(requests):
            self.output_processor.add_request(
                core_request.request_id, parsed.prompt, parsed.prompt_token_ids,
                core_request.num_prompt_tokens, core_request.sampling_params, parent, index,
                encoder_prompt=parsed.encoder_prompt,
                encoder_prompt_token_ids=parsed.encoder_prompt_token_ids)
            self.engine_core.add_request(core_request)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))
        self._flush_if_idle()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        ready, reqs_to_stop = self.output_processor.process_outputs(outputs)
        if reqs_to_stop:
            self.engine_core.stop_requests(reqs_to_stop)
        self._flush_if_idle()
        return [output for _, output in ready]

    def _flush_if_idle(self) -> None:
        if not self.has_unfinished_requests() and self.engine_core.has_requests():
            # Nothing left to run: one empty step delivers the finished ids to the model
            # runner so that it drops their state (prompt embeds included) now.
            self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()
