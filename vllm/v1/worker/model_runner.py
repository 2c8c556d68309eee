"""The model runner: scheduler output in, sampled tokens out.

`execute_model` reads as its table of contents: update states (`RequestStates`) -> prepare
inputs (`StepInputsBuilder`) -> run the model (the fused decoder, a captured graph, or eager)
-> keep stage outputs -> logits and sample -> build the output (`step_output`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention, bind_attention_layers
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.models.interfaces import (
    GraphModel,
    VllmModel,
    is_encoder_decoder,
    supports_graph_capture,
    supports_media,
)
from vllm.v1.attention.backends import get_attn_backend
from vllm.v1.attention.backends.abstract import CommonAttentionMetadata
from vllm.v1.core.kv_cache_groups import group_size, layer_slots
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler, SamplerOutput
from vllm.v1.spec_decode.spec_runner import SpecDecodeRunner, make_spec_runner
from vllm.v1.worker.encoder_runner import EncoderRunner
from vllm.v1.worker.fused_decode import FusedDecode
from vllm.v1.worker.graph_capture import (
    ANY_MIN_TOKENS,
    CPU_MAX_DEFAULT_CAPTURE_SIZE,
    CompiledGraphs,
    CudaGraphs,
    default_capture_sizes,
)
from vllm.v1.worker.input_batch import InputBatch
from vllm.v1.worker.request_states import RequestStates
from vllm.v1.worker.sampling_inputs import SamplingInputsBuilder
from vllm.v1.worker.stage_output_cache import HIDDEN_STATES, OutputSpec, StageOutputCache
from vllm.v1.worker.step_inputs import ModelInputs, StepInputsBuilder
from vllm.v1.worker.step_output import apply_step_bitmask, bookkeep

if TYPE_CHECKING:
    from vllm.lora.layers import LoRAState
    from vllm.lora.manager import LoRAModelManager

logger = logging.getLogger(__name__)


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
        self.is_encoder_decoder = self.model_config.is_encoder_decoder
        self.kv_cache_groups = self.model_config.kv_cache_groups
        self.input_batch = InputBatch(self.scheduler_config.max_num_seqs, self.max_model_len,
                                      self.block_size, self.model_config.vocab_size,
                                      self.model_config.max_encoder_len,
                                      len(self.kv_cache_groups))
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
        self.states = RequestStates(self.input_batch, self.sampling_inputs, self.spec, device)
        self.requests = self.states.requests  # req_id -> the worker's state of it
        self.step_inputs = StepInputsBuilder(self.input_batch, self.model_config,
                                             self.block_size, device, self.spec)
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
                model, lora_config, self.model_config.hf_text_config,
                self._max_step_tokens(model), self.device, self.dtype)
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
        self.step_inputs.build_decode_metadata(self.attn_backend)

    def _max_step_tokens(self, model: VllmModel) -> int:
        """The most tokens a forward may hold: a step's budget, or a captured graph's
        padded size (or the dummy step compiling the graphs for any larger size)."""
        sizes = self.vllm_config.compilation_config.cudagraph_capture_sizes or (0,)
        row_switch = model.row_switch_tokens() if supports_graph_capture(model) else 0
        return max(self.scheduler_config.max_num_batched_tokens, max(sizes),
                   CPU_MAX_DEFAULT_CAPTURE_SIZE, ANY_MIN_TOKENS, row_switch) + 1

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
        if self.device.type == "cuda":
            self._capture_cuda(model, sizes)
        else:
            self._capture_cpu(model, sizes)
        for kv_cache in self.kv_caches:  # the dummy steps wrote K/V into the null block
            kv_cache.zero_()

    def _capture_cuda(self, model: GraphModel, sizes: list[int]) -> None:
        if any(group.sliding_window is not None for group in self.kv_cache_groups):
            # Its graph buffers hold one block table and no window.
            logger.info("CUDA graphs are off for sliding-window models: eager.")
            return
        if self.model_config.uses_mrope:  # its position buffer is 1-D
            logger.info("CUDA graphs are off for M-RoPE models: eager.")
            return
        model_config = self.model_config
        self.graphs = CudaGraphs(model, sizes, model_config.uses_prompt_embeds,
                                 model_config.hidden_size, self.dtype, self.device,
                                 self.block_size, self.max_model_len, self.attn_backend,
                                 self._lora_state())
        with torch.inference_mode():
            self.graphs.capture(self.kv_caches, functools.partial(
                set_forward_context, attn_layers=self.attn_layers))

    def _capture_cpu(self, model: GraphModel, sizes: list[int]) -> None:
        """The compiled graphs, then the fused decoder where it applies, then a draft
        model's graphs."""
        model_config = self.model_config
        max_num_tokens = self.scheduler_config.max_num_batched_tokens
        self.graphs = CompiledGraphs(model, sizes, model_config.uses_prompt_embeds,
                                     model_config.hidden_size, self.dtype, self.device,
                                     max_num_tokens, self._lora_state(),
                                     mrope=model_config.uses_mrope)
        with torch.inference_mode():
            self.graphs.capture(self._dummy_step)
        self.fused_decode = FusedDecode.build(model, self.kv_caches, self.dtype,
                                              self.kv_cache_groups,
                                              self.lora_manager is not None, self.attn_backend)
        if self.spec is not None:
            self.spec.capture_model(sizes, max_num_tokens)

    def _lora_state(self) -> LoRAState | None:
        return None if self.lora_manager is None else self.lora_manager.state

    def _dummy_step(self, num_tokens: int, forward) -> None:
        """Runs `forward()` under the metadata of `num_tokens` one-token requests at
        position 0 whose K/V go to the null block's first slot."""
        common = CommonAttentionMetadata.padding_decodes(num_tokens)
        metadata = [self.attn_backend.build_metadata(common, self.block_size, self.device)
                    for _ in self.kv_cache_groups]
        with set_forward_context(metadata[0], self.kv_caches,
                                 layer_attn_metadata=self.step_inputs.layer_metadata(metadata),
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
        if scheduler_output.scheduled_encoder_inputs:
            assert self.encoder_runner is not None  # only encoder/decoder models have them
            self.encoder_runner.run(scheduler_output, self.kv_caches, self.attn_layers)
        inputs = self._prepare_inputs(scheduler_output)
        self._maybe_fail_for_tests()
        hidden_states = self._forward(inputs)
        self.stage_outputs.write(inputs.slot_mapping, hidden_states=hidden_states)
        logits = self._compute_logits(hidden_states, inputs, scheduler_output)
        output = self._sample(logits, inputs, finished_rows)
        if self.spec is not None:
            output.spec_token_ids = self.spec.propose(self.input_batch, inputs.sampling_rows,
                                                      scheduler_output)
        return output

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The final hidden states of the step's tokens, under its attention metadata."""
        model = self.model
        assert model is not None, "load_model() first"
        with set_forward_context(inputs.attn_metadata, self.kv_caches,
                                 inputs.cross_attn_metadata,
                                 layer_attn_metadata=inputs.layer_attn_metadata,
                                 attn_layers=self.attn_layers):
            return self._run_model(model, inputs)

    def _compute_logits(self, hidden_states: torch.Tensor, inputs: ModelInputs,
                        scheduler_output: SchedulerOutput) -> torch.Tensor:
        """The logits of the sampled positions, grammar-masked where a request has one."""
        assert self.model is not None, "load_model() first"
        logits_indices = inputs.logits_indices
        logits = (self.fused_decode.take_logits(hidden_states)
                  if self.fused_decode is not None else None)
        if logits is None:
            # Ascending distinct token indices as many as the tokens are every token in
            # order (a decode step where every request samples): no gather.
            logits = self.model.compute_logits(
                hidden_states if logits_indices.shape[0] == hidden_states.shape[0]
                else hidden_states[logits_indices])
        if scheduler_output.grammar_bitmask is not None:
            apply_step_bitmask(logits, self.input_batch, inputs.sampling_rows,
                               inputs.draft_layout, scheduler_output)
        return logits

    def _sample(self, logits: torch.Tensor, inputs: ModelInputs,
                finished_rows: dict[str, torch.Tensor]) -> ModelRunnerOutput:
        """Samples (or verifies a step's drafts) and appends the tokens to the batch."""
        metadata = self._sampling_metadata(inputs.sampling_rows)
        if inputs.draft_layout is None:
            return self._bookkeep(inputs.sampling_rows, self.sampler(logits, metadata),
                                  finished_rows)
        assert self.spec is not None  # drafts are scheduled only with it
        output = self.spec.verify(logits, metadata, inputs.draft_layout, self.input_batch,
                                  inputs.sampling_rows)
        output.hidden_states = finished_rows or {}
        return output

    def _run_model(self, model: VllmModel, inputs: ModelInputs) -> torch.Tensor:
        """The one place that picks the fused decoder or a captured graph (when one fits
        the step), or eager."""
        if self.fused_decode is not None:
            hidden_states = self.fused_decode.run(
                inputs.input_ids, inputs.positions, inputs.inputs_embeds, inputs.attn_metadata,
                inputs.group_commons,
                with_logits=inputs.logits_indices.shape[0] == inputs.positions.shape[0])
            if hidden_states is not None:
                return hidden_states
        assert inputs.attn_metadata is not None, "a step left to the fused decoder"
        if self.graphs is not None:
            hidden_states = self.graphs.run(inputs.input_ids, inputs.positions,
                                            inputs.inputs_embeds, inputs.common)
            if hidden_states is not None:
                return hidden_states
        return model(inputs.input_ids, inputs.positions, inputs.inputs_embeds)

    # ---- the steps of a step, each one collaborator's ---------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        self.states.update(scheduler_output)

    def embed_media(self, modality: str, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """A multimodal model's rows of media items (`MediaInput.data`) -> each item's
        [num_tokens, hidden], CPU (the engine core's media stage puts them into prompts as
        embeds rows)."""
        model = self.model
        assert model is not None and supports_media(model), "not a multimodal model"
        with torch.inference_mode():
            rows = model.embed_media(modality, [item.to(self.device) for item in data])
        return [r.cpu() for r in rows]

    def drop_requests(self, req_ids: list[str]) -> None:
        """Forgets the batch rows of a failed step's requests (`RequestStates.drop`)."""
        self.states.drop(req_ids)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        fused_max_tokens = 0 if self.fused_decode is None else FusedDecode.MAX_TOKENS
        inputs = self.step_inputs.prepare(scheduler_output, self.attn_backend, self.model,
                                          fused_max_tokens)
        if self.lora_manager is not None:  # every token's adapter slot
            batch = self.input_batch
            self.lora_manager.set_step([batch.state(row).lora_request
                                        for row in range(batch.num_reqs)],
                                       inputs.num_scheduled)
        return inputs

    def _maybe_fail_for_tests(self) -> None:
        batch = self.input_batch
        if self.fail_on_token_id is not None and any(
                self.fail_on_token_id in batch.state(row).prompt_token_ids
                for row in range(batch.num_reqs)):
            raise RuntimeError(f"Injected failure: token id {self.fail_on_token_id} "
                               "(VLLM_TEST_FAIL_ON_TOKEN_ID).")

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        return self.sampling_inputs.build(rows)

    def _bookkeep(self, rows: np.ndarray, sampler_output: SamplerOutput,
                  finished_rows: dict[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
        return bookkeep(self.input_batch, rows, sampler_output, finished_rows)
