"""LoRA beside the parallel linear layers: fixed slots of A and B per layer, and one batched
low-rank product for all rows of a step.

`LoRALinear` wraps a linear layer (after its weights are loaded and its kernel chosen). A
fused layer (q/k/v, gate/up) takes one adapter part per fused part. With `L = max_loras`
slots of `R = max_rank` columns, A is stacked part-major and B keeps each part's output
rows:

    lora_a  [P * L * R, in_features]   part p, slot s: rows (p * L + s) * R + [0, r)
    lora_b  [out_features, L * R]      part p's output rows (this rank's), slot s's
                                       columns s * R + [0, r); scaling folded in

Ranks below `R` leave zero rows and columns. Tensor parallel shards A and B like the base
layer: a column-parallel layer keeps B's rows of its output slice (A whole), a row-parallel
one A's columns of its input slice (B whole), and its partial `x A^T` is all-reduced
(n x P * L * R values) before B.

Every row of a step carries its adapter's slot in `LoRAState.indices` (-1: none). Two ways
to compute `delta[i] = B_s A_s x_i` (zero rows for -1), added to the base layer's output:

- CPU (eager and compiled graphs): the native kernel `vllm_cpu::lora_delta`
  (csrc/cpu/lora.cpp), one registered op per layer, which multiplies each row by its own
  slot's A and B only: rows grouped by slot, A and B kept packed for it (`a_packed`,
  `b_packed`, repacked when a slot changes), bfloat16 on AVX512-BF16's dot product, float32
  on FMAs. Per layer of the default model (64 rows over 4 slots of rank 16, bfloat16, one
  thread, loaded machine) it took 169 us against 702 us for the masked dense product this
  replaced (`x A^T` over all slots' columns, masked to each row's slot, times B
  block-diagonal by part, two oneDNN matmuls): that product multiplied every row by every
  slot (4x the shrink's work, 12x the expand's on q/k/v) and read ~1.5x the bytes. Bytes
  matter most inside a step: the base layers' weights (7 MB a layer) evict the adapters'
  between two calls, and with the caches flushed the same layer took 712 us against
  1,923 us, which is why the old product cost 2-3x its isolated timings in the step.
- Elsewhere (CUDA graphs, float16, a CPU without AVX-512, a row-parallel layer under
  tensor parallel, whose `x A^T` must be all-reduced between the two products):
  `delta_all_slots`, traceable ops over all `L` slots with a one-hot mask,

      delta_p = ((x @ A_p^T) * (col_slot == indices[:, None])) @ B_p^T

Either way the graph's shapes do not depend on the mix of adapters (the indices are an
input): one graph serves every mix. A step with no adapter rows skips the product
(`LoRAState.active`; the CPU graphs keep a compiled copy of each kind).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm._custom_ops import native_ops
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

LANES = 16  # the native kernel's vector width: ranks and outputs are padded to it


class LoRAState:
    """The step's adapter of every row, shared by all LoRA layers of a model."""

    def __init__(self, max_num_tokens: int, max_loras: int, max_rank: int,
                 device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        # [max_num_tokens] int64: each scheduled token's slot, -1 for none (padding too).
        self.indices = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        # Whether any row of this step has an adapter (a step without skips the product).
        self.active = False


def part_rows(base: LinearBase, num_parts: int) -> list[tuple[int, int]]:
    """(first, count) of each fused part's output rows on this rank.
    Example: q/k/v with q 64 and k, v 32 rows each -> [(0, 64), (64, 32), (96, 32)]."""
    if isinstance(base, QKVParallelLinear):
        q, kv = base.q_size, base.kv_size
        return [(0, q), (q, kv), (q + kv, kv)]
    if isinstance(base, MergedColumnParallelLinear):
        sizes = [s // base.tp_size for s in base.output_sizes]
        return [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]
    assert num_parts == 1, f"{type(base).__name__} has no fused parts"
    return [(0, base.out_features)]


def native_kernel_step(dtype: torch.dtype, device: torch.device, in_features: int
                       ) -> int | None:
    """Inputs per packed step of the native kernel (2: bfloat16 pairs, 1: float32), or None
    where it does not run (not CPU, another dtype, no AVX-512, native kernels off)."""
    step = {torch.bfloat16: 2, torch.float32: 1}.get(dtype)
    if step is None or in_features % step:
        return None
    ops = native_ops(device)
    return step if ops is not None and ops.lora_kernel_available() else None


def pack_slot_a(a: torch.Tensor, padded_rank: int, step: int) -> torch.Tensor:
    """One slot's A of every part, [P, R, in] -> the kernel's [P, in / step,
    padded_rank * step]: for each step of `step` inputs, lane j holds row j's.
    Example: step 2, A [1, 2, 4] = [[a0 a1 a2 a3], [b0 b1 b2 b3]], padded_rank 16 ->
    [[[a0 a1 b0 b1 0 ...], [a2 a3 b2 b3 0 ...]]] (1 x 2 x 32)."""
    parts, rank, in_features = a.shape
    a = F.pad(a, (0, 0, 0, padded_rank - rank))
    return (a.view(parts, padded_rank, in_features // step, step).transpose(1, 2)
            .reshape(parts, in_features // step, padded_rank * step))


def pack_slot_b(b: torch.Tensor, padded_rank: int, step: int) -> torch.Tensor:
    """One slot's B, [out, R] -> the kernel's [ceil(out / 16), padded_rank / step,
    16 * step]: for each block of 16 outputs and step of `step` ranks, lane o holds output
    o's (outputs past `out` zero)."""
    out, rank = b.shape
    blocks = -(-out // LANES)
    b = F.pad(b, (0, padded_rank - rank, 0, blocks * LANES - out))
    return (b.view(blocks, LANES, padded_rank // step, step).transpose(1, 2)
            .reshape(blocks, padded_rank // step, LANES * step))


class LoRALinear(nn.Module):
    """A linear layer plus `max_loras` slots of LoRA A/B (see the module docstring).

    `parts`: the fused layer's shard ids in order (None for an unfused layer)."""

    lora_a: torch.Tensor  # [P * max_loras * max_rank, in_features]
    lora_b: torch.Tensor  # [out_features, max_loras * max_rank]
    col_slot: torch.Tensor  # [max_loras * max_rank] int64
    indices: torch.Tensor  # [max_num_tokens] int64, `LoRAState.indices`
    # The native kernel's (CPU): see pack_slot_a / pack_slot_b.
    a_packed: torch.Tensor  # [P, max_loras, in / step, padded rank * step]
    b_packed: torch.Tensor  # [max_loras, ceil(out / 16), padded rank / step, 16 * step]
    slot_ranks: torch.Tensor  # [max_loras] int64: each slot's rank in this layer (0: none)

    def __init__(self, base: LinearBase, parts: list[int | str | None], max_loras: int,
                 max_rank: int, state: LoRAState, dtype: torch.dtype) -> None:
        super().__init__()
        self.base_layer = base
        self.parts = parts
        self.max_loras, self.max_rank = max_loras, max_rank
        self.part_rows = part_rows(base, len(parts))
        self.part_bounds = [first for first, _ in self.part_rows] + [base.out_features]
        self.row_parallel = isinstance(base, RowParallelLinear) and base.tp_size > 1
        self.is_row = isinstance(base, RowParallelLinear)
        device = state.indices.device
        self.state = state
        self.register_buffer("lora_a", torch.zeros(len(parts) * max_loras * max_rank,
                                                   base.in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(base.out_features, max_loras * max_rank,
                                                   dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("col_slot", torch.arange(max_loras * max_rank, device=device)
                             // max_rank, persistent=False)
        self.register_buffer("indices", state.indices, persistent=False)
        self.step = (None if self.row_parallel
                     else native_kernel_step(dtype, device, base.in_features))
        if self.step is not None:
            step, padded = self.step, -(-max_rank // LANES) * LANES
            self.register_buffer("a_packed", torch.zeros(
                len(parts), max_loras, base.in_features // step, padded * step, dtype=dtype,
                device=device), persistent=False)
            self.register_buffer("b_packed", torch.zeros(
                max_loras, -(-base.out_features // LANES), padded // step, LANES * step,
                dtype=dtype, device=device), persistent=False)
            self.register_buffer("slot_ranks", torch.zeros(max_loras, dtype=torch.int64,
                                                           device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if not self.state.active:
            return y
        return y + self.delta(x)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's adapter product (zero for rows without one), [n, out_features]."""
        if self.step is None:
            return self.delta_all_slots(x)
        return torch.ops.vllm_cpu.lora_delta(x, self.indices, self.slot_ranks, self.a_packed,
                                             self.b_packed, self.part_bounds)

    def delta_all_slots(self, x: torch.Tensor) -> torch.Tensor:
        """The same product over all slots in traceable ops (what a CUDA graph holds)."""
        n, width = x.shape[0], self.max_loras * self.max_rank
        xa = F.linear(x, self.lora_a)
        if self.row_parallel:  # partial sums over this rank's input columns
            xa = tensor_model_parallel_all_reduce(xa)
        mask = (self.col_slot == self.indices[:n, None]).to(xa.dtype)
        xa = xa.view(n, len(self.parts), width) * mask[:, None, :]
        return torch.cat([F.linear(xa[:, p], self.lora_b[first:first + count])
                          for p, (first, count) in enumerate(self.part_rows)], dim=1)

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]
                 ) -> None:
        """Writes one adapter into `slot`: per fused part, its (A [r, in], scaled B
        [out, r]) as the checkpoint has them (whole, every rank slicing its share), or None
        where the adapter leaves that part alone."""
        base, slots, rank = self.base_layer, self.max_loras, self.max_rank
        cols = slice(slot * rank, (slot + 1) * rank)
        self.lora_b[:, cols].zero_()
        slot_rank = 0
        for index, (shard_id, pair) in enumerate(zip(self.parts, parts, strict=True)):
            first = (index * slots + slot) * rank
            self.lora_a[first:first + rank].zero_()
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            slot_rank = max(slot_rank, r)
            if self.is_row:
                _, a = base.shard(a, shard_id, is_bias=False)
                offset = 0
            else:
                offset, b = base.shard(b, shard_id, is_bias=False)
            self.lora_a[first:first + r].copy_(a)
            self.lora_b[offset:offset + b.shape[0], slot * rank:slot * rank + r].copy_(b)
        if self.step is not None:
            padded = self.b_packed.shape[2] * self.step
            a = self.lora_a.view(len(self.parts), slots, rank, -1)[:, slot]
            self.a_packed[:, slot] = pack_slot_a(a, padded, self.step)
            self.b_packed[slot] = pack_slot_b(self.lora_b[:, cols], padded, self.step)
            self.slot_ranks[slot] = slot_rank

    def extra_repr(self) -> str:
        return f"slots={self.max_loras}, max_rank={self.max_rank}, parts={self.parts}"
