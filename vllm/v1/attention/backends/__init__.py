"""Registry of attention backends by name."""

from __future__ import annotations

from vllm.v1.attention.backends.abstract import AttentionBackend
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchSDPABackend.name: TorchSDPABackend,
}


def get_attn_backend(name: str | None = None) -> type[AttentionBackend]:
    name = name or TorchSDPABackend.name
    if name not in _BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; available: "
                         f"{', '.join(_BACKENDS)}.")
    return _BACKENDS[name]
