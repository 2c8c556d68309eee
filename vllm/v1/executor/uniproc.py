"""`UniProcExecutor`: one worker (one rank) in this process."""

from __future__ import annotations

from typing import Any

from vllm.v1.executor.abstract import Executor
from vllm.v1.worker.model_runner import ModelRunner
from vllm.v1.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.vllm_config)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    @property
    def model_runner(self) -> ModelRunner:
        return self.driver_worker.runner

    def collective_rpc(self, method: str, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]
