"""RMSNorm, computed in float32 like the Hugging Face reference; `ShardedRMSNorm` for a
vector split across tensor-parallel ranks."""

from __future__ import annotations

import torch
from torch import nn

from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import set_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector whose channels are split across tensor-parallel ranks (OLMo-2's
    q/k norm over the whole projection): each rank keeps the weight of its channels
    [start, start + local_size) and the sum of squares is all-reduced. Where `replicas`
    ranks hold the same channels (replicated KV heads) each counts 1 / replicas of them.
    On one rank it is `RMSNorm` exactly."""

    def __init__(self, full_size: int, local_size: int, start: int, eps: float = 1e-6,
                 replicas: int = 1) -> None:
        super().__init__()
        self.full_size, self.local_size, self.start = full_size, local_size, start
        self.replicas, self.eps = replicas, eps
        self.weight = set_weight_loader(nn.Parameter(torch.ones(local_size)),
                                        self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id is not None or tuple(loaded.shape) != (self.full_size,):
            raise ValueError(f"shape {tuple(loaded.shape)}, expected ({self.full_size},)")
        with torch.no_grad():
            param.copy_(loaded.narrow(0, self.start, self.local_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        if self.local_size == self.full_size:
            mean_square = h.pow(2).mean(-1, keepdim=True)
        else:
            partial = h.pow(2).sum(-1, keepdim=True) / self.replicas
            mean_square = tensor_model_parallel_all_reduce(partial) / self.full_size
        h = h * torch.rsqrt(mean_square + self.eps)
        return self.weight * h.to(dtype)
