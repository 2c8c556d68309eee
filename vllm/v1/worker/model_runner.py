"""The model runner: scheduler output in, sampled tokens out.

`execute_model` reads as its table of contents: update states -> prepare inputs -> run the
model -> keep stage outputs -> sample -> bookkeeping. Input preparation is vectorised on CPU
numpy mirrors and moved to the device once per step (see `compute_step_indices`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np
import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention, bind_attention_layers
from vllm.model_executor.layers.quantization.gguf_blocks import MAX_ROWS as GGUF_MAX_ROWS
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.models.interfaces import (
    VllmModel,
    is_encoder_decoder,
    supports_graph_capture,
)
from vllm.v1.attention.backends import get_attn_backend
from vllm.v1.attention.backends.abstract import CommonAttentionMetadata
from vllm.v1.core.kv_cache_groups import group_size, layer_slots
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.messages import EmbedsLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler, SamplerOutput
from vllm.v1.spec_decode.rejection_sampler import DraftLayout
from vllm.v1.spec_decode.spec_runner import SpecDecodeRunner, make_spec_runner
from vllm.v1.structured_output.bitmask import apply_grammar_bitmask
from vllm.v1.worker.block_table import mask_out_of_window
from vllm.v1.worker.decode_inputs import DecodeInputs, DecodeStep
from vllm.v1.worker.encoder_runner import EncoderRunner
from vllm.v1.worker.fused_decode import FusedDecode
from vllm.v1.worker.graph_capture import (
    ANY_MIN_TOKENS,
    CPU_MAX_DEFAULT_CAPTURE_SIZE,
    CompiledGraphs,
    CudaGraphs,
    default_capture_sizes,
)
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.sampling_inputs import SamplingInputsBuilder
from vllm.v1.worker.stage_output_cache import HIDDEN_STATES, OutputSpec, StageOutputCache

if TYPE_CHECKING:
    from vllm.lora.layers import LoRAState
    from vllm.lora.manager import LoRAModelManager

logger = logging.getLogger(__name__)


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


def copy_kv_blocks(kv_caches: list[torch.Tensor], block_dim: int,
                   pairs: list[tuple[int, int]]) -> None:
    """Copies whole KV blocks `src -> dst` in every layer's cache (beam search forks: a
    beam's copy of its parent's partly filled last block). Layers sharing one tensor (KV
    cache groups) are copied once."""
    if not pairs:
        return
    device = kv_caches[0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
    for cache in {id(c): c for c in kv_caches}.values():
        cache.index_copy_(block_dim, dst, cache.index_select(block_dim, src))


class ModelInputs(NamedTuple):
    input_ids: torch.Tensor | None  # [num_tokens] int64; None when embeds are given
    inputs_embeds: torch.Tensor | None  # [num_tokens, hidden_size]
    positions: torch.Tensor  # [num_tokens] int64
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


class ModelRunner:
    """Owns the model, the KV cache tensors, the stage-output cache and the persistent
    `InputBatch`.

    One runner for every device: the same code runs on CPU (the machines we test on) and
    CUDA. Encoder/decoder models add one encoder pass per step (`EncoderRunner`) and
    cross-attention metadata.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.scheduler_config = vllm_config.scheduler_config
        self.device = device
        self.dtype = self.model_config.dtype
        self.max_model_len = self.model_config.max_model_len
        self.block_size = self.cache_config.block_size
        self.num_kv_heads = self.model_config.get_num_kv_heads(  # this rank's
            vllm_config.parallel_config.tensor_parallel_size)
        # By name: `attention_backend`, else `VLLM_ATTENTION_BACKEND`, else the default.
        self.attn_backend = get_attn_backend(self.model_config.attention_backend)
        self.requests: dict[str, CachedRequestState] = {}
        self.is_encoder_decoder = self.model_config.is_encoder_decoder
        self.kv_cache_groups = self.model_config.kv_cache_groups
        self._layer_slots = layer_slots(self.kv_cache_groups)
        self.input_batch = InputBatch(self.scheduler_config.max_num_seqs, self.max_model_len,
                                      self.block_size, self.model_config.vocab_size,
                                      self.model_config.max_encoder_len,
                                      len(self.kv_cache_groups))
        # Decode-only steps' persistent inputs: one KV cache group without a window
        # (`mask_out_of_window` is the general path's), decoder-only models.
        self.decode_inputs = (DecodeInputs(self.input_batch, self.block_size)
                              if len(self.kv_cache_groups) == 1
                              and self.kv_cache_groups[0].sliding_window is None
                              and not self.is_encoder_decoder else None)
        # Decode metadata that reads those arrays in place, per number of requests.
        self._decode_metadata: dict[int, object] = {}
        self._inference_mode = torch.inference_mode()
        self.sampler = Sampler()
        self.sampling_inputs = SamplingInputsBuilder(self.input_batch, device,
                                                     self.max_model_len)
        self.kv_caches: list[torch.Tensor] = []
        self._kv_block_dim = 0  # the dimension of a KV cache tensor that block ids index
        self.stage_outputs = StageOutputCache(0, self.block_size, {})
        self.model: VllmModel | None = None
        self.attn_layers: list[Attention] = []  # bound at load: compiled graphs' op ids
        self.encoder_runner: EncoderRunner | None = None
        self.graphs: CompiledGraphs | CudaGraphs | None = None
        self.fused_decode: FusedDecode | None = None  # CPU decode steps in one native call
        self.lora_manager: LoRAModelManager | None = None  # with enable_lora
        self.spec: SpecDecodeRunner | None = make_spec_runner(vllm_config, self.attn_backend,
                                                              device)
        # Tests only: a step with a request whose prompt holds this token id raises.
        fail_id = os.environ.get("VLLM_TEST_FAIL_ON_TOKEN_ID")
        self.fail_on_token_id = int(fail_id) if fail_id else None

    # ---- set-up -------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = model = get_model(self.model_config, self.attn_backend, self.device)
        self.attn_layers = bind_attention_layers(model)
        lora_config = self.vllm_config.lora_config
        if lora_config is not None:
            from vllm.lora.manager import LoRAModelManager

            self.lora_manager = LoRAModelManager(
                cast(nn.Module, model), lora_config, self.model_config.hf_config,
                self._max_step_tokens(), self.device, self.dtype)
        if self.spec is not None:
            self.spec.load_model()
        if self.is_encoder_decoder:
            if not is_encoder_decoder(model):
                raise TypeError(f"{type(model).__name__} is configured as an encoder/decoder "
                                "model but has no encode() / cross_attention_layers().")
            self.encoder_runner = EncoderRunner(model, self.block_size, self.device)
        if self.device.type == "cpu":
            from vllm._custom_ops import cpu_ops

            cpu_ops()  # build or load the native kernels now, not on the first request
        if self.decode_inputs is not None:  # every size now: no tensor made while serving
            for n in range(1, self.input_batch.max_num_reqs + 1):
                metadata = self.attn_backend.build_decode_metadata(
                    self.decode_inputs.step(n).common, self.block_size, self.device)
                if metadata is None:
                    break  # the backend builds each step's (`build_metadata`)
                self._decode_metadata[n] = metadata

    def _max_step_tokens(self) -> int:
        """The most tokens a forward may hold: a step's budget, or a captured graph's
        padded size (or the dummy step compiling the graphs for any larger size)."""
        sizes = self.vllm_config.compilation_config.cudagraph_capture_sizes or (0,)
        return max(self.scheduler_config.max_num_batched_tokens, max(sizes),
                   CPU_MAX_DEFAULT_CAPTURE_SIZE, ANY_MIN_TOKENS, GGUF_MAX_ROWS) + 1

    def lora(self) -> LoRAModelManager:
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled (enable_lora=True).")
        return self.lora_manager

    def get_kv_cache_block_bytes(self) -> int:
        model_config = self.model_config
        per_layer = int(np.prod(self.attn_backend.get_kv_cache_shape(
            1, self.block_size, self.num_kv_heads, model_config.head_dim)))
        # A block id indexes one tensor per layer of a group (see kv_cache_groups).
        drafter = self.spec.kv_cache_block_bytes() if self.spec is not None else 0
        return per_layer * group_size(self.kv_cache_groups) * self.dtype.itemsize + drafter

    def stage_output_specs(self) -> dict[str, OutputSpec]:
        """The per-token outputs kept beside the KV cache: the last hidden states when the
        engine may return them (`enable_return_hidden_states`), else none."""
        if not self.model_config.enable_return_hidden_states:
            return {}
        return {HIDDEN_STATES: OutputSpec(self.model_config.hidden_size, self.dtype)}

    def initialize_kv_cache(self, num_blocks: int) -> None:
        model_config = self.model_config
        shape = self.attn_backend.get_kv_cache_shape(
            num_blocks, self.block_size, self.num_kv_heads, model_config.head_dim)
        # Zeroed: padded key positions are masked, but NaN garbage would still leak
        # through a 0 * NaN in the attention-weighted sum. Layer j of every KV cache group
        # shares tensor j (a block belongs to one group at a time).
        tensors = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                   for _ in range(group_size(self.kv_cache_groups))]
        slots = layer_slots(self.kv_cache_groups) if len(self.kv_cache_groups) > 1 else {}
        self.kv_caches = [tensors[slots[layer][1] if slots else layer]
                          for layer in range(model_config.num_layers)]
        bigger = self.attn_backend.get_kv_cache_shape(
            num_blocks + 1, self.block_size, self.num_kv_heads, model_config.head_dim)
        self._kv_block_dim = next(d for d, (a, b) in enumerate(zip(shape, bigger)) if a != b)
        self.stage_outputs = StageOutputCache(num_blocks, self.block_size,
                                              self.stage_output_specs())
        if self.spec is not None:
            self.spec.initialize_kv_cache(num_blocks)

    def capture_model(self) -> None:
        """Captures the forward graphs (see `graph_capture`), unless eager execution is
        asked for or the model has no graph support (encoder/decoder models run eagerly)."""
        compilation = self.vllm_config.compilation_config
        if self.model_config.enforce_eager or compilation.level == 0:
            logger.info("Graph capture off (enforce_eager or compilation level 0): eager.")
            return
        model = self.model
        assert model is not None, "load_model() first"
        if not supports_graph_capture(model):
            logger.info("%s runs eagerly (no graph support).", type(model).__name__)
            return
        scheduler_config = self.scheduler_config
        sizes = list(compilation.cudagraph_capture_sizes or default_capture_sizes(
            scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs,
            self.device.type))
        model_config = self.model_config
        if self.device.type == "cuda":
            if any(group.sliding_window is not None for group in self.kv_cache_groups):
                # Its graph buffers hold one block table and no window.
                logger.info("CUDA graphs are off for sliding-window models: eager.")
                return
            self.graphs = CudaGraphs(model, sizes, model_config.enable_prompt_embeds,
                                     model_config.hidden_size, self.dtype, self.device,
                                     self.block_size, self.max_model_len, self.attn_backend,
                                     self._lora_state())
            with torch.inference_mode():
                self.graphs.capture(self.kv_caches, functools.partial(
                    set_forward_context, attn_layers=self.attn_layers))
        else:
            self.graphs = CompiledGraphs(model, sizes, model_config.enable_prompt_embeds,
                                         model_config.hidden_size, self.dtype, self.device,
                                         scheduler_config.max_num_batched_tokens,
                                         self._lora_state())
            with torch.inference_mode():
                self.graphs.capture(self._dummy_step)
            self.fused_decode = FusedDecode.build(model, self.kv_caches, self.dtype,
                                                  len(self.kv_cache_groups),
                                                  lora=self.lora_manager is not None)
            if self.spec is not None:  # a draft model's graphs (CPU)
                self.spec.capture_model(sizes, scheduler_config.max_num_batched_tokens)
        for kv_cache in self.kv_caches:  # the dummy steps wrote K/V into the null block
            kv_cache.zero_()

    def _lora_state(self) -> LoRAState | None:
        return None if self.lora_manager is None else self.lora_manager.state

    def _dummy_step(self, num_tokens: int, forward) -> None:
        """Runs `forward()` under the metadata of `num_tokens` one-token requests at
        position 0 whose K/V go to the null block's first slot."""
        common = CommonAttentionMetadata.padding_decodes(num_tokens)
        metadata = [self.attn_backend.build_metadata(common, self.block_size, self.device)
                    for _ in self.kv_cache_groups]
        with set_forward_context(metadata[0], self.kv_caches,
                                 layer_attn_metadata=self._layer_metadata(metadata),
                                 attn_layers=self.attn_layers):
            forward()

    # ---- one step -----------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # One context object for every step: the decorator form clones one per call.
        with self._inference_mode:
            return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        copy_kv_blocks(self.kv_caches, self._kv_block_dim, scheduler_output.blocks_to_copy)
        finished_rows = self.stage_outputs.gather_finished(scheduler_output.rows_to_gather)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {}, [], hidden_states=finished_rows)
        model = self.model
        assert model is not None, "load_model() first"
        if scheduler_output.scheduled_encoder_inputs:
            assert self.encoder_runner is not None  # only encoder/decoder models have them
            self.encoder_runner.run(scheduler_output, self.kv_caches, self.attn_layers)
        inputs = self._prepare_inputs(scheduler_output)
        self._maybe_fail_for_tests()
        with set_forward_context(inputs.attn_metadata, self.kv_caches,
                                 inputs.cross_attn_metadata,
                                 layer_attn_metadata=inputs.layer_attn_metadata,
                                 attn_layers=self.attn_layers):
            hidden_states = self._run_model(model, inputs)
        self.stage_outputs.write(inputs.slot_mapping, hidden_states=hidden_states)
        logits_indices = inputs.logits_indices
        # Ascending distinct token indices as many as the tokens are every token in order
        # (a decode step where every request samples): no gather.
        logits = model.compute_logits(hidden_states if logits_indices.shape[0] ==
                                      hidden_states.shape[0] else hidden_states[logits_indices])
        if scheduler_output.grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, inputs, scheduler_output)
        metadata = self._sampling_metadata(inputs.sampling_rows)
        if inputs.draft_layout is not None:
            assert self.spec is not None  # drafts are scheduled only with it
            output = self.spec.verify(logits, metadata, inputs.draft_layout, self.input_batch,
                                      inputs.sampling_rows)
            output.hidden_states = finished_rows or {}
        else:
            output = self._bookkeep(inputs.sampling_rows, self.sampler(logits, metadata),
                                    finished_rows)
        if self.spec is not None:
            output.spec_token_ids = self.spec.propose(self.input_batch, inputs.sampling_rows,
                                                      scheduler_output)
        return output

    def _run_model(self, model: VllmModel, inputs: ModelInputs) -> torch.Tensor:
        """The one place that picks the fused decoder or a captured graph (when one fits
        the step), or eager."""
        if self.fused_decode is not None:
            hidden_states = self.fused_decode.run(inputs.input_ids, inputs.positions,
                                                  inputs.inputs_embeds, inputs.attn_metadata,
                                                  inputs.common)
            if hidden_states is not None:
                return hidden_states
        assert inputs.attn_metadata is not None, "a step left to the fused decoder"
        if self.graphs is not None:
            hidden_states = self.graphs.run(inputs.input_ids, inputs.positions,
                                            inputs.inputs_embeds, inputs.common)
            if hidden_states is not None:
                return hidden_states
        return model(inputs.input_ids, inputs.positions, inputs.inputs_embeds)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        if scheduler_output.finished_req_ids:
            self.sampling_inputs.forget()
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        # Requests not scheduled this step (preempted, or left out by the budget) leave
        # the batch but keep their state: a seeded generator continues where it was.
        for req_id in list(batch.req_id_to_index):
            if req_id not in scheduler_output.num_scheduled_tokens:
                batch.remove_request(req_id)
        to_add: list[CachedRequestState] = []
        for new in scheduler_output.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            batch.remove_request(new.req_id)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                prompt_embeds=new.prompt_embeds,
                sampling_params=new.sampling_params,
                generator=old.generator if old else self._make_generator(new.sampling_params),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=list(new.output_token_ids),
                cross_block_ids=list(new.cross_block_ids),
                num_encoder_tokens=(new.encoder_input.num_tokens
                                    if new.encoder_input is not None else 0),
                embeds_layout=EmbedsLayout.of(len(new.prompt_token_ids), new.prompt_embeds,
                                              new.prompt_is_token_ids),
                lora_request=new.lora_request,
            )
            self.requests[new.req_id] = state
            to_add.append(state)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                       cached.num_computed_tokens):
            state = self.requests[req_id]
            state.num_computed_tokens = num_computed
            state.block_ids.extend(new_block_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                to_add.append(state)
            else:
                batch.num_computed_tokens_cpu[row] = num_computed
                batch.block_table.append_row(new_block_ids, row)
        batch.condense()
        for state in to_add:
            batch.add_request(state)
        if self.spec is not None:
            self.spec.write_drafts(batch, scheduler_output)

    def drop_requests(self, req_ids: list[str]) -> None:
        """Forgets the batch rows of a failed step's requests (the scheduler re-sends any
        that go on as new requests); kept states only carry their seeded generators."""
        self.sampling_inputs.forget()
        for req_id in req_ids:
            self.input_batch.remove_request(req_id)
        self.input_batch.condense()

    def _maybe_fail_for_tests(self) -> None:
        batch = self.input_batch
        if self.fail_on_token_id is not None and any(
                self.fail_on_token_id in batch.state(row).prompt_token_ids
                for row in range(batch.num_reqs)):
            raise RuntimeError(f"Injected failure: token id {self.fail_on_token_id} "
                               "(VLLM_TEST_FAIL_ON_TOKEN_ID).")

    def _make_generator(self, params) -> torch.Generator | None:
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed)
        return generator

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        batch = self.input_batch
        num_reqs = batch.num_reqs
        # Every scheduled request has at least one token: a total of one per request is
        # a decode-only step.
        if (self.decode_inputs is not None and num_reqs
                and scheduler_output.total_num_scheduled_tokens == num_reqs
                and not scheduler_output.scheduled_spec_decode_tokens):
            inputs = self._prepare_decode(self.decode_inputs, num_reqs)
            if inputs is not None:
                return inputs
        scheduled = scheduler_output.num_scheduled_tokens
        num_scheduled = np.array([scheduled[r] for r in batch.req_ids_in_order],
                                 dtype=np.int32)
        idx = compute_step_indices(num_scheduled, batch.num_computed_tokens_cpu[:num_reqs],
                                   self.max_model_len)
        if self.lora_manager is not None:  # every token's adapter slot
            self.lora_manager.set_step([batch.state(row).lora_request
                                        for row in range(num_reqs)], num_scheduled)
        input_ids_np = batch.token_ids_cpu.reshape(-1)[idx.token_indices]
        is_token_np = batch.is_token_ids.reshape(-1)[idx.token_indices]
        num_tokens = int(idx.query_start_loc[-1])
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].copy()
        # A step the fused decoder takes needs no backend metadata (it reads `common`).
        fused = self.fused_decode is not None and self.fused_decode.takes(num_tokens)
        attn_metadata, group_commons = [], []
        for g in range(len(self.kv_cache_groups)):
            group_common = CommonAttentionMetadata(
                query_start_loc=idx.query_start_loc,
                seq_lens=idx.seq_lens,
                num_computed_tokens=num_computed,
                block_table=self._group_block_table(num_reqs, g, num_computed),
                slot_mapping=batch.block_table.compute_slot_mapping(
                    idx.req_indices, idx.positions, g),
                num_actual_tokens=num_tokens,
            )
            group_commons.append(group_common)
            attn_metadata.append(None if fused else self.attn_backend.build_metadata(
                group_common, self.block_size, self.device))
        common = group_commons[0]
        slot_mapping = common.slot_mapping
        cross_attn_metadata = self._cross_attn_metadata(common) if self.is_encoder_decoder \
            else None
        # A request samples once its whole known sequence is computed; a prefill chunk
        # that stops short of the prompt's end produces no token.
        sampling_rows = np.flatnonzero(idx.seq_lens >= batch.num_tokens[:num_reqs])
        logits_indices = idx.query_start_loc[sampling_rows + 1] - 1
        draft_layout = None
        if scheduler_output.scheduled_spec_decode_tokens:
            assert self.spec is not None  # drafts are scheduled only with it
            draft_layout = self.spec.layout(batch, sampling_rows, scheduler_output)
            logits_indices = self.spec.logits_indices(idx.query_start_loc, sampling_rows,
                                                      draft_layout)
        input_ids = torch.from_numpy(input_ids_np.astype(np.int64)).to(self.device)
        inputs_embeds = None
        if not is_token_np.all():
            inputs_embeds = self._gather_inputs_embeds(input_ids, is_token_np, idx)
            input_ids = None
        return ModelInputs(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            positions=torch.from_numpy(idx.positions).to(self.device),
            attn_metadata=attn_metadata[0],
            layer_attn_metadata=self._layer_metadata(attn_metadata),
            cross_attn_metadata=cross_attn_metadata,
            slot_mapping=slot_mapping,
            logits_indices=torch.from_numpy(logits_indices.astype(np.int64)).to(self.device),
            sampling_rows=sampling_rows,
            draft_layout=draft_layout,
            common=common,
        )

    def _prepare_decode(self, decode: DecodeInputs, num_reqs: int) -> ModelInputs | None:
        """A decode-only step from the persistent `DecodeInputs` (None where a token reads
        prompt embeds: the general path gathers those). The attention metadata of a step
        of `num_reqs` rows is built once where the backend reads the arrays in place."""
        filled = decode.fill(num_reqs)
        if filled is None:
            return None
        step, all_sample = filled
        batch = self.input_batch
        if self.lora_manager is not None:
            self.lora_manager.set_step([batch.state(row).lora_request
                                        for row in range(num_reqs)], decode.ones[:num_reqs])
        metadata = self._decode_metadata.get(num_reqs)
        if metadata is None:
            metadata = self._decode_metadata_of(step)
        rows, logits_indices = step.rows, step.logits_indices
        if not all_sample:  # a one-token prefill chunk short of its prompt's end
            rows = np.flatnonzero(step.common.seq_lens >= batch.num_tokens[:num_reqs])
            logits_indices = torch.from_numpy(rows)
        input_ids, positions = step.input_ids, step.positions
        if self.device.type != "cpu":
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
            logits_indices = logits_indices.to(self.device)
        return ModelInputs(input_ids=input_ids, inputs_embeds=None, positions=positions,
                           attn_metadata=metadata, layer_attn_metadata=None,
                           cross_attn_metadata=None, slot_mapping=step.common.slot_mapping,
                           logits_indices=logits_indices, sampling_rows=rows,
                           draft_layout=None, common=step.common)

    def _decode_metadata_of(self, step: DecodeStep) -> object:
        """The backend's metadata of a decode step: kept for every later step of as many
        rows where it reads the arrays in place, else built for this step alone."""
        common = step.common
        metadata = self.attn_backend.build_decode_metadata(common, self.block_size,
                                                           self.device)
        if metadata is None:
            return self.attn_backend.build_metadata(common, self.block_size, self.device)
        self._decode_metadata[common.num_actual_tokens] = metadata
        return metadata

    def _group_block_table(self, num_reqs: int, group: int,
                           num_computed: np.ndarray) -> np.ndarray:
        """One KV cache group's block table rows; a window group's blocks before the
        window read as the null block (`mask_out_of_window`)."""
        table = self.input_batch.block_table.group_table(num_reqs, group)
        window = self.kv_cache_groups[group].sliding_window
        if window is None:
            return table
        return mask_out_of_window(table, num_computed, window, self.block_size)

    def _layer_metadata(self, group_metadata: list) -> list | None:
        """Each decoder layer's metadata (its group's), or None with one group."""
        if len(group_metadata) == 1:
            return None
        return [group_metadata[group] for group, _ in
                (self._layer_slots[layer] for layer in range(self.model_config.num_layers))]

    def _cross_attn_metadata(self, common: CommonAttentionMetadata) -> object:
        """Cross-attention reads each request's whole encoder output from its cross
        blocks: the same query layout, with encoder lengths as sequence lengths."""
        batch = self.input_batch
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
        return self.attn_backend.build_metadata(cross, self.block_size, self.device,
                                                causal=False)

    def _gather_inputs_embeds(self, input_ids: torch.Tensor, is_token: np.ndarray,
                              idx: StepIndices) -> torch.Tensor:
        """Embeddings of the scheduled tokens: prompt-embeds rows where the position came
        from embeds, `embed_tokens(id)` where it holds a real token.

        Example: a request with prompt [t0, E0, E1, t3] (is_token [T, F, F, T]) and one
        generated token t4, computed 2, scheduled 3 (positions 2, 3, 4): is_token [F, T, T]
        -> rows [E1, embed(t3), embed(t4)] (position 2 reads row rows_before[2] = 1).
        """
        assert self.model is not None, "load_model() first"
        embeds = self.model.get_input_embeddings(input_ids)
        embedded = np.flatnonzero(~is_token)
        req_rows, positions = idx.req_indices[embedded], idx.positions[embedded]
        rows = []
        for row in np.unique(req_rows):
            state = self.input_batch.state(row)
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

    def _apply_grammar_bitmask(self, logits: torch.Tensor, inputs: ModelInputs,
                               scheduler_output: SchedulerOutput) -> None:
        assert scheduler_output.grammar_bitmask is not None
        req_ids = self.input_batch.req_ids_in_order
        logit_keys = [req_ids[row] for row in inputs.sampling_rows.tolist()]
        mask_keys = scheduler_output.structured_output_request_ids
        if inputs.draft_layout is not None:  # a key per verified position: (id, j)
            row_of_position, index_in_row = inputs.draft_layout.positions()
            logit_keys = [f"{logit_keys[row]}\0{j}" for row, j in
                          zip(row_of_position.tolist(), index_in_row.tolist())]
            mask_keys = [f"{req_id}\0{j}" for req_id, j in
                         zip(mask_keys, _occurrence_index(mask_keys))]
        apply_grammar_bitmask(logits, logit_keys, mask_keys, scheduler_output.grammar_bitmask)

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        return self.sampling_inputs.build(rows)

    def _bookkeep(self, rows: np.ndarray, sampler_output: SamplerOutput,
                  finished_rows: dict[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
        batch = self.input_batch
        req_ids = list(batch.req_ids_in_order)
        sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
        for row, token in zip(rows.tolist(), sampler_output.sampled_token_ids.tolist()):
            batch.append_token(row, token)
            sampled_token_ids[row] = [token]
        logprobs = None
        if sampler_output.logprobs is not None:
            # Rows that did not sample get empty logprob rows so that indices align.
            sampled = sampler_output.logprobs
            token_ids: list[list[int]] = [[] for _ in req_ids]
            values: list[list[float]] = [[] for _ in req_ids]
            ranks = [0] * len(req_ids)
            for i, row in enumerate(rows.tolist()):
                token_ids[row], values[row], ranks[row] = (
                    sampled.token_ids[i], sampled.logprobs[i], sampled.ranks[i])
            logprobs = type(sampled)(token_ids, values, ranks)
        return ModelRunnerOutput(req_ids, dict(batch.req_id_to_index), sampled_token_ids,
                                 logprobs, finished_rows or {})


def _occurrence_index(keys: list[str]) -> list[int]:
    """How many times each key occurred before: ["a", "a", "b", "a"] -> [0, 1, 0, 2]."""
    seen: dict[str, int] = {}
    out = []
    for key in keys:
        out.append(seen.get(key, 0))
        seen[key] = out[-1] + 1
    return out
