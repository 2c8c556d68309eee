"""Llama-family decoder (Llama 2/3, SmolLM, Mistral with its sliding window) and Qwen2 (the
same with qkv bias), and the shared blocks other decoder families are built from:
`LlamaAttention` (attention with rope; options: q/k norm per head or over the whole
projection, the softmax scale, the logit soft-cap; the config's sliding window per layer),
`LlamaMLP` (gated MLP; the activation), `LlamaDecoderLayer`, and `LlamaForCausalLM`, whose
`make_layer` / `prepare` / `compute_logits` a family overrides.

Forward takes flat token batches: `input_ids` or `inputs_embeds` for the scheduled tokens of
all requests, `positions` for rotary embedding; attention reads its paged-cache metadata
from the forward context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.utils import kv_head_start
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm, ShardedRMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.quantization import gguf_blocks
from vllm.model_executor.layers.rotary_embedding import (
    MRotaryEmbedding,
    apply_rotary,
    rotary_embedding,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
    fused_lookups,
)
from vllm.model_executor.model_loader.weight_utils import PackedModulesMapping, load_weights
from vllm.model_executor.models.interfaces import FusedDecodeLayer, FusedDecodeSpec
from vllm.transformers_utils.config import head_dim_of, layer_sliding_windows, num_kv_heads_of
from vllm.v1.attention.backends.abstract import AttentionBackend

# Where q and k are RMS-normed before rope: each head on its own (Qwen3), or the whole
# projection (OLMo-2).
QKNorm = Literal["head", "projection"]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class LlamaAttention(nn.Module):
    """q/k/v projection, rotary, paged attention (with the layer's sliding window, if the
    config gives it one), output projection. `scale` defaults to head_dim ** -0.5."""

    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend],
                 qkv_bias: bool, *, qk_norm: QKNorm | None = None,
                 scale: float | None = None, logits_soft_cap: float | None = None,
                 clip_qkv: float | None = None) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = num_kv_heads_of(config)
        self.head_dim = head_dim_of(config)
        bias = qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads,
                                          total_kv_heads, bias=bias)
        # This rank's heads (all of them with one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False))
        self.sliding_window = layer_sliding_windows(config, config.num_hidden_layers)[layer_idx]
        self.attn = Attention(backend, layer_idx, self.num_heads, self.head_dim,
                              self.num_kv_heads, self.head_dim**-0.5 if scale is None else scale,
                              sliding_window=self.sliding_window,
                              logits_soft_cap=logits_soft_cap)
        self.qk_norm = qk_norm
        eps = config.rms_norm_eps
        if qk_norm == "head":
            self.q_norm: nn.Module = RMSNorm(self.head_dim, eps)
            self.k_norm: nn.Module = RMSNorm(self.head_dim, eps)
        elif qk_norm == "projection":
            tp, rank = self.qkv_proj.tp_size, self.qkv_proj.tp_rank
            self.q_norm = ShardedRMSNorm(total_heads * self.head_dim, self.q_size,
                                         rank * self.q_size, eps)
            kv_start = kv_head_start(total_kv_heads, tp, rank) * self.head_dim
            self.k_norm = ShardedRMSNorm(total_kv_heads * self.head_dim, self.kv_size,
                                         kv_start, eps, replicas=max(tp // total_kv_heads, 1))
        elif qk_norm is not None:
            raise ValueError(f"qk_norm must be 'head', 'projection' or None, got {qk_norm!r}")
        self.clip_qkv = clip_qkv  # q, k and v clamped to [-clip_qkv, clip_qkv] (OLMoE)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor],
                x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(cos_sin, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *,
                 hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"Unsupported hidden_act {hidden_act!r}; supported: "
                             f"{', '.join(ACTIVATIONS)}.")
        self.act = ACTIVATIONS[hidden_act]
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.intermediate_size = self.gate_up_proj.out_features // 2  # this rank's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals; a family may pass its own attention
    (`self_attn`, q/k norms) or feed-forward block (`mlp`, a mixture of experts)."""

    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend],
                 qkv_bias: bool, *, qk_norm: QKNorm | None = None,
                 scale: float | None = None, self_attn: nn.Module | None = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = (LlamaAttention(config, layer_idx, backend, qkv_bias, qk_norm=qk_norm,
                                         scale=scale) if self_attn is None else self_attn)
        self.mlp = (LlamaMLP(config.hidden_size, config.intermediate_size,
                             hidden_act=getattr(config, "hidden_act", "silu"),
                             bias=bool(getattr(config, "mlp_bias", False)))
                    if mlp is None else mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(cos_sin, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    supports_graph_capture = True
    # checkpoint projections -> the fused layer holding them, in order (`load_weights`)
    packed_modules_mapping: ClassVar[PackedModulesMapping] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.rotary = rotary_embedding(config, head_dim_of(config), max_model_len, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i, backend)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size,
            tied_to=self.embed_tokens if self.tie_word_embeddings else None)

    def make_layer(self, config, layer_idx: int, backend: type[AttentionBackend]) -> nn.Module:
        """One decoder layer: forward(cos_sin, h) -> h (every layer of a model alike)."""
        return LlamaDecoderLayer(config, layer_idx, backend, self.qkv_bias)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the final hidden states, [num_tokens, hidden_size]."""
        h, cos_sin = self.prepare(input_ids, positions, inputs_embeds)
        for layer in self.layers:
            h = layer(cos_sin, h)
        return self.finish(h)

    # The forward's pieces, compiled one by one by `graph_capture` (every layer shares
    # one graph): prepare -> layers -> finish.
    def prepare(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return h, self.rotary.lookup(positions)

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)  # model dtype: the sampler upcasts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face-named tensors in (q/k/v and gate/up into their fused layers, each
        rank its slice); returns the names of the parameters loaded."""
        skip = ["rotary_emb.inv_freq"]
        if self.tie_word_embeddings:
            skip.append("lm_head.weight")
        return load_weights(self, weights, self.packed_modules_mapping, skip=skip)

    def row_switch_tokens(self) -> int:
        return gguf_blocks.row_switch_tokens(self)

    def fused_decode_shape_reason(self) -> str | None:
        """Why the fused decoder cannot run this model whatever its weights (a family that
        overrides `forward`, `prepare` or `finish`, another norm or layer), else None. The
        loader asks before the weights are processed: such a model's GGUF Q4_0 / Q4_1 /
        Q8_0 layers are kept in the layout that decoder reads."""
        return self._fused_shape_reason(experts=False)

    def _fused_shape_reason(self, experts: bool) -> str | None:
        """As `fused_decode_shape_reason`; with `experts`, a layer's feed-forward block may
        also be one that describes itself to the fused decoder (`fused_decode_experts`)."""
        cls = type(self)
        if any(getattr(cls, name) is not getattr(LlamaForCausalLM, name)
               for name in ("forward", "prepare", "finish")):
            return f"{cls.__name__} is not a plain Llama-family decoder"
        if isinstance(self.rotary, MRotaryEmbedding):
            return "M-RoPE (three positions per token; the fused decoder takes one)"
        if type(self.norm) is not RMSNorm:
            return "final norm is not RMSNorm"
        for i, layer in enumerate(self.layers):
            if (type(layer) is not LlamaDecoderLayer
                    or type(layer.self_attn) is not LlamaAttention
                    or not (type(layer.mlp) is LlamaMLP or experts and callable(
                        getattr(layer.mlp, "fused_decode_experts", None)))):
                return f"layer {i} is not a plain Llama layer"
        return None

    def fused_decode_spec(self) -> FusedDecodeSpec | str:
        """This model as the fused CPU decoder runs it, where that computes exactly what
        the layers would: the plain forward (a family overriding `forward`, `prepare` or
        `finish` changes it), RMSNorms, plain `LlamaDecoderLayer`s (q/k norms per head
        included, as Qwen3's; q/k/v biases, as Qwen2's; a mixture of experts, as Qwen2/3-MoE's)
        on GGUF weights (see `fused_decode_layer`)."""
        reason = self._fused_shape_reason(experts=True)
        if reason is not None:
            return reason
        layers = []
        for i, layer in enumerate(self.layers):
            plain = cast(_PlainLayer, layer)
            described = fused_decode_layer(i, plain.self_attn, plain.mlp, [
                plain.input_layernorm, plain.post_attention_layernorm], RMSNorm, "silu")
            if isinstance(described, str):
                return described
            layers.append(described)
        attn = cast(_PlainLayer, self.layers[0]).self_attn
        cls = type(self)
        plain_lookup = cls.get_input_embeddings is LlamaForCausalLM.get_input_embeddings
        plain_head = cls.compute_logits is LlamaForCausalLM.compute_logits
        return FusedDecodeSpec(
            embed_tokens=self.embed_tokens, layers=layers, final_norm=self.norm.weight,
            final_norm_eps=self.norm.eps, ropes=[(self.rotary.cos, self.rotary.sin)],
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            lookups=fused_lookups(self.embed_tokens if plain_lookup else None,
                                  self.lm_head if plain_head else None))


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class _PlainAttention(LlamaAttention):
    """`LlamaAttention` as `fused_decode_spec` found it (the layer types its parts as
    modules)."""

    qkv_proj: QKVParallelLinear
    o_proj: RowParallelLinear
    attn: Attention


class _PlainLayer(LlamaDecoderLayer):
    self_attn: _PlainAttention
    mlp: LlamaMLP
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm


def fused_decode_layer(i: int, attn: _PlainAttention, mlp: nn.Module, norms: list[nn.Module],
                       norm_type: type[nn.Module], activation: str,
                       rope: int = 0) -> FusedDecodeLayer | str:
    """Layer `i` (its attention, MLP and norms in the fused decoder's order) as the fused
    decoder computes it, or why it cannot: q/k norms over the whole projection or clipping,
    attention its backend does not let it compute (`fused_decode_attention`), another
    activation or norm, a projection other than a one-rank quantized kernel, experts
    the decoder does not compute (`SparseMoeBlock.fused_decode_experts`)."""
    if attn.qk_norm == "projection" or attn.clip_qkv is not None:
        return f"layer {i} has q/k norms over the whole projection or clipping"
    attention = attn.attn.impl.fused_decode_attention()
    if attention is None:
        return f"layer {i}'s attention is not one its backend lets the fused decoder compute"
    experts = None
    if isinstance(mlp, LlamaMLP):
        if mlp.act is not ACTIVATIONS[activation]:
            return f"layer {i}'s activation is not {activation}"
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    else:
        experts = cast(Any, mlp).fused_decode_experts()
        if isinstance(experts, str):
            return f"layer {i}: {experts}"
        linears = [attn.qkv_proj, attn.o_proj]
    qk_norms = [attn.q_norm, attn.k_norm] if attn.qk_norm == "head" else []
    if not all(type(n) is norm_type for n in norms + qk_norms):
        return f"layer {i}'s norms are not {norm_type.__name__}"
    if len({float(cast(float, n.eps)) for n in norms + qk_norms}) != 1:
        return f"layer {i}'s norms' epsilons differ"
    weights = [linear.fused_decode_weights() for linear in linears]
    if any(w is None for w in weights):
        return f"layer {i} has a projection other than a one-rank GGUF or int8 kernel"
    return FusedDecodeLayer(
        norms=[cast(torch.Tensor, n.weight) for n in norms],
        projections=cast(list, weights), biases=[linear.bias for linear in linears],
        attention=attention, experts=experts,
        kv_cache_layer=attn.attn.layer_idx, norm_eps=float(cast(float, norms[0].eps)),
        qk_norms=[cast(torch.Tensor, n.weight) for n in qk_norms], rope=rope)
