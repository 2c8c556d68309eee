"""`SchedulerOutput`: what the scheduler tells the model runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.messages import EncoderInput
from vllm.v1.request import Request


@dataclass(slots=True)
class NewRequestData:
    """Everything the runner needs about a request it has not seen (or has forgotten,
    after a preemption). Sent once; later steps send only `CachedRequestData` deltas."""

    req_id: str
    prompt_token_ids: list[int]  # placeholders at embeds positions
    prompt_embeds: torch.Tensor | None  # [num_embedded_positions, hidden_size]
    output_token_ids: list[int]  # generated before a preemption; usually empty
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Encoder/decoder models: the encoder input (used when the encoder runs this step) and
    # the cross-attention blocks holding its K/V.
    encoder_input: EncoderInput | None = None
    cross_block_ids: list[int] = field(default_factory=list)
    # Mixed prompts: bool [num_prompt_tokens], True at real ids (None: all one kind).
    prompt_is_token_ids: torch.Tensor | None = None
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    # M-RoPE models with media: int64 [3, num_prompt_tokens] rotary positions.
    mrope_positions: torch.Tensor | None = None
    # Media runs [start, end) attending bidirectionally (empty: all causal).
    bidirectional_spans: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int],
                     cross_block_ids: list[int] | None = None) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.all_token_ids[:request.num_prompt_tokens],
            prompt_embeds=request.prompt_embeds,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            encoder_input=request.encoder_input,
            cross_block_ids=cross_block_ids or [],
            prompt_is_token_ids=request.prompt_is_token_ids,
            lora_request=request.lora_request,
            mrope_positions=request.mrope_positions,
            bidirectional_spans=request.bidirectional_spans,
        )


@dataclass(slots=True)
class CachedRequestData:
    """Deltas for requests the runner already holds, index-aligned lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class RowsToGather:
    """A finished request whose per-token outputs the runner reads from its stage-output
    cache this step. The scheduler keeps the request's blocks until then, so no other
    request can have overwritten them."""

    req_id: str
    block_ids: list[int]  # every block the request holds, in position order
    num_rows: int  # positions [0, num_rows): all whose hidden state was computed


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step; insertion order is the scheduling order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget: finished or aborted since the last step, or
    # preempted in this one.
    finished_req_ids: list[str]
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests whose encoder runs this step, writing their new cross-attention blocks.
    scheduled_encoder_inputs: list[str] = field(default_factory=list)
    rows_to_gather: list[RowsToGather] = field(default_factory=list)
    # Structured outputs: the requests sampling under a grammar this step, in scheduling
    # order, and their allowed next tokens packed 32 to a word (bit t % 32 of word t // 32:
    # token t), one row each: [len(structured_output_request_ids), ceil(vocab / 32)] int32.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    # Beam search: (source, destination) KV blocks to copy before this step's forward (a
    # forked beam's copy of its parent's partly filled last block).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: req_id -> the drafts verified this step (its scheduled tokens
    # are its last known token + these); requests without drafts are absent.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
