"""`UniProcExecutor`: one model runner in this process."""

from __future__ import annotations

import logging

import torch

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.stage_output_cache import StageOutputCache

logger = logging.getLogger(__name__)

_MIB = 1024**2


class UniProcExecutor:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        device = torch.device(vllm_config.device_config.device)
        self.model_runner = GPUModelRunner(vllm_config, device)
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """Blocks that fit the KV budget. A block costs its KV bytes plus its rows in the
        stage-output cache (when the engine returns hidden states), so turning that cache
        on lowers the number of blocks rather than quietly going over the budget."""
        cache = self.vllm_config.cache_config
        kv_bytes = self.model_runner.get_kv_cache_block_bytes()
        specs = self.model_runner.stage_output_specs()
        stage_bytes = StageOutputCache.block_bytes(cache.block_size, specs)
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        else:
            num_blocks = cache.kv_cache_memory_bytes // (kv_bytes + stage_bytes)
        logger.info("KV cache: %d blocks of %d tokens, %.1f MiB.", num_blocks,
                    cache.block_size, num_blocks * kv_bytes / _MIB)
        if specs:
            logger.info("Stage-output cache (%s): %.1f MiB, %d bytes per block (%.1f%% of "
                        "each block's budget).", ", ".join(specs), num_blocks * stage_bytes / _MIB,
                        stage_bytes, 100 * stage_bytes / (kv_bytes + stage_bytes))
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        self.model_runner.capture_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def drop_requests(self, req_ids: list[str]) -> None:
        self.model_runner.drop_requests(req_ids)

    def get_state(self) -> dict[str, int]:
        runner = self.model_runner
        return {"num_runner_requests": len(runner.requests),
                "num_batch_rows": runner.input_batch.num_reqs}

    def shutdown(self) -> None:
        runner = self.model_runner
        runner.kv_caches = []
        runner.stage_outputs = StageOutputCache(0, runner.block_size, {})
