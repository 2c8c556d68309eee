"""GGUF files of the Qwen3, Phi-3, OLMo-2, Granite, Gemma 2 and Gemma 3 families and of the
mixture-of-experts Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE (llama.cpp's architecture names,
metadata and tensor layout, experts stacked per projection, written here with the `gguf`
package from a tiny model's safetensors as llama.cpp's converter would) load to the same
config and tensors, and run to transformers' tokens on the safetensors model."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.hf_reference import hf_greedy, load_hf_model
from tests.model_factory import make_tiny_model
from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader import gguf_loader
from vllm.transformers_utils.config import head_dim_of

FAMILIES = {
    "qwen3": {},
    "phi3": {"max_position_embeddings": 128, "original_max_position_embeddings": 32,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                 "short_factor": [1.0, 1.2, 1.5, 2.0],
                                 "long_factor": [2.0, 3.0, 5.0, 8.0]}},
    "olmo2": {},
    "granite": {},
    # Gemma: tied embeddings (the converter drops lm_head), windows shorter than the prompts,
    # llama.cpp's attention scale (1 / sqrt(head_dim)); Gemma 3 with its own layer pattern
    # (written as the per-layer array) and linear scaling on the global rope.
    "gemma2": {"tie_word_embeddings": True, "sliding_window": 5, "head_dim": 16,
               "query_pre_attn_scalar": 16, "attn_logit_softcapping": 20.0,
               "final_logit_softcapping": 15.0},
    "gemma3": {"tie_word_embeddings": True, "sliding_window": 5, "head_dim": 16,
               "query_pre_attn_scalar": 16, "num_hidden_layers": 4,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                               "sliding_attention"],
               "rope_parameters": {
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                      "rope_theta": 1e6}}},
    "qwen2_moe": {},
    "qwen3_moe": {},
    "mixtral": {},
    "olmoe": {},
}
_GEMMA = ("gemma2", "gemma3")
# tiny model arch -> llama.cpp's architecture (Mixtral is `llama` with experts)
_GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
_PERMUTED = ("granite", "mixtral")  # llama.cpp interleaves their q/k rows
# HF module -> llama.cpp tensor (written independently of the loader's table)
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
# an expert's projection -> llama.cpp's stacked tensor
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "down_proj": "ffn_down_exps", "w1": "ffn_gate_exps", "w3": "ffn_up_exps",
                 "w2": "ffn_down_exps"}


def _gguf_name(arch: str, hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{kind}"
    layer, part = stem.removeprefix("model.layers.").split(".", 1)
    if part == "post_attention_layernorm":
        post = "post_attention_norm" if arch in ("olmo2", *_GEMMA) else "ffn_norm"
        return f"blk.{layer}.{post}.{kind}"
    if part == "pre_feedforward_layernorm":
        return f"blk.{layer}.ffn_norm.{kind}"
    return f"blk.{layer}.{_NAMES[part]}.{kind}"


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(weight.shape)


def _stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """llama.cpp's layout: each layer's per-expert projections stacked [E, out, in] under
    `blk.N.ffn_*_exps.weight`, the other tensors as they are."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, weight in weights.items():
        match = re.match(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight$", name)
        if match is None:
            out[name] = weight
            continue
        layer, expert, part = match.groups()
        stacks.setdefault(f"blk.{layer}.{_EXPERT_NAMES[part]}.weight", {})[int(expert)] = weight
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def _encode(weight: torch.Tensor, type_name: str):
    """(blocks, GGML type) of `weight` in `type_name`: gguf-py's encoder, or the tests' own
    for the K-quants it cannot encode."""
    import gguf

    from tests.gguf_encoders import encode_q4_k, encode_q6_k

    qtype = gguf.GGMLQuantizationType[type_name]
    own = {"Q4_K": encode_q4_k, "Q6_K": encode_q6_k}.get(type_name)
    values = weight.float().numpy()
    return (own(values) if own else gguf.quants.quantize(values, qtype)), qtype


def _add_tokenizer(writer, model_dir: str, vocab_size: int) -> None:
    import gguf

    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        tokens[added["id"]], types[added["id"]] = added["content"], gguf.TokenType.CONTROL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in spec["model"]["merges"]])


def _write_gguf(path: str, model_dir: str, arch: str,
                expert_qtype: str | Callable[[str], str] | None = None,
                layer_qtype: str | Callable[[str], str] | None = None,
                real_tokenizer: bool = False) -> None:
    """`model_dir` as a llama.cpp-style GGUF, float32; with `layer_qtype` (a GGML type name,
    e.g. "Q4_1", or a function of the GGUF tensor name giving one) every layer matrix in
    that type and the embeddings and output in Q8_0, as llama.cpp's quantized files (the
    default model's: Q4_1 and Q8_0; a Q4_K_M file's: Q4_K, Q6_K, Q5_0 and Q8_0); with
    `expert_qtype` (the same kinds) the stacked experts in that type. The vocabulary is
    placeholder names, or with `real_tokenizer` the directory's byte-level BPE as llama.cpp's
    `gpt2` tokenizer (tokens, types, merges), so llama.cpp can tokenize for it. The
    routers (`ffn_gate_inp`) stay float32, as llama.cpp's quantizer leaves them."""
    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(path, _GGUF_ARCH.get(arch, arch))
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":  # the global layers' rope (the local base is llama.cpp's 10000)
        rope = rope["full_attention"]
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch != "gemma2":  # llama.cpp's Gemma 2 converter leaves the base at 10000
        writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta")))
    writer.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if real_tokenizer:
        _add_tokenizer(writer, model_dir, cfg["vocab_size"])
    else:
        writer.add_token_list([f"tok{i}" for i in range(cfg["vocab_size"])])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if arch == "granite":
        writer.add_embedding_scale(cfg["embedding_multiplier"])
        writer.add_residual_scale(cfg["residual_multiplier"])
        writer.add_attention_scale(cfg["attention_multiplier"])
        writer.add_logit_scale(cfg["logits_scaling"])
    if arch in _GEMMA:
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3":
        writer.add_sliding_window_pattern([t == "sliding_attention"
                                           for t in cfg["layer_types"]])
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              torch.tensor(rope[f"{kind}_factor"]).numpy())
    weights = _stack_experts(load_file(os.path.join(model_dir, "model.safetensors")))
    for name, weight in sorted(weights.items()):
        if arch in _PERMUTED and ".q_proj." in name:
            weight = _llama_cpp_permute(weight, cfg["num_attention_heads"])
        elif arch in _PERMUTED and ".k_proj." in name:
            weight = _llama_cpp_permute(weight, cfg["num_key_value_heads"])
        elif arch in _GEMMA and name.endswith("norm.weight"):
            weight = weight + 1  # Gemma's (1 + w) RMSNorm weights, stored with the one
        if name.startswith("blk.") and expert_qtype is not None:  # [E, N, K] stacked
            chosen = expert_qtype if isinstance(expert_qtype, str) else expert_qtype(name)
            blocks, qtype = _encode(weight.reshape(-1, weight.shape[-1]), chosen)
            writer.add_tensor(name, blocks.reshape(*weight.shape[:2], -1), raw_dtype=qtype)
            continue
        gguf_name = name if name.startswith("blk.") else _gguf_name(arch, name)
        # The routers stay float32, as llama.cpp's quantizer leaves them.
        if layer_qtype is not None and weight.ndim == 2 and "ffn_gate_inp" not in gguf_name:
            top = gguf_name.split(".")[0] in ("token_embd", "output")
            chosen = layer_qtype if isinstance(layer_qtype, str) else layer_qtype(gguf_name)
            blocks, qtype = _encode(weight, "Q8_0" if top else chosen)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            continue
        writer.add_tensor(gguf_name, weight.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow  # an engine: left out of `make test-fast`
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_gguf_matches_safetensors(arch, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model_dir = make_tiny_model(str(tmp_path / arch), arch, **FAMILIES[arch])
    path = str(tmp_path / f"{arch}.gguf")
    _write_gguf(path, model_dir, arch)

    ours = AutoConfig.from_pretrained(model_dir)
    config = gguf_loader.load_gguf_config(path)
    theirs = AutoConfig.for_model(config.pop("model_type"), **config)
    assert head_dim_of(theirs) == head_dim_of(ours)
    for key in ("architectures", "num_key_value_heads", "rope_parameters",
                "partial_rotary_factor", "embedding_multiplier", "residual_multiplier",
                "attention_multiplier", "logits_scaling", "original_max_position_embeddings",
                "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "sliding_window", "layer_types",
                "tie_word_embeddings", "intermediate_size", "num_experts",
                "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob"):
        assert getattr(theirs, key, None) == getattr(ours, key, None), key
    state = gguf_loader.load_gguf_state_dict(path, torch.float32)
    expected = load_file(os.path.join(model_dir, "model.safetensors"))
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        if arch in _GEMMA and name.endswith("norm.weight"):  # what the model multiplies by
            assert torch.equal(1 + state[name], 1 + tensor), name
        else:
            assert torch.equal(state[name], tensor), name

    llm = LLM(path, tokenizer=model_dir, dtype="float32", max_model_len=64,
              enforce_eager=True, kv_cache_memory_bytes=4 * 1024**2)
    prompts = ["Hello world, this is", "What is the capital of France? The capital is"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                   ignore_eos=True, logprobs=1),
                           use_tqdm=False)
    hf = load_hf_model(model_dir)
    for out in outputs:
        ref = hf_greedy(hf, out.prompt_token_ids, 16)
        completion = out.outputs[0]
        assert completion.token_ids == ref.token_ids
        assert completion.logprobs is not None
        logprobs = torch.tensor([lp[t].logprob for lp, t in
                                 zip(completion.logprobs, completion.token_ids)])
        expected_lp = ref.logprobs.gather(1, torch.tensor(ref.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(logprobs, expected_lp, atol=1e-4, rtol=0)


def _gemma_metadata_file(path: str, arch: str, layers: int, **keys) -> str:
    """A tensorless GGUF file with a Gemma architecture's metadata: hidden 4608, 32 heads of
    128 (the 27B shapes), and the optional `keys` (writer method suffix -> value)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(4608)
    writer.add_feed_forward_length(36864)
    writer.add_head_count(32)
    writer.add_head_count_kv(16)
    writer.add_key_length(128)
    writer.add_value_length(128)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(256000)
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gemma_gguf_llama_cpp_defaults(tmp_path):
    """What llama.cpp assumes where a Gemma file lacks a key: Gemma 2's 4096 window, 50 / 30
    soft-caps and alternating layers, the 27B models' attention scale (by layer count),
    Gemma 3's one global layer in six and local rope base 10000; and the keys that override
    them."""
    from transformers import AutoConfig

    def load(name: str, arch: str, layers: int, **keys) -> dict:
        path = _gemma_metadata_file(str(tmp_path / f"{name}.gguf"), arch, layers, **keys)
        return gguf_loader.load_gguf_config(path)

    sliding, full = "sliding_attention", "full_attention"
    config = load("g2_27b", "gemma2", 46)
    assert config["architectures"] == ["Gemma2ForCausalLM"]
    assert (config["query_pre_attn_scalar"], config["sliding_window"]) == (144, 4096)
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert config["layer_types"] == [sliding, full] * 23
    assert config["hidden_activation"] == "gelu_pytorch_tanh"
    assert config["tie_word_embeddings"]
    assert load("g2_9b", "gemma2", 42)["query_pre_attn_scalar"] == 128

    config = load("g3", "gemma3", 8, sliding_window=512, rope_freq_base=1e6)
    assert (config["model_type"], config["query_pre_attn_scalar"]) == ("gemma3_text", 128)
    assert config["layer_types"] == [sliding] * 5 + [full] + [sliding] * 2
    assert config["attn_logit_softcapping"] is None
    assert config["final_logit_softcapping"] is None
    hf = AutoConfig.for_model(config.pop("model_type"), **config)
    assert hf.rope_parameters == {full: {"rope_type": "default", "rope_theta": 1e6},
                                  sliding: {"rope_type": "default", "rope_theta": 1e4}}
    assert load("g3_27b", "gemma3", 62, sliding_window=1024)["query_pre_attn_scalar"] == 144

    config = load("g3_keys", "gemma3", 6, sliding_window=512, rope_freq_base_swa=2e4,
                  sliding_window_pattern=3, final_logit_softcapping=12.5)
    assert config["layer_types"] == [sliding, sliding, full] * 2
    assert (config["rope_local_base_freq"], config["final_logit_softcapping"]) == (2e4, 12.5)

    config = load("g3_global", "gemma3", 4)
    assert config["sliding_window"] is None and config["layer_types"] == [full] * 4

    with pytest.raises(ValueError, match="sliding_window_pattern has 3 entries for 4 layers"):
        load("g3_bad", "gemma3", 4, sliding_window=512, sliding_window_pattern=[True] * 3)


def test_quantized_experts_dequantize_to_each_experts_rows(tmp_path):
    """Q8_0 stacked experts dequantize to each expert's own rows (without
    `quantization="gguf"`); with it they are left out of the dense state dict and come as
    each expert's blocks instead."""
    import gguf
    from safetensors.torch import load_file

    model_dir = make_tiny_model(str(tmp_path / "qwen3_moe"), "qwen3_moe")
    path = str(tmp_path / "q8.gguf")
    _write_gguf(path, model_dir, "qwen3_moe", expert_qtype="Q8_0")
    state = gguf_loader.load_gguf_state_dict(path, torch.float32)
    expected = load_file(os.path.join(model_dir, "model.safetensors"))
    assert state.keys() == expected.keys()
    q8 = gguf.GGMLQuantizationType.Q8_0
    experts = [name for name in expected if ".experts." in name]
    assert len(experts) == 2 * 8 * 3
    for name in experts:
        rounded = gguf.quants.dequantize(gguf.quants.quantize(expected[name].numpy(), q8), q8)
        assert torch.equal(state[name], torch.from_numpy(rounded)), name
        assert not torch.equal(state[name], expected[name]), name
    kept = gguf_loader.load_gguf_state_dict(path, torch.float32, keep_blocks=True)
    assert kept.keys() == expected.keys() - set(experts)
    blocks = gguf_loader.load_gguf_block_codes(path)
    assert set(experts) <= blocks.keys()
    for name in experts:
        assert np.array_equal(blocks[name].dequantize(), state[name].numpy()), name


def test_expert_tensor_names_and_refusals(tmp_path):
    import gguf

    name = gguf_loader.hf_tensor_name
    assert name("blk.1.ffn_up_exps.weight", "qwen3_moe") == (
        "model.layers.1.mlp.experts.*.up_proj.weight")
    assert name("blk.1.ffn_down_exps.weight", "mixtral") == (
        "model.layers.1.block_sparse_moe.experts.*.w2.weight")
    assert name("blk.0.ffn_gate_inp.weight", "mixtral") == (
        "model.layers.0.block_sparse_moe.gate.weight")
    assert name("blk.0.ffn_gate_inp_shexp.weight", "qwen2_moe") == (
        "model.layers.0.mlp.shared_expert_gate.weight")
    # older Mixtral files: one tensor per expert
    assert name("blk.2.ffn_gate.7.weight", "mixtral") == (
        "model.layers.2.block_sparse_moe.experts.7.w1.weight")
    # a dense architecture with experts, and experts without a routed count
    for arch, keys in (("qwen2", {"expert_count": 4, "expert_used_count": 2}),
                       ("qwen3moe", {"expert_count": 4})):
        path = str(tmp_path / f"{arch}.gguf")
        writer = gguf.GGUFWriter(path, arch)
        for key, value in {"block_count": 1, "context_length": 32, "embedding_length": 8,
                           "feed_forward_length": 16, "attention.head_count": 2,
                           "expert_feed_forward_length": 8, **keys}.items():
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_token_list(["a", "b"])
        writer.add_tensor("token_embd.weight", torch.zeros(2, 8).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        match = "not supported" if arch == "qwen2" else "expert_used_count"
        with pytest.raises(ValueError, match=match):
            gguf_loader.load_gguf_config(path)
