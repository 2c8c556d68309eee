"""`EngineCore`: the scheduler and the executor, stepped by a three-call loop."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from vllm.config import VllmConfig
from vllm.lora.request import LoRARequest
from vllm.utils import cdiv
from vllm.v1.core.kv_cache_groups import blocks_needed
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.media_rows import MediaRows
from vllm.v1.executor.abstract import Executor, ExecutorDeadError
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output.manager import GrammarCompiler, StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the model executor; knows nothing of text.

    A step whose execution raises does not end the engine: the scheduler undoes it and
    fails the request to blame (`Scheduler.recover_from_failed_step`), the runner forgets
    the step's requests, and serving goes on. Only a failure the scheduler cannot
    attribute, or one that repeats, propagates (`EngineStepError`).
    """

    def __init__(self, vllm_config: VllmConfig,
                 grammar_compiler: GrammarCompiler | None = None) -> None:
        """`grammar_compiler`: the front end's, when it lives in this process (one cache of
        compiled grammars, one tokenizer); else the engine makes its own, which loads the
        tokenizer the first time a request needs a grammar."""
        torch.manual_seed(vllm_config.model_config.seed)
        self.vllm_config = vllm_config
        self.model_executor = Executor.get_class(vllm_config.parallel_config)(vllm_config)
        try:
            self._initialize_kv_cache()
        except BaseException:  # the workers are up: release them now, not at gc
            self.model_executor.shutdown()
            raise
        self.structured_output_manager = _structured_output_manager(vllm_config, grammar_compiler)
        # The media stage: requests with images or audio wait there for their rows; the
        # scheduler picks them within its per-step encoder budget.
        self.media_rows = (MediaRows(self.model_executor.embed_media)
                           if vllm_config.model_config.is_multimodal_model else None)
        self.scheduler = Scheduler(vllm_config.scheduler_config, vllm_config.cache_config,
                                   vllm_config.model_config.kv_cache_groups,
                                   self.structured_output_manager, self.media_rows)
        # adapter id -> the fingerprint of its files when the workers read them
        self._recent_loras: OrderedDict[int, bytes] = OrderedDict()

    def _initialize_kv_cache(self) -> None:
        """Sizes the KV cache from the workers' free memory and allocates it there; refuses
        a cache too small for one longest request."""
        vllm_config = self.vllm_config
        cache = vllm_config.cache_config
        num_blocks = self.model_executor.determine_num_blocks()
        max_len = vllm_config.model_config.max_model_len
        max_encoder_len = vllm_config.model_config.max_encoder_len
        groups = vllm_config.model_config.kv_cache_groups
        # One longest request (its cross blocks included) must fit, + the null block.
        needed = (blocks_needed(max_len, groups, cache.block_size,
                                vllm_config.scheduler_config.max_num_batched_tokens)
                  + cdiv(max_encoder_len, cache.block_size) + 1)
        if num_blocks < needed:
            encoder = (f" and an encoder input of {max_encoder_len} tokens"
                       if max_encoder_len else "")
            raise ValueError(
                f"The KV cache has room for {num_blocks} blocks of {cache.block_size} tokens, "
                f"but one request of max_model_len={max_len}{encoder} needs {needed}. Raise "
                "the KV cache size (kv_cache_memory_bytes) or lower max_model_len.")
        self.model_executor.initialize_kv_cache(num_blocks)
        cache.num_blocks = num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.lora_request is not None:
            request.lora_fingerprint = self._preload_lora(request.lora_request)
        if request.mm_inputs and self.media_rows is None:
            raise ValueError(f"{self.vllm_config.model_config.architecture} takes no "
                             "images or audio.")
        self.scheduler.add_request(request)

    def _preload_lora(self, lora_request: LoRARequest) -> bytes:
        """Reads an adapter into the workers' CPU caches when its first request arrives,
        not in the step that first runs it; returns its files' fingerprint then (the
        requests' block hashes include it). `_recent_loras` mirrors the workers' cache
        (most recent last) so that requests of a cached adapter cost no call; an adapter
        the workers dropped meanwhile is read again when a step needs it."""
        from vllm.lora.peft import files_fingerprint

        lora_id = lora_request.lora_int_id
        if lora_id in self._recent_loras:
            self._recent_loras.move_to_end(lora_id)
            return self._recent_loras[lora_id]
        fingerprint = files_fingerprint(lora_request.lora_path)
        self.model_executor.add_lora(lora_request)
        self._recent_loras[lora_id] = fingerprint
        lora_config = self.vllm_config.lora_config
        while lora_config is not None and len(self._recent_loras) > lora_config.max_cpu_loras:
            self._recent_loras.popitem(last=False)
        return fingerprint

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter ahead of its requests (a ValueError if bad)."""
        if self.vllm_config.lora_config is None:
            raise ValueError("LoRA is not enabled (enable_lora=True).")
        self._recent_loras.pop(lora_request.lora_int_id, None)
        self._preload_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drops an adapter from the workers (requests using it must be finished)."""
        self._recent_loras.pop(lora_int_id, None)
        return self.model_executor.remove_lora(lora_int_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Ends requests a stop string finished in the front end; those that asked for
        their hidden states still send them, in one last output."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_requests():
            return EngineCoreOutputs([], scheduler_stats=self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        try:
            model_output = self.model_executor.execute_model(scheduler_output)
        except ExecutorDeadError:
            raise  # a worker is gone: no request is to blame
        except Exception:
            logger.exception("A step of %d request(s) failed.",
                             len(scheduler_output.num_scheduled_tokens))
            self.model_executor.drop_requests(list(scheduler_output.num_scheduled_tokens))
            return self.scheduler.recover_from_failed_step(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones whose state the runner still holds."""
        return self.scheduler.has_requests()

    def get_state(self) -> dict[str, int | float]:
        """What the scheduler and the runner hold now (leak checks)."""
        scheduler = self.scheduler
        return {
            "num_requests": len(scheduler.requests),
            "num_running_reqs": len(scheduler.running),
            "num_waiting_reqs": len(scheduler.waiting),
            "kv_cache_usage": scheduler.kv_cache_manager.usage,
            **(self.media_rows.stats() if self.media_rows is not None else {}),
            **self.model_executor.get_state(),
        }

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the grammar compiler's threads and the executor's workers (idempotent;
        an engine core dropped unshut releases its workers through the executor's
        finalizer)."""
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()
        self.model_executor.shutdown()


def _structured_output_manager(vllm_config: VllmConfig, compiler: GrammarCompiler | None
                               ) -> StructuredOutputManager | None:
    model_config = vllm_config.model_config
    if model_config.skip_tokenizer_init:
        return None  # no tokenizer, no grammars (the processor refuses constraints)
    if compiler is None:
        compiler = GrammarCompiler.for_model(model_config)
    return StructuredOutputManager(compiler)
