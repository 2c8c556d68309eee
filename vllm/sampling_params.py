"""Sampling parameters for text generation, with vLLM's names and validation."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


# The constraint kinds of StructuredOutputsParams; exactly one is set per request.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's names): at most one of the kinds below is set.

    - `json`: a JSON schema (a dict or its JSON text); the output is JSON that validates.
      Schemas are strict, as OpenAI's strict mode and vLLM's default backend make them: an
      object that does not say `additionalProperties` has only its declared properties.
    - `regex`: the whole output matches this regular expression.
    - `choice`: the output is exactly one of these strings.
    - `grammar`: an EBNF (GBNF) or Lark grammar; the output is a sentence of it.
    - `json_object`: any JSON object.
    - `structural_tag`: free text in which every occurrence of a trigger starts one of the
      structures, vLLM's form (a dict or its JSON text): `{"type": "structural_tag",
      "structures": [{"begin": "<tool_call>\\n", "schema": {...}, "end": "\\n</tool_call>"}],
      "triggers": ["<tool_call>"]}`; each `begin` starts with a trigger, and between its
      `begin` and `end` a structure is JSON valid against its (strict) schema.

    None set: options only, which the server merges into the constraint a request gives
    another way (`response_format`, `guided_*`, `tool_choice`), as vLLM does; a request
    that samples needs a constraint (SamplingParams refuses options alone).

    Options: `disable_any_whitespace` True forbids whitespace between JSON tokens outside
    strings, False allows a bounded run of it (one line break and an indent), None leaves
    it to where the constraint came from (the server: compact for tool calls and strict
    `response_format` schemas; elsewhere bounded); `whitespace_pattern` (a regex) replaces
    the bounded run; `disable_additional_properties` is accepted (every object is closed
    already); `disable_fallback` is accepted (there is one backend and no fallback).
    Invalid input raises `ValueError` naming the field.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        set_kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) > 1:
            raise ValueError(
                "structured_outputs takes one constraint of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got {', '.join(set_kinds)}."
            )
        if self.structural_tag is not None:
            check_structural_tag(self.structural_tag, "structured_outputs.structural_tag")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise ValueError("structured_outputs.whitespace_pattern must be a non-empty "
                                 "regex.")
            if self.disable_any_whitespace:
                raise ValueError("structured_outputs.whitespace_pattern cannot be combined "
                                 "with disable_any_whitespace=true.")
        if isinstance(self.json, str):
            try:
                schema = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema object.")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(
                f"structured_outputs.json must be a dict or a JSON string, got {type(self.json)}."
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            if (not isinstance(self.choice, list | tuple) or not self.choice
                    or any(not isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given.")
        for name in ("disable_fallback", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool.")
        if self.disable_any_whitespace is not None \
                and not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool.")

    def with_options(self, options: StructuredOutputsParams | None,
                     compact: bool = False) -> StructuredOutputsParams:
        """This constraint with the options of an options-only params (the request's own
        choice wins); `compact`: the whitespace default of where the constraint came from
        (True: compact JSON, unless the request asks otherwise)."""
        whitespace = self.disable_any_whitespace
        pattern = self.whitespace_pattern
        if options is not None:
            if options.disable_any_whitespace is not None:
                whitespace = options.disable_any_whitespace
            pattern = options.whitespace_pattern or pattern
        if whitespace is None and pattern is None and compact:
            whitespace = True
        return replace(
            self, disable_any_whitespace=whitespace, whitespace_pattern=pattern,
            disable_fallback=self.disable_fallback or bool(options and options.disable_fallback),
            disable_additional_properties=self.disable_additional_properties
            or bool(options and options.disable_additional_properties))

    @property
    def kind(self) -> str | None:
        """Which constraint is set: one of STRUCTURED_OUTPUT_KINDS (None: options only)."""
        return next((k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)),
                    None)


def check_structural_tag(value: Any, where: str) -> None:
    """Raises ValueError naming what is wrong with a structural tag given as `where` (its
    schemas are checked when they compile)."""
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except ValueError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object.")
    unknown = [k for k in value if k not in ("type", "structures", "triggers")]
    if unknown:
        raise ValueError(f"{where} takes type, structures and triggers; got {unknown} "
                         "(the newer `format` form is not supported).")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f'{where}.type must be "structural_tag".')
    triggers, structures = value.get("triggers"), value.get("structures")
    if not isinstance(triggers, list) or not triggers \
            or any(not isinstance(t, str) or not t for t in triggers):
        raise ValueError(f"{where}.triggers must be a non-empty list of non-empty strings.")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{where}.structures must be a non-empty list.")
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or set(structure) != {"begin", "schema", "end"} \
                or not isinstance(structure["begin"], str) \
                or not isinstance(structure["end"], str) \
                or not isinstance(structure["schema"], dict | bool):
            raise ValueError(f"{where}.structures[{i}] must be {{begin: string, schema: JSON "
                             "schema, end: string}.")
        if not any(structure["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{where}.structures[{i}].begin {structure['begin']!r} does not "
                             "start with any of the triggers.")
    for i, trigger in enumerate(triggers):
        if not any(s["begin"].startswith(trigger) for s in structures):
            raise ValueError(f"{where}.triggers[{i}] {trigger!r} begins none of the structures.")


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search (vLLM's names): keep the `beam_width` best hypotheses by cumulative
    log-probability, return the `beam_width` best finished ones.

    Ranking follows `transformers`' `generate(num_beams=k, do_sample=False)` with its
    default `early_stopping=False`: a finished hypothesis scores
    `cum_logprob / num_generated_tokens ** length_penalty` (its EOS counted), and the search
    stops once no running beam can beat the worst of `beam_width` finished ones, or at
    `max_tokens`. The search is deterministic, so `temperature` must be 0 (the only value
    accepted; vLLM samples one extra candidate per step when it is not).
    `include_stop_str_in_output` keeps a final EOS token's text in `text`.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}.")

        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise bad("beam_width", f"must be an integer in [1, {MAX_BEAM_WIDTH}]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.temperature != 0:
            raise bad("temperature", "must be 0 for beam search (it is deterministic here)")
        if not isinstance(self.length_penalty, int | float) or self.length_penalty != \
                self.length_penalty:
            raise bad("length_penalty", "must be a number")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")

    def sampling_params(self, n: int = 1, **output_fields: Any) -> SamplingParams:
        """The `SamplingParams` that carry these beams through the engine, returning the `n`
        best; `output_fields`: logprobs, skip_special_tokens, output_kind, ..."""
        return SamplingParams(n=n, temperature=0.0, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              beam_search=self, **output_fields)

    def num_candidates(self, num_stop_ids: int) -> int:
        """Candidates kept per step (transformers' rule): enough that `beam_width` of them
        do not end, whichever of the `num_stop_ids` end-of-sequence ids the others chose."""
        return max(2, 1 + num_stop_ids) * self.beam_width


# vLLM's default cap on returned logprobs per token (the processor and the server check it).
MAX_LOGPROBS = 20

# Beams of one request run as that many sequences; a bound keeps one request's share sane.
MAX_BEAM_WIDTH = 64


def may_stop_at(index: int, min_tokens: int) -> bool:
    """The min_tokens rule: whether the output token at `index` (0-based) may end its
    sequence, by a stop id, an end-of-sequence id or the end of a stop string. The first
    `min_tokens` may not: the sampler masks the stop ids for them and the detokenizer does
    not end a stop string in them. (The scheduler's own check, vLLM's, is one token laxer:
    it stops on a stop id once the output, that id included, holds `min_tokens`; the mask
    keeps such an id from being sampled there.)

    Example: min_tokens 2 -> tokens 0 and 1 may not end the sequence, token 2 may.
    """
    return index >= min_tokens


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completion of one prompt.

    `temperature=0` is greedy. Invalid values raise `ValueError` naming the field.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The final output carries the last hidden state of every processed position:
    # [num_prompt_tokens + num_output_tokens - 1, hidden_size] (needs an engine created
    # with enable_return_hidden_states=True).
    return_hidden_states: bool = False
    # Constrain the output to a JSON schema, regex, choice or grammar (None: unconstrained).
    structured_outputs: StructuredOutputsParams | None = None
    # Sample only among these token ids (None: the whole vocabulary); e.g. Whisper's
    # language tokens for language detection.
    allowed_token_ids: list[int] | None = None
    # Beam search instead of sampling (`LLM.beam_search`, the server's use_beam_search):
    # the final output holds the n best of beam_search.beam_width beams. Only max_tokens,
    # n and the output fields of these params apply then (see `_verify_beam_search`).
    beam_search: BeamSearchParams | None = None
    # Filled in by the processor: the tokenizer's end-of-sequence token and any extra
    # ids that also end generation (e.g. from generation_config.json).
    eos_token_id: int | None = field(default=None, repr=False)
    all_stop_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        assert isinstance(self.stop, list) and self.stop_token_ids is not None  # __post_init__

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be greater than zero")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise bad("max_tokens", "must be at least 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "must be a non-negative integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.return_hidden_states, bool):
            raise bad("return_hidden_states", "must be a bool")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative integers")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            if self.structured_outputs.kind is None:
                raise ValueError(
                    "structured_outputs has options but no constraint: give one of "
                    f"{', '.join(STRUCTURED_OUTPUT_KINDS[:5])}.")
        if self.beam_search is not None:
            self._verify_beam_search()

    def _verify_beam_search(self) -> None:
        """Beam search ranks raw log-probabilities: refuses what would change them or what
        sampling alone means, naming the field, rather than ignore it."""
        beam = self.beam_search
        if not isinstance(beam, BeamSearchParams):
            raise ValueError(f"beam_search must be a BeamSearchParams, got {beam!r}.")
        if self.n > beam.beam_width:
            raise ValueError(f"n={self.n} cannot exceed beam_search.beam_width="
                             f"{beam.beam_width}.")
        defaults = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "repetition_penalty": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                    "seed": None, "min_tokens": 0, "prompt_logprobs": None,
                    "return_hidden_states": False, "structured_outputs": None,
                    "allowed_token_ids": None}
        for name, default in defaults.items():
            if getattr(self, name) != default:
                raise ValueError(f"{name} cannot be combined with beam search, got "
                                 f"{getattr(self, name)!r}.")
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0 with beam search, got {self.temperature}.")
        if self.max_tokens != beam.max_tokens or self.ignore_eos != beam.ignore_eos:
            raise ValueError("max_tokens and ignore_eos must equal beam_search's (build these "
                             "params with BeamSearchParams.sampling_params()).")
        if self.stop or self.stop_token_ids:
            raise ValueError("stop / stop_token_ids cannot be combined with beam search.")

    def stop_ids(self) -> list[int]:
        """The ids that end a sequence (once `may_stop_at` allows): `stop_token_ids`, and
        unless `ignore_eos` the end-of-sequence ids."""
        ids = list(self.stop_token_ids or ())  # a list once constructed
        if not self.ignore_eos:
            ids += self.end_of_sequence_ids()
        return ids

    def end_of_sequence_ids(self) -> list[int]:
        """The ids that end a sequence unless `ignore_eos`: the tokenizer's EOS and the
        model's other end ids (generation_config.json), as the processor filled them in."""
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        return [*eos, *self.all_stop_token_ids]

    def clone(self) -> SamplingParams:
        copy = SamplingParams.__new__(SamplingParams)
        for name in self.__slots__:
            value = getattr(self, name)
            setattr(copy, name, list(value) if isinstance(value, list) else value)
        return copy
