"""OLMoE: Llama-style attention with RMSNorm over the whole query and key projections
(all heads together, before rotary), optional `clip_qkv`, and every layer a mixture of
`num_experts` experts (`intermediate_size` wide), top-k not renormalised unless
`norm_topk_prob`."""

from __future__ import annotations

import torch
from torch import nn

from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.distributed.utils import kv_head_start
from vllm.model_executor.layers.linear import set_weight_loader
from vllm.model_executor.layers.rotary_embedding import apply_rotary
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.moe import SparseMoeBlock
from vllm.v1.attention.backends.abstract import AttentionBackend


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector split across the tensor-parallel ranks: this rank holds
    `size` of its `total` entries from `start` (and their weights); the mean of squares is
    summed over the ranks. Example: total 8 over 2 ranks, rank 1 holds entries 4-7."""

    def __init__(self, total: int, start: int, size: int, eps: float, tp_size: int) -> None:
        super().__init__()
        self.total, self.start, self.eps, self.tp_size = total, start, eps, tp_size
        self.weight = set_weight_loader(nn.Parameter(torch.ones(size), requires_grad=False),
                                        self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id is not None or loaded.shape != (self.total,):
            raise ValueError(f"shape {tuple(loaded.shape)}, expected ({self.total},)")
        with torch.no_grad():
            param.copy_(loaded.narrow(0, self.start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.tp_size == 1:
            mean_square = h.pow(2).mean(-1, keepdim=True)
        else:
            mean_square = tensor_model_parallel_all_reduce(
                h.pow(2).sum(-1, keepdim=True)) / self.total
        return self.weight * (h * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


class WholeNormAttention(LlamaAttention):
    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend]) -> None:
        super().__init__(config, layer_idx, backend, qkv_bias=False)
        qkv, eps = self.qkv_proj, config.rms_norm_eps
        if qkv.tp_size > qkv.total_num_kv_heads:
            raise ValueError(f"OLMoE normalises all key heads together: "
                             f"{qkv.total_num_kv_heads} key/value heads cannot be split "
                             f"across tensor_parallel_size={qkv.tp_size}.")
        self.q_norm = ShardedRMSNorm(qkv.total_num_heads * self.head_dim,
                                     qkv.tp_rank * self.q_size, self.q_size, eps, qkv.tp_size)
        kv_start = kv_head_start(qkv.total_num_kv_heads, qkv.tp_size, qkv.tp_rank)
        self.k_norm = ShardedRMSNorm(qkv.total_num_kv_heads * self.head_dim,
                                     kv_start * self.head_dim, self.kv_size, eps, qkv.tp_size)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor],
                x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = apply_rotary(cos_sin, q.reshape(n, self.num_heads, self.head_dim),
                            k.reshape(n, self.num_kv_heads, self.head_dim))
        return self.o_proj(self.attn(q, k, v.reshape(n, self.num_kv_heads, self.head_dim)))


class OlmoeForCausalLM(LlamaForCausalLM):
    def build_layer(self, config, layer_idx: int, backend: type[AttentionBackend]
                    ) -> nn.Module:
        mlp = SparseMoeBlock(config.hidden_size, config.num_experts,
                             config.num_experts_per_tok, config.intermediate_size,
                             bool(config.norm_topk_prob))
        return LlamaDecoderLayer(config, layer_idx, backend, self.qkv_bias, mlp=mlp,
                                 self_attn=WholeNormAttention(config, layer_idx, backend))
