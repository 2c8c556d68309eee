"""`LLMEngine`: processor -> in-process engine core -> output processor, stepped by the caller."""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm.config import ModelConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import get_tokenizer
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
        if request_id in self.output_processor.request_states or \
                request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        request, parsed = self.processor.process_inputs(request_id, prompt, params,
                                                        arrival_time)
        num_prompt = request.num_prompt_tokens
        if params.n == 1:
            self.output_processor.add_request(request_id, parsed.prompt, parsed.prompt_token_ids,
                                              num_prompt, request.sampling_params)
            self.engine_core.add_request(request)
            return
        parent = ParentRequest(request_id, params.n, params.output_kind)
        for index in range(params.n):
            child_id = f"{index}_{request_id}"
            child = type(request)(child_id, request.prompt_token_ids, request.prompt_embeds,
                                  child_params(request.sampling_params, index),
                                  request.eos_token_id, request.arrival_time)
            self.output_processor.add_request(child_id, parsed.prompt, parsed.prompt_token_ids,
                                              num_prompt, child.sampling_params, parent, index)
            self.engine_core.add_request(child)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))
        self._flush_if_idle()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        ready, reqs_to_abort = self.output_processor.process_outputs(outputs)
        if reqs_to_abort:
            self.engine_core.abort_requests(reqs_to_abort)
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
