"""`AsyncPipeline`: the served pipeline, one `AsyncLLM` (its own engine-core process) per stage.

    add_request ─► stage 0 AsyncLLM ─► connector ─► stage 1 AsyncLLM ─► ... ─► RequestStream
                   (engine-core proc)               (engine-core proc)        last stage's
                                                                              outputs, streamed

It answers the calls the OpenAI handlers make of `AsyncLLM` (`add_request`, `iterate`,
`abort_nowait`, health, `vllm_config`, `tokenizer`), so `vllm serve --pipeline` reuses them
unchanged. Each request is its own task: it enters stage k+1 as soon as stage k finishes
it, and every stage batches whatever requests it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from vllm.outputs import RequestOutput
from vllm.pipeline.stage import (
    Stage,
    load_pipeline_spec,
    resolve_connectors,
    stage_engine_args,
    stage_params,
)
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream, StatLogger


class AsyncPipeline:
    """Stages served from one API process; prompts are checked by the first stage, and the
    caller's sampling params apply to the last stage (earlier stages use their own
    `Stage.sampling_params`).

    Args:
        stat_loggers: attached to the last stage (one request counted once).
    """

    def __init__(self, stages: list[Stage], connectors: list[Any] | None = None,
                 stat_loggers: list[StatLogger] | None = None) -> None:
        self.stages = list(stages)
        self.connectors = resolve_connectors(self.stages, connectors)
        self.engines: list[AsyncLLM] = []
        all_args = stage_engine_args(self.stages, self.connectors)
        try:
            for k, args in enumerate(all_args):
                loggers = stat_loggers if k == len(all_args) - 1 else None
                self.engines.append(AsyncLLM(args.create_engine_config(), loggers))
        except BaseException:
            self.shutdown()
            raise
        self.vllm_config = self.engines[0].vllm_config
        self.tokenizer = self.engines[0].tokenizer
        self._tasks: dict[str, asyncio.Task] = {}

    @classmethod
    def from_yaml(cls, path: str, stat_loggers: list[StatLogger] | None = None
                  ) -> AsyncPipeline:
        spec = load_pipeline_spec(path)
        return cls(spec.stages, spec.connectors, stat_loggers)

    # ---- health ---------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return any(engine.errored for engine in self.engines)

    @property
    def dead_error(self) -> EngineDeadError:
        for engine in self.engines:
            if engine.errored:
                return engine.dead_error
        return EngineDeadError("The pipeline is not running.")

    def dead_engines(self) -> list[EngineDeadError]:
        return [error for engine in self.engines for error in engine.dead_engines()]

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    # ---- requests -------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          arrival_time: float | None = None,
                          data_parallel_rank: int | None = None) -> RequestStream:
        """Queues one prompt at the first stage (on its engine core `data_parallel_rank`,
        None: routed); raises ValueError (nothing queued) for a bad prompt or params the
        last stage cannot honour."""
        last_config = self.engines[-1].vllm_config.model_config
        if params.return_hidden_states and not last_config.enable_return_hidden_states:
            raise ValueError("return_hidden_states is set, but the pipeline's last stage does "
                             "not keep hidden states: give it enable_return_hidden_states.")
        per_stage = self._params_per_stage(params)
        first = await self.engines[0].add_request(request_id, prompt, per_stage[0],
                                                  arrival_time, data_parallel_rank)
        stream = RequestStream(request_id, params.output_kind == RequestOutputKind.DELTA)
        task = asyncio.get_running_loop().create_task(
            self._run(request_id, first, per_stage, stream))
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))
        return stream

    def _params_per_stage(self, params: SamplingParams) -> list[SamplingParams]:
        given = [stage.sampling_params for stage in self.stages[:-1]] + [params]
        connectors = [*self.connectors, None]
        return [stage_params(p, c) for p, c in zip(given, connectors)]

    async def _run(self, request_id: str, first: RequestStream,
                   per_stage: list[SamplingParams], stream: RequestStream) -> None:
        """Carries one request through the stages; the last stage's outputs (or the error
        that stopped it) go to `stream`."""
        earlier: list[RequestOutput] = []
        current, stage = first, 0
        try:
            while True:
                async for output in self.engines[stage].iterate(current):
                    if stage == len(self.engines) - 1:
                        output.stage_outputs = earlier
                        stream.put(output)
                    elif output.finished:
                        earlier.append(output)
                if stage == len(self.engines) - 1:
                    return
                prompt = self.connectors[stage](earlier[-1])
                stage += 1
                current = await self.engines[stage].add_request(request_id, prompt,
                                                                per_stage[stage])
        except asyncio.CancelledError:
            self.engines[stage].abort_nowait([request_id])
            raise
        except Exception as e:
            self.engines[stage].abort_nowait([request_id])
            stream.put(e)

    def iterate(self, stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
        """Yields a request's last-stage outputs; aborts it if the consumer stops early."""
        return stream.outputs(self.abort_nowait)

    async def generate(self, prompt: Any, sampling_params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        stream = await self.add_request(request_id, prompt, sampling_params)
        async for output in self.iterate(stream):
            yield output

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Stops requests wherever they are: their tasks end, and every stage forgets them
        (stages that do not hold a request ignore its id)."""
        for request_id in request_ids:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()
        for engine in self.engines:
            engine.abort_nowait(list(request_ids))

    async def abort(self, request_id: str | list[str]) -> None:
        self.abort_nowait([request_id] if isinstance(request_id, str) else list(request_id))

    # ---- utilities ------------------------------------------------------------------

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def reset_prefix_cache(self) -> bool:
        results = [await engine.reset_prefix_cache() for engine in self.engines]
        return all(results)

    def shutdown(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for engine in self.engines:
            engine.shutdown()
