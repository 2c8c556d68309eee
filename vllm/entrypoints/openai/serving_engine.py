"""What the completion and chat handlers share: errors, model names, ids, stream helpers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    OpenAIBaseModel,
    PromptTokenUsageInfo,
)
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.pipeline.async_pipeline import AsyncPipeline
from vllm.sampling_params import MAX_LOGPROBS, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream

if TYPE_CHECKING:
    from vllm.entrypoints.openai.serving_models import ServedLoRAs

T = TypeVar("T")


def error_response(error: OpenAIError) -> ErrorResponse:
    """The OpenAI error body of `error`."""
    return ErrorResponse(error=ErrorInfo(message=error.message, type=error.err_type,
                                         code=error.status_code))


# What the handlers serve: one engine, or a pipeline of them (it answers the same calls).
ServedEngine = AsyncLLM | AsyncPipeline

# What the client of a request the engine failed on gets (the details are in the log).
REQUEST_FAILED = ("Internal server error: the engine failed while running this request "
                  "(other requests were not affected).")


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """Server-wide limits and trust settings of the endpoint handlers."""

    # Bytes of decoded prompt_embeds that requests in flight may hold together.
    max_prompt_embeds_bytes_in_flight: int = 2**30
    # Requests may bring their own chat template (it is code run by the server).
    trust_request_chat_template: bool = False
    # The server's chat template (--chat-template), in place of the tokenizer's.
    chat_template: str | None = None
    # The parser that finds tool calls under tool_choice "auto" (--enable-auto-tool-choice
    # --tool-call-parser NAME); None: "auto" is refused.
    tool_parser: str | None = None
    # The LoRA adapters served beside the model (--enable-lora --lora-modules), by name.
    loras: ServedLoRAs | None = None


def raise_if_failed(output: RequestOutput) -> None:
    """A sequence the engine failed on (finish_reason "error") fails its HTTP request."""
    if any(c.finish_reason == "error" for c in output.outputs):
        raise OpenAIError(REQUEST_FAILED, "InternalServerError", 500)


def cached_tokens_usage(outputs: list[RequestOutput]) -> PromptTokenUsageInfo:
    return PromptTokenUsageInfo(cached_tokens=sum(o.num_cached_tokens for o in outputs))


def sse(payload: OpenAIBaseModel | str) -> str:
    """One server-sent event."""
    if isinstance(payload, OpenAIBaseModel):
        payload = payload.model_dump_json()
    return f"data: {payload}\n\n"


def stream_error(error: Exception) -> ErrorResponse:
    """The error event sent when a stream fails after its 200 status went out."""
    if isinstance(error, OpenAIError):
        return error_response(error)
    return error_response(OpenAIError(str(error), "InternalServerError", 500))


def random_id(prefix: str, given: str | None = None) -> str:
    """`{prefix}-{given}`, or a random id when the client gave none."""
    return f"{prefix}-{given if given is not None else uuid.uuid4().hex}"


async def merge_async_iterators(*iterators: AsyncGenerator[Any, None]
                                ) -> AsyncGenerator[tuple[int, Any], None]:
    """Yields (iterator index, item) from all iterators as items arrive.

    Stopping early (or being cancelled) cancels the pending reads and closes every
    iterator, so each can clean up (abort its request).
    """
    loop = asyncio.get_running_loop()
    pending = {loop.create_task(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[loop.create_task(anext(iterators[index]))] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            if hasattr(it, "aclose"):
                await it.aclose()


async def run_until(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """`work`'s result; None if `stop` is set first, the work then cancelled (a generation
    it awaits is aborted). Cancelling this cancels the work too."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def iterate_until(items: AsyncIterator[T], stop: asyncio.Event
                        ) -> AsyncGenerator[T, None]:
    """`items` (never None) until `stop` is set: a read still waiting then is cancelled
    (the iterator ends there, as a generator that a cancellation reached does)."""
    while not stop.is_set():
        try:
            item = await run_until(anext(items), stop)
        except StopAsyncIteration:
            return
        if item is None and stop.is_set():
            return
        assert item is not None
        yield item


# No tokenizer we support packs more characters than this into one token.
MAX_CHARS_PER_TOKEN = 64


class OpenAIServing:
    """Base of the endpoint handlers: model-name checks and request submission."""

    def __init__(self, engine: ServedEngine, served_model_names: list[str],
                 options: ServingOptions | None = None) -> None:
        self.engine = engine
        self.options = options or ServingOptions()
        self.model_config = engine.vllm_config.model_config
        self.max_model_len = self.model_config.max_model_len
        self.served_model_names = served_model_names
        self.tokenizer = engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); an unknown name
        is vLLM's 404."""
        if model is None or model in self.served_model_names:
            return None
        lora = self.options.loras.resolve(model) if self.options.loras is not None else None
        if lora is None:
            raise OpenAIError(f"The model `{model}` does not exist.", "NotFoundError", 404)
        return lora

    def response_model(self, model: str | None) -> str:
        """The `model` a reply names: the adapter a request ran with, else the model's."""
        loras = self.options.loras
        lora = loras.resolve(model) if loras is not None and model else None
        return self.model_name if lora is None else lora.lora_name

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise OpenAIError("This endpoint needs a tokenizer (skip_tokenizer_init is set).")
        return self.tokenizer

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of untrusted text, off the event loop and bounded in size first: text
        over `MAX_CHARS_PER_TOKEN * max_model_len` characters cannot fit the context."""
        tokenizer = self.require_tokenizer()
        max_chars = MAX_CHARS_PER_TOKEN * self.max_model_len
        if len(text) > max_chars:
            raise OpenAIError(f"The prompt has {len(text)} characters, more than the "
                              f"{max_chars} that could fit this model's maximum context length "
                              f"of {self.max_model_len} tokens.")
        encoding = await asyncio.to_thread(tokenizer, text,
                                           add_special_tokens=add_special_tokens)
        return encoding.input_ids

    def check_max_tokens(self, num_prompt_tokens: int | None, max_tokens: int | None) -> None:
        """vLLM's rule: prompt + requested completion must fit in the context window."""
        if num_prompt_tokens is None or max_tokens is None:
            return
        if num_prompt_tokens <= self.max_model_len < num_prompt_tokens + max_tokens:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} "
                f"in the prompt, {max_tokens} in the completion). Please reduce the length "
                "of the prompt or of the completion.")

    @staticmethod
    def check_logprobs(num: int | None, name: str) -> None:
        if num is not None and not 0 <= num <= MAX_LOGPROBS:
            raise OpenAIError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {num}.")

    async def add_requests(self, request_id: str, prompts: list[Any],
                           params: SamplingParams, lora_request: LoRARequest | None = None
                           ) -> list[RequestStream]:
        """Submits every prompt, or none: a bad prompt aborts the ones already added. With
        data parallel, every prompt goes to the engine core the first was routed to."""
        streams: list[RequestStream] = []
        engine_index: int | None = None
        # Only with an adapter: a pipeline (which serves none) takes no such argument.
        lora: dict[str, Any] = {} if lora_request is None else {"lora_request": lora_request}
        try:
            for i, prompt in enumerate(prompts):
                stream = await self.engine.add_request(f"{request_id}-{i}", prompt, params,
                                                       data_parallel_rank=engine_index,
                                                       **lora)
                streams.append(stream)
                engine_index = stream.engine_index
        except ValueError as e:
            self.engine.abort_nowait([s.request_id for s in streams])
            raise OpenAIError(str(e)) from None
        except BaseException:
            self.engine.abort_nowait([s.request_id for s in streams])
            raise
        return streams

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """The finished output of every stream; aborts them all if interrupted."""
        results: list[RequestOutput] = []
        try:
            for stream in streams:
                last = None
                async for output in self.engine.iterate(stream):
                    last = output
                assert last is not None  # a stream yields until its finished output
                results.append(last)
        finally:
            unfinished = [s.request_id for s in streams if not s.finished]
            if unfinished:
                self.engine.abort_nowait(unfinished)
        for result in results:
            raise_if_failed(result)
        return results
