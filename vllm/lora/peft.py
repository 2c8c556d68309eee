"""PEFT LoRA adapters: checking one against a base model, and loading its tensors.

An adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors`, whose tensors are named

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   A [r, in_features]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   B [out_features, r]

and a targeted projection computes `W x + scaling * B (A x)`, with `scaling = lora_alpha / r`
(or `lora_alpha / sqrt(r)` with `use_rslora`). The scaling is folded into B at load.

`check_adapter` reads only the config and the tensors' shapes (the front end refuses a bad
adapter before any request reaches the engine); `load_adapter` reads the tensors too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch

from vllm.transformers_utils.config import head_dim_of, num_kv_heads_of

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target (every decoder layer's attention and MLP).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")

_TENSOR_NAME = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.weight)?$")
_MODULE_NAME = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


@dataclass(slots=True)
class PeftAdapter:
    """A checked adapter: its rank, scaling and targeted modules (Hugging Face names,
    `model.layers.3.self_attn.q_proj`), and once loaded each module's (A, scaled B)."""

    path: str
    rank: int
    scaling: float
    modules: list[str]
    # module -> (A [r, in_features], scaling * B [out_features, r]), float32, CPU.
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None


def projection_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each supported projection of the base model."""
    hidden = hf_config.hidden_size
    q = hf_config.num_attention_heads * head_dim_of(hf_config)
    kv = num_kv_heads_of(hf_config) * head_dim_of(hf_config)
    inter = getattr(hf_config, "intermediate_size", None)
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden)}
    if inter is not None:
        shapes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter),
                      down_proj=(inter, hidden))
    return shapes


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter directory {path!r} does not exist.")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}.")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE} (only safetensors "
                         "adapters are loaded).")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object.")
    return config


def _check_config(path: str, config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config; anything this engine would not honour is
    refused by name."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {config.get('peft_type')!r} "
                         "is not LORA.")
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                      ("rank_pattern", "rank_pattern"), ("alpha_pattern", "alpha_pattern"),
                      ("layer_replication", "layer_replication"),
                      ("fan_in_fan_out", "fan_in_fan_out")):
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {what} is not supported.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={config['bias']!r} is not supported "
                         "(only 'none').")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA adapter {path!r}: r must be a positive integer, got {rank!r}.")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {rank}, over max_lora_rank="
                         f"{max_rank}; raise max_lora_rank.")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {path!r}: lora_alpha must be a number, got {alpha!r}.")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def check_adapter(path: str, hf_config, max_rank: int) -> PeftAdapter:
    """Reads an adapter's config and tensor shapes and checks them against the base model:
    a missing file, a rank over `max_rank`, a targeted module the model lacks, or a tensor
    whose shape differs from the base layer's is a ValueError naming it."""
    from safetensors import safe_open

    config = _read_config(path)
    rank, scaling = _check_config(path, config, max_rank)
    shapes = projection_shapes(hf_config)
    num_layers = hf_config.num_hidden_layers
    found: dict[str, set[str]] = {}
    try:
        with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
            for name in f.keys():
                module, which = _split_tensor_name(path, name)
                _check_module(path, module, shapes, num_layers)
                short = module.rsplit(".", 1)[1]
                in_f, out_f = shapes[short]
                expected = (rank, in_f) if which == "A" else (out_f, rank)
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected:
                    raise ValueError(f"LoRA adapter {path!r}: {name} has shape {shape}, but "
                                     f"the base model's {short} needs {expected} (rank {rank}; "
                                     "was it trained on another model?).")
                found.setdefault(module, set()).add(which)
    except ValueError:
        raise
    except Exception as e:  # safetensors' own errors: a truncated or foreign file
        raise ValueError(f"LoRA adapter {path!r}: cannot read {WEIGHTS_FILE}: {e}") from None
    for module, parts in found.items():
        if parts != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_{''.join(parts)} but "
                             "not both A and B.")
    if not found:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA tensors.")
    return PeftAdapter(path, rank, scaling, sorted(found, key=_module_order))


def load_adapter(path: str, hf_config, max_rank: int) -> PeftAdapter:
    """`check_adapter`, then every module's A and scaled B (float32, CPU)."""
    from safetensors.torch import load_file

    adapter = check_adapter(path, hf_config, max_rank)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, which = _split_tensor_name(path, name)
        pairs.setdefault(module, {})[which] = tensor.float()
    adapter.weights = {module: (pairs[module]["A"], pairs[module]["B"] * adapter.scaling)
                       for module in adapter.modules}
    return adapter


def files_fingerprint(path: str) -> bytes:
    """The adapter files' sizes and modification times (nanoseconds), hashed: an adapter
    read again from the same path after its files changed gets another fingerprint (the
    prefix cache mixes it into block hashes, so K/V of the old weights is never reused)."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            stat = os.stat(os.path.join(path, name))
        except OSError:
            digest.update(b"missing")
            continue
        digest.update(stat.st_size.to_bytes(8, "little") + stat.st_mtime_ns.to_bytes(8, "little"))
    return digest.digest()


def _split_tensor_name(path: str, name: str) -> tuple[str, str]:
    """(module, "A" | "B") of a PEFT tensor name."""
    match = _TENSOR_NAME.match(name)
    if match is None:
        raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA A/B weight "
                         f"of a linear layer (supported targets: {', '.join(SUPPORTED_MODULES)}).")
    return match.group(1), match.group(2)


def _check_module(path: str, module: str, shapes: dict[str, tuple[int, int]],
                  num_layers: int) -> None:
    match = _MODULE_NAME.match(module)
    if match is None or match.group(2) not in shapes or int(match.group(1)) >= num_layers:
        raise ValueError(f"LoRA adapter {path!r} targets {module!r}, which the base model "
                         f"lacks (supported: {', '.join(shapes)} of layers 0-{num_layers - 1}).")


def _module_order(module: str) -> tuple[int, int]:
    match = _MODULE_NAME.match(module)
    assert match is not None
    return int(match.group(1)), SUPPORTED_MODULES.index(match.group(2))
