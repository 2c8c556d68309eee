"""`FusedMoE`: every expert of one mixture-of-experts layer, with vLLM's name and stacked
weights, and the step's routing and dispatch.

    w13_weight [E, 2 * I, H]   each expert's gate (rows :I) and up (rows I:) projections
    w2_weight  [E, H, I]       each expert's down projection

Under tensor parallel every rank holds every expert, sliced by the intermediate size
(rank r: gate/up rows and down columns [r * I/tp, (r+1) * I/tp)); the ranks' partial
outputs are summed by one all-reduce after the combine.

A step (T tokens, top-k of E experts):

    router logits [T, E] --softmax, top-k, renormalise?--> weights [T, k], ids [T, k]
    group: the T*k (token, slot) rows sorted by expert id (stable), e.g. k=2,
        ids [[3, 0], [0, 5]] -> flat [3, 0, 0, 5] -> order [1, 2, 0, 3]
        -> tokens of the sorted rows [0, 1, 0, 1], rows per expert e0: 2, e3: 1, e5: 1
    each active expert multiplies its contiguous rows (gate/up, SiLU x up, down),
    the rows go back to (token, slot) order and each token sums its k rows scaled by
    their routing weights (a scatter and a sum: ~3x faster than `index_add_` into the
    tokens, which also costs a one-off ~15 ms on its first calls).

How the experts multiply is a kernel chosen after loading. Where the native kernels are
built, one call does all of it (`NativeExpertKernel`, `torch.ops.vllm_cpu.moe_experts`:
grouping, each active expert's gate/up with SiLU fused and its down product over tiles of
columns spread across threads, and the combine), with the weights in float32, bfloat16,
GGUF blocks as the file stores them, or Q8_0 blocks for `quantization="int8"`. Elsewhere a
Python loop over the active experts runs one product each (`ExpertKernel` and its
bfloat16-packed and int8 forms; `benchmarks/benchmark_models.py --moe-dispatch` measured
the alternatives).

The dispatch is data dependent (which experts, how many rows each), so compiled graphs
call it through the registered op `vllm::fused_experts`, which finds the layer by a tensor
id as `vllm::packed_linear` does; routing (softmax, top-k) stays in the graph.
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    tensor_model_parallel_all_reduce,
)
from vllm.distributed.utils import divide
from vllm.model_executor.layers.linear import set_weight_loader
from vllm.model_executor.layers.quantization.gguf_blocks import GGUFBlocks, quantize_q8_0
from vllm.model_executor.layers.quantization.int8 import (
    dequantize_output,
    quantize_per_channel,
    quantize_per_token,
)

# checkpoint projection -> its part of the stacked weights (Qwen-MoE/OLMoE and Mixtral names)
EXPERT_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
                "w1": "w1", "w3": "w3", "w2": "w2"}

# An expert's part: (expert, "w1" gate | "w3" up | "w2" down).
ShardId = int | str | tuple[int, str]

_ids = itertools.count()
_layers: weakref.WeakValueDictionary[int, FusedMoE] = weakref.WeakValueDictionary()


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) over the experts, the top `top_k`, optionally renormalised to sum
    to 1 (Mixtral always; Qwen-MoE with `norm_topk_prob`; OLMoE not): (weights [T, k] in
    the logits' dtype, expert ids [T, k] int64).

    Example: logits [0, ln 3, ln 2, ln 4] (probs .1 .3 .2 .4), k=2 -> ids [3, 1],
    weights [.4, .3], renormalised [.571, .429].
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class ExpertGroups(NamedTuple):
    """The step's (token, slot) rows sorted by expert (see the module docstring)."""

    order: torch.Tensor  # [T*k] int64: flat (token, slot) index of each sorted row
    tokens: torch.Tensor  # [T*k] int64: the token of each sorted row
    spans: list[tuple[int, int, int]]  # (expert, first row, end row) of each active expert


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sorts the rows by expert id, stable (a token's rows for one expert keep token
    order); the spans list only the experts that got rows."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    spans, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            spans.append((expert, start, start + count))
            start += count
    return ExpertGroups(order, order // topk_ids.shape[1], spans)


class ExpertKernel:
    """How the active experts multiply their rows: `w13(x, groups)` [rows, 2I] and
    `w2(a, groups)` [rows, H] over the sorted rows.

    Measured (`benchmarks/benchmark_models.py --moe-dispatch`: 64 experts top-8, hidden
    1024, intermediate 512, one thread of a shared 2-core AVX-512 CPU, median ms; read the
    ratios, other jobs were running):

        tokens  dtype  grouped_mm  gather+bmm  all experts  loop   loop packed  loop int8
        1       fp32   12.3        78          93           12.2   -            6.6
        64      fp32   174         7146        543          176    -            72
        256     fp32   379         -           1742         272    -            156
        1       bf16   7.7         20          67           7.5    6.8          6.9
        64      bf16   81          3334        292          108    71           75
        256     bf16   177         -           875          182    144          139

    A step is memory bound on the active experts' weights until a few hundred tokens, so
    what counts is reading each active expert's weights once: the per-expert loop and
    `torch._grouped_mm` (which exists for CPU and takes the same sorted rows) do, and tie
    in float32; gathering each row's expert weights (`bmm`) copies k matrices a token, and
    running every expert reads all E. In bfloat16, `F.linear` reorders
    each weight into oneDNN's layout on every call; weights packed once at load (one per
    expert, as `PackedLinear`) beat both. int8 reads a quarter of float32's bytes.
    """

    reduces = False  # whether the products are already summed over the ranks

    def __init__(self, layer: FusedMoE) -> None:
        self.w13_weight, self.w2_weight = layer.w13_weight.data, layer.w2_weight.data
        self.num_experts, self.intermediate_size = layer.num_experts, layer.intermediate_size

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                ) -> torch.Tensor:
        """The experts' weighted sum for each token (this rank's part), [T, H]."""
        groups = group_by_expert(topk_ids, self.num_experts)
        h = self.w13(x[groups.tokens], groups)
        a = F.silu(h[:, :self.intermediate_size]) * h[:, self.intermediate_size:]
        y = self.w2(a, groups)
        rows = torch.empty_like(y)
        rows[groups.order] = y  # [T*k, H] in (token, slot) order
        return (rows.view(*topk_ids.shape, -1) * topk_weights[..., None]).sum(dim=1)

    def w13(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return self._loop(x, groups, self.w13_weight)

    def w2(self, a: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return self._loop(a, groups, self.w2_weight)

    @staticmethod
    def _loop(x: torch.Tensor, groups: ExpertGroups, weight: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], weight.shape[1])
        for expert, start, end in groups.spans:
            torch.mm(x[start:end], weight[expert].t(), out=out[start:end])
        return out


class PackedExpertKernel(ExpertKernel):
    """bfloat16 experts, each weight reordered once into oneDNN's layout (`PackedLinear`)."""

    def __init__(self, layer: FusedMoE) -> None:
        super().__init__(layer)
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.w13_packed = [reorder(w, None) for w in layer.w13_weight.data]
        self.w2_packed = [reorder(w, None) for w in layer.w2_weight.data]
        self.w13_rows, self.w2_rows = layer.w13_weight.shape[1], layer.w2_weight.shape[1]

    def w13(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return self._packed_loop(x, groups, self.w13_packed, self.w13_rows)

    def w2(self, a: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return self._packed_loop(a, groups, self.w2_packed, self.w2_rows)

    @staticmethod
    def _packed_loop(x: torch.Tensor, groups: ExpertGroups, packed: list[torch.Tensor],
                     rows: int) -> torch.Tensor:
        out = x.new_empty(x.shape[0], rows)
        for expert, start, end in groups.spans:
            out[start:end] = torch.ops.mkldnn._linear_pointwise(
                x[start:end], packed[expert], None, "none", [], "")
        return out


class Int8ExpertKernel(ExpertKernel):
    """int8 experts: per expert and output channel weights, activations per row (`Int8Linear`'s
    scheme; a row is one token's, so its scale is the token's). Under tensor parallel the
    down projection is a row-parallel shard: weights scale by their whole rows' absmax, each
    row's activations by the whole row's (one max-reduce), and the int32 accumulators are
    summed over the ranks before scaling, so the result equals one rank's."""

    def __init__(self, layer: FusedMoE) -> None:
        super().__init__(layer)
        self.group = get_tp_group() if layer.tp_size > 1 else None
        self.reduces = self.group is not None
        self.w13_t, self.w13_scale = self._quantize(layer.w13_weight.data, None)
        self.w2_t, self.w2_scale = self._quantize(layer.w2_weight.data, self.group)
        self.dtype = layer.w13_weight.dtype

    @staticmethod
    def _quantize(weight: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, N, K] -> (int8 [E, K, N], float32 scales [E, N])."""
        absmax = weight.float().abs().amax(dim=2)
        if group is not None:
            absmax = group.all_reduce_max(absmax)
        pairs = [quantize_per_channel(w, m) for w, m in zip(weight, absmax)]
        return (torch.stack([q.t().contiguous() for q, _ in pairs]),
                torch.stack([s for _, s in pairs]))

    def w13(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return self._int8_loop(x, groups, self.w13_t, self.w13_scale, None)

    def w2(self, a: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return self._int8_loop(a, groups, self.w2_t, self.w2_scale, self.group)

    def _int8_loop(self, x: torch.Tensor, groups: ExpertGroups, weight_t: torch.Tensor,
                   scale: torch.Tensor, group) -> torch.Tensor:
        absmax = None
        if group is not None:
            absmax = group.all_reduce_max(x.float().abs().amax(dim=-1, keepdim=True))
        x_q, x_scale = quantize_per_token(x, absmax)
        acc = torch.empty(x.shape[0], weight_t.shape[2], dtype=torch.int32)
        for expert, start, end in groups.spans:
            # torch exports `_int_mm` at run time; its stubs do not list it.
            acc[start:end] = torch._int_mm(  # pyright: ignore[reportPrivateImportUsage]
                x_q[start:end], weight_t[expert])
        if group is not None:
            acc = group.all_reduce(acc)
        out = torch.empty(x.shape[0], weight_t.shape[2], dtype=self.dtype)
        for expert, start, end in groups.spans:
            out[start:end] = dequantize_output(acc[start:end], x_scale[start:end],
                                               scale[expert], self.dtype)
        return out


# ggml's type ids of the weights `moe_experts` reads: dense rows, and Q8_0 (int8)
_F32, _BF16, _Q8_0 = 0, 30, 8


class NativeExpertKernel:
    """All of a step's experts in one native call (`torch.ops.vllm_cpu.moe_experts`, see
    csrc/cpu/moe.cpp): gate `w1` and up `w3` [E, I, ...] and down `w2` [E, H, ...] of this
    rank, each as float32 or bfloat16 rows or GGUF blocks (uint8 rows) of a ggml type
    (`types`: w1's, w3's, w2's). `forward` as `ExpertKernel`'s; the ranks' outputs are
    summed by the layer."""

    reduces = False

    def __init__(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                 types: tuple[int, int, int]) -> None:
        self.weights = (w1, w3, w2)
        self.types = types

    @staticmethod
    def dense_type(dtype: torch.dtype) -> int | None:
        """The type id of dense weights in `dtype`, None where the op does not read it."""
        return {torch.float32: _F32, torch.bfloat16: _BF16}.get(dtype)

    @property
    def reads_blocks(self) -> bool:
        """Whether every weight is GGUF blocks (none dense)."""
        return all(t not in (_F32, _BF16) for t in self.types)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                ) -> torch.Tensor:
        return torch.ops.vllm_cpu.moe_experts(x, topk_weights, topk_ids, *self.weights,
                                              *self.types)


def native_experts_available() -> bool:
    """Whether the native `moe_experts` op was built on this machine."""
    from vllm._custom_ops import cpu_ops

    ops = cpu_ops()
    return ops is not None and ops.moe_experts_available()


class FusedMoE(nn.Module):
    """The experts of one MoE layer (`w13_weight`, `w2_weight` of this rank) and their
    routing: `forward(x, router_logits)` -> the weighted sum of each token's top-k experts'
    outputs, [T, H], summed over the ranks."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, renormalize: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and the number of experts "
                             f"({num_experts})")
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        self.intermediate_size = divide(intermediate_size, self.tp_size,
                                        "expert intermediate size")  # this rank's
        self.w13_weight = set_weight_loader(nn.Parameter(
            torch.empty(num_experts, 2 * self.intermediate_size, hidden_size),
            requires_grad=False), self.weight_loader)
        self.w2_weight = set_weight_loader(nn.Parameter(
            torch.empty(num_experts, hidden_size, self.intermediate_size),
            requires_grad=False), self.weight_loader)
        # set by process_weights_after_loading
        self.kernel: ExpertKernel | NativeExpertKernel | None = None
        # GGUF blocks of the experts' projections as loaded: part -> expert -> blocks
        self.block_codes: dict[str, dict[int, GGUFBlocks]] = {}
        self.op_id = next(_ids)
        _layers[self.op_id] = self
        self.register_buffer("op_id_tensor", torch.tensor(self.op_id), persistent=False)

    def _check_shard(self, shard_id: ShardId | None) -> tuple[int, str]:
        if not (isinstance(shard_id, tuple) and shard_id[1] in ("w1", "w2", "w3")
                and 0 <= shard_id[0] < self.num_experts):
            raise ValueError(f"an expert weight needs (expert < {self.num_experts}, 'w1' | "
                             f"'w2' | 'w3'), got {shard_id!r}")
        return shard_id

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | tuple[int, str] | None = None) -> None:
        """One expert's checkpoint projection: `shard_id` (expert, "w1" gate | "w3" up |
        "w2" down); this rank's slice of its intermediate size.

        Example: I = 8 on 2 ranks, rank 1: gate rows 4-7 -> w13[e, 0:4], up rows 4-7 ->
        w13[e, 4:8], down columns 4-7 -> w2[e].
        """
        expert, part = self._check_shard(shard_id)
        size = self.intermediate_size
        if part == "w2":
            target, piece = param[expert], loaded.narrow(1, self.tp_rank * size, size)
        else:
            offset = 0 if part == "w1" else size
            target = param[expert, offset:offset + size]
            piece = loaded.narrow(0, self.tp_rank * size, size)
        if tuple(target.shape) != tuple(piece.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} gives {tuple(piece.shape)} on rank "
                             f"{self.tp_rank}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(piece)

    def add_block_codes(self, blocks: GGUFBlocks, shard_id: ShardId | None) -> None:
        """One expert's projection as a GGUF file stores it (`shard_id` as for
        `weight_loader`), kept in its block type: this rank's slice (the down projection's
        columns in whole blocks)."""
        expert, part = self._check_shard(shard_id)
        size = self.intermediate_size
        if part == "w2":
            piece, expected = blocks.narrow(1, self.tp_rank * size, size), (self.hidden_size, size)
        else:
            piece, expected = blocks.narrow(0, self.tp_rank * size, size), (size, self.hidden_size)
        if piece.shape != expected:
            raise ValueError(f"shape {blocks.shape} gives {piece.shape} on rank "
                             f"{self.tp_rank}, expected {expected}")
        self.block_codes.setdefault(part, {})[expert] = piece

    def process_weights_after_loading(self, quantization: str | None, pack: bool) -> str:
        """Picks the experts' kernel; returns its name, as `LinearBase` does. With the native
        op: GGUF blocks as loaded, int8 as Q8_0 blocks, float32 and bfloat16 as they are;
        without it, the Python loop (int8 per output channel, oneDNN-packed bfloat16 when
        `pack`, else dense)."""
        native = native_experts_available()
        if self.block_codes:
            if not native:
                raise ValueError("GGUF blocks of experts need the native moe_experts kernel "
                                 "(AVX2 with FMA and F16C); load the file without "
                                 "quantization='gguf' to dequantize them")
            self.kernel = self._gguf_kernel()
            self._drop_dense()
            return "gguf experts"
        size = self.intermediate_size
        if quantization == "int8":
            # Q8_0 blocks of 32 along the hidden and this rank's intermediate size; a rank
            # whose slice is not whole blocks keeps the loop, whose int8 sums over the
            # ranks equal one rank's exactly (padding the slice would change the blocks).
            if native and self.hidden_size % 32 == 0 and size % 32 == 0:
                w13 = self.w13_weight.data
                gate, up, down = (torch.stack([quantize_q8_0(w) for w in part])
                                  for part in (w13[:, :size], w13[:, size:], self.w2_weight.data))
                self.kernel = NativeExpertKernel(gate, up, down, (_Q8_0, _Q8_0, _Q8_0))
                self._drop_dense()
                return "int8 experts (Q8_0 blocks, native)"
            self.kernel = Int8ExpertKernel(self)
            self._drop_dense()  # the int8 copies replace them
            return "int8 experts"
        dense = NativeExpertKernel.dense_type(self.w13_weight.dtype)
        if native and dense is not None:
            w13 = self.w13_weight.data
            self.kernel = NativeExpertKernel(w13[:, :size], w13[:, size:], self.w2_weight.data,
                                             (dense, dense, dense))
            return f"{str(self.w13_weight.dtype).removeprefix('torch.')} experts (native)"
        if pack:
            self.kernel = PackedExpertKernel(self)
            return "packed experts"
        self.kernel = ExpertKernel(self)
        return "dense experts"

    def _gguf_kernel(self) -> NativeExpertKernel:
        stacked, types = [], []
        for part in ("w1", "w3", "w2"):
            experts = self.block_codes.get(part, {})
            missing = [e for e in range(self.num_experts) if e not in experts]
            if missing:
                raise ValueError(f"GGUF blocks of experts {missing[:8]} lack their {part} part")
            kinds = {experts[e].type_name for e in range(self.num_experts)}
            if len(kinds) != 1:
                raise ValueError(f"the experts' {part} parts mix block types {sorted(kinds)}")
            stacked.append(torch.from_numpy(np.stack(
                [experts[e].data for e in range(self.num_experts)])))
            types.append(experts[0].type_id)
        self.block_codes = {}
        return NativeExpertKernel(stacked[0], stacked[1], stacked[2],
                                  (types[0], types[1], types[2]))

    def _drop_dense(self) -> None:
        for param in (self.w13_weight, self.w2_weight):
            param.data = param.data.new_empty(0)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if torch.compiler.is_compiling():
            out = torch.ops.vllm.fused_experts(x, weights, ids, self.op_id_tensor)
        else:
            out = self.run(x, weights, ids)
        if self.tp_size == 1 or (self.kernel is not None and self.kernel.reduces):
            return out
        return tensor_model_parallel_all_reduce(out)

    def run(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
            ) -> torch.Tensor:
        """The experts' weighted sum for each token (this rank's part), [T, H]."""
        return (self.kernel or ExpertKernel(self)).forward(x, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size} (this rank's), "
                f"renormalize={self.renormalize}, tp={self.tp_rank}/{self.tp_size}")


# A `torch.library.Library` op, as `vllm::packed_linear` (cheaper to call than `custom_op`).
_lib = torch.library.Library("vllm", "FRAGMENT")
_lib.define("fused_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor op_id) "
            "-> Tensor")


def _fused_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      op_id: torch.Tensor) -> torch.Tensor:
    return _layers[int(op_id)].run(x, topk_weights, topk_ids)


_lib.impl("fused_experts", _fused_experts_op, "CompositeExplicitAutograd")


@torch.library.register_fake("vllm::fused_experts", lib=_lib)
def _(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
      op_id: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
