"""`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template.

A chat template is code the server runs, so clients do not get to supply one: a request's
`chat_template` is honoured only behind --trust-request-chat-template, and one smuggled in
`chat_template_kwargs` is refused. Rendering runs off the event loop on bounded input, and
output longer than could fit the context is refused.

Rendering and its checks are `vllm.entrypoints.chat_utils` (shared with `LLM.chat`).
`prompt_embeds` content parts: the template renders with a placeholder per part, the text
between parts is tokenized piece by piece, and the engine gets a mixed prompt of token ids
and rows; the parts decode through the server's one `EmbedsIntake` (byte budget, in-flight
cap) like completion prompts. Media parts (`image_url`, `image_embeds`, `input_audio`,
`audio_url`) are read first, off the event loop (URLs under `MediaConnector`'s rules;
embeddings through the same intake), then each becomes the model's placeholder and the
engine's processor its run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm.entrypoints.chat_utils import (
    EmbedsParts,
    MediaPart,
    chat_placeholders,
    check_template_kwargs,
    input_audio_bytes,
    media_parts,
    render_chat,
    segments_prompt,
    split_at_placeholders,
    take_embeds_parts,
    with_media_placeholders,
)
from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.prompt_embeds import EmbedsLease
from vllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
)
from vllm.entrypoints.openai.serving_completion import EMBEDS_DISABLED, EmbedsIntake
from vllm.entrypoints.openai.serving_engine import (
    MAX_CHARS_PER_TOKEN,
    OpenAIServing,
    ServedEngine,
    ServingOptions,
    cached_tokens_usage,
    raise_if_failed,
    random_id,
    sse,
    stream_error,
)
from vllm.entrypoints.openai.tool_calls import (
    ToolCallStreamer,
    check_tool_request,
    finish_reason_with_tools,
    make_tool_parser,
    tool_calls_of,
    tool_choice_constraint,
)
from vllm.entrypoints.openai.tool_parsers import ToolParser
from vllm.multimodal.media import MediaConnector
from vllm.multimodal.processing import image_embeds_tensor
from vllm.outputs import CompletionOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import RequestStream


class OpenAIServingChat(OpenAIServing):
    """Renders the conversation, then generates like a completion of the rendered text."""

    def __init__(self, engine: ServedEngine, served_model_names: list[str],
                 options: ServingOptions | None = None,
                 embeds: EmbedsIntake | None = None) -> None:
        super().__init__(engine, served_model_names, options)
        # Templates render here, off the event loop (a few threads: renders are short).
        self._render_pool = ThreadPoolExecutor(2, thread_name_prefix="chat-template")
        mc = self.model_config
        # prompt_embeds parts: the server's intake, shared with /v1/completions.
        self.embeds = embeds or EmbedsIntake(self.options, mc.max_model_len, mc.hidden_size)
        # modality -> the text its parts become (`chat_placeholders`); {}: a text model
        self.placeholders = chat_placeholders(mc, self.tokenizer)
        self.media = MediaConnector.from_model_config(mc)  # where media URLs may point

    async def render(self, request: ChatCompletionRequest,
                     messages: list[dict[str, Any]] | None = None) -> str:
        """The request's prompt text, rendered off the event loop; raises OpenAIError."""
        tokenizer = self.require_tokenizer()
        if request.chat_template is not None and not self.options.trust_request_chat_template:
            raise OpenAIError("This request brings its own chat_template, but the server does "
                              "not run templates from requests: start it with "
                              "--trust-request-chat-template to allow them.")
        check_template_kwargs(request.chat_template_kwargs)
        template = request.chat_template or self.options.chat_template
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._render_pool, lambda: render_chat(
                tokenizer, request.messages if messages is None else messages,
                request.add_generation_prompt,
                request.continue_final_message, request.chat_template_kwargs,
                template, MAX_CHARS_PER_TOKEN * self.max_model_len, tools))

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncGenerator[str, None]:
        self.check_model(request.model)
        if request.logit_bias:
            raise OpenAIError("logit_bias is not supported.")
        try:
            media = media_parts(request.messages, tuple(self.placeholders))
            parts = take_embeds_parts(request.messages)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        if media and parts.data:
            raise OpenAIError("A conversation cannot mix media parts and prompt_embeds parts.")
        if parts.data and not self.model_config.enable_prompt_embeds:
            raise OpenAIError(EMBEDS_DISABLED)
        check_tool_request(request, self.options.tool_parser)
        embeds = [data for p in media if p.kind == "image_embeds"
                  for data in (p.value.values() if isinstance(p.value, dict) else [p.value])]
        lease = self.embeds.reserve(parts.data + embeds, max(1, request.n or 1))
        return await self.embeds.leased(lease, self._create(request, parts, lease, media))

    async def _create(self, request: ChatCompletionRequest, parts: EmbedsParts,
                      lease: EmbedsLease, media: list[MediaPart]
                      ) -> ChatCompletionResponse | AsyncGenerator[str, None]:
        num_logprobs = self._num_logprobs(request)
        items = [await self._load_media(part, lease, max(1, request.n or 1))
                 for part in media]
        mm_data: dict[str, list[Any]] = {}
        if items:
            messages, mm_data = with_media_placeholders(request.messages, self.placeholders,
                                                        media, items)
            parts = parts._replace(messages=messages)
        text = await self.render(request, parts.messages)
        prompt: dict[str, Any]
        if parts.data:
            prompt, num_tokens = await self._segments_prompt(request, text, parts, lease)
        else:
            token_ids = await self.tokenize(text, request.add_special_tokens)
            prompt, num_tokens = {"prompt": text, "prompt_token_ids": token_ids}, len(token_ids)
            if mm_data:  # each placeholder becomes its item's run in the engine's processor
                prompt["multi_modal_data"] = mm_data
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_max_tokens(num_tokens, max_tokens)
        params = self._sampling_params(request, max_tokens, num_logprobs)
        tool_parser = make_tool_parser(request, self.tokenizer, self.options.tool_parser)
        if tool_parser is not None:
            tool_parser.adjust_request(params)
        request_id = random_id("chatcmpl", request.request_id)
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        stream = (await self.add_requests(request_id, [prompt], params,
                                          self.check_model(request.model)))[0]
        if request.stream:
            return self._stream(request, request_id, stream, tool_parser, num_tokens)
        output = (await self.final_outputs([stream]))[0]
        choices = [self._choice(c, num_logprobs, tool_parser, _max_calls(request))
                   for c in output.outputs]
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        usage = UsageInfo(prompt_tokens=output.num_prompt_tokens,
                          completion_tokens=completion_tokens,
                          total_tokens=output.num_prompt_tokens + completion_tokens,
                          prompt_tokens_details=cached_tokens_usage([output]))
        return ChatCompletionResponse(id=request_id, model=self.response_model(request.model),
                                      choices=choices, usage=usage)

    async def _load_media(self, part: MediaPart, lease: EmbedsLease, copies: int
                          ) -> bytes | Any:
        """A media part's item, read off the event loop: the encoded bytes its URL or data
        names (`MediaConnector`'s rules), or its embeddings (and a grid given as base64)
        decoded by the embeds intake."""
        try:
            loop = asyncio.get_running_loop()
            if part.kind in ("image_url", "audio_url"):
                return await loop.run_in_executor(None, self.media.media_bytes, part.value,
                                                  part.modality)
            if part.kind == "input_audio":
                return await loop.run_in_executor(None, input_audio_bytes, part.value["data"],
                                                  self.media.max_audio_bytes)
            if not isinstance(part.value, dict):
                return image_embeds_tensor(await self.embeds.decode(part.value, lease, copies,
                                                                    "image_embeds"))
            grid = part.value["image_grid_thw"]
            if isinstance(grid, str):  # base64 of torch.save (vLLM's form); else a list
                grid = await self.embeds.decode(grid, lease, copies, "image_grid_thw")
            rows = await self.embeds.decode(part.value["image_embeds"], lease, copies,
                                            "image_embeds")
            return {"image_embeds": image_embeds_tensor(rows), "image_grid_thw": grid}
        except ValueError as e:
            raise OpenAIError(f"{part.where}: {e}") from None

    async def _segments_prompt(self, request: ChatCompletionRequest, text: str, parts: EmbedsParts,
                               lease: EmbedsLease) -> tuple[dict[str, Any], int]:
        """The rendered prompt as a mixed prompt: each text piece's ids (special tokens, if
        asked for, on the first piece only), each part's decoded rows where it stood."""
        try:
            pieces = split_at_placeholders(text, parts.placeholders)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        copies = max(1, request.n or 1)
        texts: list[list[int]] = []
        rows: list[Any] = [None] * len(parts.data)
        num_tokens = 0
        for i, piece in enumerate(pieces):
            if isinstance(piece, str):
                ids = await self.tokenize(piece, request.add_special_tokens and i == 0)
                texts.append(ids)
                num_tokens += len(ids)
                continue
            rows[piece] = await self.embeds.decode(parts.data[piece], lease, copies)
            num_tokens += rows[piece].shape[-2] if rows[piece].dim() >= 2 else 0
        return segments_prompt(pieces, texts, rows), num_tokens

    def _sampling_params(self, request: ChatCompletionRequest, max_tokens: int | None,
                         num_logprobs: int | None) -> SamplingParams:
        """The request's sampling (unset fields: the model's defaults), with the
        tool-choice schema as its output constraint."""
        try:
            if request.use_beam_search:
                return self._beam_search_params(request, max_tokens, num_logprobs)
            if request.length_penalty != 1.0:
                raise ValueError("length_penalty applies only with use_beam_search=true.")
            constraint = tool_choice_constraint(request, self.options.tool_parser)
            forced = None if constraint is None else ("tool_choice", constraint)
            params = request.to_sampling_params(max_tokens, num_logprobs,
                                                defaults=self.model_config.generation_defaults,
                                                forced=forced)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        return params

    def _beam_search_params(self, request: ChatCompletionRequest, max_tokens: int | None,
                            num_logprobs: int | None) -> SamplingParams:
        """`use_beam_search`: n beams (the completions' best_of has no chat spelling)."""
        if tool_choice_constraint(request, self.options.tool_parser) is not None:
            raise ValueError("use_beam_search cannot be combined with tool_choice \"required\", "
                             "a named function or strict tools (their output constraint).")
        return request.beam_search_params(request.n, request.length_penalty,
                                          max_tokens or self.model_config.max_model_len,
                                          num_logprobs)

    @staticmethod
    def _choice(c: CompletionOutput, num_logprobs: int | None, tool_parser: ToolParser | None,
                max_calls: int | None) -> ChatCompletionResponseChoice:
        message = ChatMessage(role="assistant", content=c.text)
        finish_reason = c.finish_reason
        if tool_parser is not None:
            extracted = tool_parser.extract(c.text)
            message = ChatMessage(role="assistant", content=extracted.content,
                                  tool_calls=tool_calls_of(extracted, max_calls))
            finish_reason = finish_reason_with_tools(finish_reason, bool(extracted.calls))
        return ChatCompletionResponseChoice(
            index=c.index, message=message, logprobs=_chat_logprobs(c, num_logprobs),
            finish_reason=finish_reason, stop_reason=c.stop_reason)

    def _num_logprobs(self, request: ChatCompletionRequest) -> int | None:
        if not request.logprobs:
            if request.top_logprobs:
                raise OpenAIError("top_logprobs needs logprobs set to true.")
            return None
        self.check_logprobs(request.top_logprobs, "top_logprobs")
        return request.top_logprobs or 0

    async def _stream(self, request: ChatCompletionRequest, request_id: str,
                      stream: RequestStream, tool_parser: ToolParser | None,
                      num_prompt_tokens: int) -> AsyncGenerator[str, None]:
        """The chunks of a streamed reply; with `stream_options.continuous_usage_stats`
        every chunk carries the usage so far (the first, before any token: the prompt's)."""
        num_logprobs = self._num_logprobs(request)
        continuous = bool(request.stream_options
                          and request.stream_options.continuous_usage_stats)
        streamers = [ToolCallStreamer(tool_parser, _max_calls(request))
                     for _ in range(request.n)] if tool_parser is not None else None

        def chunk(choices: list[ChatCompletionResponseStreamChoice], last: bool = False
                  ) -> str:
            usage_now = None
            if last or continuous:
                usage_now = usage.model_copy()
                usage_now.total_tokens = usage.prompt_tokens + usage.completion_tokens
            return sse(ChatCompletionStreamResponse(
                id=request_id, model=self.response_model(request.model), choices=choices,
                usage=usage_now))

        usage = UsageInfo(prompt_tokens=num_prompt_tokens)
        try:
            yield chunk([ChatCompletionResponseStreamChoice(
                index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(request.n)])
            async for output in self.engine.iterate(stream):
                raise_if_failed(output)
                usage.prompt_tokens = output.num_prompt_tokens
                usage.prompt_tokens_details = cached_tokens_usage([output])
                for c in output.outputs:
                    usage.completion_tokens += len(c.token_ids)
                    logprobs = _chat_logprobs(c, num_logprobs)
                    delta, finish_reason = DeltaMessage(content=c.text), c.finish_reason
                    if streamers is not None:
                        streamer = streamers[c.index]
                        delta = streamer.feed(c.text, c.finish_reason is not None)
                        finish_reason = finish_reason_with_tools(finish_reason,
                                                                 streamer.called)
                    if not (delta.content or delta.tool_calls or logprobs or finish_reason):
                        continue
                    yield chunk([ChatCompletionResponseStreamChoice(
                        index=c.index, delta=delta, logprobs=logprobs,
                        finish_reason=finish_reason, stop_reason=c.stop_reason)])
            if request.include_usage_in_stream:
                yield chunk([], last=True)
        except Exception as e:
            yield sse(stream_error(e))
        yield "data: [DONE]\n\n"


def _max_calls(request: ChatCompletionRequest) -> int | None:
    return 1 if request.parallel_tool_calls is False else None


def _chat_logprobs(completion: CompletionOutput, num: int | None
                   ) -> ChatCompletionLogProbs | None:
    if num is None or completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=False):
        sampled = entry[token_id]
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= num),
                        key=lambda lp: lp.rank or 0)
        content.append(ChatCompletionLogProbsContent(
            token=sampled.decoded_token or "", logprob=sampled.logprob,
            bytes=list((sampled.decoded_token or "").encode()),
            top_logprobs=[ChatCompletionLogProb(token=lp.decoded_token or "",
                                                logprob=lp.logprob,
                                                bytes=list((lp.decoded_token or "").encode()))
                          for lp in ranked]))
    return ChatCompletionLogProbs(content=content)
