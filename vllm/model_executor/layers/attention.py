"""`Attention`: the layer that hands q/k/v to the step's attention backend.

Under `torch.compile` the call goes through one registered op, `vllm::attention`, so that
paged attention (whose work depends on the step's metadata: prefill spans, block tables)
is a single opaque node of the graph instead of a graph break. The op finds its layer in
the forward context: whoever runs a model binds its layers once, at load
(`bind_attention_layers`: each layer's index in the model's list), and passes that list to
`set_forward_context(attn_layers=...)`; two models in one process (a target and its draft
model, two engines) each resolve their own indices. The op reads the step's metadata from
the same context, as the eager path does. Tokens past the step's real ones (a graph's
padding) get zero rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.forward_context import ForwardContext, get_forward_context
from vllm.v1.attention.backends.abstract import AttentionBackend, AttentionType

UNBOUND = -1  # a layer's op index before `bind_attention_layers`


class Attention(nn.Module):
    """One attention computation of a model; `layer_idx` names its KV cache tensor.
    `sliding_window` (keys (p - window, p] for a query at p) and `logits_soft_cap` go to
    the backend's impl; the layer's KV cache group (see `kv_cache_groups`) must agree.

    DECODER layers write and read their layer's cache; ENCODER_DECODER (cross) layers read
    the same tensor through the cross-attention blocks (their K/V are written once, by the
    encoder pass, through `write_cross_kv`); ENCODER layers use no cache.
    """

    op_id_tensor: torch.Tensor  # [] int64: the layer's `bind_attention_layers` index

    def __init__(self, backend: type[AttentionBackend], layer_idx: int, num_heads: int,
                 head_size: int, num_kv_heads: int, scale: float,
                 attn_type: AttentionType = AttentionType.DECODER,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_type = attn_type
        self.sliding_window = sliding_window
        extras = {}
        if sliding_window is not None or logits_soft_cap is not None:
            extras = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
        # Backends without these options (most test doubles) fail here, by name.
        self.impl = backend.make_impl(num_heads, head_size, num_kv_heads, scale, attn_type,
                                      **extras)
        self.output_size = num_heads * head_size
        # The layer's index in its model's `bind_attention_layers` list, as a tensor: a
        # compiled graph takes it as an input, so that one graph serves every layer of the
        # same shape instead of one specialisation per int.
        self.register_buffer("op_id_tensor", torch.tensor(UNBOUND), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None,
                v: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.vllm.attention(q, k, v, self.op_id_tensor)
        return self.run(q, k, v)

    def run(self, q: torch.Tensor, k: torch.Tensor | None,
            v: torch.Tensor | None) -> torch.Tensor:
        ctx = get_forward_context()
        if self.attn_type == AttentionType.ENCODER:
            return self.impl.forward(q, k, v, None, ctx.encoder_attn_metadata)
        return self.impl.forward(q, k, v, ctx.kv_caches[self.layer_idx],
                                 _metadata_of(self, ctx))

    def write_cross_kv(self, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        """Stores an encoder output's cross-attention K/V at the cross slots."""
        ctx = get_forward_context()
        self.impl.write_kv(k, v, ctx.kv_caches[self.layer_idx], slot_mapping)


def bind_attention_layers(model: object) -> list[Attention]:
    """The model's attention layers in module order, each given its index in that list:
    the op index through which a compiled graph finds the layer in the forward context's
    `attn_layers`. Called once per model, at load; the caller passes the list to
    `set_forward_context` for every forward of that model.

    Example: a 2-layer decoder -> [layers.0.self_attn.attn, layers.1.self_attn.attn], with
    op indices 0 and 1; a draft model loaded beside it has its own 0 and 1.
    """
    assert isinstance(model, nn.Module), f"{type(model).__name__} is not an nn.Module"
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    with torch.no_grad():
        for index, layer in enumerate(layers):
            layer.op_id_tensor.fill_(index)
    return layers


def _metadata_of(layer: Attention, ctx: ForwardContext) -> Any:
    """A layer's metadata: its KV cache group's for decoder layers of models with several
    groups, else the step's (cross-attention layers: the cross metadata)."""
    if layer.attn_type != AttentionType.DECODER:
        return ctx.cross_attn_metadata
    if ctx.layer_attn_metadata is not None:
        return ctx.layer_attn_metadata[layer.layer_idx]
    return ctx.attn_metadata


# Registered through `torch.library.Library` rather than `torch.library.custom_op`: a call
# costs ~3 us instead of ~9 (custom_op wraps every call in autograd and dynamo-disabling
# layers), and a decode step makes one call per layer.
_lib = torch.library.Library("vllm", "FRAGMENT")
_lib.define("attention(Tensor q, Tensor? k, Tensor? v, Tensor op_id) -> Tensor")


def _attention_op(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                  op_id: torch.Tensor) -> torch.Tensor:
    """One attention layer's computation in a compiled graph (K/V cache writes happen
    inside, on tensors the graph never sees). Rows past the step's real tokens (padding up
    to a captured size) are zeros."""
    ctx = get_forward_context()
    index = int(op_id)
    if ctx.attn_layers is None or index == UNBOUND:
        raise RuntimeError("a compiled attention op needs its model's "
                           "bind_attention_layers() list in set_forward_context(attn_layers=)")
    layer = ctx.attn_layers[index]
    metadata = _metadata_of(layer, ctx)
    n = q.shape[0]
    real = n if metadata is None or layer.attn_type == AttentionType.ENCODER \
        else metadata.num_actual_tokens
    if real == n:
        return layer.run(q, k, v)
    out = q.new_zeros(n, layer.output_size)
    out[:real] = layer.run(q[:real], None if k is None else k[:real],
                           None if v is None else v[:real])
    return out


_lib.impl("attention", _attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("vllm::attention", lib=_lib)
def _(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
      op_id: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], q[0].numel())  # q: [num_tokens, num_heads, head_size]
