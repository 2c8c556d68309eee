"""`Executor`: what the engine core talks to. It runs the workers (one per tensor-parallel
rank) and calls their methods by name on all of them (`collective_rpc`).

    uni  UniProcExecutor          one worker in this process
    mp   MultiprocExecutor        one worker process per rank on this machine
    ray  RayDistributedExecutor   one Ray actor per rank in a placement group (any machine)

An executor owns its workers and whatever holds them (processes, actors, the placement
group): `shutdown()` releases them, and the executors that start processes or actors also
release them through a `weakref.finalize` when they are garbage-collected unshut.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from vllm.config import ParallelConfig, VllmConfig
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput


class ExecutorDeadError(RuntimeError):
    """A worker is gone (its process or actor died): the engine cannot go on."""


class Executor(ABC):
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self._init_executor()

    @staticmethod
    def get_class(parallel_config: ParallelConfig) -> type[Executor]:
        backend = parallel_config.distributed_executor_backend
        if backend == "uni":
            from vllm.v1.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from vllm.v1.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from vllm.v1.executor.ray_executor import RayDistributedExecutor

            return RayDistributedExecutor
        raise ValueError(f"Unknown distributed_executor_backend {backend!r}.")

    @abstractmethod
    def _init_executor(self) -> None:
        """Starts the workers: device, process group, model loaded."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Calls `Worker.<method>(*args, **kwargs)` on every rank; their results in rank
        order. A worker's exception is raised here; a dead worker is `ExecutorDeadError`."""

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.collective_rpc("execute_model", (scheduler_output,))[0]
        assert output is not None  # rank 0 returns the step's output
        return output

    def embed_media(self, modality: str, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """A multimodal model's rows of media items (`MediaInput.data`) -> each item's
        [num_tokens, hidden], CPU."""
        return self.collective_rpc("embed_media", (modality, data))[0]

    def drop_requests(self, req_ids: list[str]) -> None:
        self.collective_rpc("drop_requests", (req_ids,))

    def get_state(self) -> dict[str, int]:
        return self.collective_rpc("get_state")[0]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter into every rank's CPU cache (a ValueError if bad); True if it
        was not there."""
        return self.collective_rpc("add_lora", (lora_request,))[0]

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.collective_rpc("remove_lora", (lora_int_id,))[0]

    def shutdown(self) -> None:
        """Lets every rank drop its caches and leave its process group, then releases the
        workers; idempotent."""
        self.collective_rpc("shutdown")
