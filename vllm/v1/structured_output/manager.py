"""`StructuredOutputManager`: the engine core's side of structured outputs: compiles
constraints off the step loop, caches them by canonical form, hands each request its own
matcher and fills the step's packed bitmask."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from vllm.config import ModelConfig
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backend import (
    GrammarError,
    GrammarKey,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    grammar_key,
)

logger = logging.getLogger(__name__)

# Compiled constraints kept (oldest dropped first); a compiled JSON schema is ~100 KB.
MAX_CACHED_GRAMMARS = 256


def make_backend(tokenizer: Any, vocab_size: int) -> StructuredOutputBackend:
    """The grammar engine for a tokenizer (the one backend: llguidance)."""
    from vllm.v1.structured_output.guidance import GuidanceBackend

    return GuidanceBackend(tokenizer, vocab_size)


class GrammarCompiler:
    """Compiles constraints into a cache keyed by canonical form (`GrammarKey`), for one
    tokenizer. `compile` runs in the caller's thread; the backend is built on first use.
    Shared by the front end (which validates every constraint before submitting it) and an
    engine core in the same process; dict operations keep it safe across threads (a race
    only compiles a constraint twice)."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._backend: StructuredOutputBackend | None = None
        self._cache: dict[GrammarKey, object] = {}
        self.num_compiled = 0  # cache misses (tests and benchmarks read it)

    @classmethod
    def for_model(cls, model_config: ModelConfig) -> GrammarCompiler:
        """A compiler that loads the model's tokenizer on first use."""

        def load_tokenizer() -> Any:
            from vllm.transformers_utils.tokenizer import get_tokenizer

            return get_tokenizer(model_config.tokenizer)

        return cls(load_tokenizer, model_config.vocab_size)

    @property
    def backend(self) -> StructuredOutputBackend:
        if self._backend is None:
            self._backend = make_backend(self._load_tokenizer(), self.vocab_size)
        return self._backend

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled constraint (cached). Raises GrammarError naming what is wrong."""
        key = grammar_key(params)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self.backend.compile(key)
            self.num_compiled += 1
            if len(self._cache) >= MAX_CACHED_GRAMMARS:
                del self._cache[next(iter(self._cache))]
            self._cache[key] = compiled
        return compiled

    def new_matcher(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        return self.backend.new_matcher(self.compile(params))


class StructuredOutputManager:
    """Compiles each constrained request's grammar on one background thread while the step
    loop goes on; the scheduler polls `ready` and then owns the request's matcher."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, params: StructuredOutputsParams) -> Future[StructuredOutputGrammar]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool.submit(self.compiler.new_matcher, params)

    def grammar_bitmask(self, grammars: list[StructuredOutputGrammar],
                        drafts: list[list[int]] | None = None) -> torch.Tensor:
        """The packed masks of the step's constrained sampling rows, in order:
        [len(grammars) + drafted tokens, ceil(vocab_size / 32)] int32. A grammar with
        drafts (speculative decoding; each one it allows) gets a row per position: its
        mask after 0, 1, ..., k drafts (advanced over them, then rolled back)."""
        drafts = drafts or [[] for _ in grammars]
        num_rows = sum(1 + len(d) for d in drafts)
        bitmask = torch.empty(num_rows, (self.vocab_size + 31) // 32, dtype=torch.int32)
        self.compiler.backend.fill_bitmasks(grammars, drafts, bitmask)
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_error(future: Future[StructuredOutputGrammar]) -> str | None:
    """Why a finished compile failed, or None if it succeeded."""
    error = future.exception()
    if error is None:
        return None
    if not isinstance(error, GrammarError):
        logger.error("Compiling a grammar failed unexpectedly", exc_info=error)
    return str(error)
