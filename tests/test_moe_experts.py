"""`moe_experts` (csrc/cpu/moe.cpp): one mixture-of-experts layer's experts for all of a
step's tokens in one native call, against the per-expert reference loop (each expert's
rows through its gate/up, SiLU, down, summed with the routing weights), for every weight
type and each instruction-set form this machine runs (the build's own, and the AVX2 form
built alone with -march=haswell).

Tolerances: float32 sums in another order than the reference's (`torch.mm`) differ by a
few ulp of the largest output; GGUF types compare with `gguf_mm` on the same blocks (the
activations quantized per row and 32 values the same way), where only the SiLU's last
bits may move one intermediate code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.gguf_encoders import encode_q4_k
from tests.test_gguf_mm import assert_greedy_drift_small, needs_avx2, random_blocks
from vllm.model_executor.layers.fused_moe import FusedMoE, native_experts_available
from vllm.model_executor.layers.quantization.gguf_blocks import GGUF_MM_TYPES, quantize_q8_0

E, H, I = 8, 256, 256  # noqa: E741 (K-quants need whole super-blocks of 256 on both products)

needs_native = pytest.mark.skipif(
    not native_experts_available(),
    reason="moe_experts needs AVX2 with FMA and F16C (not on this CPU, or not built)")

# (tokens, top-k, routing): uneven groups, experts with no rows, one expert with all of
# them (over the dense batched form's 32 rows), top-k equal to the number of experts, and
# ~12 rows an expert (the dense decode form's passes over one weight block: 3 or more)
ROUTINGS = [(1, 2, "random"), (5, 3, "random"), (40, 2, "one expert takes slot 0"),
            (3, E, "every expert"), (24, 4, "random")]


def _routing(tokens: int, k: int, kind: str, gen: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    if kind == "one expert takes slot 0":
        ids[:, 0] = 3
        ids[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
    weights = torch.rand(tokens, k, generator=gen)
    return weights, ids


def _reference(x, weights, ids, product) -> torch.Tensor:
    """Per expert, its rows: h = x w1^T, x w3^T; a = SiLU(gate) * up; y = a w2^T; then
    each token's rows times their weights, summed in slot order (float64 accumulation)."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for e in range(E):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if len(tokens) == 0:
            continue
        a = F.silu(product("w1", e, x[tokens])) * product("w3", e, x[tokens])
        y = product("w2", e, a)
        out.index_put_((tokens,), (weights[tokens, slots, None] * y).double(), accumulate=True)
    return out


def _weights(kind: str, gen: torch.Generator):
    """(w1, w3, w2 tensors for the op, their type ids, product(part, expert, rows))."""
    dense = {p: torch.randn(E, *shape, generator=gen) / 16
             for p, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I)))}
    if kind in ("F32", "BF16"):
        dtype = torch.float32 if kind == "F32" else torch.bfloat16
        tensors = {p: w.to(dtype) for p, w in dense.items()}
        type_id = 0 if kind == "F32" else 30
    else:
        if kind == "Q4_K":  # the tests' encoder (gguf-py cannot encode K-quants)
            tensors = {p: torch.from_numpy(encode_q4_k(w.reshape(-1, w.shape[-1]).numpy())
                                           ).reshape(E, w.shape[1], -1)
                       for p, w in dense.items()}
        elif kind == "Q8_0":  # the int8 path's encoder
            tensors = {p: quantize_q8_0(w) for p, w in dense.items()}
        else:  # random blocks of the type (every byte pattern is a valid block)
            tensors = {p: torch.from_numpy(np.stack([
                random_blocks(kind, w.shape[1], w.shape[2], seed=10 * e + i).data
                for e in range(E)])) for i, (p, w) in enumerate(dense.items())}
        type_id = GGUF_MM_TYPES[kind][0]

    def product(part, e, rows):
        if kind in ("F32", "BF16"):
            return rows.float() @ tensors[part][e].float().T
        return torch.ops.vllm_cpu.gguf_mm(rows.float().contiguous(), tensors[part][e], type_id)
    return tensors, (type_id,) * 3, product


KINDS = ["F32", "BF16", "Q8_0", "Q4_K", *[t for t in GGUF_MM_TYPES if t not in ("Q8_0", "Q4_K")]]


def _check(op, kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors, types, product = _weights(kind, gen)
    for tokens, k, routing in ROUTINGS:
        x = torch.randn(tokens, H, generator=gen)
        weights, ids = _routing(tokens, k, routing, gen)
        got = op(x, weights, ids, tensors["w1"], tensors["w3"], tensors["w2"], *types)
        want = _reference(x, weights, ids, product)
        assert got.shape == (tokens, H) and got.dtype == torch.float32
        scale = want.abs().max().item()
        tolerance = 2e-6 if kind == "F32" else 1e-2 if kind == "BF16" else 1e-3
        assert (got.double() - want).abs().max().item() <= tolerance * scale, (kind, routing)
        if kind not in ("F32", "BF16"):  # a token's result is its own, whatever the batch
            alone = torch.cat([op(x[t:t + 1], weights[t:t + 1], ids[t:t + 1], tensors["w1"],
                                  tensors["w3"], tensors["w2"], *types) for t in range(tokens)])
            assert torch.equal(got, alone), (kind, routing)


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_the_op_equals_the_per_expert_loop(kind: str) -> None:
    _check(torch.ops.vllm_cpu.moe_experts, kind)


@needs_avx2
@pytest.mark.slow  # a build of its own (conftest's `avx2_build`, about two minutes)
@pytest.mark.parametrize("kind", ["F32", "BF16", "Q8_0", "Q4_K", "Q6_K"])
def test_the_avx2_form_equals_the_per_expert_loop(avx2_build, kind: str) -> None:
    _check(avx2_build.moe_experts, kind)


@needs_native
def test_mixed_types_and_strided_halves() -> None:
    """Gate and up in different types (Q4_K, Q8_0), down in a third (Q6_K); float32 gate
    and up as the two halves of one stacked [E, 2I, H] tensor (strided views)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, H, generator=gen)
    weights, ids = _routing(6, 2, "random", gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / 16
    w2 = torch.randn(E, H, I, generator=gen) / 16
    got = torch.ops.vllm_cpu.moe_experts(x, weights, ids, w13[:, :I], w13[:, I:], w2, 0, 0, 0)
    want = _reference(x, weights, ids, lambda p, e, rows: rows @ (
        w13[e, :I] if p == "w1" else w13[e, I:] if p == "w3" else w2[e]).T)
    assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max()
    q1 = torch.from_numpy(encode_q4_k(w13[:, :I].reshape(-1, H).numpy())).reshape(E, I, -1)
    q3 = quantize_q8_0(w13[:, I:])
    q2 = torch.from_numpy(np.stack([random_blocks("Q6_K", H, I, seed=e).data for e in range(E)]))
    types = {"w1": GGUF_MM_TYPES["Q4_K"][0], "w3": GGUF_MM_TYPES["Q8_0"][0],
             "w2": GGUF_MM_TYPES["Q6_K"][0]}
    tensors = {"w1": q1, "w3": q3, "w2": q2}
    got = torch.ops.vllm_cpu.moe_experts(x, weights, ids, q1, q3, q2, types["w1"], types["w3"],
                                         types["w2"])
    want = _reference(x, weights, ids, lambda p, e, rows: torch.ops.vllm_cpu.gguf_mm(
        rows.float().contiguous(), tensors[p][e], types[p]))
    assert (got.double() - want).abs().max() <= 1e-3 * want.abs().max()


@needs_native
def test_bfloat16_activations_come_back_in_their_dtype() -> None:
    gen = torch.Generator().manual_seed(2)
    tensors, types, _ = _weights("BF16", gen)
    x = torch.randn(4, H, generator=gen).bfloat16()
    weights, ids = _routing(4, 2, "random", gen)
    got = torch.ops.vllm_cpu.moe_experts(x, weights, ids, tensors["w1"], tensors["w3"],
                                         tensors["w2"], *types)
    want = torch.ops.vllm_cpu.moe_experts(x.float(), weights, ids, tensors["w1"],
                                          tensors["w3"], tensors["w2"], *types)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.bfloat16())


@needs_native
def test_bad_inputs_are_refused_by_name() -> None:
    gen = torch.Generator().manual_seed(3)
    tensors, types, _ = _weights("F32", gen)
    x = torch.randn(2, H, generator=gen)
    weights, ids = _routing(2, 2, "random", gen)
    w1, w3, w2 = tensors["w1"], tensors["w3"], tensors["w2"]
    op = torch.ops.vllm_cpu.moe_experts
    with pytest.raises(RuntimeError, match="expert id 8 is not below 8"):
        op(x, weights, torch.full_like(ids, 8), w1, w3, w2, *types)
    with pytest.raises(RuntimeError, match="topk_ids must be int64"):
        op(x, weights, ids.int(), w1, w3, w2, *types)
    with pytest.raises(RuntimeError, match="w1 is Float, type 30 needs bfloat16"):
        op(x, weights, ids, w1, w3, w2, 30, 0, 0)
    with pytest.raises(RuntimeError, match="w2's rows hold"):
        op(x, weights, ids, w1, w3, quantize_q8_0(w2)[..., :-1], 0, 0, 8)
    with pytest.raises(RuntimeError, match="unsupported GGUF block type 99"):
        op(x, weights, ids, w1, w3, torch.zeros(E, H, 10, dtype=torch.uint8), 0, 0, 99)


@needs_native
def test_the_layer_picks_the_op_for_each_weight_type() -> None:
    """FusedMoE after loading: float32 and bfloat16 weights as they are, int8 as Q8_0
    blocks (sizes in whole blocks of 32; else the per-channel int8 loop)."""
    gen = torch.Generator().manual_seed(4)
    x, logits = torch.randn(7, 64, generator=gen), torch.randn(7, E, generator=gen)

    def layer(inter: int, hidden: int = 64) -> FusedMoE:
        m = FusedMoE(E, 2, hidden, inter, renormalize=True)
        m.w13_weight.data = torch.randn(E, 2 * inter, hidden, generator=gen) / 8
        m.w2_weight.data = torch.randn(E, hidden, inter, generator=gen) / 8
        return m

    for inter in (32, 64):
        m = layer(inter)
        reference = m(x, logits)  # no kernel picked yet: the Python loop
        assert m.process_weights_after_loading(None, pack=False) == "float32 experts (native)"
        torch.testing.assert_close(m(x, logits), reference, atol=1e-5, rtol=1e-5)
        assert m.process_weights_after_loading("int8", pack=False) == (
            "int8 experts (Q8_0 blocks, native)")
        assert m.w13_weight.numel() == 0  # the blocks replace the dense weights
        assert (m(x, logits) - reference).norm() / reference.norm() < 0.02
    for inter, hidden in ((24, 64), (32, 48)):
        assert layer(inter, hidden).process_weights_after_loading("int8", pack=False) == (
            "int8 experts")


@needs_native
@pytest.mark.slow
def test_a_gguf_moe_file_keeps_its_experts_blocks_and_generates(tmp_path) -> None:
    """Qwen3-MoE written by the tests with its experts in Q4_K (gate, up) and Q8_0 (down):
    `quantization="gguf"` keeps them as the file stores them (resident bytes = the file's,
    no dense copy), and greedy continuations agree with the same file dequantized at load,
    with logprobs drifting only by the activations' int8 rounding."""
    from typing import Any, cast

    from tests.model_factory import make_tiny_model
    from tests.test_gguf_families import _write_gguf
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.fused_moe import NativeExpertKernel
    from vllm.model_executor.model_loader.gguf_file import GGUFFile

    model_dir = make_tiny_model(str(tmp_path / "qwen3_moe"), "qwen3_moe", hidden_size=256,
                                moe_intermediate_size=256, num_attention_heads=4,
                                num_key_value_heads=2)
    path = str(tmp_path / "moe.gguf")
    _write_gguf(path, model_dir, "qwen3_moe",
                expert_qtype=lambda name: "Q8_0" if "down" in name else "Q4_K")
    kwargs: dict[str, Any] = dict(tokenizer=model_dir, dtype="float32", max_model_len=128,
                                  enforce_eager=True, kv_cache_memory_bytes=4 * 1024**2)
    quantized = LLM(path, quantization="gguf", **kwargs)
    model = cast(Any, quantized.llm_engine.engine_core.model_executor).model_runner.model
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2
    held = 0
    for layer in layers:
        assert isinstance(layer.kernel, NativeExpertKernel)
        assert layer.kernel.types == (GGUF_MM_TYPES["Q4_K"][0], GGUF_MM_TYPES["Q4_K"][0],
                                      GGUF_MM_TYPES["Q8_0"][0])
        assert layer.w13_weight.numel() == layer.w2_weight.numel() == 0  # no dense copy
        held += sum(w.untyped_storage().nbytes() for w in layer.kernel.weights)
    file_bytes = sum(t.data.nbytes for t in GGUFFile(path).tensors if "_exps" in t.name)
    assert held == file_bytes

    reference = LLM(path, quantization="none", **kwargs)  # the file widened to float32
    prompts = ["Hello world, this is", "What is the capital of France? The capital is",
               "1, 2, 3, 4, 5,", "The quick brown fox"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    got = quantized.generate(prompts, params, use_tqdm=False)
    want = reference.generate(prompts, params, use_tqdm=False)
    assert_greedy_drift_small(got, want)
