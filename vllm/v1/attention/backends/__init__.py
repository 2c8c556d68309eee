"""Registry of attention backends by name.

    @register_attn_backend
    class MyBackend(AttentionBackend):
        name = "MY_BACKEND"        # attention_backend="MY_BACKEND" picks it

The runner picks `model_config.attention_backend`, else `VLLM_ATTENTION_BACKEND`, else
`DEFAULT_BACKEND` (`get_attn_backend`). A backend registered at run time exists in the
process that registered it: the in-process executor (`uni`) sees it, worker processes only
if they import the module that registers it.
"""

from __future__ import annotations

import os

from vllm.v1.attention.backends.abstract import AttentionBackend
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

DEFAULT_BACKEND = TorchSDPABackend.name
ENV_VAR = "VLLM_ATTENTION_BACKEND"

_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchSDPABackend.name: TorchSDPABackend,
}


def register_attn_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Registers `cls` under `cls.name` (usable as a class decorator). Registering the
    same class again is a no-op; another class under a taken name is an error."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a non-empty `name` to be registered.")
    registered = _BACKENDS.get(name)
    if registered is not None and registered is not cls:
        raise ValueError(f"Attention backend name {name!r} is taken by "
                         f"{registered.__module__}.{registered.__qualname__}.")
    _BACKENDS[name] = cls
    return cls


def get_attn_backend(name: str | None = None) -> type[AttentionBackend]:
    """The backend registered as `name`; None: `VLLM_ATTENTION_BACKEND` if set, else
    the default."""
    name = name or os.environ.get(ENV_VAR) or DEFAULT_BACKEND
    if name not in _BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; registered: "
                         f"{', '.join(_BACKENDS)}.")
    return _BACKENDS[name]
