"""Building a model and filling it from safetensors files, a GGUF file or a CTranslate2
directory (converted to Hugging Face names at load)."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from typing import cast

import torch

from vllm.config import ModelConfig
from vllm.model_executor.layers.packed_linear import can_pack
from vllm.model_executor.model_loader.weight_utils import process_weights_after_loading
from vllm.model_executor.models.interfaces import VllmModel
from vllm.model_executor.models.registry import resolve_model_cls
from vllm.v1.attention.backends.abstract import AttentionBackend

logger = logging.getLogger(__name__)


def iterate_weights(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if model_config.is_gguf:
        from vllm.model_executor.model_loader.gguf_loader import load_gguf_state_dict

        yield from load_gguf_state_dict(model_config.model, model_config.dtype,
                                        keep_blocks=model_config.quantization == "gguf").items()
        return
    from vllm.model_executor.model_loader.ct2_loader import is_ct2_model_dir

    if is_ct2_model_dir(model_config.model):
        from vllm.model_executor.model_loader.ct2_loader import load_ct2_state_dict

        yield from load_ct2_state_dict(model_config.model, model_config.dtype).items()
        return
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_config.model, "*.safetensors")))
    if not files:
        raise ValueError(f"No *.safetensors files in {model_config.model!r}.")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def get_model(model_config: ModelConfig, backend: type[AttentionBackend],
              device: torch.device) -> VllmModel:
    model_cls = resolve_model_cls(model_config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            module = model_cls(model_config.hf_config, backend,
                               model_config.max_model_len, model_config.dtype)
    finally:
        torch.set_default_dtype(previous)
    model = cast(VllmModel, module)  # every registered class is one (registry.py checks)
    loaded = model.load_weights(iterate_weights(model_config))
    if model_config.quantization == "gguf":
        from vllm.model_executor.model_loader.gguf_loader import load_gguf_block_codes

        # The block-quantized tensors' codes, sliced and fused like their weights (experts
        # kept in blocks load only here).
        loaded |= model.load_weights(load_gguf_block_codes(model_config.model).items())
    missing = sorted(set(dict(module.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"Checkpoint {model_config.model!r} lacks weights for: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    counts = process_weights_after_loading(module, model_config.quantization,
                                           pack=can_pack(model_config.dtype, device))
    logger.info("Linear layers by kernel: %s.",
                ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    module.eval().requires_grad_(False)
    return model
