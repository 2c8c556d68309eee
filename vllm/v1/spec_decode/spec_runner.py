"""`SpecDecodeRunner`: the model runner's side of speculative decoding.

A step that verifies drafts runs through the ordinary forward: request r's scheduled
tokens are its last known token followed by its k_r drafts (written into the token-id
table past its known tokens), a query of 1 + k_r tokens against the paged cache like any
prefill chunk. The logits of all 1 + k_r positions go to the `RejectionSampler`; the
accepted drafts and the token after them are appended to the batch. Rejected drafts need
no undo here: the scheduler rolls `num_computed_tokens` back, and their KV slots and
token-table cells are overwritten later. After every step each request that sampled gets
its drafts for the next step from the proposer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from vllm.config import SpeculativeConfig, VllmConfig
from vllm.v1.attention.backends.abstract import AttentionBackend
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.ngram_proposer import NgramIndex, NgramProposer
from vllm.v1.spec_decode.rejection_sampler import (
    DraftLayout,
    RejectionSampler,
    expand_metadata,
    is_plain_greedy,
)
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch


class Proposer(Protocol):
    def propose_rows(self, batch: InputBatch, rows: list[int],
                     scheduler_output: SchedulerOutput) -> dict[int, list[int]]:
        """Drafts for the given batch rows (each's known tokens end with its newest)."""
        ...


@runtime_checkable
class _HasModel(Protocol):
    """A proposer with a model of its own (the draft model)."""

    def load_model(self) -> None: ...

    def kv_cache_block_bytes(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def capture_model(self, sizes: list[int], max_num_tokens: int) -> None: ...


class NgramRowProposer:
    """Prompt lookup for each batch row from an `NgramIndex` per request, extended by the
    tokens each step appended (built from the prompt on the request's first proposal,
    and again when its state is replaced: a preempted request re-sent, a reused id)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                   config.prompt_lookup_max)
        self.indices: dict[str, NgramIndex] = {}

    def propose_rows(self, batch: InputBatch, rows: list[int],
                     scheduler_output: SchedulerOutput) -> dict[int, list[int]]:
        for req_id in scheduler_output.finished_req_ids:
            self.indices.pop(req_id, None)
        if len(self.indices) > 2 * batch.max_num_reqs:  # requests that left unfinished
            self.indices = {r: i for r, i in self.indices.items()
                            if r in batch.req_id_to_index}
        drafts = {}
        for row in rows:
            state = batch.state(row)
            index = self.indices.get(state.req_id)
            if index is None or index.owner is not state:
                index = self.indices[state.req_id] = self._index_prompt(state)
            # Known tokens: the prompt and the outputs (as far as the token table goes).
            num_tokens = min(state.num_tokens, batch.max_model_len)
            num_indexed = len(index.tokens)
            if num_tokens > num_indexed:
                index.extend(state.output_token_ids[num_indexed - state.num_prompt_tokens:
                                                    num_tokens - state.num_prompt_tokens])
            drafts[row] = index.propose(self.ngram.k)
        return drafts

    def _index_prompt(self, state: CachedRequestState) -> NgramIndex:
        index = self.ngram.index(owner=state)
        prompt: list[int | None] = list(state.prompt_token_ids)
        if state.embeds_layout is not None:  # embeds positions are not tokens
            prompt = [t if ok else None for t, ok in
                      zip(prompt, state.embeds_layout.is_token.tolist())]
        index.extend(prompt)
        return index


class SpecDecodeRunner:
    """Writes drafts into the batch, picks the positions to score, verifies and proposes.
    A draft model's proposer also owns a model and a KV cache (loaded and sized here)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.rejection_sampler = RejectionSampler()

    def load_model(self) -> None:
        if isinstance(self.proposer, _HasModel):
            self.proposer.load_model()

    def kv_cache_block_bytes(self) -> int:
        """The drafter's KV bytes per block (0 without a draft model)."""
        if isinstance(self.proposer, _HasModel):
            return self.proposer.kv_cache_block_bytes()
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if isinstance(self.proposer, _HasModel):
            self.proposer.initialize_kv_cache(num_blocks)

    def capture_model(self, sizes: list[int], max_num_tokens: int) -> None:
        """The drafter's CPU graphs (called when the target captures its own)."""
        if isinstance(self.proposer, _HasModel):
            self.proposer.capture_model(sizes, max_num_tokens)

    @staticmethod
    def write_drafts(batch: InputBatch, scheduler_output: SchedulerOutput) -> None:
        """Puts each verified request's drafts after its known tokens (not counted in
        `num_tokens`: they become tokens only once accepted)."""
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            row = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens[row])
            batch.token_ids_cpu[row, start:start + len(drafts)] = drafts
            batch.is_token_ids[row, start:start + len(drafts)] = True

    @staticmethod
    def layout(batch: InputBatch, sampling_rows: np.ndarray,
               scheduler_output: SchedulerOutput) -> DraftLayout:
        spec = scheduler_output.scheduled_spec_decode_tokens
        req_ids = batch.req_ids_in_order
        return DraftLayout.of([spec.get(req_ids[row], []) for row in sampling_rows.tolist()])

    @staticmethod
    def logits_indices(query_start_loc: np.ndarray, sampling_rows: np.ndarray,
                       layout: DraftLayout) -> np.ndarray:
        """Every scored position: a row's last 1 + k tokens.

        Example: query_start_loc [0, 3, 6, 8], sampling rows [0, 1, 2] with drafts
        [0, 2, 1]: ends [3, 6, 8] -> [2, 3, 4, 5, 6, 7].
        """
        indices: list[int] = []
        for end, drafts in zip(query_start_loc[sampling_rows + 1].tolist(), layout.drafts):
            indices += range(end - 1 - len(drafts), end)
        return np.array(indices, dtype=np.int64)

    def verify(self, logits: torch.Tensor, metadata: SamplingMetadata, layout: DraftLayout,
               batch: InputBatch, sampling_rows: np.ndarray) -> ModelRunnerOutput:
        """Rejection-samples the step's positions; appends each row's emitted tokens."""
        rows = sampling_rows.tolist()
        if not is_plain_greedy(metadata):  # per-position metadata
            metadata = self._expand(metadata, layout, [batch.state(row) for row in rows])
        verified = self.rejection_sampler(logits, metadata, layout)
        req_ids = list(batch.req_ids_in_order)
        sampled: list[list[int]] = [[] for _ in req_ids]
        for row, tokens in zip(rows, verified.token_ids):
            batch.append_tokens(row, tokens)
            sampled[row] = tokens
        # Sampling rows ascend, so the verified logprobs rows are already in batch order.
        starts = None
        if verified.logprobs is not None:
            starts = [0, *np.cumsum([len(tokens) for tokens in sampled]).tolist()]
        return ModelRunnerOutput(req_ids, dict(batch.req_id_to_index), sampled,
                                 verified.logprobs, logprob_starts=starts)

    @staticmethod
    def _expand(metadata: SamplingMetadata, layout: DraftLayout,
                states: list[CachedRequestState]) -> SamplingMetadata:
        """`expand_metadata` with each sampling row's output count, min_tokens and the
        ids min_tokens blocks (`SamplingParams.stop_ids`)."""
        stop_ids = [s.sampling_params.stop_ids() for s in states]
        return expand_metadata(metadata, layout, [len(s.output_token_ids) for s in states],
                               [s.sampling_params.min_tokens for s in states], stop_ids)

    def propose(self, batch: InputBatch, sampling_rows: np.ndarray,
                scheduler_output: SchedulerOutput) -> list[list[int]]:
        """Drafts for each batch row that sampled this step ([] for the others; the
        scheduler keeps of a constrained request's drafts those its grammar allows)."""
        drafts = self.proposer.propose_rows(batch, sampling_rows.tolist(), scheduler_output)
        return [drafts.get(row, []) for row in range(batch.num_reqs)]


def make_spec_runner(vllm_config: VllmConfig, backend: type[AttentionBackend],
                     device: torch.device) -> SpecDecodeRunner | None:
    """The runner's speculative decoding, or None when `speculative_config` is unset."""
    config = vllm_config.speculative_config
    if config is None:
        return None
    if config.method == "draft_model":
        from vllm.v1.spec_decode.draft_model import DraftModelProposer

        return SpecDecodeRunner(config, DraftModelProposer(
            config, backend, vllm_config.cache_config.block_size, device))
    return SpecDecodeRunner(config, NgramRowProposer(config))
