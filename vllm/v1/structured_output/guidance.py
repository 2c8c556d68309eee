"""`GuidanceBackend`: structured outputs on llguidance (JSON schemas, regexes, choices,
Lark and GBNF grammars).

Chosen over xgrammar by what locks cleanly: xgrammar's wheel declares triton on Linux, which
this project's CPU lock refuses; llguidance has no dependencies. Its mask for the default
model's 49,152-token vocabulary takes ~20 us per row (README, "Structured outputs").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from vllm.v1.structured_output.backend import (
    GrammarError,
    GrammarKey,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


class GuidanceGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id
        # EOS accepted where the matcher had already stopped (a grammar that can only end:
        # `{"a":1}` of an object schema): the matcher does not record it, so a rollback
        # over it must not count it. Always the last tokens accepted.
        self._unrecorded_eos = 0

    def accept_tokens(self, token_ids: list[int]) -> bool:
        num_taken = self.matcher.try_consume_tokens(token_ids)
        if num_taken == len(token_ids):
            return True
        # EOS where the grammar may end is accepted, though try_consume_tokens stops at it.
        if token_ids[num_taken:] == [self.eos_token_id] and self.matcher.is_accepting():
            if self.matcher.is_stopped():
                self._unrecorded_eos += 1
                return True
            return self.matcher.consume_token(self.eos_token_id)
        self.matcher.rollback(num_taken)
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        unrecorded = min(num_tokens, self._unrecorded_eos)
        self._unrecorded_eos -= unrecorded
        if num_tokens > unrecorded:
            self.matcher.rollback(num_tokens - unrecorded)

    def reset(self) -> None:
        self._unrecorded_eos = 0
        self.matcher.reset()


class GuidanceBackend(StructuredOutputBackend):
    """llguidance over a Hugging Face fast tokenizer; `vocab_size` is the logits' width
    (ids the tokenizer lacks are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        # Special tokens by text (a structural tag's trigger may be one, e.g. Qwen's
        # <tool_call>: a token, not text the grammar could match byte by byte).
        special = getattr(tokenizer, "all_special_tokens", [])
        self.special_ids: dict[str, int] = {
            text: tokenizer.convert_tokens_to_ids(text) for text in special}
        # Fills a step's masks, as many at once as the engine's intra-op threads (the step
        # waits for them, so the cores the forward uses are free). Not on two threads or
        # fewer: there the pool's hand-off costs about what it saves (docs/structured-outputs.md).
        threads = torch.get_num_threads()
        self.executor = llguidance.LLExecutor(num_threads=threads) if threads > 2 else None

    def compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        grammar = _to_guidance(key, self.special_ids)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"Invalid {_NAMES[key.kind]}: {_first_line(matcher.get_error())}")
        # A grammar that matches nothing shows at its first mask: an error state.
        probe = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask(matcher, probe, 0)
        if matcher.is_error() or not probe.any():
            raise GrammarError(f"The {_NAMES[key.kind]} cannot match any output.")
        matcher.reset()
        return matcher

    def new_matcher(self, compiled: object) -> GuidanceGrammar:
        assert isinstance(compiled, llguidance.LLMatcher)
        return GuidanceGrammar(compiled.deep_copy(), self.ll_tokenizer.eos_token)

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], drafts: list[list[int]],
                      bitmask: torch.Tensor) -> None:
        """All rows at once on llguidance's thread pool (the GIL released), when there is
        one and no grammar has drafts (the usual step); with drafts, row by row
        (llguidance's batched form with drafts stops at a drafted EOS and leaves the rows
        after it unwritten)."""
        if self.executor is None or any(drafts):
            super().fill_bitmasks(grammars, drafts, bitmask)
            return
        matchers = []
        for row, grammar in enumerate(grammars):
            assert isinstance(grammar, GuidanceGrammar)
            matchers.append((grammar.matcher, row))
        llguidance.torch.fill_next_token_bitmask_par(self.executor, matchers, bitmask)


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice",
          "grammar": "grammar", "structural_tag": "structural tag"}


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


def _to_guidance(key: GrammarKey, special_ids: dict[str, int]) -> str:
    """The llguidance grammar text of a constraint; GrammarError on malformed input."""
    # Overrides, not defaults: a schema's own "x-guidance" options cannot unbound the
    # whitespace.
    whitespace: JsonCompileOptions = (
        {"whitespace_flexible": True, "whitespace_pattern": key.whitespace}
        if key.whitespace else {"whitespace_flexible": False})
    try:
        if key.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(key.spec, overrides=whitespace)
        if key.kind == "structural_tag":
            return llguidance.LLMatcher.grammar_from_lark(
                _structural_tag_lark(json.loads(key.spec), whitespace, special_ids))
        if key.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(key.spec)
        if key.kind == "choice":
            choices = json.loads(key.spec)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices))
        return llguidance.grammar_from("grammar", key.spec)  # Lark or GBNF
    except ValueError as e:
        raise GrammarError(f"Invalid {_NAMES[key.kind]}: {_first_line(str(e))}") from None


def _structural_tag_lark(tag: dict[str, Any], whitespace: JsonCompileOptions,
                         special_ids: dict[str, int]) -> str:
    """The Lark grammar of a structural tag: free text, in which a trigger (a lazy lexeme:
    it ends the text at its first occurrence) must go on into one of the structures that
    begin with it. E.g. for one structure {"begin": "<f>{", "schema": S, "end": "}</f>"}
    with the trigger "<f>":

        start: (tag_0)* text
        text: TEXT
        trigger_0[lazy]: TEXT "<f>"
        tag_0: trigger_0 "{" %json {S, "x-guidance": whitespace} "}</f>"

    A trigger that is a special token (`special_ids`) is that token (`<[id]>`), which
    text never holds: `trigger_0: TEXT <[151657]>`.
    """
    triggers: list[str] = tag["triggers"]
    structures = tag["structures"]
    lines = ["%llguidance {}",
             f"start: ({' | '.join(f'tag_{i}' for i in range(len(structures)))})* text",
             "text: TEXT", r"TEXT: /(.|\n)*/"]
    lines += [f"trigger_{i}: TEXT <[{special_ids[t]}]>" if t in special_ids
              else f"trigger_{i}[lazy]: TEXT {json.dumps(t)}" for i, t in enumerate(triggers)]
    for i, structure in enumerate(structures):
        begin: str = structure["begin"]
        # The longest trigger the structure begins with (the rest of `begin` follows it).
        t = max((j for j, t in enumerate(triggers) if begin.startswith(t)),
                key=lambda j: len(triggers[j]))
        schema = structure["schema"]
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        body = json.dumps({**schema, "x-guidance": whitespace})
        rest, end = begin[len(triggers[t]):], structure["end"]
        lines.append(f"tag_{i}: trigger_{t} {json.dumps(rest) if rest else ''} %json {body} "
                     f"{json.dumps(end) if end else ''}")
    return "\n".join(lines) + "\n"
