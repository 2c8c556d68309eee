"""`PackedLinear`: a bfloat16 `nn.Linear` on CPU (and the float32 vocabulary projection, see
`can_pack_float32`) whose weight is reordered once, at load, into oneDNN's blocked layout.

`F.linear` in bfloat16 on CPU runs oneDNN's matmul but reorders the weight on every call;
for the small steps of decoding that reorder is most of the work. With the weight packed
once, the same kernel gives bit-identical results several times faster (one 576 x 3072
weight, 2-core AVX512-BF16 CPU: 4 rows 397 -> 164 us, 64 rows 4.4 -> 1.8 ms; at 512 rows
the two are equal).

The packed weight is an opaque oneDNN tensor that `torch.compile` cannot take as a graph
input (inductor only packs weights itself when a graph is frozen, which would give every
layer its own graph), so compiled graphs call it through the registered op
`vllm::packed_linear`, which finds the layer by a tensor id, as `vllm::attention` does.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch
from torch import nn

from vllm.platforms.cpu import read_cpu_flags

logger = logging.getLogger(__name__)

_ids = itertools.count()
_layers: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()


# oneDNN reorders a bfloat16 weight only on CPUs with these flags (either set); elsewhere
# (AVX2-only CPUs, where `dtype="bfloat16"` must be asked for: `auto` is float32 there) the
# reorder raises, and `F.linear` runs bfloat16 by widening it.
_ONEDNN_BF16_FLAGS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})


def can_pack(dtype: torch.dtype, device: torch.device,
             cpu_flags: frozenset[str] | None = None) -> bool:
    """bfloat16 on a CPU with oneDNN and the instructions its bfloat16 reorder needs
    (float32 stays on `F.linear`: oneDNN's float32 result differs from MKL's in the last
    bits, and parity is checked in float32). `cpu_flags`: this machine's by default."""
    if not (dtype == torch.bfloat16 and _onednn_reorders(device)):
        return False
    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    return any(needed <= flags for needed in _ONEDNN_BF16_FLAGS)


def can_pack_float32(device: torch.device) -> bool:
    """float32 in oneDNN's layout, for the vocabulary projection (`ParallelLMHead`): MKL's
    sgemm repacks the weight on every call, which for the largest matrix of a step is most
    of its work (one 49152 x 576 weight, 2-core Zen 3: 1 row 9.4 -> 4.8 ms, 7 rows 29 ->
    7.4, 64 rows 52 -> 29). oneDNN's float32 sums differ from MKL's in the last bits (~1e-5
    on logits of a few units), which is why the decoder layers, whose hidden states are
    checked bit for bit, keep `F.linear`; a row's logits do not depend on the other rows of
    the batch nor on which rows of the weight a tensor-parallel rank holds."""
    return _onednn_reorders(device)


def _onednn_reorders(device: torch.device) -> bool:
    """A CPU, and a torch built with oneDNN's linear weight reorder."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """A linear layer's kernel: its weight in oneDNN's layout (built from anything with
    `nn.Linear`'s weight, bias and sizes)."""

    def __init__(self, linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                                     None)
        self.bias = linear.bias
        self.op_id = next(_ids)
        _layers[self.op_id] = self
        self.register_buffer("op_id_tensor", torch.tensor(self.op_id), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.vllm.packed_linear(x, self.bias, self.op_id_tensor,
                                                self.out_features)
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                  [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                "oneDNN-packed")


# A `torch.library.Library` op, not `custom_op`: ~3 us a call instead of ~9 (see
# `vllm::attention`), four or five calls a layer.
_lib = torch.library.Library("vllm", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor? bias, Tensor op_id, int out_features) -> Tensor")


def _packed_linear_op(x: torch.Tensor, bias: torch.Tensor | None, op_id: torch.Tensor,
                      out_features: int) -> torch.Tensor:
    return _layers[int(op_id)].run(x)


_lib.impl("packed_linear", _packed_linear_op, "CompositeExplicitAutograd")


@torch.library.register_fake("vllm::packed_linear", lib=_lib)
def _(x: torch.Tensor, bias: torch.Tensor | None, op_id: torch.Tensor,
      out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
