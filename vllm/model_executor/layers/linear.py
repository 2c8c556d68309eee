"""Linear layers sharded across tensor-parallel ranks, with vLLM's names.

    ColumnParallelLinear        W [out, in] split by output rows: rank r keeps rows
                                [r * out/tp, (r+1) * out/tp); its output is a slice.
    MergedColumnParallelLinear  several column-parallel matrices fused (gate/up): each
                                part split on its own, the rank's slices side by side.
    QKVParallelLinear           q, k, v fused; query heads split, KV heads split or, where
                                the ranks outnumber them, replicated.
    RowParallelLinear           W split by input columns; takes the slice a column-parallel
                                layer produced and all-reduces the partial sums (the bias is
                                added once, after the reduce).
    ReplicatedLinear            every rank holds all of W.

Every parameter carries its own `weight_loader(param, loaded, shard_id)`: it takes the
checkpoint's full tensor (or one part of a fused one: `shard_id` 0/1 for gate/up, "q"/"k"/"v")
and copies the rows or columns this rank keeps (`shard`). The same slicing serves a GGUF
file's block codes (`add_block_codes`), so quantized weights shard exactly as dense ones.

How a layer multiplies is a property of the layer, chosen after loading
(`process_weights_after_loading`): `F.linear` on the weight (float32, or no kernel for the
shape), a oneDNN-packed bfloat16 weight (`PackedLinear`), int8 (`Int8Linear`), or GGUF block
codes (`GGUFLinear`, `GGUFBlockLinear`).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    tensor_model_parallel_all_reduce,
)
from vllm.distributed.utils import divide, kv_head_start, kv_heads_per_rank
from vllm.model_executor.layers.quantization.int8 import Int8Linear, int8_kernel

if TYPE_CHECKING:
    from vllm.model_executor.layers.quantization.gguf_blocks import FusedWeights

logger = logging.getLogger(__name__)


class Narrowable(Protocol):
    """A full weight as the checkpoint has it: a tensor, or GGUF `BlockCodes` / `GGUFBlocks`."""

    @property
    def shape(self) -> tuple[int, ...] | torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> Any: ...


def set_weight_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor,
                          shard_id: int | str | tuple[int, str] | None = None) -> None:
    """A replicated parameter: the whole tensor, shapes equal."""
    if shard_id is not None:
        raise ValueError(f"a fused part ({shard_id!r}) for a parameter that is not fused")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


class DenseLinear(nn.Module):
    """`F.linear` on a layer's weight and bias (a kernel's dense path for large steps)."""

    def __init__(self, view) -> None:
        super().__init__()
        self.weight, self.bias = view.weight, view.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LinearBase(nn.Module):
    """`weight` [out_features, in_features] and `bias` [out_features] of this rank (the
    per-rank sizes; `nn.Linear`'s attribute names, so kernels built from an `nn.Linear`
    take one of these too)."""

    # GGUF blocks may take gguf_mm's faster arrangement (`GGUFBlockLinear`'s `repack`).
    repack_gguf_rows = True

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = set_weight_loader(
            nn.Parameter(torch.empty(out_features, in_features), requires_grad=False),
            self.weight_loader)
        # Zeros: a fused bias may lack a part in the checkpoint (Whisper has no k bias).
        self.bias: nn.Parameter | None = None if not bias else set_weight_loader(
            nn.Parameter(torch.zeros(out_features), requires_grad=False), self.weight_loader)
        self.kernel: nn.Module | None = None  # set by process_weights_after_loading
        self._codes: list[tuple[int, Any]] = []  # GGUF block codes: (row offset, codes)

    # ---- loading ------------------------------------------------------------------

    def shard(self, loaded: Narrowable, shard_id: int | str | None, is_bias: bool
              ) -> tuple[int, Any]:
        """(row offset in this rank's parameter, the piece of `loaded` this rank keeps)."""
        return 0, loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        offset, piece = self.shard(loaded, shard_id, is_bias=param.dim() == 1)
        rows = param[offset:offset + piece.shape[0]] if piece.shape[0] != param.shape[0] \
            else param
        if tuple(rows.shape) != tuple(piece.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} gives {tuple(piece.shape)} on rank "
                             f"{self.tp_rank}, expected {tuple(rows.shape)}")
        with torch.no_grad():
            rows.copy_(piece)

    def add_block_codes(self, codes: Narrowable, shard_id: int | str | None) -> None:
        """GGUF block codes of the (part of the) weight, sliced as the weight is (None where
        this rank's slice would split a block: the weight then stays dense)."""
        try:
            self._codes.append(self.shard(codes, shard_id, is_bias=False))
        except ValueError:
            self._codes.append((0, None))

    # ---- after loading: how to multiply --------------------------------------------

    @property
    def kernel_bias(self) -> torch.Tensor | None:
        """The bias a kernel may fuse (a row-parallel layer adds it after the reduce)."""
        return self.bias

    def process_weights_after_loading(self, quantization: str | None, pack: bool,
                                      repack_for_fused_decode: bool = False) -> str:
        """Picks the kernel: GGUF codes where loaded and a kernel takes them, int8 when
        asked, oneDNN-packed bfloat16 when `pack`; returns its name ("dense" for
        `F.linear`). `repack_for_fused_decode`: the model is one the fused decoder may run,
        which reads Q4_0 / Q4_1 / Q8_0 weights in quant_gemv's layout."""
        from vllm.model_executor.layers.packed_linear import PackedLinear

        assert self.weight is not None
        view = SimpleNamespace(weight=self.weight.data, bias=self.kernel_bias,
                               in_features=self.in_features, out_features=self.out_features)
        codes, self._codes = self._codes, []
        if quantization == "int8" and self.quantizable:
            self.kernel, name = int8_kernel(view, self.int8_weight_absmax)
            self.weight = None  # the int8 copy replaces it
            return name
        if codes and quantization == "gguf":
            kernel = self._gguf_kernel([c for _, c in sorted(codes, key=lambda p: p[0])],
                                       view, pack, repack_for_fused_decode)
            if kernel is not None:
                return kernel
        # Packed only where it is kept: blocks read in their own type need no dense copy.
        self.kernel = PackedLinear(view) if pack else None
        return "packed" if pack else "dense"

    def _gguf_kernel(self, parts: list[Any], view, pack: bool,
                     repack_for_fused_decode: bool) -> str | None:
        """Sets the kernel of GGUF `parts` (this rank's, in row order) and returns its name,
        or None where the weight stays dense (the reason logged). Every part is read in its
        own type by `gguf_mm`, except in a model the fused decoder may run whose parts are
        all of one quant_gemv type (the default model's): quant_gemv's layout, which that
        decoder reads."""
        from vllm.model_executor.layers.packed_linear import PackedLinear
        from vllm.model_executor.layers.quantization.gguf_blocks import (
            BlockCodes,
            GGUFBlockLinear,
            GGUFBlocks,
            GGUFLinear,
            gguf_mm_available,
        )

        assert self.weight is not None
        if any(p is None for p in parts):
            logger.info("GGUF weight of %s stays dense: a tensor-parallel slice splits its "
                        "blocks", type(self).__name__)
            return None
        if sum(p.shape[0] for p in parts) != self.weight.shape[0]:
            return None  # a part the file does not quantize: the weight stays dense
        blocks = [p for p in parts if isinstance(p, GGUFBlocks)]
        bits = {p.legacy_bits for p in blocks}
        repack = repack_for_fused_decode and len(bits) == 1 and None not in bits
        if len(blocks) == len(parts) and not repack:
            if not gguf_mm_available():
                logger.info("GGUF %s weight of %s stays dense: gguf_mm was not built here",
                            "+".join(p.type_name for p in blocks), type(self).__name__)
                return None
            self.kernel = GGUFBlockLinear(blocks, self.kernel_bias,
                                          repack=self.repack_gguf_rows)
            self.weight = None  # the blocks replace it
            return f"gguf {'+'.join(sorted(set(p.type_name for p in blocks)))} gguf_mm"
        codes = [p.to_block_codes() if isinstance(p, GGUFBlocks) else p for p in parts]
        fused = BlockCodes.concat(codes)
        if fused is None or tuple(fused.shape) != tuple(self.weight.shape):
            return None
        try:
            kernel = GGUFLinear(view, fused, dense=lambda: PackedLinear(view) if pack
                                else DenseLinear(view))
        except ValueError as e:
            logger.info("GGUF weight of %s stays dense: %s", type(self).__name__, e)
            return None
        self.kernel = kernel
        if kernel.dense is None:
            self.weight = None  # the codes replace it
        return f"gguf {fused.bits}-bit {kernel.kernel}"

    quantizable = True  # int8 applies (the vocabulary projection says no)

    def int8_weight_absmax(self) -> torch.Tensor | None:
        """The absmax int8 scales each output row by; None: this rank's rows are whole."""
        return None

    def fused_decode_weights(self) -> FusedWeights | None:
        """This layer's quantized weight as the fused CPU decoder reads it (quant_gemv's
        codes, `gguf_mm`'s blocks or `int8_mm`'s tiles), on one rank; else None. The decoder
        adds `bias` as the layer does."""
        from vllm.model_executor.layers.quantization.gguf_blocks import (
            GGUFBlockLinear,
            GGUFLinear,
        )

        if self.tp_size != 1:
            return None
        if isinstance(self.kernel, GGUFLinear):
            return self.kernel.quant_gemv_weights()
        if isinstance(self.kernel, GGUFBlockLinear | Int8Linear):
            return self.kernel.fused_decode_weights()
        return None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x times this rank's weight, plus `bias` on the dense path; a kernel adds the
        bias it was built with (`kernel_bias`: the same choice)."""
        if self.kernel is not None:
            return self.kernel(x)
        assert self.weight is not None
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}")


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output rows split across ranks; the output stays split (`gather_output` is not
    offered: every user here feeds a row-parallel layer or gathers itself)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True) -> None:
        tp = get_tensor_model_parallel_world_size()
        super().__init__(input_size, divide(output_size, tp, "output size"), bias)
        self.output_size = output_size

    def shard(self, loaded: Narrowable, shard_id: int | str | None, is_bias: bool
              ) -> tuple[int, Any]:
        if shard_id is not None:
            raise ValueError(f"a fused part ({shard_id!r}) for an unfused layer")
        size = self.out_features
        return 0, loaded.narrow(0, self.tp_rank * size, size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel matrices of `output_sizes` fused (gate/up): part i is split on its
    own; this rank's slices sit side by side."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        for size in output_sizes:
            divide(size, self.tp_size, "fused part size")

    def shard(self, loaded: Narrowable, shard_id: int | str | None, is_bias: bool
              ) -> tuple[int, Any]:
        if not isinstance(shard_id, int):
            raise ValueError(f"a fused layer of {len(self.output_sizes)} parts needs the "
                             f"part's index, got {shard_id!r}")
        sizes = [s // self.tp_size for s in self.output_sizes]
        return sum(sizes[:shard_id]), loaded.narrow(0, self.tp_rank * sizes[shard_id],
                                                    sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v fused. Query heads are split across ranks; KV heads too, or replicated
    when there are fewer KV heads than ranks (each rank keeps the one its queries use)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = True) -> None:
        tp = get_tensor_model_parallel_world_size()
        kv = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, kv
        self.num_heads = divide(total_num_heads, tp, "attention heads")
        self.num_kv_heads = kv_heads_per_rank(kv, tp)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size
        LinearBase.__init__(self, hidden_size, out, bias)
        self.output_size = out * tp

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def shard(self, loaded: Narrowable, shard_id: int | str | None, is_bias: bool
              ) -> tuple[int, Any]:
        if shard_id == "q":
            return 0, loaded.narrow(0, self.tp_rank * self.q_size, self.q_size)
        if shard_id in ("k", "v"):
            start = kv_head_start(self.total_num_kv_heads, self.tp_size, self.tp_rank)
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            return offset, loaded.narrow(0, start * self.head_size, self.kv_size)
        raise ValueError(f"a fused q/k/v layer needs 'q', 'k' or 'v', got {shard_id!r}")


class RowParallelLinear(LinearBase):
    """Input columns split across ranks: takes a column-parallel layer's slice, and the
    ranks' partial products are all-reduced; the bias (whole on every rank) is added once,
    after the reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True) -> None:
        tp = get_tensor_model_parallel_world_size()
        super().__init__(divide(input_size, tp, "input size"), output_size, bias)
        self.input_size = input_size

    def shard(self, loaded: Narrowable, shard_id: int | str | None, is_bias: bool
              ) -> tuple[int, Any]:
        if shard_id is not None:
            raise ValueError(f"a fused part ({shard_id!r}) for an unfused layer")
        if is_bias:
            return 0, loaded
        size = self.in_features
        return 0, loaded.narrow(1, self.tp_rank * size, size)

    @property
    def kernel_bias(self) -> torch.Tensor | None:
        return self.bias if self.tp_size == 1 else None

    def int8_weight_absmax(self) -> torch.Tensor | None:
        if self.tp_size == 1:
            return None
        assert self.weight is not None
        return get_tp_group().all_reduce_max(self.weight.detach().float().abs().amax(dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.linear(x, self.bias)
        if isinstance(self.kernel, Int8Linear):
            y = self.kernel.forward_sharded(x, get_tp_group())
        else:
            y = tensor_model_parallel_all_reduce(self.linear(x, None))
        return y if self.bias is None else y + self.bias
