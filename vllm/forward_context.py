"""The per-step context the attention layers read during one forward pass."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: Any  # the backend's metadata for this step (decoder self-attention)
    kv_caches: list  # one tensor per (decoder) attention layer
    # Encoder/decoder models only: cross-attention over the cross blocks, and the encoder.
    cross_attn_metadata: Any = None
    encoder_attn_metadata: Any = None
    # Models with several KV cache groups (sliding-window layers): each decoder layer's
    # metadata (its group's block table and window), by layer index; None: attn_metadata.
    layer_attn_metadata: list | None = None
    # The running model's attention layers (`bind_attention_layers`): where a compiled
    # graph's attention op finds its layer by index. None: eager forwards only.
    attn_layers: Sequence[Any] | None = None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "called outside set_forward_context()"
    return _forward_context


@contextmanager
def set_forward_context(attn_metadata: Any, kv_caches: list, cross_attn_metadata: Any = None,
                        encoder_attn_metadata: Any = None,
                        layer_attn_metadata: list | None = None,
                        attn_layers: Sequence[Any] | None = None) -> Iterator[None]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata, kv_caches, cross_attn_metadata,
                                      encoder_attn_metadata, layer_attn_metadata, attn_layers)
    try:
        yield
    finally:
        _forward_context = previous
