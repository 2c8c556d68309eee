"""LoRA beside the parallel linear layers: fixed slots of A and B per layer, and one batched
low-rank product for all rows of a step.

`LoRALinear` wraps a linear layer (after its weights are loaded and its kernel chosen). A
fused layer (q/k/v, gate/up) takes one adapter part per fused part. With `L = max_loras`
slots of `R = max_rank` columns, A is stacked part-major and B keeps each part's output
rows:

    lora_a  [P * L * R, in_features]   part p, slot s: rows (p * L + s) * R + [0, r)
    lora_b  [out_features, L * R]      part p's output rows (this rank's), slot s's
                                       columns s * R + [0, r); scaling folded in

so part p's product is `x A_p^T` (its `L * R` columns of `x lora_a^T`) times its own rows
of B (the CUDA path multiplies per part; the CPU op builds B block-diagonal by part over
the step's slots, one matmul: at 2 threads and these sizes the op count, not the
multiply-adds, sets the cost: 64 rows over 4 slots, summed over q/k/v, o, gate/up and down,
511 us block-diagonal vs 655 us a matmul per part). Ranks below `R` leave zero columns.
Tensor parallel shards A and B like the base layer: a column-parallel layer keeps B's rows
of its output slice (A whole), a row-parallel one A's columns of its input slice (B whole),
and its partial `x A^T` is all-reduced (n x P * L * R values) before B.

Every row of a step carries its adapter's slot in `LoRAState.indices` (-1: none), and a
one-hot mask keeps each row's own slot's columns:

    delta_p = ((x @ A_p^T) * (col_slot == indices[:, None])) @ B_p^T

Measured on the 2-core CPU we test on (one 576 -> 1536 layer, 4 slots of rank 16, float32):
1 / 8 / 64 / 256 rows took 23 / 58 / 2227 / 6828 us masked, against 4196 / 1904 / 20750 /
31938 us gathering each row's A and B by index for two bmm's (the gather copies
r x (in + out) values per row), and a loop over the active slots, gathering their rows, lost
to the mask at decode sizes too (bfloat16, 64 rows over 4 slots, the q/k/v layer: 333 vs
273 us; the per-slot matmuls are too small to run at speed).

Two ways to run it:
- CPU (eager and compiled graphs): the registered op `vllm::lora_delta`, opaque to the
  graph, so each step may use fewer columns than the graph's shapes hold: only the first
  `k` slots (`LoRAState.num_slots`, the highest slot the step uses rounded up to a power of
  two or `L`), with A and B of each `k` kept ready (`_Variant`: oneDNN-packed in bfloat16,
  as `PackedLinear`, so no call reorders them). The mask is built once per step
  (`LoRAState.mask`), not per layer. Per layer (eager, 64 rows, bfloat16, 2 threads, quiet)
  this took the product from 235 / 291 / 150 us (q/k/v, gate/up, down) to 144-182 /
  159-207 / 60-90 us; end to end (`benchmarks/benchmark_lora.py`) no gain showed, and one
  adapter still costs about what four do: the time in the compiled step is not where these
  per-layer measurements put it (not yet profiled).
- CUDA graphs: traced into the graph over all `L` slots (`indices` a graph input), since a
  CUDA graph cannot choose `k` per step.

Either way the graph's shapes do not depend on the mix of adapters: one graph serves every
mix. A step with no adapter rows skips the product (`LoRAState.active`; the CPU graphs keep
a compiled copy of each kind).
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.packed_linear import can_pack


class LoRAState:
    """The step's adapter of every row, shared by all LoRA layers of a model."""

    def __init__(self, max_num_tokens: int, max_loras: int, max_rank: int,
                 device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        # [max_num_tokens] int64: each scheduled token's slot, -1 for none (padding too).
        self.indices = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        # Whether any row of this step has an adapter (a step without skips the product).
        self.active = False
        # The slots the CPU product covers this step: the first `num_slots`.
        self.num_slots = max_loras
        self._masks: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}

    def set_step(self, highest_slot: int | None) -> None:
        """A new step's indices are written: `highest_slot` is the highest slot a row uses
        (None: no adapter row)."""
        self.active = highest_slot is not None
        self.num_slots = slot_count(highest_slot or 0, self.max_loras)
        self._masks.clear()

    def mask(self, n: int, dtype: torch.dtype, num_parts: int = 1) -> torch.Tensor:
        """[n, num_parts * num_slots * max_rank]: 1 where the column's slot is the row's
        (built once per step, row count and part count, for every layer).

        Example: max_rank 2, num_slots 2, indices [1, -1, 0], 1 part ->
        [[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]]; 2 parts: each row twice over.
        """
        mask = self._masks.get((n, dtype, num_parts))
        if mask is None:
            col_slot = torch.arange(self.num_slots * self.max_rank,
                                    device=self.indices.device) // self.max_rank
            mask = (self.indices[:n, None] == col_slot).to(dtype).repeat(1, num_parts)
            self._masks[(n, dtype, num_parts)] = mask
        return mask


def slot_counts(max_loras: int) -> list[int]:
    """The slot counts the CPU product keeps A and B ready for: powers of two below
    `max_loras`, and `max_loras`. Example: 4 -> [1, 2, 4]; 6 -> [1, 2, 4, 6]."""
    counts = [c for c in (2 ** i for i in range(max_loras.bit_length())) if c < max_loras]
    return [*counts, max_loras]


def slot_count(highest_slot: int, max_loras: int) -> int:
    """The smallest kept slot count covering slots 0..`highest_slot`.
    Example: max_loras 6: slot 0 -> 1, slot 2 -> 4, slot 4 -> 6."""
    return next(c for c in slot_counts(max_loras) if c > highest_slot)


class _Variant(NamedTuple):
    """A and each part's B over the first `k` slots, as the CPU product multiplies them
    (oneDNN-packed in bfloat16, plain tensors otherwise)."""

    lora_a: torch.Tensor  # [P * k * R, in_features]
    lora_b: torch.Tensor  # [out_features, P * k * R], block-diagonal by part


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


_ids = itertools.count()
_layers: weakref.WeakValueDictionary[int, LoRALinear] = weakref.WeakValueDictionary()


class LoRALinear(nn.Module):
    """A linear layer plus `max_loras` slots of LoRA A/B (see the module docstring).

    `parts`: the fused layer's shard ids in order (None for an unfused layer)."""

    lora_a: torch.Tensor  # [P * max_loras * max_rank, in_features]
    lora_b: torch.Tensor  # [out_features, max_loras * max_rank]
    col_slot: torch.Tensor  # [max_loras * max_rank] int64
    indices: torch.Tensor  # [max_num_tokens] int64, `LoRAState.indices`

    def __init__(self, base: LinearBase, parts: list[int | str | None], max_loras: int,
                 max_rank: int, state: LoRAState, dtype: torch.dtype) -> None:
        super().__init__()
        self.base_layer = base
        self.parts = parts
        self.max_loras, self.max_rank = max_loras, max_rank
        self.part_rows = part_rows(base, len(parts))
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
        # The CPU product's A and B per slot count, rebuilt after a slot changes.
        self.dynamic = device.type == "cpu"
        self.pack = can_pack(dtype, device)
        self._variants: dict[int, _Variant] = {}
        self.op_id = next(_ids)
        _layers[self.op_id] = self
        self.register_buffer("op_id_tensor", torch.tensor(self.op_id), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if not self.state.active:
            return y
        if not self.dynamic:
            return y + self.delta_all_slots(x)
        if torch.compiler.is_compiling():
            return y + torch.ops.vllm.lora_delta(x, self.op_id_tensor, y.shape[-1])
        return y + self.delta(x)

    def delta_all_slots(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's adapter product (zero for rows without one), [n, out_features], over
        all slots in traceable ops (what a CUDA graph holds)."""
        n, width = x.shape[0], self.max_loras * self.max_rank
        xa = F.linear(x, self.lora_a)
        if self.row_parallel:  # partial sums over this rank's input columns
            xa = tensor_model_parallel_all_reduce(xa)
        mask = (self.col_slot == self.indices[:n, None]).to(xa.dtype)
        xa = xa.view(n, len(self.parts), width) * mask[:, None, :]
        return torch.cat([F.linear(xa[:, p], self.lora_b[first:first + count])
                          for p, (first, count) in enumerate(self.part_rows)], dim=1)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The same product over the step's first `num_slots` slots (see the module
        docstring), [n, out_features]: two matmuls and the mask, whatever the parts."""
        k = self.state.num_slots
        variant = self._variants.get(k)
        if variant is None:
            variant = self._variants[k] = self._variant(k)
        linear = _packed_linear if self.pack else F.linear
        xa = linear(x, variant.lora_a)
        if self.row_parallel:
            xa = tensor_model_parallel_all_reduce(xa)
        return linear(xa * self.state.mask(x.shape[0], xa.dtype, len(self.parts)),
                      variant.lora_b)

    def _variant(self, k: int) -> _Variant:
        """A's rows of the first `k` slots, and B over them block-diagonal by part (at
        `k` slots the zeros cost less than a matmul per part). Example: 2 parts, 4 slots of
        rank 2, k 2: A rows [0, 4) (part 0, slots 0-1) and [8, 12) (part 1, slots 0-1); B
        [out, 8], part 0's rows in columns [0, 4), part 1's in [4, 8)."""
        num_parts, slots, rank = len(self.parts), self.max_loras, self.max_rank
        a = self.lora_a.view(num_parts, slots, rank, -1)[:, :k].reshape(num_parts * k * rank,
                                                                         -1)
        b = self.lora_b.new_zeros(self.lora_b.shape[0], num_parts * k * rank)
        for p, (first, count) in enumerate(self.part_rows):
            b[first:first + count, p * k * rank:(p + 1) * k * rank] = \
                self.lora_b[first:first + count, :k * rank]
        if not self.pack:
            return _Variant(a, b)
        pack = torch.ops.mkldnn._reorder_linear_weight
        return _Variant(pack(a.contiguous(), None), pack(b, None))

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]
                 ) -> None:
        """Writes one adapter into `slot`: per fused part, its (A [r, in], scaled B
        [out, r]) as the checkpoint has them (whole, every rank slicing its share), or None
        where the adapter leaves that part alone."""
        base, slots, rank = self.base_layer, self.max_loras, self.max_rank
        cols = slice(slot * rank, (slot + 1) * rank)
        self.lora_b[:, cols].zero_()
        for index, (shard_id, pair) in enumerate(zip(self.parts, parts, strict=True)):
            first = (index * slots + slot) * rank
            self.lora_a[first:first + rank].zero_()
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            if self.is_row:
                _, a = base.shard(a, shard_id, is_bias=False)
                offset = 0
            else:
                offset, b = base.shard(b, shard_id, is_bias=False)
            self.lora_a[first:first + r].copy_(a)
            self.lora_b[offset:offset + b.shape[0], slot * rank:slot * rank + r].copy_(b)
        self._variants.clear()  # rebuilt on their next use

    def extra_repr(self) -> str:
        return f"slots={self.max_loras}, max_rank={self.max_rank}, parts={self.parts}"


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")


# A `torch.library.Library` op, as `vllm::packed_linear` (cheaper to call than `custom_op`).
_lib = torch.library.Library("vllm", "FRAGMENT")
_lib.define("lora_delta(Tensor x, Tensor op_id, int out_features) -> Tensor")


def _lora_delta_op(x: torch.Tensor, op_id: torch.Tensor, out_features: int) -> torch.Tensor:
    return _layers[int(op_id)].delta(x)


_lib.impl("lora_delta", _lora_delta_op, "CompositeExplicitAutograd")


@torch.library.register_fake("vllm::lora_delta", lib=_lib)
def _(x: torch.Tensor, op_id: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)
