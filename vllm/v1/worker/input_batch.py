"""The model runner's own mirror of its requests: `CachedRequestState` and `InputBatch`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.messages import EmbedsLayout, mrope_delta
from vllm.v1.worker.block_table import BlockTable


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]  # placeholders at embeds positions
    prompt_embeds: torch.Tensor | None  # [num_embedded_positions, hidden_size]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Encoder/decoder models: the cross-attention blocks and how many rows they hold.
    cross_block_ids: list[int] = field(default_factory=list)
    num_encoder_tokens: int = 0
    # Which prompt positions read embeds rows (None: a prompt of token ids only).
    embeds_layout: EmbedsLayout | None = None
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    # M-RoPE models with media: int64 [3, num_prompt_tokens] each prompt position's rotary
    # positions; later positions p take p + mrope_delta (None: p itself).
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    # Media runs [start, end) whose positions attend to each other both ways (Gemma 3).
    bidirectional_spans: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.embeds_layout is None:  # embeds without a layout: an embeds-only prompt
            self.embeds_layout = EmbedsLayout.of(len(self.prompt_token_ids),
                                                 self.prompt_embeds, None)
        if self.mrope_positions is not None:
            self.mrope_delta = mrope_delta(self.mrope_positions)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Persistent per-row tables of the requests in the current batch.

    Rows `0..num_reqs-1` are occupied (holes are closed by `condense`). The token-id
    table holds every known token of a request; `is_token_ids` says which positions are
    real tokens (False where the input comes from prompt embeds). Encoder/decoder models
    (`max_encoder_len > 0`) also keep a cross-attention block table and encoder lengths;
    sliding-window models one block table row per request holding every KV cache group's
    blocks (see `BlockTable`).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 vocab_size: int, max_encoder_len: int = 0, num_kv_cache_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_states: list[CachedRequestState | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.num_reqs = 0
        # Bumped whenever a row changes request (add, remove, move): caches of per-row
        # request state compare it instead of the rows' states.
        self.version = 0

        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.is_token_ids = np.zeros((max_num_reqs, max_model_len), dtype=bool)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(max_num_reqs, max_model_len, block_size,
                                      num_kv_cache_groups)
        self.cross_block_table = (BlockTable(max_num_reqs, max_encoder_len, block_size)
                                  if max_encoder_len else None)
        self.num_encoder_tokens = np.zeros(max_num_reqs, dtype=np.int32)

        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # -1: none
        self._row_arrays = [self.token_ids_cpu, self.is_token_ids, self.num_tokens,
                            self.num_prompt_tokens, self.num_computed_tokens_cpu,
                            self.temperature, self.top_p, self.top_k, self.min_p,
                            self.presence_penalty, self.frequency_penalty,
                            self.repetition_penalty, self.min_tokens, self.num_logprobs,
                            self.num_encoder_tokens]
        self._block_tables = [t for t in (self.block_table, self.cross_block_table)
                              if t is not None]

    def state(self, row: int) -> CachedRequestState:
        """The request state of an occupied row (`0..num_reqs-1` after `condense`)."""
        state = self.req_states[row]
        assert state is not None, f"batch row {row} holds no request"
        return state

    def add_request(self, state: CachedRequestState) -> int:
        row = self.num_reqs
        assert row < self.max_num_reqs
        self.num_reqs += 1
        self.version += 1
        self.req_ids[row] = state.req_id
        self.req_states[row] = state
        self.req_id_to_index[state.req_id] = row

        num_prompt, num_tokens = state.num_prompt_tokens, state.num_tokens
        num_stored = min(num_tokens, self.max_model_len)
        self.token_ids_cpu[row, :num_prompt] = state.prompt_token_ids
        self.token_ids_cpu[row, num_prompt:num_stored] = \
            state.output_token_ids[:num_stored - num_prompt]
        self.is_token_ids[row, :num_stored] = True
        if state.embeds_layout is not None:
            self.is_token_ids[row, :num_prompt] = state.embeds_layout.is_token
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        if self.cross_block_table is not None:
            self.cross_block_table.add_row(state.cross_block_ids, row)
            self.num_encoder_tokens[row] = state.num_encoder_tokens

        params = state.sampling_params
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k if params.top_k > 0 else self.vocab_size
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        return row

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.version += 1
        self.req_ids[row] = None
        self.req_states[row] = None
        for table in self._block_tables:
            table.clear_row(row)
        return row

    def condense(self) -> None:
        """Moves the last occupied rows into the holes left by removed requests.

        Example: rows [a, -, b, -, c] (num_reqs was 5) become [a, c, b] (num_reqs 3).
        """
        holes = [i for i in range(self.num_reqs) if self.req_ids[i] is None]
        last = self.num_reqs - 1
        for hole in holes:
            while last > hole and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            last -= 1
        self.num_reqs = len(self.req_id_to_index)

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None  # condense moves occupied rows only
        self.version += 1
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_states[dst], self.req_states[src] = self.req_states[src], None
        self.req_id_to_index[req_id] = dst
        for array in self._row_arrays:
            array[dst] = array[src]
        for table in self._block_tables:
            table.move_row(src, dst)
            table.clear_row(src)

    def append_token(self, row: int, token_id: int) -> None:
        """Records a sampled token; it becomes the row's next input position."""
        pos = self.num_tokens[row]
        if pos < self.max_model_len:
            self.token_ids_cpu[row, pos] = token_id
            self.is_token_ids[row, pos] = True
        self.num_tokens[row] = pos + 1
        self.state(row).output_token_ids.append(token_id)

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Records a step's tokens of one row (verified drafts and the token after them):
        `append_token` for each, with one store per table."""
        pos = int(self.num_tokens[row])
        end = min(pos + len(token_ids), self.max_model_len)
        if end > pos:
            self.token_ids_cpu[row, pos:end] = token_ids[:end - pos]
            self.is_token_ids[row, pos:end] = True
        self.num_tokens[row] = pos + len(token_ids)
        self.state(row).output_token_ids.extend(token_ids)

    @property
    def req_ids_in_order(self) -> list[str]:
        return self.req_ids[:self.num_reqs]  # type: ignore[return-value]
