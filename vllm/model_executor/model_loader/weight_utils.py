"""The one weight-loading path of every model.

A checkpoint tensor's name (Hugging Face's) finds its parameter through the model's
`packed_modules_mapping`, which names the fused layers and the checkpoint projections they
hold (`qkv_proj` <- `q_proj` "q", `k_proj` "k", `v_proj` "v"); the parameter's own
`weight_loader` then copies the part this tensor-parallel rank keeps. GGUF block codes
(`BlockCodes`) take the same path to the linear layers using that weight (a tied LM head
included), which slice them exactly as their weights.

Example: "model.layers.3.self_attn.k_proj.weight" -> "layers.3.self_attn.qkv_proj.weight",
part "k": on 2 ranks over 4 KV heads, rank 1 copies heads 2-3 after its query rows.

Mixture-of-experts checkpoints keep one tensor per expert and projection; they go to the
experts' stacked parameters (`FusedMoE`) with the part (expert, "w1" | "w3" | "w2"):
"model.layers.0.mlp.experts.5.up_proj.weight" -> "layers.0.mlp.experts.w13_weight",
(5, "w3"); Mixtral's "...block_sparse_moe.experts.5.w3.weight" names the same part.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe import EXPERT_PARTS, FusedMoE
from vllm.model_executor.layers.linear import LinearBase, default_weight_loader
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

# fused module name -> [(checkpoint module name, part id)]
PackedModulesMapping = Mapping[str, Sequence[tuple[str, int | str]]]
# A fused part: an index or letter of a fused layer, or (expert, "w1" | "w2" | "w3").
ShardId = int | str | tuple[int, str]

_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


def resolve_expert_name(dotted: str) -> tuple[str, tuple[int, str]] | None:
    """(stacked parameter name, (expert, part)) of one expert's projection, else None.

    Example: ".layers.0.mlp.experts.5.down_proj.weight" -> ("layers.0.mlp.experts.w2_weight",
    (5, "w2")).
    """
    match = _EXPERT_NAME.search(dotted)
    if match is None or match.group(2) not in EXPERT_PARTS:
        return None
    part = EXPERT_PARTS[match.group(2)]
    param = "w2_weight" if part == "w2" else "w13_weight"
    return f"{dotted[1:match.start()]}.experts.{param}", (int(match.group(1)), part)


def resolve_name(name: str, mapping: PackedModulesMapping,
                 rename: Mapping[str, str | None]) -> tuple[str, ShardId | None] | None:
    """(parameter name, fused part or None) of a checkpoint name; None to skip it."""
    name = name.removeprefix("model.")
    if name in rename:
        renamed = rename[name]
        if renamed is None:
            return None
        name = renamed
    dotted = f".{name}"
    expert = resolve_expert_name(dotted)
    if expert is not None:
        return expert
    for fused, parts in mapping.items():
        for part, shard_id in parts:
            if f".{part}." in dotted:
                return dotted.replace(f".{part}.", f".{fused}.", 1)[1:], shard_id
    return name, None


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]],
                 mapping: PackedModulesMapping, *, skip: Sequence[str] = (),
                 rename: Mapping[str, str | None] | None = None) -> set[str]:
    """Loads checkpoint tensors (or GGUF block codes) into `model`, fused parts by its
    `mapping` (the model's `packed_modules_mapping`); returns the names of the parameters
    and buffers filled. A name containing one of `skip` is left out; `rename` maps names
    (after the `model.` prefix is stripped) first, None to skip."""
    from vllm.model_executor.layers.quantization.gguf_blocks import BlockCodes, GGUFBlocks

    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update(model.named_buffers())
    # parameter -> the layers reading it (linear layers, embeddings), which take its GGUF
    # blocks too
    users: dict[int, list[LinearBase | VocabParallelEmbedding]] = {}
    experts: dict[int, FusedMoE] = {}  # stacked expert parameter -> its layer
    for module in model.modules():
        if isinstance(module, LinearBase | VocabParallelEmbedding) and module.weight is not None:
            users.setdefault(id(module.weight), []).append(module)
        elif isinstance(module, FusedMoE):
            experts[id(module.w13_weight)] = experts[id(module.w2_weight)] = module
    loaded: set[str] = set()
    for name, value in weights:
        if any(s in name for s in skip):
            continue
        resolved = resolve_name(name, mapping, rename or {})
        if resolved is None:
            continue
        target, shard_id = resolved
        if target not in targets:
            if isinstance(value, BlockCodes | GGUFBlocks):
                continue  # codes of a weight the model does not keep (a skipped copy)
            raise ValueError(f"Checkpoint tensor {name!r} has no place in the model.")
        param = targets[target]
        try:
            if isinstance(value, BlockCodes | GGUFBlocks):
                if isinstance(shard_id, tuple):  # an expert's part
                    if id(param) not in experts or not isinstance(value, GGUFBlocks):
                        raise ValueError("experts take GGUF blocks of their stacked weights")
                    experts[id(param)].add_block_codes(value, shard_id)
                    loaded.add(target)
                    continue
                for layer in users.get(id(param), []):
                    layer.add_block_codes(value, shard_id)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, value, shard_id)
        except ValueError as e:
            raise ValueError(f"Checkpoint tensor {name!r}: {e}.") from None
        loaded.add(target)
    return loaded


def process_weights_after_loading(model: nn.Module, quantization: str | None,
                                  pack: bool) -> dict[str, int]:
    """Every linear layer and experts layer picks how it multiplies (see `LinearBase`,
    `FusedMoE`) and every embedding how it looks rows up; returns the count of layers per
    kernel. A model the fused decoder may run (`fused_decode_shape_reason()` None) keeps its
    decoder layers' GGUF Q4_0 / Q4_1 / Q8_0 weights in that decoder's layout."""
    shape_reason = getattr(model, "fused_decode_shape_reason", None)
    fused_decode = callable(shape_reason) and shape_reason() is None
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, LinearBase):
            kernel = module.process_weights_after_loading(quantization, pack, fused_decode)
        elif isinstance(module, VocabParallelEmbedding):
            kernel = f"embedding {module.process_weights_after_loading(quantization)}"
        elif isinstance(module, FusedMoE):
            kernel = module.process_weights_after_loading(quantization, pack)
        else:
            continue
        counts[kernel] = counts.get(kernel, 0) + 1
    return counts
