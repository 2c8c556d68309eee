"""Random non-zero PEFT LoRA adapters for tests, and their merged transformers models."""

from __future__ import annotations

import copy
import functools

import torch

from tests.hf_reference import load_hf_model


def _peft_model(base_path: str, rank: int, alpha: int, targets: list[str],
                use_rslora: bool, seed: int, std: float):
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(load_hf_model(base_path))
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                        use_rslora=use_rslora, lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_" in name:  # both A and B non-zero (PEFT starts B at zero)
                param.copy_(std * torch.randn(param.shape, generator=generator))
    return peft_model.eval()


def make_adapter(base_path: str, out_dir: str, *, rank: int = 8, alpha: int = 16,
                 targets: tuple[str, ...] = ("q_proj", "v_proj"), use_rslora: bool = False,
                 seed: int = 0, std: float = 0.1) -> str:
    """Writes a PEFT adapter of `base_path` with seeded random A and B to `out_dir` (the
    PEFT model is kept for `merged_model`, which then merges it instead of copying the base
    model and reading the adapter back: a deep copy fewer of the default model)."""
    peft_model = _peft_model(base_path, rank, alpha, list(targets), use_rslora, seed, std)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    _unmerged[(base_path, out_dir)] = peft_model
    while len(_unmerged) > 8:
        _unmerged.pop(next(iter(_unmerged)))
    return out_dir


# (base, adapter dir) -> the PEFT model `make_adapter` wrote it from, until merged
_unmerged: dict[tuple[str, str], object] = {}


@functools.lru_cache(maxsize=8)
def merged_model(base_path: str, adapter_dir: str):
    """The base model with the adapter merged in (PEFT's own merge)."""
    from peft import PeftModel

    made = _unmerged.pop((base_path, adapter_dir), None)
    if made is not None:
        return made.merge_and_unload().eval()  # type: ignore[attr-defined]
    model = copy.deepcopy(load_hf_model(base_path))
    return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
