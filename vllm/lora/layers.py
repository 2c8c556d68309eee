"""LoRA beside the parallel linear layers: fixed slots of stacked A and B per layer, and one
batched low-rank product for all rows of a step.

`LoRALinear` wraps a linear layer (after its weights are loaded and its kernel chosen). A
fused layer (q/k/v, gate/up) takes one adapter part per fused part, so a slot is `P`
parts of `max_rank` columns each (`width = P * max_rank`), stacked slot after slot:

    lora_a  [max_loras * width, in_features]    slot s, part p: rows s*width + p*R + [0, r)
    lora_b  [out_features, max_loras * width]   part p's output rows (this rank's), the same
                                                columns; scaling folded in, other parts 0

A fused layer's B is block-diagonal: part p's columns feed only part p's output rows, so
`x A^T B^T` gives each part its own low-rank product. Ranks below `max_rank` leave zero
columns. Tensor parallel shards A and B like the base layer: a column-parallel layer keeps
B's rows of its output slice (A whole), a row-parallel one A's columns of its input slice
(B whole), and its partial `x A^T` is all-reduced (n x slots*width values) before B.

Every row of a step carries its adapter's slot in `LoRAState.indices` (-1: none), the same
tensor for every layer and a graph input, so a captured graph serves any mix of adapters:

    delta = ((x @ lora_a^T) * (col_slot == indices[:, None])) @ lora_b^T

The one-hot mask keeps each row's own slot's columns. Measured on the 2-core CPU we test on
(one 576 -> 1536 layer, 4 slots of rank 16, float32): 1 / 8 / 64 / 256 rows took
23 / 58 / 2227 / 6828 us masked, against 4196 / 1904 / 20750 / 31938 us gathering each
row's A and B by index for two bmm's (the gather copies r x (in + out) values per row) and
148 / 2253 / 2904 / 5097 us looping over the active slots (data-dependent shapes, which a
static graph cannot hold). The masked product wins everywhere a step is decode-sized and
keeps graph shapes static. A step with no adapter rows skips it (`LoRAState.active`; the
CPU graphs keep a compiled copy of each kind).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import LinearBase, RowParallelLinear


class LoRAState:
    """The step's adapter of every row, shared by all LoRA layers of a model."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        # [max_num_tokens] int64: each scheduled token's slot, -1 for none (padding too).
        self.indices = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        # Whether any row of this step has an adapter (a step without skips the product).
        self.active = False


class LoRALinear(nn.Module):
    """A linear layer plus `max_loras` slots of LoRA A/B (see the module docstring).

    `parts`: the fused layer's shard ids in order (None for an unfused layer)."""

    lora_a: torch.Tensor  # [max_loras * width, in_features]
    lora_b: torch.Tensor  # [out_features, max_loras * width]
    col_slot: torch.Tensor  # [max_loras * width] int64
    indices: torch.Tensor  # [max_num_tokens] int64, `LoRAState.indices`

    def __init__(self, base: LinearBase, parts: list[int | str | None], max_loras: int,
                 max_rank: int, state: LoRAState, dtype: torch.dtype) -> None:
        super().__init__()
        self.base_layer = base
        self.parts = parts
        self.max_loras, self.max_rank = max_loras, max_rank
        self.width = len(parts) * max_rank
        self.row_parallel = isinstance(base, RowParallelLinear) and base.tp_size > 1
        self.is_row = isinstance(base, RowParallelLinear)
        device = state.indices.device
        cols = max_loras * self.width
        self.state = state
        self.register_buffer("lora_a", torch.zeros(cols, base.in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(base.out_features, cols, dtype=dtype,
                                                   device=device), persistent=False)
        # [cols] the slot each column belongs to
        self.register_buffer("col_slot", torch.arange(cols, device=device) // self.width,
                             persistent=False)
        self.register_buffer("indices", state.indices, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if not self.state.active:
            return y
        return y + self.delta(x)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's adapter product (zero for rows without one), [n, out_features]."""
        xa = F.linear(x, self.lora_a)
        if self.row_parallel:  # partial sums over this rank's input columns
            xa = tensor_model_parallel_all_reduce(xa)
        mask = self.col_slot == self.indices[:x.shape[0], None]
        return F.linear(xa * mask.to(xa.dtype), self.lora_b)

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]
                 ) -> None:
        """Writes one adapter into `slot`: per fused part, its (A [r, in], scaled B
        [out, r]) as the checkpoint has them (whole, every rank slicing its share), or None
        where the adapter leaves that part alone."""
        base, width, rank_cols = self.base_layer, self.width, self.max_rank
        first = slot * width
        self.lora_a[first:first + width].zero_()
        self.lora_b[:, first:first + width].zero_()
        for index, (shard_id, pair) in enumerate(zip(self.parts, parts, strict=True)):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            col = first + index * rank_cols
            if self.is_row:
                _, a = base.shard(a, shard_id, is_bias=False)
                offset = 0
            else:
                offset, b = base.shard(b, shard_id, is_bias=False)
            self.lora_a[col:col + r].copy_(a)
            self.lora_b[offset:offset + b.shape[0], col:col + r].copy_(b)

    def extra_repr(self) -> str:
        return f"slots={self.max_loras}, max_rank={self.max_rank}, parts={self.parts}"
