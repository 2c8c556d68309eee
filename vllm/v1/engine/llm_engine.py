"""`LLMEngine`: processor -> in-process engine core -> output processor, stepped by the caller."""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.front_end import build_front_end, fan_out, register_request
from vllm.v1.metrics.reader import Metric, spec_decode_metrics
from vllm.v1.spec_decode.metrics import SpecDecodingStats


class LLMEngine:
    """One engine core in this process (offline `LLM`, offline pipelines)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        dp = vllm_config.parallel_config.data_parallel_size
        if dp > 1:
            raise ValueError(
                f"data_parallel_size={dp}: offline LLM runs one engine core in this process. "
                f"Serve with `vllm serve MODEL --data-parallel-size {dp}` (N engine cores "
                "behind one server), or start one LLM per process yourself, as vLLM does "
                "offline.")
        self.vllm_config = vllm_config
        self.tokenizer, self.processor, self.output_processor = build_front_end(
            vllm_config.model_config, vllm_config.lora_config)
        self.engine_core = EngineCore(vllm_config, self.processor.grammar_compiler)
        spec = vllm_config.speculative_config
        # Speculative decoding's counts since start (None: it is off).
        self.spec_decoding_stats = (None if spec is None
                                    else SpecDecodingStats.new(spec.num_speculative_tokens))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validates and queues one prompt; raises ValueError, touching nothing, if bad."""
        self.output_processor.check_request_id(request_id)
        request, parsed = self.processor.process_inputs(request_id, prompt, params,
                                                        arrival_time, lora_request)
        parent, requests = fan_out(request, params.n, params.output_kind)
        try:
            for index, core_request in enumerate(requests):
                register_request(self.output_processor, core_request, parsed, parent, index)
                self.engine_core.add_request(core_request)
        except BaseException:
            self.abort_request([request_id])  # nothing of it stays behind
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))
        self._flush_if_idle()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        stats = outputs.scheduler_stats
        if (self.spec_decoding_stats is not None and stats is not None
                and stats.spec_decoding is not None):
            self.spec_decoding_stats.add(stats.spec_decoding)
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

    def get_metrics(self) -> list[Metric]:
        """vLLM's offline metrics: speculative decoding's counters (when it is on)."""
        if self.spec_decoding_stats is None:
            return []
        labels = {"model_name": self.vllm_config.model_config.name, "engine": "0"}
        return spec_decode_metrics(self.spec_decoding_stats, labels)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Releases the engine core's workers now (idempotent); dropping the engine does
        the same when it is garbage-collected."""
        self.engine_core.shutdown()
