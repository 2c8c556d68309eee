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


# Whitespace allowed between JSON tokens unless the request asks for compact JSON: at most
# one line break and an indent, so a model can pretty-print but cannot spend its budget on
# blank lines (an unbounded run of whitespace is always a valid continuation).
BOUNDED_WHITESPACE = r"(\n|\r\n)?[ \t]{0,24}"


class GrammarKey(NamedTuple):
    """A constraint in canonical form: equal constraints compile once.

    kind: "json" | "regex" | "choice" | "grammar" | "structural_tag" (json_object is the
    schema {"type": "object"}); spec: the schema as compact JSON (key order kept; objects
    closed, see `strict_schema`), the regex, the choices as a JSON list, the grammar text,
    or the structural tag as compact JSON `{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}` (its schemas strict);
    whitespace: the regex of whitespace allowed between JSON tokens ("" for compact JSON).
    """

    kind: str
    spec: str
    whitespace: str


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    kind = params.kind
    if kind is None:
        raise GrammarError("structured_outputs has options but no constraint.")
    if params.disable_any_whitespace:
        whitespace = ""
    else:
        whitespace = params.whitespace_pattern or BOUNDED_WHITESPACE
    if kind in ("json", "json_object"):
        schema: Any = params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        # json_object is any object: open by definition. Every schema is strict.
        schema = {"type": "object"} if kind == "json_object" else strict_schema(schema)
        spec = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the output's
        return GrammarKey("json", spec, whitespace)
    if kind == "choice":
        return GrammarKey("choice", json.dumps(params.choice), whitespace)
    if kind == "structural_tag":
        tag: Any = params.structural_tag
        if isinstance(tag, str):
            tag = json.loads(tag)
        structures = [{"begin": s["begin"], "schema": strict_schema(s["schema"]), "end": s["end"]}
                      for s in tag["structures"]]
        spec = json.dumps({"structures": structures, "triggers": tag["triggers"]},
                          separators=(",", ":"))
        return GrammarKey("structural_tag", spec, whitespace)
    value = getattr(params, kind)
    assert isinstance(value, str), kind  # regex or grammar: StructuredOutputsParams checked
    return GrammarKey(kind, value, whitespace)


# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_ONE_SCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems",
               "unevaluatedItems", "contains", "propertyNames", "not", "if", "then", "else")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any) -> Any:
    """The schema in strict mode (OpenAI's strict schemas; vLLM's default backend): an
    object schema that does not say `additionalProperties` (or `unevaluatedProperties`)
    gets `"additionalProperties": false`, and an array of `prefixItems` that does not say
    `items` gets `"items": false`. One that says them (true, or a schema) keeps them. An
    integer without bounds gets I-JSON's (+/- 2**53 - 1, what every JSON reader holds
    exactly), so its digits end: a small model otherwise writes digits until max_tokens.

    Composed objects close as a whole: the branches of `allOf` (and of `anyOf`/`oneOf` on a
    node that is itself an object schema) are parts of their node, so they stay open at
    their top and the node declares every property the parts do (as `{}`: the parts say
    what each holds). `$ref` parts are resolved in the document and inlined for that. E.g.
    {"allOf": [{"properties": {"a": A}}, {"properties": {"b": B}}]} becomes
    {"allOf": [...], "properties": {"a": {}, "b": {}}, "additionalProperties": false}.
    Only keywords holding subschemas are walked: `const`, `enum`, `default`, `examples` and
    property names are data and stay as they are.
    """
    return _StrictWalk(schema).close(schema, is_part=False)


class _StrictWalk:
    def __init__(self, root: Any) -> None:
        self.root = root

    def close(self, node: Any, is_part: bool) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        objectish = _is_object_schema(node)
        parts = ["allOf"] + (["anyOf", "oneOf"] if objectish else [])
        for key, value in node.items():
            if key in _ONE_SCHEMA or (key == "items" and isinstance(value, list)):
                out[key] = ([self.close(v, False) for v in value] if isinstance(value, list)
                            else self.close(value, False))
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                out[key] = [self.close(self._inline(v) if key in parts else v, key in parts)
                            for v in value]
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: self.close(v, False) for name, v in value.items()}
        if is_part:
            return out
        part_names = [name for key in parts for part in out.get(key) or []
                      if isinstance(part, dict) for name in part.get("properties") or {}]
        if (objectish or part_names) and not _says_extra(node):
            own = dict(out.get("properties") or {})
            for name in part_names:
                own.setdefault(name, {})
            if own or "properties" in out:
                out["properties"] = own
            out["additionalProperties"] = False
        if "prefixItems" in node and "items" not in node and "unevaluatedItems" not in node:
            out["items"] = False
        if node.get("type") == "integer":
            _bound_integer(out)
        return out

    def _inline(self, part: Any) -> Any:
        """A part that is only a local `$ref` ("#/..."), replaced by what it points to (so
        its properties are known); any other part as it is."""
        if not (isinstance(part, dict) and set(part) == {"$ref"}
                and isinstance(part["$ref"], str) and part["$ref"].startswith("#")):
            return part
        target: Any = self.root
        for token in part["$ref"][1:].split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or token not in target:
                return part  # a dangling ref: the backend names it
            target = target[token]
        return target


# I-JSON's (RFC 7493) integers: what every JSON reader holds exactly.
MAX_SAFE_INTEGER = 2**53 - 1


def _bound_integer(node: dict[str, Any]) -> None:
    """Gives an integer schema the bounds it lacks: +/- MAX_SAFE_INTEGER (a side whose other
    bound lies beyond it stays open)."""
    def given(*keys: str) -> list[float]:
        return [node[k] for k in keys if isinstance(node.get(k), int | float)]

    low, high = given("minimum", "exclusiveMinimum"), given("maximum", "exclusiveMaximum")
    if not low and all(h >= -MAX_SAFE_INTEGER for h in high):
        node["minimum"] = -MAX_SAFE_INTEGER
    if not high and all(lo <= MAX_SAFE_INTEGER for lo in low):
        node["maximum"] = MAX_SAFE_INTEGER


def _is_object_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) \
        or "properties" in node


def _says_extra(node: dict[str, Any]) -> bool:
    return "additionalProperties" in node or "unevaluatedProperties" in node


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

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], drafts: list[list[int]],
                      bitmask: torch.Tensor) -> None:
        """Writes the grammars' masks into consecutive rows of `bitmask`, one row per
        grammar, or with drafts one per position: its mask after 0, 1, ..., k drafts (each
        one it allows; the matcher is advanced over them, then rolled back). E.g. grammars
        [a, b] with drafts [[7, 8], []] fill rows: a, a after 7, a after 7 8, b.

        One row after another here; a backend may fill them in parallel, to the same bits.
        """
        row = 0
        for grammar, tokens in zip(grammars, drafts, strict=True):
            for j in range(len(tokens) + 1):
                grammar.fill_bitmask(bitmask, row)
                row += 1
                if j < len(tokens):
                    accepted = grammar.accept_tokens([tokens[j]])
                    assert accepted  # the scheduler kept only the drafts it allows
            if tokens:
                grammar.rollback(len(tokens))
