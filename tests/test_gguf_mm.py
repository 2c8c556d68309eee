"""`gguf_mm`: every GGUF block type multiplied as the file stores it (csrc/cpu/gguf_mm.cpp).

Blocks are random bytes with small finite float16 scales (every byte pattern of the other
fields is a valid block), decoded by `gguf_dequantize` (with AVX2, from the unpacked blocks
the products read) and compared with gguf-py's `gguf.quants.dequantize` bit for bit; the
products are compared with the activations' int8 rounding applied to the reference (what
the integer form computes), and from `gguf_mm_dense_rows` rows with the exact product.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from vllm.model_executor.layers.quantization.gguf_blocks import (
    GGUF_MM_TYPES,
    GGUFBlockLinear,
    GGUFBlocks,
    gguf_mm_available,
)
from vllm.platforms.cpu import read_cpu_flags

# Where each type keeps its float16 scales (byte offsets in a block).
HALF_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                "IQ4_NL": [0], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2],
                "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}

needs_avx2 = pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= read_cpu_flags() or not gguf_mm_available(),
    reason="gguf_mm's one form needs AVX2 with FMA and F16C (not on this CPU, or not built)")


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> GGUFBlocks:
    _, values, size = GGUF_MM_TYPES[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for offset in HALF_OFFSETS[type_name]:
        scales = rng.uniform(-0.02, 0.02, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return GGUFBlocks(raw.reshape(n, -1), type_name, k)


def quantized_rows_reference(x: torch.Tensor, weight: np.ndarray) -> torch.Tensor:
    """x quantized per row and group of 32 to int8 (absmax / 127, ties to even, in float32
    as the kernel computes the codes), times the weight, in float64."""
    rows, k = x.shape
    groups = x.float().view(rows, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    q = torch.round(groups * (127 / amax)).nan_to_num(0).double()
    xq = (q * (amax / 127).double()).view(rows, k)
    return xq @ torch.from_numpy(weight).double().T


def _products_match_reference(mm, type_name: str) -> None:
    """`mm` (a build's gguf_mm) against the quantized-rows reference, at 1 to 20 rows."""
    n, k = 40, 512  # 40 output rows: two tiles and a part past 8 activation rows
    blocks = random_blocks(type_name, n, k, seed=1)
    weight = blocks.dequantize()
    w = torch.from_numpy(blocks.data)
    gen = torch.Generator().manual_seed(2)
    x, got = torch.empty(0), torch.empty(0)
    for rows in (1, 2, 3, 7, 8, 9, 20):
        x = torch.randn(rows, k, generator=gen)
        got = mm(x, w, blocks.type_id)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        ref = quantized_rows_reference(x, weight)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        # Against the exact product: only the activations' rounding (~1/254 per group).
        exact = x.double() @ torch.from_numpy(weight).double().T
        assert (got.double() - exact).abs().max() <= 0.03 * exact.abs().max()
    # Every row's result is the bits it has alone, whatever the pass it ran in.
    alone = torch.cat([mm(row[None], w, blocks.type_id) for row in x])
    assert torch.equal(got, alone)
    for dtype in (torch.bfloat16, torch.float16):
        low = mm(x.to(dtype), w, blocks.type_id)
        assert low.dtype == dtype
        ref = quantized_rows_reference(x.to(dtype).float(), weight)
        assert (low.double() - ref).abs().max() <= 0.01 * ref.abs().max()


def assert_greedy_drift_small(got, want) -> None:
    """Greedy continuations of a quantized engine (`got`) against its float twin (`want`,
    the same weights dequantized): at least 3 of the 4 agree on their first 4 tokens, and
    over each common prefix the chosen tokens' logprobs differ by 0.15 on average (the
    activations' int8 rounding, amplified by a tiny random model)."""
    agree, drift = 0, []
    for g, w in zip(got, want, strict=True):
        ids, ref_ids = g.outputs[0].token_ids, w.outputs[0].token_ids
        lps, ref_lps = g.outputs[0].logprobs, w.outputs[0].logprobs
        assert lps is not None and ref_lps is not None
        common = 0
        while common < len(ids) and ids[common] == ref_ids[common]:
            drift.append(abs(lps[common][ids[common]].logprob
                             - ref_lps[common][ids[common]].logprob))
            common += 1
        agree += common >= 4
    assert agree >= 3
    assert sum(drift) / len(drift) < 0.15


def test_every_file_type_the_issue_names_has_a_layout() -> None:
    for name, (type_id, values, size) in GGUF_MM_TYPES.items():
        kind = gguf.GGMLQuantizationType[name]
        assert int(kind) == type_id
        assert gguf.GGML_QUANT_SIZES[kind] == (values, size)


@needs_avx2
@pytest.mark.parametrize("type_name", list(GGUF_MM_TYPES))
def test_dequantize_is_gguf_py_bit_for_bit(type_name: str) -> None:
    blocks = random_blocks(type_name, 9, 512)
    got = torch.ops.vllm_cpu.gguf_dequantize(torch.from_numpy(blocks.data), blocks.type_id)
    assert np.array_equal(got.numpy(), blocks.dequantize())


@needs_avx2
@pytest.mark.parametrize("type_name", list(GGUF_MM_TYPES))
def test_products_equal_the_quantized_rows_reference(type_name: str) -> None:
    """The form this machine's build runs (`gguf_mm_form`: "avx512" takes the super-block
    types in 512-bit pairs; the AVX2 form of those is tested below by its own build)."""
    _products_match_reference(torch.ops.vllm_cpu.gguf_mm, type_name)


@needs_avx2
@pytest.mark.slow  # a build of its own (conftest's `avx2_build`, about two minutes)
@pytest.mark.parametrize("type_name", list(GGUF_MM_TYPES))
def test_the_avx2_form_equals_the_quantized_rows_reference(avx2_build, type_name: str) -> None:
    _products_match_reference(avx2_build.gguf_mm, type_name)


@needs_avx2
@pytest.mark.parametrize("type_name", list(GGUF_MM_TYPES))
def test_large_steps_multiply_the_dequantized_weight(type_name: str) -> None:
    """From `gguf_mm_dense_rows(type)` rows a step multiplies x as it is by the weight
    dequantized a tile at a time: the exact product up to float32 rounding, in both forms
    (below 512 rows each thread's own tiles: 520 rows of 512 inputs, on 2 threads 6 tiles
    of 87; from 512 rows tiles shared by the threads, two of them). A row fewer takes the
    integer products (x quantized per group)."""
    from vllm._custom_ops import cpu_ops

    ops = cpu_ops()
    assert ops is not None
    blocks = random_blocks(type_name, 520, 512, seed=6)
    weight = blocks.dequantize()
    w = torch.from_numpy(blocks.data)
    rows = ops.gguf_mm_dense_rows(blocks.type_id)
    values = GGUF_MM_TYPES[type_name][1]
    assert rows == (128 if type_name == "Q8_0" else 48 if values == 32 else 96)
    for count in (rows + 3, 515):
        x = torch.randn(count, 512, generator=torch.Generator().manual_seed(7))
        exact = x.double() @ torch.from_numpy(weight).double().T
        got = torch.ops.vllm_cpu.gguf_mm(x, w, blocks.type_id)
        assert got.dtype == torch.float32 and got.shape == (count, 520)
        assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    x = x[:rows + 3]
    below = torch.ops.vllm_cpu.gguf_mm(x[:rows - 1], w, blocks.type_id)
    ref = quantized_rows_reference(x[:rows - 1], weight)
    assert torch.allclose(below.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    low = torch.ops.vllm_cpu.gguf_mm(x.bfloat16(), w, blocks.type_id)
    assert low.dtype == torch.bfloat16
    exact_low = x.bfloat16().double() @ torch.from_numpy(weight).double().T
    assert (low.double() - exact_low).abs().max() <= 0.01 * exact_low.abs().max()
    # 0: never dense (the integer products at any size); -1: the defaults again.
    ops.set_gguf_mm_dense_rows(0)
    try:
        integer = torch.ops.vllm_cpu.gguf_mm(x, w, blocks.type_id)
    finally:
        ops.set_gguf_mm_dense_rows(-1)
    ref = quantized_rows_reference(x, weight)
    assert torch.allclose(integer.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert ops.gguf_mm_dense_rows(blocks.type_id) == rows
    with pytest.raises(RuntimeError, match="rows must be >= -1"):
        ops.set_gguf_mm_dense_rows(-2)


@needs_avx2
def test_large_steps_under_inference_mode() -> None:
    """The engine runs its steps under `torch.inference_mode()`, whose output tensors only
    inference mode may write; the dense form's worker threads (each multiplying tiles of
    its own) must write them as the caller would, in both modes, with the same values."""
    blocks = random_blocks("Q5_0", 300, 256, seed=8)
    w = torch.from_numpy(blocks.data)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(9))
    outside = torch.ops.vllm_cpu.gguf_mm(x, w, blocks.type_id)
    with torch.inference_mode():
        inside = torch.ops.vllm_cpu.gguf_mm(x, w, blocks.type_id)
        assert inside.is_inference()
    assert torch.equal(inside, outside)


@needs_avx2
def test_bad_inputs_are_refused_by_name() -> None:
    blocks = random_blocks("Q4_K", 4, 256)
    w = torch.from_numpy(blocks.data)
    with pytest.raises(RuntimeError, match="x has 255 columns"):
        torch.ops.vllm_cpu.gguf_mm(torch.randn(1, 255), w, blocks.type_id)
    with pytest.raises(RuntimeError, match="unsupported GGUF block type 99"):
        torch.ops.vllm_cpu.gguf_mm(torch.randn(1, 256), w, 99)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        torch.ops.vllm_cpu.gguf_mm(torch.randn(1, 256).double(), w, blocks.type_id)
    with pytest.raises(ValueError, match="do not hold 512 values"):
        GGUFBlocks(blocks.data, "Q4_K", 512)


def test_blocks_slice_as_a_tensor_parallel_rank_keeps_them() -> None:
    blocks = random_blocks("Q6_K", 6, 512)
    full = blocks.dequantize()
    assert np.array_equal(blocks.narrow(0, 2, 3).dequantize(), full[2:5])
    assert np.array_equal(blocks.narrow(1, 256, 256).dequantize(), full[:, 256:])
    with pytest.raises(ValueError, match="split a Q6_K block of 256"):
        blocks.narrow(1, 128, 256)
    order = np.array([5, 0, 3, 1, 2, 4])
    assert np.array_equal(blocks.permute_rows(order).dequantize(), full[order])
    padded = blocks.pad_rows(8).dequantize()
    assert np.array_equal(padded[:6], full) and not padded[6:].any()


@needs_avx2
def test_a_fused_layer_keeps_each_part_in_its_own_type() -> None:
    """A Q4_K_M file's fused q/k/v: q and k Q5_0, v Q8_0, all multiplied in place."""
    parts = [random_blocks("Q5_0", 16, 256, seed=3), random_blocks("Q5_0", 8, 256, seed=4),
             random_blocks("Q8_0", 8, 256, seed=5)]
    bias = torch.randn(32)
    layer = GGUFBlockLinear(parts, bias)
    weight = np.concatenate([p.dequantize() for p in parts])
    x = torch.randn(5, 256)
    ref = quantized_rows_reference(x, weight) + bias.double()
    got = layer(x)
    assert got.shape == (5, 32)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert sum(b.numel() for b in layer.buffers()) == sum(p.data.nbytes for p in parts)


@needs_avx2
@pytest.mark.parametrize("k", [128, 256, 288, 640, 864])
def test_repacked_q5_0_rows_keep_their_values(k: int) -> None:
    """`gguf_repack`: Q5_0 rows of at least 256 values as super-blocks of 8 blocks (type
    1006, the same bytes), a row's last k % 256 values left as Q5_0 blocks (k 288: one,
    640: four, 864: three); shorter rows stay as they are. Dequantized, gguf-py's values
    bit for bit; the products as the quantized-rows reference at 1 to 20 rows (the integer
    form) and exact at 70 (the dense one), each row's result the same alone; the layer takes
    the form unless told not to (a tied LM head's blocks are the embedding's too)."""
    from vllm._custom_ops import cpu_ops

    ops = cpu_ops()
    assert ops is not None
    blocks = random_blocks("Q5_0", 40, k, seed=k)
    weight = blocks.dequantize()
    w, type_id = ops.gguf_repack(torch.from_numpy(blocks.data), blocks.type_id)
    assert type_id == (6 if k < 256 else 1006) and w.shape == blocks.data.shape
    assert np.array_equal(w.numpy(), blocks.data) == (k < 256)
    assert np.array_equal(torch.ops.vllm_cpu.gguf_dequantize(w, type_id).numpy(), weight)
    gen = torch.Generator().manual_seed(1)
    x, got = torch.empty(0), torch.empty(0)
    for rows in (1, 2, 3, 8, 9, 20):
        x = torch.randn(rows, k, generator=gen)
        got = torch.ops.vllm_cpu.gguf_mm(x, w, type_id)
        ref = quantized_rows_reference(x, weight)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    alone = torch.cat([torch.ops.vllm_cpu.gguf_mm(row[None], w, type_id) for row in x])
    assert torch.equal(got, alone)
    assert ops.gguf_mm_dense_rows(type_id) == 48
    x = torch.randn(70, k, generator=gen)  # past gguf_mm_dense_rows
    exact = x.double() @ torch.from_numpy(weight).double().T
    got = torch.ops.vllm_cpu.gguf_mm(x, w, type_id)
    assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert GGUFBlockLinear([blocks], None).types == [type_id]
    kept = GGUFBlockLinear([blocks], None, repack=False)
    assert kept.types == [6] and np.array_equal(kept.weights[0].numpy(), blocks.data)


def q4_k_m_type(gguf_name: str) -> str:
    """The layer types of a llama.cpp Q4_K_M file: Q6_K for v and down, Q4_K for the
    rest, and a Q5_0 gate (its fallback where a row is not whole super-blocks)."""
    for part, type_name in (("attn_v", "Q6_K"), ("ffn_down", "Q6_K"), ("ffn_gate", "Q5_0")):
        if part in gguf_name:
            return type_name
    return "Q4_K"


@needs_avx2
@pytest.mark.slow
def test_a_q4_k_m_file_keeps_its_blocks_and_matches_its_dequantized_weights(tmp_path) -> None:
    from typing import Any, cast

    from tests.model_factory import make_tiny_model
    from tests.test_gguf_families import _write_gguf
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.gguf_file import GGUFFile

    # Untied: the Q8_0 embedding table and the Q8_0 output each read their own blocks.
    model_dir = make_tiny_model(str(tmp_path / "llama"), "llama", hidden_size=256,
                                intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, tie_word_embeddings=False)
    path = str(tmp_path / "q4_k_m.gguf")
    _write_gguf(path, model_dir, "llama", layer_qtype=q4_k_m_type)
    kwargs: dict[str, Any] = dict(tokenizer=model_dir, dtype="float32", max_model_len=128,
                                  enforce_eager=True, kv_cache_memory_bytes=4 * 1024**2)
    quantized = LLM(path, quantization="gguf", **kwargs)
    model = cast(Any, quantized.llm_engine.engine_core.model_executor).model_runner.model
    blocks = [m.kernel for m in model.modules()
              if isinstance(m, LinearBase) and isinstance(m.kernel, GGUFBlockLinear)]
    assert len(blocks) == 2 * 4 + 1  # qkv, o, gate_up, down of two layers; the output
    for m in model.modules():
        if isinstance(m, LinearBase) and isinstance(m.kernel, GGUFBlockLinear):
            assert m.weight is None  # no dense copy kept
    assert {name for k in blocks for name in k.type_names} == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    embedding = model.embed_tokens
    assert embedding.weight is None and embedding.blocks is not None
    # Every quantized tensor's resident bytes are the file's (the norms are float32 in
    # both), and nothing else of size is held.
    block_bytes = sum(b.numel() for kernel in blocks for b in kernel.buffers())
    block_bytes += embedding.blocks.numel()
    file_bytes = sum(t.data.nbytes for t in GGUFFile(path).tensors
                     if t.tensor_type.name != "F32")
    assert block_bytes == file_bytes
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert dense_bytes < 0.02 * file_bytes

    # Against the same file dequantized at load. Layer by layer: each kernel is exactly the
    # dequantized weight times int8-rounded activations (the loader kept every part, in its
    # type, in the order and row permutation of the dense weight).
    reference = LLM(path, quantization="none", **kwargs)
    dense = dict(cast(Any, reference.llm_engine.engine_core.model_executor)
                 .model_runner.model.named_modules())
    gen = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and isinstance(module.kernel, GGUFBlockLinear):
            x = torch.randn(3, module.in_features, generator=gen)
            ref = dense[name]  # an untied float32 head keeps only its oneDNN-packed copy
            weight = ref.weight if ref.weight is not None else ref.kernel.packed_weight.to_dense()
            want = quantized_rows_reference(x, weight.numpy())
            assert torch.allclose(module(x).double(), want, rtol=1e-5,
                                  atol=1e-5 * want.abs().max().item()), name
    # End to end: greedy continuations agree; over their common prefix the chosen tokens'
    # logprobs drift by the activations' rounding, amplified by this tiny random model as
    # much as quant_gemv's are (Q8_0 and Q4_1 files of this model: up to ~0.3, mean ~0.06).
    prompts = ["Hello world, this is", "What is the capital of France? The capital is",
               "1, 2, 3, 4, 5,", "The quick brown fox"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    got = quantized.generate(prompts, params, use_tqdm=False)
    want_out = reference.generate(prompts, params, use_tqdm=False)
    assert_greedy_drift_small(got, want_out)
    assert len({tuple(o.outputs[0].token_ids) for o in got}) > 1  # not degenerate
