"""Load GGUF checkpoints (llama.cpp format) as Hugging Face-style config, weights and tokenizer.

GGUF stores metadata as typed key/value fields and weights as (possibly quantized) tensors with
llama.cpp names. This module translates both into what the rest of the engine expects from a
Hugging Face checkpoint: a ``config.json``-style dict, a state dict keyed by HF parameter names
with HF shapes and rotary layout, and a ``transformers`` fast tokenizer.

Mixture-of-experts files stack each layer's experts in one tensor per projection
(`blk.N.ffn_gate_exps` [E, I, H] in HF order); the state dict unstacks them into the
per-expert names of the HF checkpoint (`model.layers.N.mlp.experts.5.gate_proj.weight`, views
of the stacked tensor), which the weight loader places (and slices for tensor parallel) as it
does a safetensors checkpoint's. Mixtral is llama.cpp's `llama` with `llama.expert_count`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any

import numpy as np
import torch

from vllm.model_executor.model_loader.gguf_file import GGUFFile, GGUFTensor

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# llama.cpp architecture -> Hugging Face `model_type` where they differ (`llama` with experts
# is Mixtral, see `_model_type`).
_HF_MODEL_TYPES: dict[str, str] = {
    "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
_HF_ARCHITECTURES: dict[str, str] = {"mixtral": "MixtralForCausalLM"}
# Whether the top-k routing weights are renormalised where the file does not say
# (`{arch}.expert_weights_norm`): llama.cpp's fixed choice per architecture, which is what
# these families' checkpoints set.
_NORM_TOPK_PROB: dict[str, bool] = {"qwen2_moe": False, "qwen3_moe": True, "olmoe": False}
# Architectures whose q/k rows llama.cpp's converter interleaves for its "normal" rope
# (the others use the NeoX layout, which is Hugging Face's).
_PERMUTED_ROTARY_ARCHS = ("llama", "granite", "mixtral")

_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6

_GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_TENSOR_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    # mixture of experts: the router, the stacked experts (`*` is the expert) and the
    # shared expert with its sigmoid gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Where a model type's block tensor means something else (keyed by HF `model_type`): Phi-3's
# `ffn_up` is gate and up fused (its checkpoint's `gate_up_proj`); Gemma's `ffn_norm` is the
# norm before the MLP (its `post_attention_norm` being the one after attention); Mixtral's
# experts are `block_sparse_moe.experts.{e}.w1/w3/w2`.
_ARCH_BLOCK_TENSOR_NAMES: dict[str, dict[str, str]] = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3_text": {"ffn_norm": "pre_feedforward_layernorm"},
    "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate",
                "ffn_gate_exps": "block_sparse_moe.experts.*.w1",
                "ffn_up_exps": "block_sparse_moe.experts.*.w3",
                "ffn_down_exps": "block_sparse_moe.experts.*.w2"},
}
_EXPERT_SLOT = ".*."  # where an HF name of stacked experts takes the expert index
# Architectures whose RMSNorms scale by (1 + weight): llama.cpp's converter stores the
# weight plus one, so the loader takes the one off again.
_NORM_PLUS_ONE_ARCHS = ("gemma2", "gemma3")
# What llama.cpp assumes of Gemma files that lack the keys: every `n`-th layer global, the
# others windowed (`attention.sliding_window_pattern`), Gemma 2's window and soft-caps.
_GEMMA_DEFAULT_PATTERN: dict[str, int] = {"gemma2": 2, "gemma3": 6}
_GEMMA2_DEFAULT_WINDOW = 4096
_GEMMA2_DEFAULT_SOFT_CAPS = (50.0, 30.0)  # attention logits, final logits
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# llama.cpp's rule for the attention scale: 1 / sqrt(head_dim), except for the 27B models
# (known by their layer count), which use 1 / sqrt(hidden_size / num_heads).
_GEMMA_27B_BLOCK_COUNTS: dict[str, int] = {"gemma2": 46, "gemma3": 62}

_IGNORED_TENSORS = re.compile(
    r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight|rope_factors_(long|short)\.weight)$")
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Older Mixtral files (llama.cpp before stacking, 2024) keep one tensor per expert.
_PER_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")
_GLOBAL_TENSOR = re.compile(r"^([a-z_]+)\.(weight|bias)$")

_FILE_TYPE_DTYPES: dict[int, str] = {0: "float32", 1: "float16", 32: "bfloat16"}


@functools.lru_cache(maxsize=4)
def _read_metadata_cached(path: str, mtime_ns: int) -> tuple[dict[str, Any], frozenset[str]]:
    """Parse every metadata field and the tensor names of a GGUF file (cached per file version)."""
    gguf_file = GGUFFile(path)
    return gguf_file.fields, frozenset(tensor.name for tensor in gguf_file.tensors)


def _read_metadata(path: str) -> tuple[dict[str, Any], frozenset[str]]:
    """Return (metadata fields, tensor names) of the GGUF file at ``path``."""
    path = os.path.abspath(path)
    return _read_metadata_cached(path, os.stat(path).st_mtime_ns)


def _architecture(fields: dict[str, Any]) -> str:
    """Return the file's ``general.architecture``, rejecting ones this engine cannot run."""
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r}; supported architectures: {supported}"
        )
    return arch


def _torch_dtype_name(fields: dict[str, Any]) -> str:
    """Map ``general.file_type`` to a dtype name; quantized files dequantize to float32."""
    file_type = fields.get("general.file_type")
    return _FILE_TYPE_DTYPES.get(int(file_type), "float32") if file_type is not None else "float32"


def _model_type(fields: dict[str, Any], arch: str) -> str:
    """Hugging Face `model_type` of a file of llama.cpp architecture `arch`."""
    if arch == "llama" and int(fields.get("llama.expert_count") or 0) > 0:
        return "mixtral"
    return _HF_MODEL_TYPES.get(arch, arch)


def _moe_config(fields: dict[str, Any], arch: str, model_type: str, intermediate: Any
                ) -> dict[str, Any]:
    """The experts' config keys (HF names of each family); {} for a dense model."""
    num_experts = int(fields.get(f"{arch}.expert_count") or 0)
    if model_type not in ("mixtral", *_NORM_TOPK_PROB):
        if num_experts:
            raise ValueError(f"GGUF architecture {arch!r} with {arch}.expert_count = "
                             f"{num_experts} is not supported (experts are supported in "
                             "llama (Mixtral), qwen2moe, qwen3moe and olmoe)")
        return {}
    top_k = fields.get(f"{arch}.expert_used_count")
    if num_experts <= 0 or top_k is None:
        raise ValueError(f"GGUF {arch} file needs {arch}.expert_count and "
                         f"{arch}.expert_used_count")
    if model_type == "mixtral":
        return {"num_local_experts": num_experts, "num_experts_per_tok": int(top_k),
                "intermediate_size": int(intermediate)}
    norm = fields.get(f"{arch}.expert_weights_norm")
    out: dict[str, Any] = {"num_experts": num_experts, "num_experts_per_tok": int(top_k),
                           "norm_topk_prob": _NORM_TOPK_PROB[model_type] if norm is None
                           else bool(norm)}
    if model_type == "olmoe":
        return {**out, "intermediate_size": int(intermediate)}
    expert_width = fields.get(f"{arch}.expert_feed_forward_length")
    if expert_width is None:
        raise ValueError(f"GGUF {arch} file needs {arch}.expert_feed_forward_length")
    out["moe_intermediate_size"] = int(expert_width)
    out["intermediate_size"] = int(intermediate if intermediate is not None else expert_width)
    if model_type == "qwen2_moe":
        shared = fields.get(f"{arch}.expert_shared_feed_forward_length")
        out["shared_expert_intermediate_size"] = int(shared or 0)
    return out


def _float32_value(value: Any) -> float:
    """Convert a float32 metadata value to the shortest decimal it stands for (1e-05, not
    9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _vocab_size(fields: dict[str, Any], arch: str) -> int:
    """Vocabulary size from metadata, falling back to the length of the token list."""
    size = fields.get(f"{arch}.vocab_size")
    if size is not None:
        return int(size)
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF file has neither a vocab_size field nor a token list")
    return len(tokens)


def _optional_token_id(fields: dict[str, Any], key: str) -> int | None:
    """Read a ``tokenizer.ggml.*_token_id`` field as int, or None when absent."""
    value = fields.get(f"tokenizer.ggml.{key}_token_id")
    return None if value is None else int(value)


def load_gguf_config(path: str) -> dict:
    """Build a Hugging Face ``config.json``-style dict from the GGUF file's metadata."""
    fields, tensor_names = _read_metadata(path)
    arch = _architecture(fields)

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file is missing required metadata field {arch}.{key}")
        return value

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden_size // num_heads)
    model_type = _model_type(fields, arch)
    # Qwen-MoE files may give only the experts' width (`expert_feed_forward_length`)
    intermediate = (fields.get(f"{arch}.feed_forward_length")
                    if model_type in ("qwen2_moe", "qwen3_moe") else get("feed_forward_length"))
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES.get(model_type, SUPPORTED_ARCHITECTURES[arch])],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(
            get("attention.layer_norm_rms_epsilon", _DEFAULT_RMS_NORM_EPS)
        ),
        "rope_theta": _float32_value(get("rope.freq_base", _DEFAULT_ROPE_THETA)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": _vocab_size(fields, arch),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _optional_token_id(fields, "bos"),
        "eos_token_id": _optional_token_id(fields, "eos"),
        "torch_dtype": _torch_dtype_name(fields),
    }
    pad_token_id = _optional_token_id(fields, "padding")
    if pad_token_id is not None:
        config["pad_token_id"] = pad_token_id
    config.update(_moe_config(fields, arch, model_type, intermediate))
    if "intermediate_size" not in config:
        config["intermediate_size"] = int(get("feed_forward_length"))
    config.update(_rope_config(path, fields, arch, config))
    if arch == "granite":
        config.update({
            "embedding_multiplier": _float32_value(get("embedding_scale", 1.0)),
            "residual_multiplier": _float32_value(get("residual_scale", 1.0)),
            "attention_multiplier": _float32_value(get("attention.scale", head_dim**-0.5)),
            "logits_scaling": _float32_value(get("logit_scale", 1.0)),
        })
    window = fields.get(f"{arch}.attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
    if arch in _GEMMA_DEFAULT_PATTERN:
        config.update(_gemma_config(fields, arch, config))
    return config


def _gemma_config(fields: dict[str, Any], arch: str, config: dict) -> dict:
    """Gemma 2 / 3 keys: GeGLU, attention scale, soft-caps, window layers, Gemma 3's local
    rope base (`rope.freq_base_swa`, else llama.cpp's 10000; `rope.freq_base` and any
    rope scaling are the global layers')."""
    out: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh",
                           "hidden_activation": "gelu_pytorch_tanh"}
    num_layers = config["num_hidden_layers"]
    if num_layers == _GEMMA_27B_BLOCK_COUNTS[arch]:
        out["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        out["query_pre_attn_scalar"] = config["head_dim"]
    attn_cap, final_cap = _GEMMA2_DEFAULT_SOFT_CAPS if arch == "gemma2" else (None, None)
    for key, default in (("attn_logit_softcapping", attn_cap),
                         ("final_logit_softcapping", final_cap)):
        value = fields.get(f"{arch}.{key}")
        out[key] = _float32_value(value) if value is not None else default
    window = config.get("sliding_window")
    if window is None and arch == "gemma2":
        window = _GEMMA2_DEFAULT_WINDOW
    out["sliding_window"] = window
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern",
                         _GEMMA_DEFAULT_PATTERN[arch])
    if window is None:
        windowed = [False] * num_layers
    elif isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"GGUF field {arch}.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {num_layers} layers")
        windowed = [bool(v) for v in pattern]
    else:  # every `pattern`-th layer global (0: every layer windowed), as llama.cpp
        period = int(pattern)
        windowed = [period == 0 or i % period < period - 1 for i in range(num_layers)]
    out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windowed]
    if arch == "gemma3":
        out["rope_local_base_freq"] = _float32_value(
            fields.get(f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE))
    return out


def _rope_config(path: str, fields: dict[str, Any], arch: str, config: dict) -> dict:
    """Partial rotary (`rope.dimension_count` < head_dim) and rope scaling (`rope.scaling.*`;
    Phi-3's longrope factors are the tensors `rope_factors_short` / `rope_factors_long`)."""
    out: dict[str, Any] = {}
    head_dim = config["head_dim"]
    rotary_dim = fields.get(f"{arch}.rope.dimension_count")
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        out["partial_rotary_factor"] = int(rotary_dim) / head_dim
    original = fields.get(f"{arch}.rope.scaling.original_context_length")
    _, tensor_names = _read_metadata(path)
    if "rope_factors_long.weight" in tensor_names:
        factors = {t.name: [_float32_value(v) for v in _dequantize(t).reshape(-1)]
                   for t in GGUFFile(path).tensors if t.name.startswith("rope_factors")}
        scaling: dict[str, Any] = {
            "rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"]}
        attn_factor = fields.get(f"{arch}.rope.scaling.attn_factor")
        if attn_factor is not None:
            scaling["attention_factor"] = _float32_value(attn_factor)
        out["rope_scaling"] = scaling
        if original is not None:
            out["original_max_position_embeddings"] = int(original)
        return out
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling = {"rope_type": kind,
                   "factor": _float32_value(fields[f"{arch}.rope.scaling.factor"])}
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        out["rope_scaling"] = scaling
    elif kind not in (None, "none"):
        raise ValueError(f"Unsupported GGUF rope scaling type {kind!r} ({arch}.rope.scaling"
                         ".type); supported: none, linear, yarn, and Phi-3's longrope factors")
    return out


def hf_tensor_name(gguf_name: str, arch: str | None = None) -> str | None:
    """Translate a llama.cpp tensor name to its HF name (for HF model type `arch`'s meaning
    of it); None for tensors HF models lack. Stacked experts get `*` for the expert:
    "blk.0.ffn_up_exps.weight" -> "model.layers.0.mlp.experts.*.up_proj.weight"; an older
    file's "blk.0.ffn_up.5.weight" -> "model.layers.0.mlp.experts.5.up_proj.weight"."""
    if _IGNORED_TENSORS.match(gguf_name):
        return None
    block = _BLOCK_TENSOR.match(gguf_name)
    names = {**_BLOCK_TENSOR_NAMES, **_ARCH_BLOCK_TENSOR_NAMES.get(arch or "", {})}
    expert = _PER_EXPERT_TENSOR.match(gguf_name)
    if expert is not None:
        layer, part, index = expert.groups()
        stacked = names[f"{part}_exps"].replace(_EXPERT_SLOT, f".{index}.")
        return f"model.layers.{layer}.{stacked}.weight"
    if block is not None and block.group(2) in names:
        layer, part, kind = block.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    top = _GLOBAL_TENSOR.match(gguf_name)
    if top is not None and top.group(1) in _GLOBAL_TENSOR_NAMES:
        return f"{_GLOBAL_TENSOR_NAMES[top.group(1)]}.{top.group(2)}"
    raise ValueError(f"Unknown GGUF tensor name {gguf_name!r}")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row interleaving of a llama q/k projection weight or bias.

    HF's rotary embedding pairs dimension ``i`` with ``i + head_dim / 2`` of each head, while
    llama.cpp pairs adjacent dimensions, so its converter reorders each head's rows so that
    GGUF row ``2 * i`` is HF row ``i`` and GGUF row ``2 * i + 1`` is HF row ``i + head_dim / 2``.
    This gathers the even rows then the odd rows of every head to restore the HF order.
    """
    rows = weight.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(f"Cannot split {rows} rows into {num_heads} heads of even size")
    per_head = weight.reshape(num_heads, rows // num_heads, -1)
    restored = torch.cat([per_head[:, 0::2], per_head[:, 1::2]], dim=1)
    return restored.reshape(weight.shape)


def _dequantize(tensor: GGUFTensor) -> np.ndarray:
    """Dequantize one tensor to float32 in HF (row-major ``[out, in]``) shape: block types
    by the native `gguf_dequantize` where it is built (gguf-py's values bit for bit, about
    5x faster: 0.4 against 1.8 s for the default model's file), else by gguf-py."""
    import gguf

    from vllm._custom_ops import cpu_ops
    from vllm.model_executor.layers.quantization.gguf_blocks import GGUF_MM_TYPES

    if tensor.tensor_type.name in GGUF_MM_TYPES and cpu_ops() is not None:
        data = np.array(tensor.data)  # a writable copy of the mapped bytes
        blocks = torch.from_numpy(data.reshape(-1, data.shape[-1]))
        values = torch.ops.vllm_cpu.gguf_dequantize(blocks, int(tensor.tensor_type)).numpy()
    else:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    hf_shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    values = np.ascontiguousarray(values, dtype=np.float32)
    if not values.flags.writeable:
        values = values.copy()
    return values.reshape(hf_shape)


def _rotary_heads(hf_name: str, config: dict) -> int | None:
    """Number of heads whose rows llama.cpp permuted in this tensor, or None if not permuted."""
    if config["model_type"] not in _PERMUTED_ROTARY_ARCHS:
        return None
    if ".self_attn.q_proj." in hf_name:
        return config["num_attention_heads"]
    if ".self_attn.k_proj." in hf_name:
        return config["num_key_value_heads"]
    return None


def _unstack_experts(hf_name: str, weight: torch.Tensor
                     ) -> list[tuple[str, torch.Tensor]]:
    """[(HF name, tensor)]: each expert of a stacked tensor ([E, out, in], `*` in the name)
    under its own name, else the tensor itself. A shared-expert gate llama.cpp wrote as a
    vector [H] becomes HF's [1, H]."""
    if _EXPERT_SLOT not in hf_name:
        if hf_name.endswith(".shared_expert_gate.weight") and weight.dim() == 1:
            weight = weight[None]
        return [(hf_name, weight)]
    if weight.dim() != 3:
        raise ValueError(f"GGUF tensor of stacked experts {hf_name!r} has shape "
                         f"{tuple(weight.shape)}, expected [experts, rows, columns]")
    return [(hf_name.replace(_EXPERT_SLOT, f".{e}."), w) for e, w in enumerate(weight)]


def _kept_experts(name: str, tensor: GGUFTensor) -> bool:
    """Whether `quantization="gguf"` keeps this tensor of stacked experts in its blocks."""
    from vllm.model_executor.layers.quantization.gguf_blocks import GGUF_MM_TYPES

    return _EXPERT_SLOT in name and tensor.tensor_type.name in GGUF_MM_TYPES


def load_gguf_state_dict(path: str, dtype: torch.dtype, keep_blocks: bool = False
                         ) -> dict[str, torch.Tensor]:
    """Dequantize every GGUF tensor into an HF-named, HF-shaped state dict cast to ``dtype``
    (stacked experts split into the HF checkpoint's per-expert tensors). With `keep_blocks`
    (`quantization="gguf"`), experts a kernel reads in their block type are left out: they
    load as blocks only (`load_gguf_block_codes`), never dense."""
    config = load_gguf_config(path)
    arch = _architecture(_read_metadata(path)[0])
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in GGUFFile(path).tensors:
        name = hf_tensor_name(tensor.name, config["model_type"])
        if name is None or (keep_blocks and _kept_experts(name, tensor)):
            continue
        weight = torch.from_numpy(_dequantize(tensor))
        num_heads = _rotary_heads(name, config)
        if num_heads is not None:
            weight = unpermute_rotary_rows(weight, num_heads)
        if arch in _NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight"):
            # The model's 1 + (w' - 1) gives back the stored w' (= HF's float32 1 + w)
            # exactly for weights w' in [0.5, 4); further out it may round by an ulp.
            weight = weight - 1.0
        for hf_name, part in _unstack_experts(name, weight):
            state_dict[hf_name] = part.to(dtype)
    return state_dict


def load_gguf_block_codes(path: str) -> dict[str, Any]:
    """HF name -> `GGUFBlocks` of every block-quantized tensor a kernel reads in place
    (`GGUF_MM_TYPES`), rows in HF order. Logs which types stay quantized and which are
    widened to the model's dtype, and why."""
    from vllm.model_executor.layers.quantization.gguf_blocks import GGUF_MM_TYPES, GGUFBlocks

    config = load_gguf_config(path)
    codes = {}
    kept: dict[str, int] = {}
    widened: dict[str, int] = {}
    for tensor in GGUFFile(path).tensors:
        name = hf_tensor_name(tensor.name, config["model_type"])
        type_name = tensor.tensor_type.name
        if name is None or type_name in ("F32", "F16", "BF16"):
            continue
        if type_name not in GGUF_MM_TYPES:
            widened[f"{type_name} (no kernel reads it)"] = widened.get(
                f"{type_name} (no kernel reads it)", 0) + 1
            continue
        k = int(tensor.shape[0])
        blocks = GGUFBlocks(np.asarray(tensor.data).reshape(-1, tensor.data.shape[-1]),
                            type_name, k)
        if _EXPERT_SLOT in name:  # [E * rows, bytes]: each expert's rows under its name
            rows = int(tensor.shape[1])
            for e in range(blocks.shape[0] // rows):
                codes[name.replace(_EXPERT_SLOT, f".{e}.")] = blocks.narrow(0, e * rows, rows)
            kept[type_name] = kept.get(type_name, 0) + 1
            continue
        num_heads = _rotary_heads(name, config)
        if num_heads is not None:
            rows = torch.arange(blocks.shape[0])[:, None]
            blocks = blocks.permute_rows(unpermute_rotary_rows(rows, num_heads)[:, 0].numpy())
        codes[name] = blocks
        kept[type_name] = kept.get(type_name, 0) + 1
    logger.info("GGUF tensors kept in their block types: %s; widened: %s.",
                ", ".join(f"{n} {t}" for t, n in sorted(kept.items())) or "none",
                ", ".join(f"{n} {t}" for t, n in sorted(widened.items())) or "none")
    return codes


def load_gguf_tokenizer(path: str) -> Any:
    """Return a ``transformers`` fast tokenizer built from the GGUF file's embedded vocabulary.

    The bos/eos/pad special tokens are checked against the file's ``tokenizer.ggml.*`` ids and
    reset from them if ``transformers`` picked different ones.
    """
    path = os.path.abspath(path)
    tokenizer = _tokenizer_class(path).from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
    )
    fields, _ = _read_metadata(path)
    tokens = fields.get("tokenizer.ggml.tokens") or []
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = _optional_token_id(fields, key)
        if token_id is None or token_id >= len(tokens):
            continue
        if getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokens[token_id])
    return tokenizer


def _tokenizer_class(path: str) -> Any:
    """The tokenizer class `AutoTokenizer` picks for the file's model type (the registered
    class, else the generic fast backend), found from this loader's own config: asked to
    find it itself, `AutoTokenizer` reads the whole file with gguf-py first (~3 s)."""
    from transformers import AutoConfig
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    config_dict = dict(load_gguf_config(path))
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    cls: Any = TOKENIZER_MAPPING.get(type(config), None)
    if cls is None or cls.__name__ == "MistralCommonBackend":  # a GGUF has no mistral format
        return TokenizersBackend
    return cls
