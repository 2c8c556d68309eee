"""The draft-model proposer: a smaller model (or the same one quantized harder) in the
same worker, with its own KV cache over the target's block ids.

After each step, every request that sampled catches its drafter up (the tokens from
where the drafter's cache stops being valid to the newest token, one batched forward)
and the drafter then proposes k tokens greedily, one batched single-token forward per
further draft. Its KV slots are the target's (the same block table; the scheduler
allocates `num_lookahead_tokens` slots past each step for the drafts it writes).
Drafts are the drafter's argmax, so verification treats them as one-hot proposals. On CPU
the drafter's forward is compiled like the target's when the target captures graphs.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from vllm.config import ModelConfig, SpeculativeConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention, bind_attention_layers
from vllm.model_executor.models.interfaces import VllmModel, supports_graph_capture
from vllm.v1.attention.backends.abstract import AttentionBackend, CommonAttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.graph_capture import CompiledGraphs
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The drafter's config, checked against the target: the same vocabulary (size and
    tokens), room for max_model_len positions, one KV cache group, and with prompt embeds
    enabled the target's hidden size (the drafter reads the same embeds rows)."""
    from vllm.engine.arg_utils import max_decoder_positions
    from vllm.transformers_utils.config import get_config, resolve_model_path

    path = resolve_model_path(spec.model)
    hf_config = get_config(path)
    draft = dataclasses.replace(target, model=path, tokenizer=path, hf_config=hf_config,
                                quantization=spec.quantization, enforce_eager=True,
                                enable_return_hidden_states=False)
    if draft.is_encoder_decoder:
        raise ValueError(f"speculative_config model {spec.model!r} is an encoder/decoder "
                         "model; the drafter must be a decoder-only model.")
    if draft.uses_mrope:  # the drafter's steps carry one position per token
        raise ValueError(f"speculative_config model {spec.model!r} uses M-RoPE (three "
                         "positions per token); the drafter must be a text model.")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model {spec.model!r} has a vocabulary of "
                         f"{draft.vocab_size} tokens, the target {target.vocab_size}: the "
                         "drafter must share the target's vocabulary.")
    if not target.skip_tokenizer_init and not _same_tokens(path, target.tokenizer):
        raise ValueError(f"speculative_config model {spec.model!r} has another tokenizer "
                         "than the target (token ids mean other text): the drafter must "
                         "share the target's vocabulary.")
    if max_decoder_positions(hf_config) < target.max_model_len:
        raise ValueError(f"speculative_config model {spec.model!r} has "
                         f"{max_decoder_positions(hf_config)} positions, fewer than "
                         f"max_model_len={target.max_model_len}.")
    if len(target.kv_cache_groups) > 1 or len(draft.kv_cache_groups) > 1:
        raise ValueError("speculative_config method 'draft_model' does not run with "
                         "sliding-window models (several KV cache groups); use 'ngram'.")
    if target.enable_prompt_embeds and draft.hidden_size != target.hidden_size:
        raise ValueError(
            f"speculative_config model {spec.model!r} cannot read prompt embeds: its hidden "
            f"size is {draft.hidden_size}, the target's (and the embeds rows') "
            f"{target.hidden_size}. Use a drafter of the same hidden size, 'ngram', or "
            "disable enable_prompt_embeds.")
    return draft


def _same_tokens(draft_path: str, target_tokenizer: str) -> bool:
    from vllm.transformers_utils.tokenizer import get_tokenizer

    if os.path.realpath(draft_path) == os.path.realpath(target_tokenizer):
        return True
    return get_tokenizer(draft_path).get_vocab() == get_tokenizer(target_tokenizer).get_vocab()


@dataclasses.dataclass(slots=True)
class _DrafterState:
    state: CachedRequestState  # the runner's state it belongs to (a new one: start over)
    valid: int  # positions [0, valid) of the drafter's cache hold the request's tokens
    fed_from: int  # the draft tokens it fed from this position on ...
    fed: list[int]  # ... which are right only if they became the request's tokens


class DraftModelProposer:
    """Owns the drafter model and its KV cache; proposes drafts for batch rows."""

    def __init__(self, spec: SpeculativeConfig, backend: type[AttentionBackend],
                 block_size: int, device: torch.device) -> None:
        assert spec.draft_model_config is not None  # resolved by EngineArgs
        self.config = spec.draft_model_config
        self.k = spec.num_speculative_tokens
        self.backend, self.block_size, self.device = backend, block_size, device
        self.model: VllmModel | None = None
        self.graphs: CompiledGraphs | None = None  # CPU graphs when the target has them
        self.kv_caches: list[torch.Tensor] = []
        self.attn_layers: list[Attention] = []  # bound at load
        self.states: dict[str, _DrafterState] = {}

    def load_model(self) -> None:
        from vllm.model_executor.model_loader.loader import get_model

        self.model = get_model(self.config, self.backend, self.device)
        self.attn_layers = bind_attention_layers(self.model)

    def capture_model(self, sizes: list[int], max_num_tokens: int) -> None:
        """Compiles the drafter's forward like the target's (CPU graphs, `sizes`)."""
        model = self.model
        assert model is not None, "load_model() first"
        if not supports_graph_capture(model):
            return
        config = self.config
        self.graphs = CompiledGraphs(model, sizes, config.enable_prompt_embeds,
                                     config.hidden_size, config.dtype, self.device,
                                     max_num_tokens)
        with torch.inference_mode():
            self.graphs.capture(self._dummy_step)
        for kv_cache in self.kv_caches:  # the dummy steps wrote K/V into the null block
            kv_cache.zero_()

    def _dummy_step(self, num_tokens: int, forward) -> None:
        common = CommonAttentionMetadata.padding_decodes(num_tokens)
        metadata = self.backend.build_metadata(common, self.block_size, self.device)
        with set_forward_context(metadata, self.kv_caches, attn_layers=self.attn_layers):
            forward()

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        return tuple(self.backend.get_kv_cache_shape(num_blocks, self.block_size,
                                                     self.config.num_kv_heads,
                                                     self.config.head_dim))

    def kv_cache_block_bytes(self) -> int:
        return (int(np.prod(self._kv_shape(1))) * self.config.num_layers
                * self.config.dtype.itemsize)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [torch.zeros(self._kv_shape(num_blocks), dtype=self.config.dtype,
                                      device=self.device)
                          for _ in range(self.config.num_layers)]

    def propose_rows(self, batch: InputBatch, rows: list[int],
                     scheduler_output: SchedulerOutput) -> dict[int, list[int]]:
        live = set(batch.req_id_to_index)
        self.states = {r: s for r, s in self.states.items() if r in live}
        max_len = batch.max_model_len
        # Each row: start of its catch-up and its newest position (its last known token).
        starts, lasts = [], []
        for row in rows:
            starts.append(self._valid_prefix(batch, row))
            lasts.append(int(batch.num_tokens[row]) - 1)
        drafts: dict[int, list[int]] = {row: [] for row in rows}
        active = [i for i, last in enumerate(lasts) if last + 1 < max_len]
        for j in range(self.k):
            if not active:
                break
            sub_rows = [rows[i] for i in active]
            if j == 0:
                spans = [(starts[i], lasts[i] + 1) for i in active]
                tokens = None
            else:
                spans = [(lasts[i] + j, lasts[i] + j + 1) for i in active]
                tokens = [drafts[rows[i]][-1] for i in active]
            next_tokens = self._forward(batch, sub_rows, spans, tokens)
            for i, token in zip(active, next_tokens):
                drafts[rows[i]].append(token)
            # A draft at position p needs the slot of p - 1 fed next; stay below max_len.
            active = [i for i in active if lasts[i] + j + 2 < max_len]
        for row, last in zip(rows, lasts):
            state = batch.state(row)
            self.states[state.req_id] = _DrafterState(state, last + 1, last + 1,
                                                      drafts[row][:-1])
        return drafts

    def _valid_prefix(self, batch: InputBatch, row: int) -> int:
        """Where the drafter's cache for this row stops holding the request's tokens
        (capped so that at least the newest token is fed)."""
        state = batch.state(row)
        last = int(batch.num_tokens[row]) - 1
        kept = self.states.get(state.req_id)
        if kept is None or kept.state is not state:
            return 0
        valid = kept.valid
        known = batch.token_ids_cpu[row, kept.fed_from:last + 1].tolist()
        for fed, actual in zip(kept.fed, known):
            if fed != actual:
                break
            valid += 1
        return min(valid, last)

    @torch.inference_mode()
    def _forward(self, batch: InputBatch, rows: list[int], spans: list[tuple[int, int]],
                 tokens: list[int] | None) -> list[int]:
        """One drafter forward over positions [start, end) of each row (its own tokens, or
        `tokens`: one each); the argmax after each row's last position."""
        model = self.model
        assert model is not None, "load_model() first"
        num_scheduled = np.array([end - start for start, end in spans], dtype=np.int64)
        cu = np.cumsum(num_scheduled)
        req_indices = np.repeat(np.arange(len(rows)), num_scheduled)
        positions = np.concatenate([np.arange(start, end) for start, end in spans])
        row_array = np.array(rows, dtype=np.int64)
        if tokens is None:
            ids = batch.token_ids_cpu[row_array[req_indices], positions].astype(np.int64)
        else:
            ids = np.array(tokens, dtype=np.int64)
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        query_start_loc[1:] = cu
        num_computed = np.array([start for start, _ in spans], dtype=np.int32)
        table = batch.block_table.group_table(batch.num_reqs, 0)[row_array]
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=(num_computed + num_scheduled).astype(np.int32),
            num_computed_tokens=num_computed,
            block_table=np.ascontiguousarray(table),
            slot_mapping=_slot_mapping(table, req_indices, positions, self.block_size),
            num_actual_tokens=int(cu[-1]),
        )
        metadata = self.backend.build_metadata(common, self.block_size, self.device)
        input_ids = torch.from_numpy(ids).to(self.device)
        inputs_embeds = None
        if tokens is None:
            inputs_embeds = self._embeds(model, batch, row_array[req_indices], positions,
                                         input_ids)
        ids = None if inputs_embeds is not None else input_ids
        positions_t = torch.from_numpy(positions).to(self.device)
        with set_forward_context(metadata, self.kv_caches, attn_layers=self.attn_layers):
            hidden = None
            if self.graphs is not None:
                hidden = self.graphs.run(ids, positions_t, inputs_embeds, common)
            if hidden is None:
                hidden = model(ids, positions_t, inputs_embeds)
        last = torch.from_numpy(cu - 1).to(self.device)
        return model.compute_logits(hidden[last]).float().argmax(dim=-1).tolist()

    @staticmethod
    def _embeds(model: VllmModel, batch: InputBatch, rows: np.ndarray, positions: np.ndarray,
                input_ids: torch.Tensor) -> torch.Tensor | None:
        """The target's prompt-embeds rows at embeds positions (None when there are none)."""
        is_token = batch.is_token_ids[rows, positions]
        if is_token.all():
            return None
        embeds = model.get_input_embeddings(input_ids)
        for i in np.flatnonzero(~is_token).tolist():
            state = batch.state(int(rows[i]))
            assert state.prompt_embeds is not None and state.embeds_layout is not None
            index = int(state.embeds_layout.row_index(positions[i:i + 1])[0])
            embeds[i] = state.prompt_embeds[index].to(embeds.dtype)
        return embeds


def _slot_mapping(table: np.ndarray, req_indices: np.ndarray, positions: np.ndarray,
                  block_size: int) -> np.ndarray:
    """slot = table[req, pos // block_size] * block_size + pos % block_size."""
    blocks = table[req_indices, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size
