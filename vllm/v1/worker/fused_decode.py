"""Decode steps of a decoder on GGUF weights as one native call per step
(`csrc/cpu/fused_decode.cpp`'s `FusedDecoder`): every layer's norm, quantized q/k/v (q/k
norms), rotary, KV write, paged attention, o_proj, (norm,) residual, norm, gate_up,
act(gate) x up, down, (norm,) residual, then the final norm, in one OpenMP parallel region
with buffers allocated once.

A one-token step of a small model otherwise spends more time around its kernels than in
them: one compiled graph call per layer (dynamo's per-call entry, the dispatcher, the
attention op's Python) and a fork and join of the thread team per kernel; on the default
model that was ~170 us of a layer's ~250, against ~80 us of weight streaming.

It applies where the fused code computes exactly what the layers would (`unsupported_reason`
says why not, logged once): CPU, no LoRA, a float dtype, and a model that declares itself
one the decoder computes (`FusedDecodeModel.fused_decode_spec`: the Llama family's plain
layers, Qwen2's q/k/v biases, Qwen3's q/k norms, Gemma 2 / 3's sandwich norms, tanh GELU,
window layers and soft-caps, Qwen2/3-MoE's experts with a dense router (and a shared
expert); one-rank quantized projections, quant_gemv's codes, `gguf_mm`'s blocks or
`quantization="int8"`'s `int8_mm` tiles (processors without VNNI); attention its
backend lets the decoder compute, `AttentionImpl.fused_decode_attention`), its
rotary tables full-width in the model dtype and its norms of one epsilon. Each layer reads
the block table of its KV cache group (window layers' groups mask blocks before the
window). Per step (`run`), where the step has at most `MAX_TOKENS` tokens (where the layers
themselves take quant_gemv): decode rows (one token per request, read from the backend's
decode metadata, `AttentionBackend.decode_rows`, with one KV cache group), a speculative
verification step's k + 1 tokens of a request (the same kernels as a decode step: a query
of several tokens against the paged cache), or a short prompt chunk. Larger steps, and
every step when `VLLM_CPU_FUSED_DECODE=0`, take the compiled graphs. It is built with the
graphs (`capture_model`), so `enforce_eager` turns it off too.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from vllm.model_executor.layers.quantization.gguf_blocks import (
    MAX_ROWS,
    FusedWeights,
    QuantGemvWeights,
)
from vllm.model_executor.layers.quantization.int8 import Int8Weights
from vllm.model_executor.models.interfaces import (
    FusedDecodeLayer,
    FusedDecodeSpec,
    VllmModel,
    supports_fused_decode,
)
from vllm.v1.attention.backends.abstract import AttentionBackend, CommonAttentionMetadata
from vllm.v1.core.kv_cache_groups import KVCacheGroupSpec, layer_slots

logger = logging.getLogger(__name__)

# "0" turns the fused path off (the compiled graphs run every step).
ENV_SWITCH = "VLLM_CPU_FUSED_DECODE"


def fused_decode_spec(model: VllmModel, kv_caches: list[torch.Tensor], dtype: torch.dtype,
                      lora: bool) -> FusedDecodeSpec | str:
    """The model as the fused decoder runs it, or why the decoder cannot run its steps."""
    if os.environ.get(ENV_SWITCH) == "0":
        return f"{ENV_SWITCH}=0"
    if lora:
        return "LoRA adapters"
    if not supports_fused_decode(model):
        return f"{type(model).__name__} declares no fused decoder form"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {dtype}"
    spec = model.fused_decode_spec()
    if isinstance(spec, str):
        return spec
    for table in (t for rope in spec.ropes for t in rope):
        if tuple(table.shape[1:]) != (spec.head_dim,) or table.dtype != dtype:
            return "a rotary table is not full-width in the model dtype"
    for i, layer in enumerate(spec.layers):
        if layer.kv_cache_layer >= len(kv_caches):
            return f"layer {i} has no KV cache"
    if len({layer.norm_eps for layer in spec.layers} | {spec.final_norm_eps}) != 1:
        return "the norms' epsilons differ"
    if len({(a.scale, a.soft_cap) for a in (layer.attention for layer in spec.layers)}) != 1:
        return "the layers' attention scales or soft-caps differ"
    if spec.activation not in _ACTIVATIONS:
        return f"activation {spec.activation}"
    return spec


def unsupported_reason(model: VllmModel, kv_caches: list[torch.Tensor], dtype: torch.dtype,
                       lora: bool) -> str | None:
    """Why the fused decoder cannot run `model`'s decode steps, or None where it can."""
    spec = fused_decode_spec(model, kv_caches, dtype, lora)
    return spec if isinstance(spec, str) else None


# The models' activation names -> the native decoder's.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _native_weight(ops: Any, weight: FusedWeights, bias: torch.Tensor | None = None) -> Any:
    if isinstance(weight, QuantGemvWeights):
        return ops.FusedWeight.quant_gemv(weight.codes, weight.d, weight.m, weight.bits, bias)
    if isinstance(weight, Int8Weights):
        return ops.FusedWeight.int8(weight.packed, weight.scale, weight.in_features, bias)
    return ops.FusedWeight.gguf(weight.parts, weight.types, bias)


def _native_mlp(ops: Any, layer: FusedDecodeLayer) -> Any:
    e = layer.experts
    if e is None:
        gate_up, down = (_native_weight(ops, w, b)
                         for w, b in zip(layer.projections[2:], layer.biases[2:]))
        return ops.FusedMLP.dense(gate_up, down)
    mlp = ops.FusedMLP.experts(e.router, e.w1, e.w3, e.w2, list(e.types), e.top_k,
                               e.renormalize)
    if e.shared is not None:
        gate_up, down, gate = e.shared
        mlp = mlp.with_shared(_native_weight(ops, gate_up), _native_weight(ops, down), gate)
    return mlp


class FusedDecode:
    """The native decoder of one model and its KV caches; `steps` and `tokens` count the
    steps it ran and their tokens."""

    def __init__(self, decoder: Any, spec: FusedDecodeSpec, block_size: int,
                 backend: type[AttentionBackend] = AttentionBackend) -> None:
        self.decoder = decoder
        self.spec = spec
        self.block_size = block_size
        self.backend = backend  # reads a decode-only step's rows (`decode_rows`)
        self.steps = 0
        self.tokens = 0
        # The last step's (hidden states, logits) where it ran the LM head (`take_logits`).
        self._logits: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, model: VllmModel, kv_caches: list[torch.Tensor], dtype: torch.dtype,
              kv_cache_groups: list[KVCacheGroupSpec], lora: bool,
              backend: type[AttentionBackend]) -> FusedDecode | None:
        """The fused decoder where it applies (see the module docstring), else None."""
        from vllm._custom_ops import cpu_ops

        ops = cpu_ops()
        spec = ("no native kernels" if ops is None or not hasattr(ops, "FusedDecoder")
                or not ops.quant_gemv_available() else
                fused_decode_spec(model, kv_caches, dtype, lora))
        if isinstance(spec, str):
            logger.info("Fused decode steps off: %s.", spec)
            return None
        assert ops is not None
        groups = {layer: group for layer, (group, _) in layer_slots(kv_cache_groups).items()}
        layers = spec.layers
        try:
            decoder = ops.FusedDecoder(
                [n for layer in layers for n in layer.norms] + [spec.final_norm],
                len(layers[0].norms), spec.one_plus_norms,
                [_native_weight(ops, w, b) for layer in layers
                 for w, b in zip(layer.projections[:2], layer.biases[:2])],
                [_native_mlp(ops, layer) for layer in layers],
                [kv_caches[layer.kv_cache_layer] for layer in layers],
                [groups.get(layer.kv_cache_layer, 0) for layer in layers],
                [n for layer in layers for n in layer.qk_norms],
                [cos for cos, _ in spec.ropes], [sin for _, sin in spec.ropes],
                [layer.rope for layer in layers], [layer.attention.window for layer in layers],
                spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.final_norm_eps,
                layers[0].attention.scale, layers[0].attention.soft_cap,
                _ACTIVATIONS[spec.activation])
            ends = spec.lookups
            if ends is not None and ends.table is not None:
                decoder.set_embedding(*ends.table, ends.scale or 0.0)
            if ends is not None and ends.head is not None:
                decoder.set_head(_native_weight(ops, ends.head, ends.head_bias), ends.vocab_size)
        except RuntimeError as e:  # a shape the native decoder does not take
            logger.info("Fused decode steps off: %s", e)
            return None
        logger.info("Fused decode steps on: %d layers in one native call per step%s.",
                    len(layers), "".join(
                        f", {part} in it" for part, on in (
                            ("the embedding lookup", decoder.has_embedding),
                            ("the LM head", decoder.has_head)) if on))
        return cls(decoder, spec, kv_caches[0].shape[2], backend)

    # The most tokens of a step it takes: as many as the layers' quant_gemv kernels take.
    MAX_TOKENS = MAX_ROWS

    @staticmethod
    def takes(num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs here (the runner then builds no
        attention metadata for it but a decode-only step's, which is kept per size)."""
        return num_tokens <= FusedDecode.MAX_TOKENS

    def run(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
            inputs_embeds: torch.Tensor | None, attn_metadata: object,
            group_commons: list[CommonAttentionMetadata],
            with_logits: bool = False) -> torch.Tensor | None:
        """The step's final hidden states, or None where the step is not one it `takes`.
        With `with_logits` (every row samples), a decoder holding the LM head computes their
        logits in the same call, for `take_logits`.

        A decode-only step from the runner's persistent inputs (one KV cache group) reads
        the backend's decode block table and lengths (`attn_metadata`). Any other step
        (`attn_metadata` None: several KV cache groups, a verification step's k + 1 tokens
        of a request, a short prompt chunk) runs each token as a decode query at its own
        length, `seq_lens - query_lens + i + 1` for the request's i-th token, through its
        request's block-table row of each group (`group_commons`, one per group)."""
        self._logits = None
        n = positions.shape[0]
        common = group_commons[0]
        if not self.takes(n) or common.num_actual_tokens != n or common.key_ends is not None:
            return None  # (it attends causally: bidirectional media spans are not its)
        if attn_metadata is None:
            block_tables, seq_lens = self._token_rows(group_commons)
            slot_mappings = [torch.from_numpy(c.slot_mapping) for c in group_commons]
            # Several tokens of one sequence: every K/V row written before any attends.
            shared = n > common.seq_lens.size
        else:
            rows = self.backend.decode_rows(attn_metadata)
            if rows is None or len(group_commons) != 1:
                return None
            block_tables, seq_lens, slot_mappings = ([rows.block_table], rows.seq_lens,
                                                     [rows.slot_mapping])
            shared = False
        if inputs_embeds is not None:
            h = inputs_embeds.to(self.spec.ropes[0][0].dtype)
        elif self.decoder.has_embedding:
            assert input_ids is not None
            h = input_ids  # looked up in the call
        else:
            assert input_ids is not None
            h = self.spec.embed_tokens(input_ids)
        with_logits = with_logits and self.decoder.has_head
        outs = self.decoder.forward(h, positions, block_tables, seq_lens, slot_mappings,
                                    shared, with_logits)
        self._logits = (outs[0], outs[1]) if with_logits else None
        self.steps += 1
        self.tokens += n
        return outs[0]

    def take_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The logits of `hidden_states` where the last step computed them (the tensor it
        returned, with `with_logits`), else None; each step's are taken once."""
        taken, self._logits = self._logits, None
        return taken[1] if taken is not None and taken[0] is hidden_states else None

    def _token_rows(self, group_commons: list[CommonAttentionMetadata]
                    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each token's block-table row in each group, and its sequence length (it and the
        keys before it), the same in every group: computed once (Gemma 3 has six groups).

        e.g. query_start_loc [0, 1, 4], seq_lens [7, 12]: token rows [0, 1, 1, 1], lengths
        [7, 10, 11, 12]."""
        common = group_commons[0]
        starts = common.query_start_loc
        query_lens = np.diff(starts)
        token_rows = np.repeat(np.arange(query_lens.size), query_lens)
        offsets = np.arange(token_rows.size) - starts[token_rows]
        lengths = (common.seq_lens - query_lens)[token_rows] + offsets + 1
        max_blocks = -(-int(lengths.max()) // self.block_size)
        tables = [torch.from_numpy(np.ascontiguousarray(c.block_table[token_rows, :max_blocks]))
                  for c in group_commons]
        return tables, torch.from_numpy(lengths.astype(np.int32))
