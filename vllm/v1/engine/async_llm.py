"""`AsyncLLM`: asyncio front end over an engine core in a background process (the server's engine).

    generate() ─► Processor ─► AsyncMPClient ══ZMQ══► EngineCore (own process)
         ▲                                                   │
         └── per-request queue ◄── OutputProcessor ◄── output handler task

With `data_parallel_size` N > 1 the client is a `DPAsyncMPClient`: N engine cores, each
request routed to one of them (all children of an n > 1 request, and every prompt of one
OpenAI call, to the same one); an engine that dies fails only the requests it held.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.inputs.parse import ParsedPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from vllm.v1.engine.core_client import AsyncMPClient, DPAsyncMPClient, EngineDeadError, EngineLost
from vllm.v1.engine.front_end import build_front_end, fan_out, register_request
from vllm.v1.engine.output_processor import ParentRequest
from vllm.v1.metrics.stats import IterationStats, RequestStatsTracker

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]

# Outputs handled per slice before yielding to the event loop (keeps streams responsive).
_OUTPUT_CHUNK = 128


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_index: int = 0) -> None: ...


class RequestStream:
    """The outputs of one user request, in order; an exception put in is raised.

    Bounded: it holds at most one pending output. An output that arrives before the reader
    took the last one is folded into it (`RequestOutput.add`: DELTA outputs concatenate,
    others replace), so a slow reader costs at most one request's own output, never a
    queue that grows with every step.
    """

    def __init__(self, request_id: str, delta: bool = False) -> None:
        self.request_id = request_id
        self.delta = delta  # outputs are DELTA: fold by appending
        self.engine_index: int | None = None  # the data-parallel engine serving it
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        if isinstance(pending, RequestOutput) and isinstance(item, RequestOutput):
            pending.add(item, aggregate=self.delta)
        elif not isinstance(pending, BaseException):  # the first error stays
            self._pending = item
        self._ready.set()

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        assert item is not None  # `put` sets the event only with an item pending
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def outputs(self, abort_nowait: Callable[[list[str]], None]
                      ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the outputs until the last; a consumer that stops early (closes or
        cancels the iterator) aborts the request through `abort_nowait`."""
        try:
            while not self.finished:
                yield await self.get()
        finally:
            if not self.finished:
                abort_nowait([self.request_id])


class AsyncLLM:
    """Serves many concurrent requests; `generate` is an async iterator of `RequestOutput`s.

    Tokenizing, validation and detokenizing happen here (the API process); scheduling and
    the model run in the engine-core process. Abandoning a `generate` iterator (a client
    that disconnected) aborts the request in the core, which frees its KV blocks.
    """

    def __init__(self, vllm_config: VllmConfig,
                 stat_loggers: list[StatLogger] | None = None) -> None:
        self.vllm_config = vllm_config
        self.tokenizer, self.processor, self.output_processor = build_front_end(
            vllm_config.model_config, vllm_config.lora_config)
        self.stats_tracker = RequestStatsTracker()
        self.stat_loggers = list(stat_loggers or [])
        self.engine_core = (DPAsyncMPClient(vllm_config)
                            if vllm_config.parallel_config.data_parallel_size > 1
                            else AsyncMPClient(vllm_config))
        vllm_config.cache_config.num_blocks = self.engine_core.num_blocks
        self._output_handler: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        # Engine-core ids are `{request_id}-{n}` with n unique to this engine, so a late
        # abort of a finished request can never reach a newer one with the same id.
        self._submissions = itertools.count()
        self._adding: set[str] = set()  # ids being validated (audio: off the event loop)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs,
                         stat_loggers: list[StatLogger] | None = None) -> AsyncLLM:
        return cls(engine_args.create_engine_config(), stat_loggers)

    # ---- health ---------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return not self.engine_core.is_alive()

    @property
    def dead_error(self) -> EngineDeadError:
        return self.engine_core.dead_error or EngineDeadError("The engine core is not running.")

    def dead_engines(self) -> list[EngineDeadError]:
        """Why each engine core that is gone is gone: with data parallel, some may be gone
        while the others serve (`errored` is False until all are)."""
        return self.engine_core.dead_engines()

    async def check_health(self) -> None:
        """Raises `EngineDeadError` if the engine core process is gone."""
        if self.errored:
            raise self.dead_error

    # ---- requests -------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          arrival_time: float | None = None,
                          data_parallel_rank: int | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Validates and queues one prompt; raises ValueError (bad input or an id a live
        request has, nothing queued) or EngineDeadError. `data_parallel_rank` picks the
        engine core (None: the router's choice); `stream.engine_index` says which served."""
        if self.errored:
            raise self.dead_error
        if request_id in self._adding:
            raise ValueError(f"Request id {request_id!r} is already in use by a request "
                             "that has not finished.")
        self.output_processor.check_request_id(request_id)
        self._adding.add(request_id)
        try:
            return await self._add_request(request_id, prompt, params, arrival_time,
                                           data_parallel_rank, lora_request)
        finally:
            self._adding.discard(request_id)

    async def _add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                           arrival_time: float | None, engine_index: int | None,
                           lora_request: LoRARequest | None = None) -> RequestStream:
        core_id = f"{request_id}-{next(self._submissions)}"
        if self.processor.is_audio_model or (isinstance(prompt, dict)
                                             and prompt.get("multi_modal_data") is not None):
            # Log-mel features and image decoding take tens of milliseconds: off the loop.
            request, parsed = await asyncio.to_thread(
                self.processor.process_inputs, core_id, prompt, params, arrival_time,
                lora_request)
        else:
            request, parsed = self.processor.process_inputs(core_id, prompt, params,
                                                            arrival_time, lora_request)
        self._ensure_output_handler()
        stream = RequestStream(request_id, params.output_kind == RequestOutputKind.DELTA)
        parent, requests = fan_out(request, params.n, params.output_kind)
        try:
            for index, core_request in enumerate(requests):  # children follow the first
                engine_index = await self._add_engine_request(core_request, parsed, stream,
                                                              parent, index, engine_index)
                stream.engine_index = engine_index
        except BaseException:
            self.abort_nowait([request_id])
            raise
        return stream

    async def _add_engine_request(self, request: EngineCoreRequest, parsed: ParsedPrompt,
                                  stream: RequestStream, parent: ParentRequest | None = None,
                                  index: int = 0, engine_index: int | None = None) -> int:
        register_request(self.output_processor, request, parsed, parent, index, queue=stream,
                         external_id=stream.request_id)
        engine_index = await self.engine_core.add_request_async(request, engine_index)
        self.stats_tracker.add(request.request_id, request.arrival_time,
                               request.num_prompt_tokens, engine_index)
        return engine_index

    async def generate(self, prompt: Any, sampling_params: SamplingParams,
                       request_id: str, lora_request: LoRARequest | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the request's outputs (per `sampling_params.output_kind`) until finished.

        Closing or cancelling the iterator early aborts the request.
        """
        stream = await self.add_request(request_id, prompt, sampling_params,
                                        lora_request=lora_request)
        async for output in self.iterate(stream):
            yield output

    def iterate(self, stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
        """Yields a stream's outputs; aborts the request if the consumer stops early."""
        return stream.outputs(self.abort_nowait)

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        core_ids = self._forget(ids)
        await self.engine_core.abort_requests_async(core_ids)

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Abort from synchronous code (a `finally` of a cancelled stream)."""
        core_ids = self._forget(request_ids)
        if core_ids and not self.errored:
            self._spawn(self.engine_core.abort_requests_async(core_ids))

    def _forget(self, request_ids: list[str]) -> list[str]:
        core_ids = self.output_processor.abort_requests(request_ids)
        self._log(None, self.stats_tracker.end(core_ids, "abort", time.monotonic()))
        return core_ids

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- outputs --------------------------------------------------------------------

    def _ensure_output_handler(self) -> None:
        if self._output_handler is None or self._output_handler.done():
            self._output_handler = asyncio.get_running_loop().create_task(
                self._run_output_handler())

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                if isinstance(outputs, EngineLost):
                    self._fail_engine(outputs)
                else:
                    await self._process_outputs(outputs)
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:
            logger.exception("The output handler failed.")
            self._fail_all(EngineDeadError(f"The output handler failed: {e}"))

    async def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.monotonic()
        self._log(outputs.scheduler_stats, self.stats_tracker.update(outputs, now),
                  outputs.engine_index)
        items = outputs.outputs
        for start in range(0, len(items), _OUTPUT_CHUNK):
            if start:
                await asyncio.sleep(0)
            chunk = EngineCoreOutputs(items[start:start + _OUTPUT_CHUNK])
            ready, stopped = self.output_processor.process_outputs(chunk)
            for state, request_output in ready:
                state.queue.put(request_output)
            if stopped:  # a stop string matched: finished here, the core must stop it too
                self._log(None, self.stats_tracker.end(stopped, "stop", now))
                await self.engine_core.stop_requests_async(stopped)

    def _fail_all(self, error: BaseException) -> None:
        self._fail([s.queue for s in self.output_processor.request_states.values()], error)

    def _fail_engine(self, lost: EngineLost) -> None:
        """One engine core of several died: only the requests it held fail."""
        self._log(SchedulerStats(), None, lost.engine_index)  # it runs and holds nothing
        self._fail([s.queue for s in self.output_processor.request_states.values()
                    if s.queue.engine_index == lost.engine_index], lost.error)

    def _fail(self, streams: list[RequestStream], error: BaseException) -> None:
        unique = list({id(stream): stream for stream in streams}.values())  # n > 1: shared
        core_ids = self.output_processor.abort_requests([s.request_id for s in unique])
        self._log(None, self.stats_tracker.end(core_ids, "error", time.monotonic()))
        for stream in unique:
            stream.put(error)

    def _log(self, scheduler_stats: SchedulerStats | None,
             iteration_stats: IterationStats | None, engine_index: int = 0) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record(scheduler_stats, iteration_stats, engine_index)

    # ---- utilities ------------------------------------------------------------------

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.reset_prefix_cache_async()

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Checks an adapter here (a ValueError if bad) and loads it into every engine
        core's workers ahead of its requests."""
        self.processor.check_lora(lora_request)
        lora = lora_request
        await self.call_engines("add_lora", lora.lora_name, lora.lora_int_id, lora.lora_path,
                                lora.base_model_name)
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        return any(await self.call_engines("remove_lora", lora_int_id))

    async def get_scheduler_stats(self) -> list[dict[str, Any]]:
        """Running/waiting requests and KV usage of each live engine core, asked now."""
        return await self.call_engines("get_scheduler_stats")

    async def call_engines(self, method: str, *args: Any) -> list[Any]:
        """A utility call on every live engine core, in engine order."""
        return [await engine.call_utility_async(method, *args)
                for engine in self.engine_core.engines if engine.is_alive()]

    def shutdown(self) -> None:
        if self._output_handler is not None:
            self._output_handler.cancel()
        self.engine_core.shutdown()
