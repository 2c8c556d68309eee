"""Incremental detokenization and stop-string matching for one sequence."""

from __future__ import annotations

from typing import Any

from vllm.sampling_params import may_stop_at

# Prompt tokens used to prime decoding, so that the first generated token decodes as it
# would in context (leading spaces of SentencePiece-style tokens, merged bytes).
_PRIME_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters.

    Each step decodes two windows of the id list, `[prefix:read]` and `[prefix:]`; the
    text the second adds beyond the first is new, unless it ends in U+FFFD (a multi-byte
    character split across tokens), in which case nothing is emitted until the character
    completes. Byte-level BPE and SentencePiece both decode correctly this way.

    `incremental=False` (outputs nobody streams, and no stop strings to match) defers all
    decoding to `flush()` at the end: one decode of the primed window instead of two per
    token, with the same text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int] | None,
                 skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool, min_tokens: int = 0,
                 incremental: bool = True) -> None:
        if stop and not incremental:
            raise ValueError("Stop strings need incremental detokenizing.")
        self.tokenizer = tokenizer
        self.incremental = incremental
        self.min_tokens = min_tokens  # stop strings count only after this many tokens
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.stop_buffer_length = max((len(s) for s in stop), default=1) - 1
        prime = list(prompt_token_ids[-_PRIME_TOKENS:]) if prompt_token_ids else []
        self.tokens: list[int] = prime
        self.prefix_offset = 0
        self.read_offset = len(prime)
        self.output_text = ""
        self.token_ids: list[int] = []

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Appends tokens and decodes them; returns the stop string matched, if any.

        `stop_terminated`: the last token ended the request (EOS / stop token id); its
        text is not added. Several tokens at once (speculative decoding) are checked one
        by one: a stop string completed by one of them drops the tokens after it.
        """
        num_before = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None:
            return None
        decode_ids = new_token_ids[:-1] if stop_terminated and not self.include_stop \
            else new_token_ids
        if not self.incremental:
            self.tokens.extend(decode_ids)
            return None
        start = len(self.output_text)
        for i, token_id in enumerate(decode_ids):
            self.tokens.append(token_id)
            self.output_text += self._decode_next()
            if i + 1 < len(new_token_ids):
                stop = self._check_stop(start, num_before + i + 1)
                if stop is not None:
                    del self.token_ids[num_before + i + 1:]
                    return stop
        return self._check_stop(start, len(self.token_ids))

    def _decode_next(self) -> str:
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full[len(prefix):]
        return ""

    def flush(self) -> None:
        """At the end of the sequence, emits what was held back waiting for a character
        to complete (invalid bytes become U+FFFD, as a full decode would show them)."""
        if self.tokenizer is None or self.read_offset == len(self.tokens):
            return
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        self.output_text += full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _check_stop(self, new_text_start: int, num_tokens: int) -> str | None:
        if not self.stop or not may_stop_at(num_tokens - 1, self.min_tokens):
            return None
        search_from = max(0, new_text_start - self.stop_buffer_length)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[:index + (len(stop) if self.include_stop else 0)]
        return stop

    def get_text(self, finished: bool) -> str:
        """The text that is safe to show: without a tail that might still become a stop
        string, unless the sequence is finished."""
        if finished or not self.stop or self.include_stop:
            return self.output_text
        return self.output_text[:max(0, len(self.output_text) - self.stop_buffer_length)]

    def decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
