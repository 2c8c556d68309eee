"""The grammar-engine interface of structured outputs, and a request's constraint in
canonical form (the compile cache's key)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

from vllm.sampling_params import StructuredOutputsParams


class GrammarError(ValueError):
    """A constraint that cannot be compiled, or that no output can satisfy."""


class GrammarKey(NamedTuple):
    """A constraint in canonical form: equal constraints compile once.

    kind: "json" | "regex" | "choice" | "grammar" (json_object is the schema
    {"type": "object"}); spec: the schema as compact JSON (key order kept), the regex, the
    choices as a JSON list, or the grammar text; any_whitespace: JSON may have whitespace
    between tokens.
    """

    kind: str
    spec: str
    any_whitespace: bool


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        if params.disable_additional_properties:
            schema = _close_objects(schema)
        spec = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the output's
        return GrammarKey("json", spec, any_whitespace)
    if kind == "choice":
        return GrammarKey("choice", json.dumps(params.choice), any_whitespace)
    value = getattr(params, kind)
    assert isinstance(value, str), kind  # regex or grammar: StructuredOutputsParams checked
    return GrammarKey(kind, value, any_whitespace)


def _close_objects(schema: Any) -> Any:
    """The schema with `"additionalProperties": false` on every object schema that does not
    set it (disable_additional_properties)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: _close_objects(v) for k, v in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) \
            and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


class StructuredOutputGrammar(ABC):
    """One request's matcher: where its output stands in the grammar."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advances over sampled tokens; False (matcher unchanged) if the grammar rejects
        one of them."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (int32, bit t % 32 of word
        t // 32 set = token t allowed; EOS set only where the grammar may end)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and accepts nothing more (only EOS may follow)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` accepted tokens."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start, as if no token had been accepted."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary width (the logits' width)."""

    @abstractmethod
    def compile(self, key: GrammarKey) -> object:
        """The compiled form of a constraint (cacheable, shared by requests).

        Raises:
            GrammarError: the constraint does not compile or matches no output.
        """

    @abstractmethod
    def new_matcher(self, compiled: object) -> StructuredOutputGrammar:
        """A fresh matcher of a compiled constraint, for one request."""
