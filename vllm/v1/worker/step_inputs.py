"""One step's model inputs from the persistent `InputBatch`: token ids or embeds, positions,
each KV cache group's attention metadata, cross-attention metadata, and the rows that
sample. Vectorised on CPU numpy mirrors and moved to the device once per step (see
`compute_step_indices`); decode-only steps read the persistent `DecodeInputs` instead.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from vllm.config import ModelConfig
from vllm.model_executor.models.interfaces import VllmModel
from vllm.v1.attention.backends.abstract import AttentionBackend, CommonAttentionMetadata
from vllm.v1.core.kv_cache_groups import layer_slots
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.spec_decode.rejection_sampler import DraftLayout
from vllm.v1.spec_decode.spec_runner import SpecDecodeRunner
from vllm.v1.worker.decode_inputs import DecodeInputs, DecodeStep
from vllm.v1.worker.input_batch import InputBatch


class StepIndices(NamedTuple):
    req_indices: np.ndarray  # [num_tokens] batch row of each token
    positions: np.ndarray  # [num_tokens] position of each token in its request
    token_indices: np.ndarray  # [num_tokens] index into the flattened token-id table
    query_start_loc: np.ndarray  # [num_reqs + 1]
    seq_lens: np.ndarray  # [num_reqs] computed + scheduled


def compute_step_indices(num_scheduled: np.ndarray, num_computed: np.ndarray,
                         max_model_len: int) -> StepIndices:
    """Token-level indices of one step from request-level counts.

    Example: num_scheduled [3, 2, 5], nothing computed, max_model_len M:
        cu_num_tokens   = [3, 5, 10]
        query_start_loc = [0, 3, 5, 10]
        req_indices     = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
        arange          = [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
        positions       = num_computed[req_indices] + arange = arange
        token_indices   = positions + req_indices * M = [0, 1, 2, M, M+1, 2M, ..., 2M+4]
        seq_lens        = [3, 2, 5]
    With num_scheduled [1, 1, 93, 75, 30] and num_computed [54, 145, 0, 0, 0], positions
    start [54, 145, 0, 1, ...] and seq_lens are [55, 146, 93, 75, 30].
    """
    num_reqs = num_scheduled.shape[0]
    cu_num_tokens = np.cumsum(num_scheduled)
    total = int(cu_num_tokens[-1]) if num_reqs else 0
    req_indices = np.repeat(np.arange(num_reqs, dtype=np.int64), num_scheduled)
    arange = np.arange(total, dtype=np.int64) - np.repeat(cu_num_tokens - num_scheduled,
                                                          num_scheduled)
    positions = num_computed[req_indices].astype(np.int64) + arange
    token_indices = positions + req_indices * max_model_len
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    query_start_loc[1:] = cu_num_tokens
    seq_lens = (num_computed[:num_reqs] + num_scheduled).astype(np.int32)
    return StepIndices(req_indices, positions, token_indices, query_start_loc, seq_lens)


def mrope_step_positions(batch: InputBatch, idx: StepIndices) -> np.ndarray:
    """[3, num_tokens] int64 M-RoPE positions of a step: a prompt position's from its
    request's table, a later position p's p + the request's delta (all three rows), and a
    request without a table (no media) p itself.

    Example: a request whose prompt (9 tokens, an image of 2 x 3 rows at 2..7) has the
    table t [0 1 2 2 2 2 2 2 5], h [0 1 2 2 2 3 3 3 5], w [0 1 2 3 4 2 3 4 5] (delta -3),
    scheduled positions 7, 8, 9 -> t [2 5 6], h [3 5 6], w [4 5 6].
    """
    positions = np.repeat(idx.positions[None], 3, axis=0)
    for row in np.unique(idx.req_indices):
        state = batch.state(int(row))
        table = state.mrope_positions
        if table is None:
            continue
        tokens = np.flatnonzero(idx.req_indices == row)
        p = idx.positions[tokens]
        prompt = p < table.shape[1]
        positions[:, tokens[prompt]] = table[:, p[prompt]]
        positions[:, tokens[~prompt]] += state.mrope_delta
    return positions


def bidirectional_key_ends(batch: InputBatch, idx: StepIndices) -> np.ndarray | None:
    """[num_tokens] int32: the end (exclusive) of the keys each scheduled query sees, its
    bidirectional span's end where it lies in one, else its position + 1; None when no
    scheduled position lies in a span (the scheduler never splits one across steps).

    Example: one request with the span [2, 6), positions 0..7 scheduled ->
    [1, 2, 6, 6, 6, 6, 7, 8].
    """
    key_ends = None
    for row in range(batch.num_reqs):
        spans = batch.state(row).bidirectional_spans
        if not spans:
            continue
        tokens = np.flatnonzero(idx.req_indices == row)
        p = idx.positions[tokens]
        for start, end in spans:
            inside = tokens[(p >= start) & (p < end)]
            if inside.size:
                if key_ends is None:
                    key_ends = (idx.positions + 1).astype(np.int32)
                key_ends[inside] = end
    return key_ends


class ModelInputs(NamedTuple):
    input_ids: torch.Tensor | None  # [num_tokens] int64; None when embeds are given
    inputs_embeds: torch.Tensor | None  # [num_tokens, hidden_size]
    positions: torch.Tensor  # [num_tokens] int64; M-RoPE models: [3, num_tokens]
    attn_metadata: object  # KV cache group 0's (the only group of most models)
    # Models with several KV cache groups: each decoder layer's (its group's); else None.
    layer_attn_metadata: list | None
    cross_attn_metadata: object | None  # encoder/decoder models only
    slot_mapping: np.ndarray  # [num_tokens] int64 KV slot of each token (group 0)
    logits_indices: torch.Tensor  # [num_sampling_reqs] int64
    sampling_rows: np.ndarray  # [num_sampling_reqs] batch rows that sample this step
    # Speculative decoding: the sampling rows' drafts (logits_indices then hold 1 + k
    # positions per row); None in a step without drafts.
    draft_layout: DraftLayout | None
    common: CommonAttentionMetadata  # the step's batch layout (for CUDA graph buffers)
    # Each KV cache group's layout (block tables and slots; [common] with one group)
    group_commons: list[CommonAttentionMetadata]
    num_scheduled: np.ndarray  # [num_reqs] int32 tokens of each batch row (LoRA slots)


class StepInputsBuilder:
    """Builds each step's `ModelInputs` from the runner's persistent `InputBatch`, and
    keeps the backend's decode metadata of decode-only steps (built once per number of
    requests where the backend reads the persistent arrays in place).

    The backend, the model's embedding and whether the fused decoder takes small steps
    are the runner's, passed per step (`prepare`).
    """

    def __init__(self, batch: InputBatch, model_config: ModelConfig, block_size: int,
                 device: torch.device, spec: SpecDecodeRunner | None) -> None:
        self.batch = batch
        self.block_size = block_size
        self.device = device
        self.spec = spec
        self.max_model_len = model_config.max_model_len
        self.num_layers = model_config.num_layers
        self.is_encoder_decoder = model_config.is_encoder_decoder
        self.kv_cache_groups = model_config.kv_cache_groups
        self._layer_slots = layer_slots(self.kv_cache_groups)
        self._windows = [g.sliding_window for g in self.kv_cache_groups]
        # Three rotary positions per token, from each request's table (`mrope_positions`).
        self.uses_mrope = model_config.uses_mrope
        # Media spans attending bidirectionally (`bidirectional_key_ends`).
        self.bidirectional = model_config.bidirectional_media
        # Decode-only steps' persistent inputs: decoder-only models with 1-D positions.
        self.decode_inputs = (DecodeInputs(batch, block_size, self._windows)
                              if not self.is_encoder_decoder and not self.uses_mrope
                              else None)
        # Decode metadata that reads those arrays in place, per number of requests.
        self._decode_metadata: dict[int, object] = {}

    def build_decode_metadata(self, backend: type[AttentionBackend]) -> None:
        """Every size's decode metadata now, where the backend reads the arrays in place
        (one KV cache group without a window): no tensor made while serving."""
        if self.decode_inputs is None or not self.decode_inputs.in_place:
            return
        for n in range(1, self.batch.max_num_reqs + 1):
            metadata = backend.build_decode_metadata(self.decode_inputs.step(n).common,
                                                     self.block_size, self.device)
            if metadata is None:
                break  # the backend builds each step's (`build_metadata`)
            self._decode_metadata[n] = metadata

    def prepare(self, scheduler_output: SchedulerOutput, backend: type[AttentionBackend],
                model: VllmModel | None, fused_max_tokens: int) -> ModelInputs:
        """The step's inputs. A step of at most `fused_max_tokens` tokens (the fused
        decoder's; 0 without it) gets no backend metadata: the fused decoder reads
        `common`."""
        num_reqs = self.batch.num_reqs
        # Every scheduled request has at least one token: a total of one per request is
        # a decode-only step.
        if (self.decode_inputs is not None and num_reqs
                and scheduler_output.total_num_scheduled_tokens == num_reqs
                and not scheduler_output.scheduled_spec_decode_tokens):
            inputs = self._prepare_decode(self.decode_inputs, num_reqs, backend,
                                          fused_max_tokens)
            if inputs is not None:
                return inputs
        return self._prepare_general(scheduler_output, backend, model, fused_max_tokens)

    def _prepare_general(self, scheduler_output: SchedulerOutput,
                         backend: type[AttentionBackend], model: VllmModel | None,
                         fused_max_tokens: int) -> ModelInputs:
        batch = self.batch
        num_reqs = batch.num_reqs
        scheduled = scheduler_output.num_scheduled_tokens
        num_scheduled = np.array([scheduled[r] for r in batch.req_ids_in_order],
                                 dtype=np.int32)
        idx = compute_step_indices(num_scheduled, batch.num_computed_tokens_cpu[:num_reqs],
                                   self.max_model_len)
        input_ids_np = batch.token_ids_cpu.reshape(-1)[idx.token_indices]
        is_token_np = batch.is_token_ids.reshape(-1)[idx.token_indices]
        num_tokens = int(idx.query_start_loc[-1])
        key_ends = bidirectional_key_ends(batch, idx) if self.bidirectional else None
        # The fused decoder attends causally: a step with a bidirectional span is not its.
        fused = num_tokens <= fused_max_tokens and key_ends is None
        attn_metadata, commons = self._group_metadata(idx, backend, build=not fused,
                                                      key_ends=key_ends)
        common = commons[0]
        cross_attn_metadata = (self._cross_attn_metadata(common, backend)
                               if self.is_encoder_decoder else None)
        sampling_rows, logits_indices, draft_layout = self._sampling_rows(idx,
                                                                          scheduler_output)
        input_ids = torch.from_numpy(input_ids_np.astype(np.int64)).to(self.device)
        inputs_embeds = None
        if not is_token_np.all():
            assert model is not None, "load_model() first"
            inputs_embeds = self._gather_inputs_embeds(model, input_ids, is_token_np, idx)
            input_ids = None
        positions = mrope_step_positions(batch, idx) if self.uses_mrope else idx.positions
        return ModelInputs(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            positions=torch.from_numpy(positions).to(self.device),
            attn_metadata=attn_metadata[0],
            layer_attn_metadata=self.layer_metadata(attn_metadata),
            cross_attn_metadata=cross_attn_metadata,
            slot_mapping=common.slot_mapping,
            logits_indices=torch.from_numpy(logits_indices.astype(np.int64)).to(self.device),
            sampling_rows=sampling_rows,
            draft_layout=draft_layout,
            common=common,
            group_commons=commons,
            num_scheduled=num_scheduled,
        )

    def _sampling_rows(self, idx: StepIndices, scheduler_output: SchedulerOutput
                       ) -> tuple[np.ndarray, np.ndarray, DraftLayout | None]:
        """The rows that sample, the token index of each logit row and the drafts' layout.
        A request samples once its whole known sequence is computed; a prefill chunk that
        stops short of the prompt's end produces no token. With drafts, a row's logits are
        its 1 + k verified positions."""
        batch = self.batch
        sampling_rows = np.flatnonzero(idx.seq_lens >= batch.num_tokens[:batch.num_reqs])
        logits_indices = idx.query_start_loc[sampling_rows + 1] - 1
        if not scheduler_output.scheduled_spec_decode_tokens:
            return sampling_rows, logits_indices, None
        assert self.spec is not None  # drafts are scheduled only with it
        draft_layout = self.spec.layout(batch, sampling_rows, scheduler_output)
        logits_indices = self.spec.logits_indices(idx.query_start_loc, sampling_rows,
                                                  draft_layout)
        return sampling_rows, logits_indices, draft_layout

    def _group_metadata(self, idx: StepIndices, backend: type[AttentionBackend],
                        build: bool, key_ends: np.ndarray | None = None
                        ) -> tuple[list, list[CommonAttentionMetadata]]:
        """Each KV cache group's backend metadata (None each where not `build`) and common
        layout."""
        batch = self.batch
        num_reqs = batch.num_reqs
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].copy()
        # Every group's tables and slots in a few whole-array operations: a decode step runs
        # with cold caches, where each numpy call costs tens of microseconds (Gemma 3's six
        # groups took ~0.5 ms a step group by group).
        tables = batch.block_table.group_tables(num_reqs, num_computed, self._windows)
        slots = batch.block_table.compute_slot_mappings(idx.req_indices, idx.positions)
        num_tokens = int(idx.query_start_loc[-1])
        metadata, commons = [], []
        for g in range(len(self.kv_cache_groups)):
            group_common = CommonAttentionMetadata(
                query_start_loc=idx.query_start_loc,
                seq_lens=idx.seq_lens,
                num_computed_tokens=num_computed,
                block_table=tables[g],
                slot_mapping=slots[g],
                num_actual_tokens=num_tokens,
                key_ends=key_ends,
            )
            commons.append(group_common)
            metadata.append(backend.build_metadata(group_common, self.block_size, self.device)
                            if build else None)
        return metadata, commons

    def _prepare_decode(self, decode: DecodeInputs, num_reqs: int,
                        backend: type[AttentionBackend], fused_max_tokens: int
                        ) -> ModelInputs | None:
        """A decode-only step from the persistent `DecodeInputs` (None where a token reads
        prompt embeds: the general path gathers those). With one KV cache group and no
        window, the attention metadata of a step of `num_reqs` rows is built once where the
        backend reads the arrays in place; with several, each group's per step (none for a
        step the fused decoder takes, as on the general path)."""
        filled = decode.fill(num_reqs)
        if filled is None:
            return None
        step, all_sample, commons = filled
        if decode.in_place:
            metadata = self._decode_metadata.get(num_reqs)
            if metadata is None:
                metadata = self._decode_metadata_of(step, backend)
            group_metadata = [metadata]
        else:
            build = num_reqs > fused_max_tokens
            group_metadata = [backend.build_metadata(c, self.block_size, self.device)
                              if build else None for c in commons]
        rows, logits_indices = step.rows, step.logits_indices
        if not all_sample:  # a one-token prefill chunk short of its prompt's end
            rows = np.flatnonzero(step.common.seq_lens >= self.batch.num_tokens[:num_reqs])
            logits_indices = torch.from_numpy(rows)
        input_ids, positions = step.input_ids, step.positions
        if self.device.type != "cpu":
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
            logits_indices = logits_indices.to(self.device)
        return ModelInputs(input_ids=input_ids, inputs_embeds=None, positions=positions,
                           attn_metadata=group_metadata[0],
                           layer_attn_metadata=self.layer_metadata(group_metadata),
                           cross_attn_metadata=None, slot_mapping=step.common.slot_mapping,
                           logits_indices=logits_indices, sampling_rows=rows,
                           draft_layout=None, common=step.common,
                           group_commons=commons, num_scheduled=decode.ones[:num_reqs])

    def _decode_metadata_of(self, step: DecodeStep, backend: type[AttentionBackend]) -> object:
        """The backend's metadata of a decode step: kept for every later step of as many
        rows where it reads the arrays in place, else built for this step alone."""
        common = step.common
        metadata = backend.build_decode_metadata(common, self.block_size, self.device)
        if metadata is None:
            return backend.build_metadata(common, self.block_size, self.device)
        self._decode_metadata[common.num_actual_tokens] = metadata
        return metadata

    def layer_metadata(self, group_metadata: list) -> list | None:
        """Each decoder layer's metadata (its group's), or None with one group."""
        if len(group_metadata) == 1:
            return None
        return [group_metadata[group] for group, _ in
                (self._layer_slots[layer] for layer in range(self.num_layers))]

    def _cross_attn_metadata(self, common: CommonAttentionMetadata,
                             backend: type[AttentionBackend]) -> object:
        """Cross-attention reads each request's whole encoder output from its cross
        blocks: the same query layout, with encoder lengths as sequence lengths."""
        batch = self.batch
        num_reqs = batch.num_reqs
        assert batch.cross_block_table is not None  # an encoder/decoder model's batch
        cross = CommonAttentionMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=batch.num_encoder_tokens[:num_reqs].copy(),
            num_computed_tokens=np.zeros(num_reqs, dtype=np.int32),
            block_table=batch.cross_block_table.table[:num_reqs],
            slot_mapping=np.zeros(0, dtype=np.int64),  # read-only: nothing is written
            num_actual_tokens=common.num_actual_tokens,
        )
        return backend.build_metadata(cross, self.block_size, self.device, causal=False)

    def _gather_inputs_embeds(self, model: VllmModel, input_ids: torch.Tensor,
                              is_token: np.ndarray, idx: StepIndices) -> torch.Tensor:
        """Embeddings of the scheduled tokens: prompt-embeds rows where the position came
        from embeds, `embed_tokens(id)` where it holds a real token.

        Example: a request with prompt [t0, E0, E1, t3] (is_token [T, F, F, T]) and one
        generated token t4, computed 2, scheduled 3 (positions 2, 3, 4): is_token [F, T, T]
        -> rows [E1, embed(t3), embed(t4)] (position 2 reads row rows_before[2] = 1).
        """
        embeds = model.get_input_embeddings(input_ids)
        embedded = np.flatnonzero(~is_token)
        req_rows, positions = idx.req_indices[embedded], idx.positions[embedded]
        rows = []
        for row in np.unique(req_rows):
            state = self.batch.state(row)
            # Positions that are not tokens read rows of the request's prompt embeds.
            assert state.prompt_embeds is not None and state.embeds_layout is not None
            index = state.embeds_layout.row_index(positions[req_rows == row])
            first, last = int(index[0]), int(index[-1]) + 1
            if last - first == len(index):  # one run of rows: a view, no gather
                rows.append(state.prompt_embeds[first:last])
            else:
                rows.append(state.prompt_embeds[torch.from_numpy(index)])
        target = torch.from_numpy(embedded).to(self.device)
        embeds[target] = torch.cat(rows).to(device=self.device, dtype=embeds.dtype)
        return embeds
