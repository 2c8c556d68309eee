"""The OpenAI-compatible HTTP server: a FastAPI app over `AsyncLLM`, run by uvicorn.

    python -m vllm.entrypoints.openai.api_server MODEL --enable-prompt-embeds
    vllm serve MODEL --enable-prompt-embeds          (the same, via the CLI)
    vllm serve --pipeline stages.yaml                (a pipeline of stages, see vllm.pipeline)
    vllm serve --task transcription                  (Whisper tiny.en: /v1/audio/*)
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, Form, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

import vllm
from vllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from vllm.entrypoints.anthropic.protocol import error_body as anthropic_error_body
from vllm.entrypoints.anthropic.serving_messages import (
    AnthropicServingMessages,
    is_messages_path,
)
from vllm.entrypoints.chat_utils import render_chat
from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TranscriptionRequest,
    UnloadLoRAAdapterRequest,
)
from vllm.entrypoints.openai.responses_protocol import ResponsesRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import (
    MAX_CHARS_PER_TOKEN,
    OpenAIServing,
    ServingOptions,
    error_response,
)
from vllm.entrypoints.openai.serving_models import (
    ServedLoRAs,
    parse_lora_module,
    runtime_updating_allowed,
)
from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm.entrypoints.openai.serving_transcription import AudioLimits, OpenAIServingTranscription
from vllm.pipeline.async_pipeline import AsyncPipeline
from vllm.pipeline.stage import load_pipeline_spec
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError
from vllm.v1.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger("vllm.entrypoints.openai.api_server")


@dataclass
class ServerState:
    engine: AsyncLLM | AsyncPipeline  # a pipeline answers the same calls
    served_model_names: list[str]
    metrics: PrometheusStatLogger
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    transcription: OpenAIServingTranscription
    base: OpenAIServing  # model checks and tokenizer for /tokenize, /detokenize
    loras: ServedLoRAs | None = None  # with --enable-lora

    @classmethod
    def create(cls, engine: AsyncLLM | AsyncPipeline, served_model_names: list[str],
               metrics: PrometheusStatLogger, audio_limits: AudioLimits | None = None,
               options: ServingOptions | None = None) -> ServerState:
        completion = OpenAIServingCompletion(engine, served_model_names, options)
        return cls(engine, served_model_names, metrics, completion,
                   OpenAIServingChat(engine, served_model_names, options, completion.embeds),
                   OpenAIServingTranscription(engine, served_model_names, audio_limits,
                                              metrics),
                   OpenAIServing(engine, served_model_names, options),
                   options.loras if options is not None else None)

    @property
    def max_request_body_bytes(self) -> int:
        """Room for the largest request an endpoint accepts, plus its JSON or form fields.
        An audio upload may be up to twice its limit, so that a file a little over it gets
        the audio endpoint's 400 naming the limit rather than a bare 413."""
        limit = self.completion.max_request_body_bytes
        if self.transcription.is_whisper:
            limit = max(limit, 2 * self.transcription.limits.max_file_bytes)
        return limit + 2**20


def error_json(message: str, err_type: str, status: int, path: str = "",
               headers: dict[str, str] | None = None) -> JSONResponse:
    """The error body of the API `path` belongs to: Anthropic's form under /v1/messages,
    else OpenAI's."""
    if is_messages_path(path):
        body = anthropic_error_body(message, status).model_dump()
    else:
        body = error_response(OpenAIError(message, err_type, status)).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def _dev_mode() -> bool:
    """vLLM's VLLM_SERVER_DEV_MODE: debugging routes (`/server_info`) that expose engine
    internals; never on a public endpoint."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0")


class ApiKeyMiddleware:
    """Answers 401 to `/v1/*` requests without `Authorization: Bearer <api key>` or
    Anthropic's `x-api-key: <api key>` (pure ASGI, so streaming and disconnects pass through
    untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") \
                and scope["method"] != "OPTIONS":
            headers = dict(scope["headers"])
            bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            key_ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
            if not (bearer_ok or key_ok):
                response = error_json("Unauthorized: a valid API key is required.",
                                      "AuthenticationError", HTTPStatus.UNAUTHORIZED,
                                      scope["path"])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 to bodies whose Content-Length is over `max_bytes`, before anything reads
    them; a chunked body that grows past it is cut off as a client disconnect."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            response = error_json(f"Request body is larger than {self.max_bytes} bytes.",
                                  "BadRequestError", HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                  scope["path"])
            await response(scope, receive, send)
            return
        seen = 0

        async def bounded_receive() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            return {"type": "http.disconnect"} if seen > self.max_bytes else message

        await self.app(scope, bounded_receive, send)


async def with_cancellation(handler: Coroutine[Any, Any, Any], request: Request) -> Any:
    """Runs a handler, cancelling it if the client disconnects first (returns None then).

    Streaming responses are covered by Starlette itself; this covers the wait for a
    non-streaming result, so an abandoned request stops using the engine.
    """
    handler_task = asyncio.ensure_future(handler)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    disconnect_task = asyncio.ensure_future(wait_for_disconnect())
    done, _ = await asyncio.wait([handler_task, disconnect_task],
                                 return_when=asyncio.FIRST_COMPLETED)
    for task in (handler_task, disconnect_task):
        if task not in done:
            task.cancel()
    if handler_task in done:
        return handler_task.result()
    await asyncio.gather(handler_task, return_exceptions=True)
    return None


def _respond(result: Any) -> Response:
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    if isinstance(result, AsyncGenerator):
        return StreamingResponse(result, media_type="text/event-stream")
    if isinstance(result, str):  # audio endpoints: response_format text, srt, vtt
        return PlainTextResponse(result)
    return JSONResponse(result.model_dump())


def _add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_json(exc.message, exc.err_type, exc.status_code, request.url.path,
                          exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            message = err.get("msg")
            if err.get("type") == "extra_forbidden":
                message = "this server does not support this field"
            parts.append(f"{where}: {message}" if where else str(message))
        return error_json("; ".join(parts) or "Invalid request.", "BadRequestError",
                          HTTPStatus.BAD_REQUEST, request.url.path)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_json(str(exc), "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR,
                          request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error in a request.")
        return error_json(f"Internal server error: {type(exc).__name__}: {exc}",
                          "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR,
                          request.url.path)


def build_app(state: ServerState, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="vLLM-compatible OpenAI API server", version=vllm.__version__)
    app.state.server = state
    _add_exception_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=state.max_request_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    _add_info_routes(app, state)
    if state.loras is not None and runtime_updating_allowed():
        _add_lora_routes(app, state)
    _add_generation_routes(app, state)
    _add_tokenizer_routes(app, state)
    return app


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 while every engine core runs; 503 naming those that are gone (with data
        parallel, the others still serve requests)."""
        if state.engine.errored:
            return error_json(f"The engine is not healthy: {state.engine.dead_error}",
                              "ServiceUnavailableError", HTTPStatus.SERVICE_UNAVAILABLE)
        dead = state.engine.dead_engines()
        if dead:
            return error_json("Engine cores are gone (the others still serve): "
                              + " ".join(map(str, dead)), "ServiceUnavailableError",
                              HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=200)

    if _dev_mode():
        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            """What each engine core holds now (requests, runner states, KV usage, memory;
            stages in order, then data-parallel engines in order) and the API process's
            prompt-embeds bytes in flight, for leak checks."""
            served = state.engine
            engines = served.engines if isinstance(served, AsyncPipeline) else [served]
            return {"engines": [info for engine in engines
                                for info in await engine.call_engines("get_engine_state")],
                    "prompt_embeds_bytes_in_flight": state.completion.embeds.in_flight.used}

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            """vLLM's dev route: forgets every cached block (benchmarks repeat a workload
            without hits). 409 while requests hold blocks: nothing is dropped then."""
            if not await state.engine.reset_prefix_cache():
                return error_json("The prefix cache was not reset: requests are running.",
                                  "ConflictError", HTTPStatus.CONFLICT)
            return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": vllm.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        mc = state.engine.vllm_config.model_config
        cards = [ModelCard(id=name, root=mc.model, max_model_len=mc.max_model_len)
                 for name in state.served_model_names]
        if state.loras is not None:
            cards += state.loras.cards(mc.max_model_len)
        return ModelList(data=cards).model_dump()


def _add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's bodies and replies;
    only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set and LoRA enabled)."""
    loras = state.loras
    engine = state.engine
    assert loras is not None and isinstance(engine, AsyncLLM)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        lora = loras.make_request(request.lora_name, request.lora_path)
        try:
            await engine.add_lora(lora)
        except (ValueError, RuntimeError) as e:
            raise OpenAIError(str(e)) from None
        loras.add(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        known = loras.resolve(request.lora_name)
        if (known is not None and request.lora_int_id is not None
                and request.lora_int_id != known.lora_int_id):
            raise OpenAIError(f"lora_int_id {request.lora_int_id} is not the id of the lora "
                              f"adapter '{request.lora_name}' ({known.lora_int_id}).")
        lora = loras.remove(request.lora_name)
        await engine.remove_lora(lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed "
                                 "successfully.")


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    if state.transcription.is_whisper:
        _add_missing_text_routes(app, state)
    else:
        _add_text_routes(app, state)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Annotated[TranscriptionRequest, Form()],
                             raw_request: Request) -> Response:
        return _respond(await with_cancellation(
            state.transcription.create_transcription(request, "transcribe"), raw_request))

    @app.post("/v1/audio/translations")
    async def translations(request: Annotated[TranscriptionRequest, Form()],
                           raw_request: Request) -> Response:
        return _respond(await with_cancellation(
            state.transcription.create_transcription(request, "translate"), raw_request))


def _keep_alive_seconds() -> int:
    """How long an idle HTTP connection stays open: vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`
    (whole seconds, default 5)."""
    value = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be a whole number of seconds "
                         f">= 1, got {value!r}")
    return int(value)


def _add_text_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return _respond(await with_cancellation(
            state.completion.create_completion(request), raw_request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request
                               ) -> Response:
        return _respond(await with_cancellation(
            state.chat.create_chat_completion(request), raw_request))

    messages = AnthropicServingMessages(state.chat)

    @app.post("/v1/messages")
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        return _respond(await with_cancellation(messages.create_message(request), raw_request))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: CountTokensRequest) -> Response:
        return _respond(await messages.count_tokens(request))

    _add_responses_routes(app, OpenAIServingResponses(state.chat))


def _add_responses_routes(app: FastAPI, responses: OpenAIServingResponses) -> None:
    """`/v1/responses` (translated to chat completions) and its stored responses."""
    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return _respond(await with_cancellation(responses.create_response(request),
                                                raw_request))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return _respond(responses.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _add_missing_text_routes(app: FastAPI, state: ServerState) -> None:
    """A speech-to-text model has no text endpoints: vLLM answers 404 there (whatever the
    body); so does this server, in each API's error form and saying where to go instead."""
    for path, api in (("/v1/completions", "Completions"),
                      ("/v1/chat/completions", "Chat Completions"),
                      ("/v1/messages", "Messages"), ("/v1/messages/count_tokens", "Messages"),
                      ("/v1/responses", "Responses")):
        app.add_api_route(path, _not_found(
            f"The model `{state.served_model_names[0]}` does not support the {api} API: it "
            "is a speech-to-text model; use /v1/audio/transcriptions or "
            "/v1/audio/translations.", path), methods=["POST"], include_in_schema=False)


def _not_found(message: str, path: str) -> Callable[[], Awaitable[Response]]:
    async def not_found() -> Response:
        return error_json(message, "NotFoundError", HTTPStatus.NOT_FOUND, path)

    return not_found


def _add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    base = state.base

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict[str, Any]:
        base.check_model(request.model)
        tokenizer = base.require_tokenizer()
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give exactly one of prompt and messages.")
        if request.messages is not None:
            text = await asyncio.to_thread(render_chat, tokenizer, request.messages,
                                           request.add_generation_prompt, False, None,
                                           base.options.chat_template,
                                           MAX_CHARS_PER_TOKEN * base.max_model_len)
            add_special = bool(request.add_special_tokens)
        else:
            assert request.prompt is not None  # exactly one of prompt and messages is given
            text = request.prompt
            add_special = request.add_special_tokens is not False
        ids = await base.tokenize(text, add_special)
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=base.max_model_len, tokens=ids,
                                token_strs=strs).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict[str, Any]:
        base.check_model(request.model)
        tokenizer = base.require_tokenizer()
        vocab = base.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < max(vocab, len(tokenizer))]
        if bad:
            raise OpenAIError(f"Token id {bad[0]} is out of the vocabulary (size {vocab}).")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens)).model_dump()


# ---- running ----------------------------------------------------------------------------


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)


async def run_server(args: argparse.Namespace) -> None:
    """Starts the engine process, serves until SIGINT/SIGTERM, then stops the engine."""
    from vllm.entrypoints.openai.serve_args import (
        audio_limits_from_namespace,
        chat_template_of,
        check_task,
        engine_args_from_namespace,
        served_names,
        tool_parser_of,
    )

    # Until uvicorn takes over (and again when it hands a captured signal back), a signal
    # ends the process through SystemExit, so the `finally` below stops the engine.
    signal.signal(signal.SIGINT, _exit_on_signal)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    audio_limits = audio_limits_from_namespace(args)
    loras = None
    if args.pipeline:
        engine, names, metrics = _start_pipeline(args)
    else:
        engine_args = engine_args_from_namespace(args)
        vllm_config = engine_args.create_engine_config()
        check_task(args, vllm_config.model_config)
        names = served_names(args, vllm_config.model_config.model)
        metrics = PrometheusStatLogger(names[0],
                                       vllm_config.parallel_config.data_parallel_size)
        engine = AsyncLLM(vllm_config, stat_loggers=[metrics])
    try:
        if args.pipeline and (args.enable_lora or args.lora_modules):
            raise ValueError("--enable-lora / --lora-modules serve one model, not a "
                             "--pipeline.")
        if args.enable_lora:
            assert isinstance(engine, AsyncLLM)
            loras = await _served_loras(engine, names[0], args.lora_modules or [])
        elif args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora.")
        options = ServingOptions(args.max_prompt_embeds_bytes_in_flight,
                                 args.trust_request_chat_template, chat_template_of(args),
                                 tool_parser_of(args), loras)
        state = ServerState.create(engine, names, metrics, audio_limits, options)
        app = build_app(state, args.api_key)
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log,
                                timeout_keep_alive=_keep_alive_seconds(),
                                timeout_graceful_shutdown=5)
        logger.info("Serving %s on http://%s:%d", names[0], args.host, args.port)
        await uvicorn.Server(config).serve()
    finally:
        engine.shutdown()
        logger.info("Engine stopped; server shut down.")


async def _served_loras(engine: AsyncLLM, base_name: str, modules: list[str]) -> ServedLoRAs:
    """The `--lora-modules` adapters, each checked and loaded before the server starts."""
    loras = ServedLoRAs(base_name)
    for text in modules:
        lora = loras.make_request(*parse_lora_module(text))
        await engine.add_lora(lora)
        loras.add(lora)
        logger.info("Serving LoRA adapter %s from %s.", lora.lora_name, lora.lora_path)
    return loras


def _start_pipeline(args: argparse.Namespace
                    ) -> tuple[AsyncPipeline, list[str], PrometheusStatLogger]:
    """The stages of `--pipeline`, one engine-core process each; served under
    --served-model-name, else the YAML's `name`, else the file's stem."""
    if args.model_tag or args.model:
        raise ValueError("Give either MODEL or --pipeline, not both.")
    spec = load_pipeline_spec(args.pipeline)
    stem = os.path.splitext(os.path.basename(args.pipeline))[0]
    names = list(args.served_model_name or [spec.name or stem])
    metrics = PrometheusStatLogger(names[0])
    return AsyncPipeline(spec.stages, spec.connectors, [metrics]), names, metrics


def run(args: argparse.Namespace) -> int:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: "
                        "%(message)s")
    torch.set_num_threads(1)  # the API process only decodes and checks inputs
    asyncio.run(run_server(args))
    return 0


if __name__ == "__main__":
    from vllm.entrypoints.openai.serve_args import make_parser

    raise SystemExit(run(make_parser().parse_args()))
