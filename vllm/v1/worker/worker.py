"""`Worker`: one tensor-parallel rank: its cores, its place in the process group, its model
runner. Executors call its methods by name (`Executor.collective_rpc`), on every rank with
the same arguments; each rank runs the same step on its slice of the model.
"""

from __future__ import annotations

import logging
import os

import torch

from vllm.config import VllmConfig
from vllm.distributed.utils import (
    bind_memory_to_node,
    cpus_for_rank,
    memory_node_for_rank,
    visible_memory_nodes,
)
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.model_runner import ModelRunner
from vllm.v1.worker.stage_output_cache import StageOutputCache

logger = logging.getLogger(__name__)

_MIB = 1024**2


class Worker:
    """Rank `rank` of `tensor_parallel_size`. With more than one rank, `init_device` joins
    the process group at `distributed_init_method` (rank 0's address) and, on CPU, binds
    the process to its cores (`VLLM_CPU_OMP_THREADS_BIND`); `local_rank` and
    `local_world_size` count the ranks on this machine (the cores are split among them)."""

    def __init__(self, vllm_config: VllmConfig, rank: int = 0,
                 distributed_init_method: str | None = None, local_rank: int | None = None,
                 local_world_size: int | None = None) -> None:
        self.vllm_config = vllm_config
        self.rank = rank
        self.world_size = vllm_config.parallel_config.tensor_parallel_size
        self.distributed_init_method = distributed_init_method
        self.local_rank = rank if local_rank is None else local_rank
        self.local_world_size = self.world_size if local_world_size is None \
            else local_world_size
        self.device = torch.device(vllm_config.device_config.device)
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        if self.device.type == "cpu":
            self._bind_cpus()
        elif self.device.type == "cuda" and self.world_size > 1:
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            from vllm.distributed.parallel_state import (
                init_distributed_environment,
                initialize_model_parallel,
            )

            assert self.distributed_init_method is not None, "ranks need rank 0's address"
            backend = "gloo" if self.device.type == "cpu" else "nccl"
            init_distributed_environment(self.world_size, self.rank,
                                         self.distributed_init_method, backend)
            initialize_model_parallel(self.world_size, backend)
        self.model_runner = ModelRunner(self.vllm_config, self.device)

    def _bind_cpus(self) -> None:
        """Only ranks in processes of their own bind (the `uni` executor shares the
        user's process and leaves it alone)."""
        if self.world_size == 1:
            return
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        engine_cpus = self.vllm_config.parallel_config.cpu_ids
        visible = visible_memory_nodes() if bind in (None, "auto") else None
        if engine_cpus is not None:  # a data-parallel engine's cores: its ranks split them
            cpus = cpus_for_rank("auto", self.local_rank, self.local_world_size,
                                 available=list(engine_cpus))
            visible = None
        else:
            cpus = cpus_for_rank(bind, self.local_rank, self.local_world_size,
                                 visible=visible)
        if cpus is None:
            return
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
        node = memory_node_for_rank(self.local_rank, self.local_world_size, visible)
        if node is not None:
            try:
                bind_memory_to_node(node)
            except OSError as e:
                logger.warning("Rank %d: memory not bound to NUMA node %d: %s", self.rank,
                               node, e)
        logger.info("Rank %d bound to CPUs %s (%d threads)%s.", self.rank, cpus, len(cpus),
                    f", memory on NUMA node {node}" if node is not None else "")

    @property
    def runner(self) -> ModelRunner:
        assert self.model_runner is not None, "init_device() first"
        return self.model_runner

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        """Blocks that fit the KV budget. A block costs its KV bytes plus its rows in the
        stage-output cache (when the engine returns hidden states), so turning that cache
        on lowers the number of blocks rather than quietly going over the budget. With
        tensor parallel the budget is each rank's (its KV heads are a slice)."""
        cache = self.vllm_config.cache_config
        kv_bytes = self.runner.get_kv_cache_block_bytes()
        specs = self.runner.stage_output_specs()
        stage_bytes = StageOutputCache.block_bytes(cache.block_size, specs)
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        else:
            num_blocks = cache.kv_cache_memory_bytes // (kv_bytes + stage_bytes)
        if self.rank == 0:
            logger.info("KV cache: %d blocks of %d tokens, %.1f MiB%s.", num_blocks,
                        cache.block_size, num_blocks * kv_bytes / _MIB,
                        f" per rank ({self.world_size} ranks)" if self.world_size > 1 else "")
            if specs:
                logger.info("Stage-output cache (%s): %.1f MiB, %d bytes per block (%.1f%% of "
                            "each block's budget).", ", ".join(specs),
                            num_blocks * stage_bytes / _MIB, stage_bytes,
                            100 * stage_bytes / (kv_bytes + stage_bytes))
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_model()
        # Every rank samples the same tokens from the same gathered logits: their global
        # generators must agree, whatever set-up drew from them.
        torch.manual_seed(self.vllm_config.model_config.seed)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output on rank 0; None elsewhere (every rank holds the same)."""
        output = self.runner.execute_model(scheduler_output)
        return output if self.rank == 0 else None

    def embed_media(self, modality: str, data: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.runner.embed_media(modality, data)

    def drop_requests(self, req_ids: list[str]) -> None:
        self.runner.drop_requests(req_ids)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.runner.lora().add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.runner.lora().remove_lora(lora_int_id)

    def get_state(self) -> dict[str, int]:
        runner = self.runner
        return {"num_runner_requests": len(runner.requests),
                "num_batch_rows": runner.input_batch.num_reqs}

    def shutdown(self) -> None:
        runner = self.model_runner
        if runner is not None:
            runner.kv_caches = []
            runner.stage_outputs = StageOutputCache(0, runner.block_size, {})
        if self.world_size > 1:
            from vllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()
