"""`POST /v1/completions`: text, token-id and prompt-embeds prompts, batched, streamed or not."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from vllm.entrypoints.embeds_codec import (
    decode_prompt_embeds,
    encode_tensor,
    prompt_embeds_byte_budget,
)
from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.prompt_embeds import EmbedsBytesInFlight, EmbedsLease
from vllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    PromptTokenUsageInfo,
    UsageInfo,
)
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServedEngine,
    ServingOptions,
    cached_tokens_usage,
    merge_async_iterators,
    raise_if_failed,
    random_id,
    sse,
    stream_error,
)
from vllm.outputs import CompletionOutput
from vllm.v1.engine.processor import PROMPT_LOGPROBS_WITH_EMBEDS
from vllm.v1.outputs import SampleLogprobs

# A request may carry this many maximum-size prompt_embeds (more, if they are shorter).
_MAX_EMBEDS_PER_REQUEST = 8
# Seconds a client refused for want of prompt-embeds room is told to wait.
_EMBEDS_RETRY_AFTER_S = 1
EMBEDS_DISABLED = ("prompt_embeds given, but prompt embeds are disabled: start the server "
                   "with --enable-prompt-embeds.")


_T = TypeVar("_T")


class EmbedsIntake:
    """The server's one way in for untrusted `prompt_embeds` (completion prompts and chat
    content parts alike): the byte budget of one tensor, the server-wide cap on decoded
    bytes in flight, and the single decoding thread (torch.load's sparse-invariant
    checking is process-global state)."""

    def __init__(self, options: ServingOptions, max_model_len: int, hidden_size: int) -> None:
        self.in_flight = EmbedsBytesInFlight(options.max_prompt_embeds_bytes_in_flight)
        self.budget = prompt_embeds_byte_budget(max_model_len, hidden_size)
        self.max_request_chars = _MAX_EMBEDS_PER_REQUEST * self.budget * 4 // 3
        self._decode_pool = ThreadPoolExecutor(1, thread_name_prefix="prompt-embeds")

    def reserve(self, datas: list[Any], copies: int) -> EmbedsLease:
        """Reserves the decoded size of `datas` (3/4 of the base64, once per sample: each
        of the n samples holds its copy in the engine core); raises OpenAIError."""
        total = sum(len(d) for d in datas if isinstance(d, str)) * copies
        if total > self.max_request_chars:
            raise OpenAIError(f"The prompt_embeds of one request total {total} base64 "
                              f"characters (times n={copies}), over the limit of "
                              f"{_MAX_EMBEDS_PER_REQUEST} maximum-size prompts; split the "
                              "batch into several requests.")
        num_bytes = sum(len(d) * 3 // 4 for d in datas if isinstance(d, str)) * copies
        limit = self.in_flight.limit
        if num_bytes > limit:
            raise OpenAIError(f"The prompt_embeds of this request take {num_bytes} bytes, more "
                              f"than the server's limit of {limit} bytes in flight "
                              "(--max-prompt-embeds-bytes-in-flight).")
        lease = self.in_flight.reserve(num_bytes)
        if lease is None:
            raise _embeds_busy()
        return lease

    async def decode(self, data: Any, lease: EmbedsLease, copies: int,
                     name: str = "prompt_embeds") -> torch.Tensor:
        """The dense tensor in `data` (base64 of torch.save), decoded off the event loop
        under the byte budget; raises OpenAIError (naming the field `name`)."""
        loop = asyncio.get_running_loop()
        try:
            embeds = await loop.run_in_executor(self._decode_pool, decode_prompt_embeds, data,
                                                self.budget, name)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        # A sparse payload decodes larger than its base64 suggested.
        extra = (embeds.numel() * embeds.element_size() - len(data) * 3 // 4) * copies
        if extra > 0 and not lease.grow(extra):
            raise _embeds_busy()
        return embeds

    @staticmethod
    async def leased(lease: EmbedsLease, work: Awaitable[_T]) -> _T:
        """`work`'s response, holding the lease until it is done: a response at once, a
        stream (an async generator) when it is closed or dropped unread."""
        try:
            result = await work
        except BaseException:
            lease.release()
            raise
        if not isinstance(result, AsyncGenerator):
            lease.release()
            return result
        weakref.finalize(result, lease.release)  # a stream never started is dropped unread
        return cast("_T", _release_at_end(result, lease))


@dataclass(slots=True)
class CompletionPrompt:
    engine_prompt: dict[str, Any]  # what AsyncLLM.add_request takes
    text: str | None  # for echo; None for embeds
    num_tokens: int | None  # None when the embeds shape is invalid (the Processor says why)


class OpenAIServingCompletion(OpenAIServing):
    """Turns a CompletionRequest into one engine request per prompt (embeds prompts first)."""

    def __init__(self, engine: ServedEngine, served_model_names: list[str],
                 options: ServingOptions | None = None) -> None:
        super().__init__(engine, served_model_names, options)
        mc = self.model_config
        self.embeds = EmbedsIntake(self.options, mc.max_model_len, mc.hidden_size)
        self.max_request_body_bytes = self.embeds.max_request_chars

    async def create_completion(self, request: CompletionRequest
                                ) -> CompletionResponse | AsyncGenerator[str, None]:
        """The response, or an SSE generator when `request.stream`; raises OpenAIError.

        The request's prompt_embeds bytes count against the server-wide cap from before
        they are decoded until the response is done (for a stream: until it is closed, or
        dropped unread)."""
        self.check_model(request.model)
        self._check_unsupported(request)
        copies = max(1, request.n or 1)
        lease = self.embeds.reserve(_as_list(request.prompt_embeds), copies)
        return await self.embeds.leased(lease, self._create_completion(request, lease))

    async def _create_completion(self, request: CompletionRequest, lease: EmbedsLease
                                 ) -> CompletionResponse | AsyncGenerator[str, None]:
        prompts = await self._make_prompts(request, lease)
        for prompt in prompts:
            self.check_max_tokens(prompt.num_tokens, request.max_tokens)
        try:
            if request.use_beam_search:
                params = request.to_beam_search_params(
                    request.max_tokens or self.model_config.max_model_len, request.logprobs)
            else:
                params = request.to_sampling_params(request.max_tokens, request.logprobs,
                                                    request.prompt_logprobs,
                                                    self.model_config.generation_defaults)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        params.return_hidden_states = request.return_hidden_states
        request_id = random_id("cmpl", request.request_id)
        streams = await self.add_requests(request_id, [p.engine_prompt for p in prompts],
                                          params, self.check_model(request.model))
        if request.stream:
            return self._stream(request, request_id, prompts, streams)
        outputs = await self.final_outputs(streams)
        return self._response(request, request_id, prompts, outputs)

    def _check_unsupported(self, request: CompletionRequest) -> None:
        has_embeds = bool(request.prompt_embeds)
        if request.prompt is None and not has_embeds:
            raise OpenAIError("Either prompt or prompt_embeds must be given.")
        if has_embeds and not self.model_config.enable_prompt_embeds:
            raise OpenAIError(EMBEDS_DISABLED)
        if has_embeds and request.echo:
            raise OpenAIError("echo is not supported with prompt_embeds: there is no prompt "
                              "text to echo.")
        if has_embeds and request.prompt_logprobs is not None:
            raise OpenAIError(PROMPT_LOGPROBS_WITH_EMBEDS)
        if request.echo and request.logprobs is not None:
            raise OpenAIError("echo with logprobs needs prompt logprobs, which this server "
                              "does not support.")
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported.")
        if request.logit_bias:
            raise OpenAIError("logit_bias is not supported.")
        if not request.use_beam_search:
            if request.best_of is not None and request.best_of != request.n:
                raise OpenAIError("best_of is supported only with use_beam_search (beams) "
                                  "or equal to n.")
            if request.length_penalty != 1.0:
                raise OpenAIError("length_penalty applies only with use_beam_search=true.")
        self.check_logprobs(request.logprobs, "logprobs")

    # ---- prompts ----------------------------------------------------------------------

    async def _make_prompts(self, request: CompletionRequest, lease: EmbedsLease
                            ) -> list[CompletionPrompt]:
        # Each of the n samples of an embeds prompt holds its own copy in the engine core.
        copies = max(1, request.n or 1)
        prompts = [await self._embeds_prompt(data, lease, copies)
                   for data in _as_list(request.prompt_embeds)]
        prompts += await self._text_prompts(request)
        if request.cache_salt is not None:
            for prompt in prompts:
                prompt.engine_prompt["cache_salt"] = request.cache_salt
        return prompts

    async def _embeds_prompt(self, data: Any, lease: EmbedsLease, copies: int
                             ) -> CompletionPrompt:
        embeds = await self.embeds.decode(data, lease, copies)
        num_tokens = None
        if embeds.dim() == 2 or (embeds.dim() == 3 and embeds.shape[0] == 1):
            num_tokens = embeds.shape[-2]
        return CompletionPrompt({"prompt_embeds": embeds}, None, num_tokens)

    async def _text_prompts(self, request: CompletionRequest) -> list[CompletionPrompt]:
        prompt = request.prompt
        # The openai client needs some `prompt`; vLLM's convention for "embeds only" is "".
        if prompt is None or (request.prompt_embeds and prompt in ("", [], [""])):
            return []
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt is empty.")
        result = []
        # Texts or token-id lists: a bare text or id list was wrapped above.
        for item in cast("list[str | list[int]]", prompt):
            if isinstance(item, str):
                ids = await self.tokenize(item, request.add_special_tokens)
                result.append(CompletionPrompt({"prompt": item, "prompt_token_ids": ids}, item,
                                               len(ids)))
            else:
                text = None
                if request.echo:
                    text = self.require_tokenizer().decode(item)
                result.append(CompletionPrompt({"prompt_token_ids": list(item)}, text,
                                               len(item)))
        return result

    # ---- responses --------------------------------------------------------------------

    def _response(self, request: CompletionRequest, request_id: str,
                  prompts: list[CompletionPrompt], outputs: list[Any]) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        usage = UsageInfo(prompt_tokens_details=cached_tokens_usage(outputs))
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            usage.prompt_tokens += output.num_prompt_tokens
            for completion in output.outputs:
                prefix = prompt.text if request.echo and prompt.text else ""
                usage.completion_tokens += len(completion.token_ids)
                choices.append(CompletionResponseChoice(
                    index=i * request.n + completion.index,
                    text=prefix + completion.text,
                    logprobs=_logprobs(completion, request.logprobs, len(prefix)),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    hidden_states=_hidden_states(completion),
                ))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(id=request_id, model=self.response_model(request.model),
                                  choices=choices, usage=usage)

    async def _stream(self, request: CompletionRequest, request_id: str,
                      prompts: list[CompletionPrompt], streams: list[Any]
                      ) -> AsyncGenerator[str, None]:
        n = request.n
        text_lens = [0] * (len(prompts) * n)  # text sent so far, per choice
        usage = UsageInfo()
        cached_tokens = 0  # of the finished prompts, served from the prefix cache
        iterators = [self.engine.iterate(s) for s in streams]
        try:
            async for i, output in merge_async_iterators(*iterators):
                raise_if_failed(output)
                if output.finished:
                    usage.prompt_tokens += output.num_prompt_tokens
                    cached_tokens += output.num_cached_tokens
                for completion in output.outputs:
                    index = i * n + completion.index
                    text = completion.text
                    if request.echo and text_lens[index] == 0 and prompts[i].text:
                        text = prompts[i].text + text
                    usage.completion_tokens += len(completion.token_ids)
                    logprobs = _logprobs(completion, request.logprobs, text_lens[index])
                    text_lens[index] += len(text)
                    if not (text or logprobs or completion.finish_reason):
                        continue
                    yield sse(CompletionStreamResponse(
                        id=request_id, model=self.response_model(request.model),
                        choices=[CompletionResponseChoice(
                            index=index, text=text, logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                            hidden_states=_hidden_states(completion))]))
            if request.include_usage_in_stream:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens)
                yield sse(CompletionStreamResponse(
                    id=request_id, model=self.response_model(request.model), choices=[],
                    usage=usage))
        except Exception as e:
            yield sse(stream_error(e))
        yield "data: [DONE]\n\n"


def _embeds_busy() -> OpenAIError:
    return OpenAIError("The server holds as many prompt_embeds bytes as it may "
                       "(--max-prompt-embeds-bytes-in-flight); retry shortly.",
                       "ServiceUnavailableError", 503,
                       {"Retry-After": str(_EMBEDS_RETRY_AFTER_S)})


async def _release_at_end(stream: AsyncGenerator[str, None], lease: EmbedsLease
                          ) -> AsyncGenerator[str, None]:
    try:
        async for chunk in stream:
            yield chunk
    finally:
        lease.release()
        await stream.aclose()


def _hidden_states(completion: CompletionOutput) -> str | None:
    """A finished choice's hidden states as base64 of torch.save (on its last chunk when
    streaming: the engine returns them with the final output)."""
    if completion.hidden_states is None:
        return None
    return encode_tensor(completion.hidden_states)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _logprobs(completion: CompletionOutput, num: int | None,
              text_offset: int) -> CompletionLogProbs | None:
    """OpenAI's completion logprobs for the tokens in `completion` (a delta when streaming)."""
    if num is None or completion.logprobs is None:
        return None
    result = CompletionLogProbs()
    entries: SampleLogprobs = completion.logprobs
    for token_id, entry in zip(completion.token_ids, entries, strict=False):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.text_offset.append(text_offset)
        text_offset += len(token)
        top = {}
        for lp in sorted(entry.values(), key=lambda lp: lp.rank or 0):
            if lp.rank is not None and lp.rank <= max(num, 1):
                top.setdefault(lp.decoded_token or "", lp.logprob)
        top.setdefault(token, sampled.logprob)
        result.top_logprobs.append(top)
    return result
