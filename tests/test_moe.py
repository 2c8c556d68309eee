"""Mixture of experts: routing and grouping exactly, the experts layer against a naive
per-token reference (float, bfloat16 packed, int8), checkpoint names into the stacked
weights and their tensor-parallel slices, and each MoE family end to end against
transformers (float32: greedy tokens identical, logprobs within 1e-4) with a batch of
different lengths, chunked prefill, preemption, prefix hits, prompt embeds and graphs;
two ranks equal one (float: the ranks' partial sums; int8: end to end)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.hf_reference import (
    assert_close_greedy,
    assert_identical_greedy,
    hf_greedy,
    load_hf_model,
)
from tests.model_factory import make_tiny_model
from tests.test_tensor_parallel import Q8_0_LOGPROB_TOL, _as_rank, _assert_same, _run_both
from vllm import LLM, SamplingParams
from vllm.config import InputKind
from vllm.model_executor.layers.fused_moe import (
    ExpertKernel,
    FusedMoE,
    PackedExpertKernel,
    group_by_expert,
    native_experts_available,
    select_experts,
)
from vllm.model_executor.layers.packed_linear import can_pack
from vllm.model_executor.model_loader.weight_utils import resolve_expert_name, resolve_name
from vllm.v1.executor.uniproc import UniProcExecutor

# ---- routing and grouping ---------------------------------------------------------------


def test_select_experts_example() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 4.0]]).log()
    logits[0, 0] = 0.0  # probs .1 .3 .2 .4 (exp(0) = 1 of a total of 10)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.4, 0.3]]))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.tensor([[4 / 7, 3 / 7]]))


def test_group_by_expert_example() -> None:
    groups = group_by_expert(torch.tensor([[3, 0], [0, 5]]), num_experts=8)
    assert groups.order.tolist() == [1, 2, 0, 3]
    assert groups.tokens.tolist() == [0, 1, 0, 1]
    assert groups.spans == [(0, 0, 2), (3, 2, 3), (5, 3, 4)]  # only the active experts


def _random_layer(num_experts: int = 8, top_k: int = 2, hidden: int = 32, inter: int = 16,
                  renormalize: bool = True, seed: int = 0) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    layer = FusedMoE(num_experts, top_k, hidden, inter, renormalize)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(layer.w13_weight.shape, generator=g) * 0.3)
        layer.w2_weight.copy_(torch.randn(layer.w2_weight.shape, generator=g) * 0.3)
    return layer


def _naive(layer: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Token by token, slot by slot: softmax, top-k, each chosen expert's SiLU-gated MLP."""
    out = torch.zeros_like(x)
    inter = layer.intermediate_size
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].float(), -1)
        top = probs.topk(layer.top_k)
        weights = top.values / top.values.sum() if layer.renormalize else top.values
        for w, e in zip(weights.tolist(), top.indices.tolist()):
            gate_up = layer.w13_weight[e] @ x[t]
            a = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += w * (layer.w2_weight[e] @ a)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_experts_equal_a_naive_per_token_reference(renormalize: bool) -> None:
    """1 token (2 of 8 experts active) and 40 tokens (all active, uneven groups)."""
    layer = _random_layer(renormalize=renormalize)
    layer.process_weights_after_loading(None, pack=False)
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 40):
        x = torch.randn(tokens, 32, generator=g)
        logits = torch.randn(tokens, 8, generator=g)
        torch.testing.assert_close(layer(x, logits), _naive(layer, x, logits),
                                   atol=1e-5, rtol=1e-5)


def test_int8_experts_stay_close() -> None:
    """int8 experts stay within a few percent of float (per-channel weights, per-token
    activations), and a token's result does not depend on the other tokens of its step."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(24, 32, generator=g)
    logits = torch.randn(24, 8, generator=g)
    layer = _random_layer()
    reference = _naive(layer, x, logits)
    layer.process_weights_after_loading("int8", pack=False)
    int8 = layer(x, logits)
    assert (int8 - reference).norm() / reference.norm() < 0.03
    torch.testing.assert_close(layer(x[5:6], logits[5:6]), int8[5:6])  # batch independent


@pytest.mark.parametrize("path", [pytest.param("packed", marks=pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")),
    reason="no oneDNN bfloat16 reorder: it needs AVX-512 BW+VL+DQ or AVX-NE-CONVERT (or a "
           "torch build with oneDNN); [dense] checks the loop's other form")), "dense",
    pytest.param("native", marks=pytest.mark.skipif(
        not native_experts_available(), reason="moe_experts not built (no AVX2 with FMA and "
                                               "F16C); the loop forms run instead"))])
def test_bfloat16_expert_kernels_give_f_linears_result(path: str) -> None:
    """Each bfloat16 experts' kernel (native: the `moe_experts` op the loader picks where it
    is built; the Python loop's where it is not: packed, oneDNN-packed weights where it
    reorders bfloat16, dense, `F.linear`) gives the unprocessed layer's bfloat16 result,
    within bfloat16 rounding of float (the native op keeps its sums and the intermediate
    activations in float32, so it is at least as close to float as the loop)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(24, 32, generator=g)
    logits = torch.randn(24, 8, generator=g)
    reference = _naive(_random_layer(), x, logits)
    layer = _random_layer().to(torch.bfloat16)
    dense = layer(x.bfloat16(), logits.bfloat16())
    if path == "native":
        assert layer.process_weights_after_loading(None, pack=True) == (
            "bfloat16 experts (native)")
    else:
        layer.kernel = (PackedExpertKernel if path == "packed" else ExpertKernel)(layer)
    got = layer(x.bfloat16(), logits.bfloat16())
    error = (got.float() - reference).norm() / reference.norm()
    if path == "native":
        assert error <= (dense.float() - reference).norm() / reference.norm()
    else:
        torch.testing.assert_close(got, dense)
    assert error < 0.02


# ---- checkpoint names and tensor-parallel slices ------------------------------------------


def test_expert_checkpoint_names_resolve_to_the_stacked_parts() -> None:
    assert resolve_expert_name(".layers.0.mlp.experts.5.down_proj.weight") == (
        "layers.0.mlp.experts.w2_weight", (5, "w2"))
    assert resolve_name("model.layers.1.mlp.experts.12.up_proj.weight", {}, {}) == (
        "layers.1.mlp.experts.w13_weight", (12, "w3"))
    assert resolve_expert_name(".layers.0.mlp.experts.3.w1.weight") == (
        "layers.0.mlp.experts.w13_weight", (3, "w1"))  # Mixtral
    # The shared expert and the router stay on the ordinary path.
    mapping = {"gate_up_proj": [("gate_proj", 0), ("up_proj", 1)]}
    assert resolve_name("model.layers.0.mlp.shared_expert.gate_proj.weight", mapping, {}) == (
        "layers.0.mlp.shared_expert.gate_up_proj.weight", 0)
    assert resolve_name("model.layers.0.mlp.gate.weight", mapping, {}) == (
        "layers.0.mlp.gate.weight", None)


def test_expert_weights_shard_by_intermediate_size() -> None:
    """I = 8 on 2 ranks, rank 1: gate rows 4-7 -> w13[e, :4], up rows 4-7 -> w13[e, 4:],
    down columns 4-7 -> w2[e]."""
    with _as_rank(1, 2):
        layer = FusedMoE(4, 2, 3, 8, renormalize=True)
    gate = torch.arange(8.0)[:, None].expand(8, 3)
    down = torch.arange(8.0)[None, :].expand(3, 8)
    layer.weight_loader(layer.w13_weight, gate, (2, "w1"))
    layer.weight_loader(layer.w13_weight, gate + 100, (2, "w3"))
    layer.weight_loader(layer.w2_weight, down, (2, "w2"))
    assert layer.w13_weight[2, :, 0].tolist() == [4, 5, 6, 7, 104, 105, 106, 107]
    assert layer.w2_weight[2, 0].tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"expert < 4"):
        layer.weight_loader(layer.w13_weight, gate, (4, "w1"))
    with pytest.raises(ValueError, match=r"expected \(4, 3\)"):
        layer.weight_loader(layer.w13_weight, gate[:, :2], (0, "w3"))


def test_ranks_partial_outputs_sum_to_one_ranks() -> None:
    """Float experts on 2 ranks: each rank's slice of the same checkpoint gives a partial
    output; their sum (the all-reduce) is the one-rank output."""
    full = _random_layer(inter=16)
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(6, 32, generator=g), torch.randn(6, 8, generator=g)
    weights, ids = select_experts(logits, 2, True)
    partials = []
    for rank in range(2):
        with _as_rank(rank, 2):
            layer = FusedMoE(8, 2, 32, 16, renormalize=True)
        for e in range(8):
            w13, w2 = full.w13_weight[e], full.w2_weight[e]
            layer.weight_loader(layer.w13_weight, w13[:16], (e, "w1"))
            layer.weight_loader(layer.w13_weight, w13[16:], (e, "w3"))
            layer.weight_loader(layer.w2_weight, w2, (e, "w2"))
        partials.append(layer.run(x, weights, ids))
    torch.testing.assert_close(partials[0] + partials[1], full.run(x, weights, ids),
                               atol=1e-5, rtol=1e-5)


# ---- end to end against transformers ------------------------------------------------------

PROMPTS = [
    "Hello world, this is",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot "
    "who lived in a quiet village by the sea, and every morning it walked to the market.",
    "A",
    "What is the capital of France? The capital of France is",
    "She ordered a café au lait and a croissant; 日本語 🙂",
]
MAX_TOKENS = 24


def _check(outputs, refs) -> None:
    assert_identical_greedy(outputs, refs)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"])
@pytest.mark.slow
def test_moe_family_matches_transformers(arch: str, tmp_path) -> None:
    """One engine: chunks of 16 tokens, blocks of 4, a cache too small for the batch
    (preemptions), prompt embeds on, graphs of 4 tokens (both sets replayed): text prompts,
    then two of them again (a prefix hit) beside two others' embeddings."""
    path = make_tiny_model(str(tmp_path / arch), arch)
    llm = LLM(path, dtype="float32", max_model_len=96, block_size=4,
              num_gpu_blocks_override=26, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prompt_embeds=True, compilation_config={"cudagraph_capture_sizes": [4]})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    model = load_hf_model(path)
    refs = [hf_greedy(model, o.prompt_token_ids, MAX_TOKENS) for o in first]
    _check(first, refs)
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0
    embeds = [{"prompt_embeds": model.get_input_embeddings()(
        torch.tensor(o.prompt_token_ids)).detach()} for o in first[:2]]
    # The last prompts finished last: their blocks are the last the cache evicts.
    second = llm.generate([PROMPTS[4], PROMPTS[3], *embeds], params, use_tqdm=False)
    _check(second, [refs[4], refs[3], refs[0], refs[1]])
    assert second[0].num_cached_tokens > 0
    assert isinstance(core.model_executor, UniProcExecutor)
    graphs = core.model_executor.model_runner.graphs
    assert graphs is not None
    assert {kind for kind, _ in graphs.replays} == {InputKind.TOKEN_IDS, InputKind.EMBEDS}


# ---- tensor parallel ----------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_match_transformers_in_float32(tmp_path) -> None:
    """Qwen2-MoE (routed experts and the gated shared expert) on 2 ranks, in chunks of 16
    tokens: each rank's experts (32 of 64 intermediate columns) through the native op, the
    ranks' outputs summed; greedy tokens identical to transformers'."""
    from tests.test_tensor_parallel import _llm

    path = make_tiny_model(str(tmp_path / "qwen2_moe"), "qwen2_moe", moe_intermediate_size=64)
    llm = _llm(path, 2, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    model = load_hf_model(path)
    _check(outputs, [hf_greedy(model, o.prompt_token_ids, 12) for o in outputs])


@pytest.mark.slow
def test_two_ranks_equal_one_int8_and_drift(tmp_path) -> None:
    """OLMoE in int8 (experts as Q8_0 blocks through the native op where it is built) on 2
    ranks and on 1, intermediate size 64: the experts sliced by the loader (whole blocks of
    32 a rank), the q/k norms over the whole projection summed over the ranks; the same
    tokens, logprobs within Q8_0_LOGPROB_TOL (the ranks' float sums of Q8_0 products can
    round a later activation to the next code: test_tensor_parallel's comment). Then the
    intermediate size 32 model on 1 rank: the int8 tokens stay close to float
    transformers' (the same until a near-tie flips, logprobs within 0.1 until then).

    A flip here can be the router's: with Q8_0 experts, the first prompt's 7th token takes
    another expert in the second layer, whose float top-2 margin is 0.006 in probability,
    and from there its logits differ by ~1 nat (the token float chooses is not in int8's
    top 5). So the check at the first divergence is that each side's token is in the
    other's top 5 or the sequences agreed for at least 6 tokens (measured: 6, 2, 10, 1)."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    wide = make_tiny_model(str(tmp_path / "olmoe64"), "olmoe", intermediate_size=64)
    ones, twos = _run_both(wide, PROMPTS[:4], greedy, enforce_eager=True, quantization="int8")
    _assert_same(ones, twos, Q8_0_LOGPROB_TOL)
    from tests.test_tensor_parallel import _llm

    path = make_tiny_model(str(tmp_path / "olmoe"), "olmoe")
    ones = _llm(path, 1, quantization="int8").generate(PROMPTS[:4], greedy, use_tqdm=False)
    model = load_hf_model(path)
    common = []
    for out in ones:
        ref = hf_greedy(model, out.prompt_token_ids, 10)
        completion = out.outputs[0]
        n = next((i for i, (a, b) in enumerate(zip(completion.token_ids, ref.token_ids))
                  if a != b), 10)
        if n < 6:
            # Identical up to a first divergence, where each side's token is in the other's
            # top 5 (the tiny random model's distributions are flat: near-ties at ~0.15).
            assert_close_greedy(completion.token_ids, completion.logprobs, ref, k=5)
        common.append(n)
        logprobs = completion.logprobs
        assert logprobs is not None
        for i in range(n):
            t = completion.token_ids[i]
            assert abs(logprobs[i][t].logprob - float(ref.logprobs[i, t])) < 0.1
    assert sum(common) >= 15  # of 40 tokens (19 measured with Q8_0 experts, 18 per channel)


def test_bad_moe_configs_are_refused() -> None:
    from tests.model_factory import tiny_model_config
    from vllm.distributed.utils import check_tp_divisibility

    config = tiny_model_config("qwen3_moe", 64, moe_intermediate_size=33)
    with pytest.raises(ValueError, match="moe_intermediate_size 33 is not divisible by "
                                         "tensor_parallel_size=2"):
        check_tp_divisibility(config, 2)
    with pytest.raises(ValueError, match=r"top_k \(9\) must be between 1 and the number of "
                                         r"experts \(8\)"):
        FusedMoE(8, 9, 32, 16, renormalize=True)
