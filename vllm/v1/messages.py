"""Wire types between the front end (processor, output processor) and the engine core,
and the request-level types both sides and the core's parts share (the scheduler, requests,
metrics, models). Below the engine package: nothing here imports the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import LogprobsLists
from vllm.v1.spec_decode.metrics import SpecDecodingStats


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3  # the engine failed while running this request; others went on

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


@dataclass(slots=True)
class EncoderInput:
    """The encoder side of an encoder/decoder request, validated by the `Processor`.

    Exactly one of `token_ids` and `features` is set. `num_tokens` is the encoder's output
    length, i.e. the number of cross-attention K/V rows; `content_hash` names the input so
    that requests with the same encoder input share cross-attention blocks.
    """

    token_ids: list[int] | None
    # Encoder prompt embeds [num_tokens, d_model] (BART), or log-mel features
    # [num_mel_bins, num_frames] (Whisper); model dtype (embeds) or float32 (features), CPU.
    features: torch.Tensor | None
    num_tokens: int
    content_hash: bytes


@dataclass(slots=True)
class MediaInput:
    """One image or audio clip of a prompt, preprocessed by the `Processor`: the engine
    core's media stage (`vllm/v1/engine/media_rows.py`) turns it into `num_tokens`
    prompt-embeds rows for the placeholder run starting at prompt position `offset`. Exactly
    one of `data` (the model's encoder computes the rows) and `embeds` (the user's
    precomputed rows) is set."""

    modality: str  # "image" or "audio"
    # image: pixel values [3, H, W]; audio: log-mel features [num_mel_bins, frames + 2] (the
    # clip's frames and the two after it that the convolution stem reads); float32, CPU,
    # raw tensor frames on the wire.
    data: torch.Tensor | None
    offset: int
    num_tokens: int
    content_hash: bytes  # sha256 of `data` (the encoder cache's key) or of `embeds`
    embeds: torch.Tensor | None = None  # [num_tokens, hidden_size], model dtype, CPU


class EmbedsLayout:
    """Which prompt positions take their input from prompt-embeds rows, and which row.

    `is_token[p]` is True where position p holds a real token id; the embeds rows belong,
    in order, to the other positions. Example: is_token [T, F, F, T, F] -> rows_before
    [0, 0, 1, 2, 2, 3]: positions 1, 2, 4 read rows 0, 1, 2; positions [1, 4) read rows
    [0, 2). Positions past the prompt (generated tokens) are tokens.
    """

    __slots__ = ("is_token", "rows_before")

    def __init__(self, is_token: np.ndarray) -> None:
        self.is_token = is_token
        self.rows_before = np.zeros(len(is_token) + 1, dtype=np.int64)
        np.cumsum(~is_token, out=self.rows_before[1:])

    @classmethod
    def of(cls, num_prompt_tokens: int, prompt_embeds: torch.Tensor | None,
           prompt_is_token_ids: torch.Tensor | None) -> EmbedsLayout | None:
        """None for a prompt of token ids only; all rows for an embeds-only prompt."""
        if prompt_embeds is None:
            return None
        if prompt_is_token_ids is None:
            return cls(np.zeros(num_prompt_tokens, dtype=bool))
        return cls(prompt_is_token_ids.numpy().astype(bool, copy=False))

    def rows(self, start: int, end: int) -> tuple[int, int]:
        """The embeds rows [first, last) of positions [start, end)."""
        n = len(self.is_token)
        return int(self.rows_before[min(start, n)]), int(self.rows_before[min(end, n)])

    def row_index(self, positions: np.ndarray) -> np.ndarray:
        """The embeds row of each (embedded) prompt position."""
        return self.rows_before[positions]

    def block_mask(self, start: int, end: int) -> np.ndarray:
        """is_token of positions [start, end) (True past the prompt)."""
        mask = np.ones(end - start, dtype=bool)
        inside = self.is_token[start:end]
        mask[:len(inside)] = inside
        return mask


def mrope_delta(positions: np.ndarray | torch.Tensor) -> int:
    """The offset of the positions past the prompt of an M-RoPE table ([3,
    num_prompt_tokens]): position p >= num_prompt_tokens sits at p + delta in all three rows,
    delta = (the prompt's largest position + 1) - num_prompt_tokens (see
    `vllm/multimodal/qwen2_vl.py`)."""
    return int(positions.max()) + 1 - positions.shape[1]


@dataclass(slots=True)
class EngineCoreRequest:
    """One prompt, tokenized and validated, ready for the scheduler.

    A prompt of token ids sets `prompt_token_ids`, one of embeds `prompt_embeds`; a mixed
    prompt (`prompt_segments`, chat messages with embeds parts) sets both and
    `prompt_is_token_ids`: real ids at text positions, placeholders at the others, whose
    rows `prompt_embeds` holds in order. For encoder/decoder models they are the decoder
    prompt, and `encoder_input` is the encoder's.
    """

    request_id: str
    prompt_token_ids: list[int] | None
    # [num_embedded_positions, hidden_size], model dtype, CPU; raw tensor frames on the wire.
    prompt_embeds: torch.Tensor | None
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    encoder_input: EncoderInput | None = None
    # Tenant isolation in the prefix cache: requests share cached blocks only if their
    # salts are equal (None is a salt of its own).
    cache_salt: str | None = None
    # Mixed prompts only: bool [num_prompt_tokens], True at positions holding real ids.
    prompt_is_token_ids: torch.Tensor | None = None
    # The LoRA adapter the request runs with (None: the base model), and the fingerprint of
    # its files as the workers read them (set by the engine core; `files_fingerprint`).
    lora_request: LoRARequest | None = None
    lora_fingerprint: bytes = b""
    # Media whose rows the engine core computes: their placeholder positions are False in
    # `prompt_is_token_ids`, and `prompt_embeds` is None until the media stage fills it.
    mm_inputs: list[MediaInput] | None = None
    # M-RoPE models (Qwen2-VL) with media: int64 [3, num_prompt_tokens], each prompt
    # position's rotary positions; positions past the prompt are p + delta (see
    # `vllm/multimodal/qwen2_vl.py`). None: the position itself, in all three rows.
    mrope_positions: torch.Tensor | None = None
    # Models whose media attend bidirectionally (Gemma 3): each item's run [start, end) of
    # prompt positions, in order; its positions see each other both ways. None: causal.
    bidirectional_spans: list[tuple[int, int]] | None = None

    @property
    def embeds_layout(self) -> EmbedsLayout | None:
        return EmbedsLayout.of(self.num_prompt_tokens, self.prompt_embeds,
                               self.prompt_is_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        assert self.prompt_embeds is not None
        return self.prompt_embeds.shape[0]


@dataclass(slots=True)
class BeamHypothesis:
    """One finished beam of a beam-search request: its generated tokens and, per token,
    the candidates its beam ranked at that step (row i: [chosen, top candidates...] with
    their log-probabilities; `ranks[i]`: the chosen token's rank)."""

    token_ids: list[int]
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: FinishReason
    stop_reason: int | None
    logprobs: LogprobsLists


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # On the final output of a request that asked for them (return_hidden_states):
    # [num_tokens - 1, hidden_size], model dtype; crosses the process boundary as a raw frame.
    hidden_states: torch.Tensor | None = None
    # On the final output of a beam-search request: its finished beams, best first.
    beams: list[BeamHypothesis] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found this step
    num_preemptions: int = 0
    # Speculative decoding: this step's verifications (None: none this step).
    spec_decoding: SpecDecodingStats | None = None


@dataclass(slots=True)
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = field(default_factory=time.monotonic)
    # The data-parallel engine core that sent them (set by the client that received them).
    engine_index: int = 0
