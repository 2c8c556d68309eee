"""Building a model and filling it from safetensors files, a GGUF file or a CTranslate2
directory (converted to Hugging Face names at load)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from torch import nn

from vllm.config import ModelConfig
from vllm.model_executor.layers.packed_linear import can_pack, pack_linears
from vllm.model_executor.layers.quantization import quantize_model
from vllm.model_executor.models.interfaces import VllmModel
from vllm.model_executor.models.registry import resolve_model_cls
from vllm.v1.attention.backends.abstract import AttentionBackend


def iterate_weights(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if model_config.is_gguf:
        from vllm.model_executor.model_loader.gguf_loader import load_gguf_state_dict

        yield from load_gguf_state_dict(model_config.model, model_config.dtype).items()
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
            model = model_cls(model_config.hf_config, backend, model_config.max_model_len,
                              model_config.dtype)
    finally:
        torch.set_default_dtype(previous)
    loaded = model.load_weights(iterate_weights(model_config))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"Checkpoint {model_config.model!r} lacks weights for: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if model_config.quantization == "gguf":
        _keep_gguf_blocks(model, model_config.model)
    else:
        quantize_model(model, model_config.quantization)
    if getattr(model, "supports_packed_linears", False) and can_pack(model_config.dtype,
                                                                      device):
        pack_linears(model)  # the linear layers left in bfloat16, vocabulary projection too
    return model.eval().requires_grad_(False)


def _keep_gguf_blocks(model: nn.Module, path: str) -> None:
    """`quantization="gguf"`: the block-quantized tensors' codes, fused like the model fuses
    their weights (q/k/v, gate/up: concatenated along the output rows in offset order); a
    tied vocabulary projection takes the embedding's codes."""
    from vllm.model_executor.layers.quantization.gguf_blocks import (
        BlockCodes,
        apply_block_codes,
    )
    from vllm.model_executor.model_loader.gguf_loader import load_gguf_block_codes

    fused_target = getattr(model, "fused_target", None)
    parts: dict[str, list[tuple[int, BlockCodes]]] = {}
    for name, codes in load_gguf_block_codes(path).items():
        name = name.removeprefix("model.")
        target, offset = fused_target(name) if fused_target else (name, None)
        parts.setdefault(target, []).append((offset or 0, codes))
    fused = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for target, pieces in parts.items():
        codes = BlockCodes.concat([c for _, c in sorted(pieces, key=lambda p: p[0])])
        if codes is not None and target in params and \
                codes.u.shape == tuple(params[target].shape):
            fused[target] = codes  # every piece of the fused weight has codes of one width
    if getattr(model, "tie_word_embeddings", False) and "embed_tokens.weight" in fused:
        fused["lm_head.weight"] = fused["embed_tokens.weight"]
    apply_block_codes(model, fused)
