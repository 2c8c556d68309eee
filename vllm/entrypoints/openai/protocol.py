"""OpenAI-compatible request and response bodies (pydantic), with vLLM's extra fields."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from fastapi import UploadFile
from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    check_structural_tag,
)


class OpenAIBaseModel(BaseModel):
    # A field this server does not implement is refused by name (a 400), never accepted and
    # silently ignored: see api_server's validation error handler.
    model_config = ConfigDict(extra="forbid")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """`/v1/load_lora_adapter` (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """`/v1/unload_lora_adapter` (vLLM's body; an id, if given, must be the adapter's)."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    # The schema is always enforced and its objects closed; strict also makes the JSON
    # compact (unless structured_outputs.disable_any_whitespace says false).
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's text, json_object and json_schema, and vLLM's structural_tag: free text in
    which each trigger starts one of the structures, `{"type": "structural_tag",
    "structures": [{"begin", "schema", "end"}], "triggers": [...]}` (see
    `StructuredOutputsParams.structural_tag`). A field of another type is refused."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None
    structures: list[Any] | None = None
    triggers: list[Any] | None = None
    # The newer structural-tag form: declared only to be refused by name, with the reason.
    format: Any = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ResponseFormat:
        own = {"json_schema": ("json_schema",), "structural_tag": ("structures", "triggers",
                                                                  "format")}
        foreign = [name for name in ("json_schema", "structures", "triggers", "format")
                   if getattr(self, name) is not None and name not in own.get(self.type, ())]
        if foreign:
            raise ValueError(f"response_format of type {self.type!r} takes no "
                             f"{', '.join(foreign)}.")
        return self


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat, mapped onto `SamplingParams`."""

    # The endpoint's stream can carry the usage on every chunk (continuous_usage_stats).
    continuous_usage: ClassVar[bool] = False

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    # Advisory (OpenAI documents them as the client's own labels): accepted, not acted on.
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    # OpenAI's stored completions: only the default (not stored) is possible here.
    store: bool | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Requests share prefix-cache blocks only if their salts are equal (tenant isolation).
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # The id of this request (default: random); refused while a live request has it.
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or the
    # older guided_* spellings; at most one constraint in all.
    response_format: ResponseFormat | None = None
    # Validated as the dataclass itself (its types, an unknown key, at most one constraint;
    # options alone apply to the constraint given another way: structured_outputs_params).
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None = None,
                           defaults: Mapping[str, Any] | None = None,
                           forced: tuple[str, StructuredOutputsParams] | None = None
                           ) -> SamplingParams:
        """Raises ValueError (naming the field) for out-of-range values. A field the
        request leaves unset (None) takes the model's default from `defaults` (its
        generation_config.json), else SamplingParams' own. `forced`: an output constraint
        the endpoint adds (see `structured_outputs_params`)."""
        self._check_unhonoured()
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            **self._sampling_fields(defaults or {}),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params(forced),
        )

    def beam_search_params(self, beam_width: int, length_penalty: float, max_tokens: int,
                           logprobs: int | None) -> SamplingParams:
        """The params of a beam search (`use_beam_search`) returning the n best of
        `beam_width` beams. Fields that only sampling means (temperature > 0, top_p,
        penalties, stop, a seed, ...) are refused by name (ValueError), as is streaming: the
        beams are known only at the end."""
        self._check_unhonoured()
        if self.stream:
            raise ValueError("use_beam_search cannot be combined with stream=true: the beams "
                             "are only known when the search ends.")
        beam = BeamSearchParams(
            beam_width=beam_width, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
            temperature=self.temperature or 0.0, length_penalty=length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output)
        return SamplingParams(
            n=self.n, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if self.repetition_penalty is None
                                else self.repetition_penalty),
            temperature=0.0, top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params(), beam_search=beam)

    def _sampling_fields(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """temperature, top_p, top_k, min_p and repetition_penalty: the request's where
        set, else the model's default, else SamplingParams'."""
        builtin = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                   "repetition_penalty": 1.0}
        return {name: value if (value := getattr(self, name)) is not None
                else defaults.get(name, fallback) for name, fallback in builtin.items()}

    def _check_unhonoured(self) -> None:
        """Fields this server defines (clients send them) but can honour only in part."""
        if self.store:
            raise ValueError("store=true is not supported: this server does not store "
                             "completions.")
        if self.stream_options is not None:
            if not self.stream:
                raise ValueError("stream_options can only be given with stream=true.")
            if self.stream_options.continuous_usage_stats and not self.continuous_usage:
                raise ValueError("stream_options.continuous_usage_stats is supported only on "
                                 "/v1/chat/completions.")

    def structured_outputs_params(
            self, forced: tuple[str, StructuredOutputsParams] | None = None
    ) -> StructuredOutputsParams | None:
        """The request's one output constraint, from whichever field spelled it (`forced`:
        one the endpoint adds, e.g. ("tool_choice", its calls' schema)), with the options of
        a `structured_outputs` that gives options only (vLLM's way to pass e.g.
        disable_any_whitespace beside response_format). Tool calls and strict
        response_format schemas are compact JSON unless the options say otherwise.

        Raises ValueError naming the fields when more than one constraint is given, or
        options without any."""
        given: list[tuple[str, StructuredOutputsParams]] = []
        options = self.structured_outputs
        if options is not None and options.kind is not None:
            given.append(("structured_outputs", options))
            options = None
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given.append((name, StructuredOutputsParams(**{kind: value})))
        if self.response_format is not None and self.response_format.type != "text":
            given.append(("response_format", _response_format_params(self.response_format)))
        if forced is not None:
            given.append(forced)
        if len(given) > 1:
            raise ValueError("Only one output constraint per request; got "
                             f"{', '.join(name for name, _ in given)}.")
        if not given:
            if options is not None:
                raise ValueError("structured_outputs gives options but no constraint: add one "
                                 "of json, regex, choice, grammar, json_object (or "
                                 "response_format, or tool_choice \"required\").")
            return None
        source, constraint = given[0]
        strict = source == "tool_choice" or (
            source == "response_format" and self.response_format is not None
            and self.response_format.json_schema is not None
            and bool(self.response_format.json_schema.strict))
        return constraint.with_options(options, compact=strict)

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _response_format_params(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.type == "structural_tag":
        tag = response_format.model_dump(exclude={"json_schema"}, exclude_none=True)
        check_structural_tag(tag, "response_format")
        return StructuredOutputsParams(structural_tag=tag)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise ValueError('response_format of type "json_schema" needs json_schema.schema.')
    return StructuredOutputsParams(json=spec.json_schema)


# ---- /v1/completions ----------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    # base64 of torch.save(tensor [num_tokens, hidden_size]); one or a list of them.
    prompt_embeds: str | list[str] | None = None
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True
    # vLLM extension: each choice carries its last hidden states (see CompletionResponseChoice).
    return_hidden_states: bool = False
    # vLLM extensions: beam search, max(n, best_of) beams, the n best returned.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def to_beam_search_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """`use_beam_search`: max(n, best_of) beams, the n best returned."""
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be at least n={self.n}, got {self.best_of}.")
        params = self.beam_search_params(max(self.n, self.best_of or self.n),
                                         self.length_penalty, max_tokens, logprobs)
        params.prompt_logprobs = self.prompt_logprobs  # refused by the processor, by name
        return params


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With return_hidden_states, on the choice's last chunk: base64 of torch.save(tensor
    # [num_prompt_tokens + num_output_tokens - 1, hidden_size]), the form prompt_embeds takes.
    hidden_states: str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions -----------------------------------------------------------


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    # Arguments must follow `parameters` exactly: honoured by a grammar under tool_choice
    # "required" or a named function; refused under "auto" (nothing enforces it there).
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


class ChatCompletionRequest(SamplingRequest):
    continuous_usage: ClassVar[bool] = True

    messages: list[dict[str, Any]]
    tools: list[ChatCompletionToolsParam] | None = None
    # Default: "auto" when tools are given, else "none" (OpenAI's rule).
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Only honoured by a server started with --trust-request-chat-template.
    chat_template: str | None = None
    # vLLM extensions: beam search, n beams returned best first.
    use_beam_search: bool = False
    length_penalty: float = 1.0


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as the model wrote it


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=random_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """One call's piece of a stream: `id`, `type` and `name` come once, in the call's first
    delta; `arguments` fragments join into the call's arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/audio/transcriptions, /v1/audio/translations ----------------------------------


class TranscriptionRequest(OpenAIBaseModel):
    """The multipart form of both audio endpoints (translations ignore `language`'s role as
    the output language: Whisper translates into English)."""

    file: UploadFile
    model: str | None = None
    language: str | None = None  # ISO-639-1 code of the audio's language
    prompt: str = ""  # previous text: context and spelling for the model
    response_format: Literal["json", "text", "verbose_json", "srt", "vtt"] = "json"
    temperature: float = 0.0
    timestamp_granularities: list[str] = Field(default_factory=list,
                                               alias="timestamp_granularities[]")
    stream: bool = False
    # vLLM extensions
    # stream_options, flattened for the form: a last event with the usage, and usage on
    # every event (only with stream=true).
    stream_include_usage: bool = False
    stream_continuous_usage_stats: bool = False
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    max_completion_tokens: int | None = None
    # Beam search over each window: max(n, best_of) beams (vLLM's beam width is n, as on
    # completions; default 5, as faster-whisper's and OpenAI whisper's beam_size), the best
    # one's text returned (a transcription is one text: n is the width, not a count).
    use_beam_search: bool = False
    n: int | None = None
    best_of: int | None = None
    length_penalty: float = 1.0

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (naming the field) for out-of-range values, and for sampling
        fields given with use_beam_search (or beam fields without it)."""
        if self.use_beam_search:
            return self._beam_search_params(max_tokens, logprobs)
        if self.best_of is not None or self.length_penalty != 1.0:
            raise ValueError("best_of and length_penalty apply only with use_beam_search=true.")
        if self.n not in (None, 1):
            raise ValueError(f"n={self.n} applies only with use_beam_search=true (it is the "
                             "beam width): a transcription returns one text.")
        return SamplingParams(
            temperature=self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            repetition_penalty=(1.0 if self.repetition_penalty is None
                                else self.repetition_penalty),
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            max_tokens=max_tokens,
            logprobs=logprobs,
            # Streamed or not, a window's text is read once it is final (serving_transcription).
            output_kind=RequestOutputKind.FINAL_ONLY,
        )


    def _beam_search_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.stream:
            raise ValueError("use_beam_search cannot be combined with stream=true: the beams "
                             "are only known when the search ends.")
        sampling_only = {"temperature": self.temperature or None, "seed": self.seed,
                         "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                         "repetition_penalty": self.repetition_penalty,
                         "frequency_penalty": self.frequency_penalty,
                         "presence_penalty": self.presence_penalty}
        given = [name for name, value in sampling_only.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with use_beam_search.")
        for name in ("n", "best_of"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.n is not None and self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be at least n={self.n}, got {self.best_of}.")
        width = max(self.n or 0, self.best_of or 0) or 5
        beam = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                length_penalty=self.length_penalty)
        return beam.sampling_params(logprobs=logprobs, output_kind=RequestOutputKind.FINAL_ONLY)


class TranscriptionUsage(OpenAIBaseModel):
    type: Literal["duration"] = "duration"
    seconds: int


class TranscriptionResponse(OpenAIBaseModel):
    text: str
    usage: TranscriptionUsage | None = None


class TranscriptionSegment(OpenAIBaseModel):
    id: int
    seek: int  # the 10 ms mel frame where the segment's 30 s window starts
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class TranscriptionWord(OpenAIBaseModel):
    word: str
    start: float
    end: float


class TranscriptionResponseVerbose(OpenAIBaseModel):
    task: Literal["transcribe", "translate"] = "transcribe"
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegment]
    words: list[TranscriptionWord] | None = None  # with timestamp_granularities[]=word
    usage: TranscriptionUsage | None = None


class TranscriptionStreamChoice(OpenAIBaseModel):
    delta: DeltaMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class TranscriptionStreamUsage(UsageInfo):
    """A stream's token usage in both spellings: vLLM's (`prompt_tokens`,
    `completion_tokens`) and OpenAI's streamed-transcription usage (`type` "tokens",
    `input_tokens`, `output_tokens`); `total_tokens` is common to both."""

    type: Literal["tokens"] = "tokens"
    input_tokens: int = 0
    output_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> TranscriptionStreamUsage:
        total = prompt_tokens + completion_tokens
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=total, input_tokens=prompt_tokens,
                   output_tokens=completion_tokens)


class TranscriptionStreamResponse(OpenAIBaseModel):
    """One event of a transcription stream, readable both as vLLM's chunk (`object`,
    `choices[0].delta.content`, `usage`) and as OpenAI's event (`type` and its fields, in
    the subclasses below)."""

    id: str
    object: Literal["transcription.chunk", "translation.chunk"] = "transcription.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[TranscriptionStreamChoice]
    usage: TranscriptionStreamUsage | None = None


class TranscriptionTextDelta(TranscriptionStreamResponse):
    """A piece of text: OpenAI's `delta` is the choice's `delta.content`."""

    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptionTextDone(TranscriptionStreamResponse):
    """The last event: the whole text. Its `choices` are vLLM's usage chunk's (none) when
    the usage was asked for, else one empty delta that repeats the finish reason."""

    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str


# ---- /tokenize, /detokenize ---------------------------------------------------------


class TokenizeRequest(OpenAIBaseModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
