"""`Request`: the scheduler's record of one sequence in flight."""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from vllm.config import InputKind
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.messages import (
    EmbedsLayout,
    EncoderInput,
    EngineCoreRequest,
    FinishReason,
    mrope_delta,
)
from vllm.v1.structured_output.backend import StructuredOutputGrammar

# Token id stored at positions whose input comes from prompt embeds. The scheduler never
# reads it; the model runner's is_token_ids table says the position is not a real token.
EMBEDS_PLACEHOLDER_TOKEN_ID = 0


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # its structured-output grammar is compiling
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Token ids (placeholders where the prompt is embeds), progress and block hashes.

    `num_tokens - num_computed_tokens` is all the scheduler needs: prefill, chunked
    prefill, prefix hits and decode are the same arithmetic.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        prompt_embeds: torch.Tensor | None,
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        max_model_len: int,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        encoder_input: EncoderInput | None = None,
        cache_salt: str | None = None,
        prompt_is_token_ids: torch.Tensor | None = None,
        lora_request: LoRARequest | None = None,
        lora_fingerprint: bytes = b"",
        mrope_positions: torch.Tensor | None = None,
        bidirectional_spans: list[tuple[int, int]] | None = None,
    ) -> None:
        self.request_id = request_id
        # Its LoRA adapter: mixed into the first block's hash with its files' fingerprint
        # (`files_fingerprint`), and it holds a slot while it runs.
        self.lora_request = lora_request
        self.lora_fingerprint = lora_fingerprint
        self.cache_salt = cache_salt  # mixed into the first block's hash
        # Encoder/decoder models: the encoder's input, kept until the request finishes (a
        # preempted request whose cross blocks were evicted runs the encoder again).
        self.encoder_input = encoder_input
        self.prompt_token_ids = prompt_token_ids
        self.prompt_embeds = prompt_embeds
        # Mixed prompts: True at the positions holding real ids (see EngineCoreRequest).
        self.prompt_is_token_ids = prompt_is_token_ids
        # M-RoPE models with media: [3, num_prompt_tokens] (see EngineCoreRequest), and the
        # offset of the positions past the prompt (`mrope_delta`), which the block hashes read.
        self.mrope_positions = mrope_positions
        self.mrope_delta = 0 if mrope_positions is None else mrope_delta(mrope_positions)
        # Media runs attending bidirectionally (see EngineCoreRequest): never split.
        self.bidirectional_spans = [(int(s), int(e)) for s, e in bidirectional_spans or ()]
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        if prompt_token_ids is not None:
            self.num_prompt_tokens = len(prompt_token_ids)
            self._all_token_ids = list(prompt_token_ids)
        else:
            assert prompt_embeds is not None
            self.num_prompt_tokens = prompt_embeds.shape[0]
            self._all_token_ids = [EMBEDS_PLACEHOLDER_TOKEN_ID] * self.num_prompt_tokens
        # Which positions read embeds rows; None for a prompt of token ids only.
        self.embeds_layout = EmbedsLayout.of(self.num_prompt_tokens, prompt_embeds,
                                             prompt_is_token_ids)
        room = max_model_len - self.num_prompt_tokens
        requested = sampling_params.max_tokens
        self.max_tokens = max(1, room if requested is None else min(requested, max(room, 1)))
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # set on the first schedule
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # A stop string matched in the front end while this request (which must return its
        # rows) was not fully computed: it finishes at its next sampled token.
        self.stop_requested = False
        # Structured outputs: the compile in flight, then this request's matcher, advanced
        # with every token it accepts (kept across preemptions: the outputs are kept too).
        self.grammar_future: Future[StructuredOutputGrammar] | None = None
        self.grammar: StructuredOutputGrammar | None = None
        # Beam search: the `BeamGroup` this beam belongs to, and whether the runner must get
        # this request in full at its next schedule (its tokens changed behind the runner's
        # back: a beam's chosen token is not the one the runner sampled).
        self.beam_group: Any = None
        # Speculative decoding: drafts of the next tokens, verified at the next schedule.
        self.spec_token_ids: list[int] = []
        self.resend_in_full = False
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest, max_model_len: int,
                                 block_hasher: Callable[[Request], list[bytes]] | None
                                 ) -> Request:
        return cls(request.request_id, request.prompt_token_ids, request.prompt_embeds,
                   request.sampling_params, request.eos_token_id, request.arrival_time,
                   max_model_len, block_hasher, request.encoder_input, request.cache_salt,
                   request.prompt_is_token_ids, request.lora_request,
                   request.lora_fingerprint, request.mrope_positions,
                   request.bidirectional_spans)

    def splits_span(self, position: int) -> bool:
        """Whether a cut before `position` falls inside a bidirectional span (the span's
        positions must be computed in one step, all of them seeing each other)."""
        return any(start < position < end for start, end in self.bidirectional_spans)

    def chunk_end(self, begin: int, end: int) -> int:
        """The end of a chunk [begin, end), cut back where it would split a bidirectional
        span: to the span's start (the span waits for a step that takes it whole).
        Example: spans [(4, 20)], begin 0: end 12 -> 4, end 20 -> 20, end 25 -> 25;
        begin 4: end 12 -> 4 (nothing this step)."""
        for start, stop in self.bidirectional_spans:
            if begin <= start < end < stop:
                return start
        return end

    def span_at(self, position: int) -> int:
        """The length of the bidirectional span that starts at `position` (0: none)."""
        for start, stop in self.bidirectional_spans:
            if start == position:
                return stop - start
        return 0

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prompt_kind(self) -> InputKind:
        return InputKind.TOKEN_IDS if self.prompt_embeds is None else InputKind.EMBEDS

    @property
    def num_encoder_tokens(self) -> int:
        """Rows of cross-attention K/V this request needs (0 for decoder-only models)."""
        return 0 if self.encoder_input is None else self.encoder_input.num_tokens

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def fork(self, request_id: str) -> Request:
        """A beam forked from this one: the same tokens, progress and block hashes (its
        blocks come from `KVCacheManager.fork`); runs under `request_id`."""
        child = copy.copy(self)
        child.request_id = request_id
        child.output_token_ids = list(self.output_token_ids)
        child._all_token_ids = list(self._all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.num_preemptions = 0
        child.resend_in_full = True
        return child

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)
