"""`UniProcExecutor`: one model runner in this process."""

from __future__ import annotations

import torch

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class UniProcExecutor:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        device = torch.device(vllm_config.device_config.device)
        self.model_runner = GPUModelRunner(vllm_config, device)
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        cache = self.vllm_config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        return cache.kv_cache_memory_bytes // self.model_runner.get_kv_cache_block_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.model_runner.kv_caches = []
