"""Decode steps of a Llama-family model on GGUF block codes as one native call per step
(`csrc/cpu/fused_decode.cpp`'s `FusedDecoder`): every layer's RMSNorm, quantized q/k/v,
rotary, KV write, paged attention, o_proj, residual, RMSNorm, gate_up, SiLU x up, down and
residual, then the final norm, in one OpenMP parallel region with buffers allocated once.

A one-token step of a small model otherwise spends more time around its kernels than in
them: one compiled graph call per layer (dynamo's per-call entry, the dispatcher, the
attention op's Python) and a fork and join of the thread team per kernel; on the default
model that was ~170 us of a layer's ~250, against ~80 us of weight streaming.

It applies where the fused code computes exactly what the layers would (`unsupported_reason`
says why not, logged once): CPU, `quantization="gguf"` with the `quant_gemv` kernel on every
projection of every layer, plain `LlamaForCausalLM` layers (RMSNorm, SiLU-gated MLP, full
rotary in rotate-half form, no bias, no sliding window, soft-cap or q/k norm), one KV cache
group, no LoRA, one rank; and per step (`run`), where the step has at most
`gguf_blocks.MAX_ROWS` tokens (where the layers themselves take quant_gemv): decode rows
(one token per request), a speculative verification step's k + 1 tokens of a request (the
same kernels as a decode step: a query of several tokens against the paged cache), or a
short prompt chunk. Larger steps, and every step when `VLLM_CPU_FUSED_DECODE=0`, take the
compiled graphs. It is built with the graphs (`capture_model`), so `enforce_eager` turns it
off too.
"""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.quantization.gguf_blocks import MAX_ROWS, GGUFLinear
from vllm.model_executor.models.llama import (
    ACTIVATIONS,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from vllm.v1.attention.backends.abstract import CommonAttentionMetadata
from vllm.v1.attention.backends.torch_sdpa import TorchSDPAImpl, TorchSDPAMetadata

logger = logging.getLogger(__name__)

# "0" turns the fused path off (the compiled graphs run every step).
ENV_SWITCH = "VLLM_CPU_FUSED_DECODE"


def _quant_gemv_kernel(linear: nn.Module) -> GGUFLinear | None:
    """The layer's GGUF kernel where it runs quant_gemv on one rank without a bias."""
    kernel = getattr(linear, "kernel", None)
    if (isinstance(kernel, GGUFLinear) and kernel.kernel == "quant_gemv"
            and getattr(linear, "bias", None) is None and getattr(linear, "tp_size", 1) == 1):
        return kernel
    return None


def unsupported_reason(model: object, kv_caches: list[torch.Tensor], dtype: torch.dtype,
                       num_kv_cache_groups: int, lora: bool) -> str | None:
    """Why the fused decoder cannot run `model`'s decode steps, or None where it can."""
    if os.environ.get(ENV_SWITCH) == "0":
        return f"{ENV_SWITCH}=0"
    if lora:
        return "LoRA adapters"
    if num_kv_cache_groups != 1:
        return "several KV cache groups"
    cls = type(model)
    if not isinstance(model, LlamaForCausalLM) or any(
            getattr(cls, name) is not getattr(LlamaForCausalLM, name)
            for name in ("forward", "prepare", "finish")):
        return f"{cls.__name__} is not a plain Llama-family decoder"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {dtype}"
    if type(model.norm) is not RMSNorm:
        return "final norm is not RMSNorm"
    for i, layer in enumerate(model.layers):
        if (type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention
                or type(layer.mlp) is not LlamaMLP):
            return f"layer {i} is not a plain Llama layer"
    layers = _llama_layers(model)
    head_dim = layers[0].self_attn.head_dim if layers else 0
    if tuple(model.rotary.cos.shape[1:]) != (head_dim,) or model.rotary.cos.dtype != dtype:
        return "rotary table is not full-width in the model dtype"
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qk_norm is not None or attn.clip_qkv is not None:
            return f"layer {i} has q/k norms or clipping"
        impl = attn.attn.impl
        if (not isinstance(impl, TorchSDPAImpl) or impl.sliding_window is not None
                or impl.logits_soft_cap is not None):
            return f"layer {i}'s attention has a window, a soft-cap or another backend"
        if mlp.act is not ACTIVATIONS["silu"]:
            return f"layer {i}'s activation is not SiLU"
        if not all(type(n) is RMSNorm for n in (layer.input_layernorm,
                                                layer.post_attention_layernorm)):
            return f"layer {i}'s norms are not RMSNorm"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if _quant_gemv_kernel(linear) is None:
                return (f"layer {i} has a projection other than a bias-free quant_gemv GGUF "
                        "kernel")
        if attn.attn.layer_idx >= len(kv_caches):
            return f"layer {i} has no KV cache"
    return None


class FusedDecode:
    """The native decoder of one model and its KV caches; `steps` and `tokens` count the
    steps it ran and their tokens."""

    def __init__(self, decoder: Any, model: LlamaForCausalLM, block_size: int) -> None:
        self.decoder = decoder
        self.model = model
        self.block_size = block_size
        self.steps = 0
        self.tokens = 0

    @classmethod
    def build(cls, model: object, kv_caches: list[torch.Tensor], dtype: torch.dtype,
              num_kv_cache_groups: int, lora: bool) -> FusedDecode | None:
        """The fused decoder where it applies (see the module docstring), else None."""
        from vllm._custom_ops import cpu_ops

        ops = cpu_ops()
        reason = ("no native kernels" if ops is None or not hasattr(ops, "FusedDecoder")
                  or not ops.quant_gemv_available() else None)
        reason = reason or unsupported_reason(model, kv_caches, dtype, num_kv_cache_groups, lora)
        if reason is not None:
            logger.info("Fused decode steps off: %s.", reason)
            return None
        assert isinstance(model, LlamaForCausalLM) and ops is not None
        layers = _llama_layers(model)
        norms = [w for layer in layers for w in (layer.input_layernorm.weight,
                                                 layer.post_attention_layernorm.weight)]
        kernels = [_quant_gemv_kernel(linear) for layer in layers for linear in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)]
        eps = {n.eps for n in (*(layer.input_layernorm for layer in layers),
                               *(layer.post_attention_layernorm for layer in layers),
                               model.norm)}
        if len(eps) != 1:
            logger.info("Fused decode steps off: the norms' epsilons differ.")
            return None
        attn = layers[0].self_attn
        impl = attn.attn.impl
        assert isinstance(impl, TorchSDPAImpl)
        try:
            decoder = ops.FusedDecoder(
                norms + [model.norm.weight], [k.codes for k in kernels if k is not None],
                [k.d for k in kernels if k is not None], [k.m for k in kernels if k is not None],
                [k.bits for k in kernels if k is not None],
                [kv_caches[layer.self_attn.attn.layer_idx] for layer in layers],
                model.rotary.cos, model.rotary.sin, attn.num_heads, attn.num_kv_heads,
                attn.head_dim, eps.pop(), impl.scale)
        except RuntimeError as e:  # a shape the native decoder does not take
            logger.info("Fused decode steps off: %s", e)
            return None
        logger.info("Fused decode steps on: %d layers in one native call per step.",
                    len(layers))
        return cls(decoder, model, kv_caches[0].shape[2])

    # The most tokens of a step it takes: as many as the layers' quant_gemv kernels take.
    MAX_TOKENS = MAX_ROWS

    @staticmethod
    def takes(num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs here (the runner then builds no
        attention metadata for it but a decode-only step's, which is kept per size)."""
        return num_tokens <= FusedDecode.MAX_TOKENS

    def run(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
            inputs_embeds: torch.Tensor | None, attn_metadata: object,
            common: CommonAttentionMetadata) -> torch.Tensor | None:
        """The step's final hidden states, or None where the step is not one it `takes`.

        A decode-only step from the runner's persistent inputs reads the backend's decode
        block table and lengths (`attn_metadata`). Any other step (`attn_metadata` None: a
        verification step's k + 1 tokens of a request, a short prompt chunk) runs each
        token as a decode query at its own length, `seq_lens - query_lens + i + 1` for the
        request's i-th token, through its request's block-table row."""
        n = positions.shape[0]
        if not self.takes(n) or common.num_actual_tokens != n:
            return None
        if attn_metadata is None:
            block_table, seq_lens = self._token_rows(common)
            slot_mapping = torch.from_numpy(common.slot_mapping)
            # Several tokens of one sequence: every K/V row written before any attends.
            shared = n > common.seq_lens.size
        else:
            m = attn_metadata
            if (not isinstance(m, TorchSDPAMetadata) or not m.decode_only
                    or m.decode_seq_lens is None or m.decode_block_table_i32 is None):
                return None
            block_table, seq_lens = m.decode_block_table_i32, m.decode_seq_lens
            slot_mapping, shared = m.slot_mapping, False
        h = (self.model.embed_tokens(input_ids) if inputs_embeds is None
             else inputs_embeds.to(self.model.rotary.cos.dtype))
        out = self.decoder.forward(h, positions, block_table, seq_lens, slot_mapping, shared)
        self.steps += 1
        self.tokens += n
        return out

    def _token_rows(self, common: CommonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's block-table row and sequence length (it and the keys before it).

        e.g. query_start_loc [0, 1, 4], seq_lens [7, 12]: token rows [0, 1, 1, 1], lengths
        [7, 10, 11, 12]."""
        starts = common.query_start_loc
        query_lens = np.diff(starts)
        token_rows = np.repeat(np.arange(query_lens.size), query_lens)
        offsets = np.arange(token_rows.size) - starts[token_rows]
        lengths = (common.seq_lens - query_lens)[token_rows] + offsets + 1
        max_blocks = -(-int(lengths.max()) // self.block_size)
        table = np.ascontiguousarray(common.block_table[token_rows, :max_blocks])
        return torch.from_numpy(table), torch.from_numpy(lengths.astype(np.int32))


class _Attention(LlamaAttention):
    """`LlamaAttention` as the checks found it (the layer types its parts as modules)."""
    attn: Attention


class _Layer(LlamaDecoderLayer):
    self_attn: _Attention
    mlp: LlamaMLP


def _llama_layers(model: LlamaForCausalLM) -> list[_Layer]:
    """The model's layers, typed as `unsupported_reason` checked them."""
    return [cast(_Layer, layer) for layer in model.layers]
