"""The fused decode path (`vllm/v1/worker/fused_decode.py`, `csrc/cpu/fused_decode.cpp`)
against the path it replaces, in one engine (its runner's fused decoder set aside for the
reference runs): the compiled graphs of a tiny random Llama written as Q4_1 layers with
Q8_0 embeddings and output, in float32 (tokens identical, logprobs close), and the eager
model of the other families' Q4_K_M files and the default model's, over contexts
spanning several KV blocks, prefix-cache hits and several requests decoding in the same
steps; speculative verification steps (k + 1 tokens of a request, past quant_gemv's 8
register rows) against one-token steps, exactly; and the default model's file in bfloat16
(drift bounded). The fused decoder's step and token counters prove it ran."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
import torch

from tests.model_factory import make_tiny_model
from tests.quant_drift import DRIFT_PROMPTS, measure_drift
from tests.test_gguf_families import FAMILIES, _write_gguf
from tests.test_gguf_mm import q4_k_m_type
from tests.test_spec_decode import NoDrafts, OracleProposer
from vllm import LLM, SamplingParams
from vllm._custom_ops import cpu_ops
from vllm.inputs import TokensPrompt
from vllm.v1.attention.backends.abstract import CommonAttentionMetadata
from vllm.v1.worker.fused_decode import ENV_SWITCH, FusedDecode, unsupported_reason

_ops = cpu_ops()
pytestmark = pytest.mark.skipif(
    _ops is None or not _ops.quant_gemv_available() or not hasattr(_ops, "FusedDecoder"),
    reason="needs the native CPU kernels with quant_gemv (AVX-512 VNNI, or AVX2 with FMA "
           "and F16C)")

# Prompts of 5 to 40 tokens (blocks of 16: up to 4 blocks after 24 new tokens); the last
# repeats the first's opening so that it hits the prefix cache.
_PROMPTS = [list(range(5, 45)), [7, 3, 9, 11, 4], list(range(60, 83)), list(range(5, 37)) + [90]]
_NEW_TOKENS = 24
# The graphs these tests hold the fused decoder against: the four prompts' decode steps
# (4 rows) and the repeat's (1); prefill steps take the ANY graph. Not the default five
# sizes, each compiled at start-up.
_SIZES = {"cudagraph_capture_sizes": [1, 4]}


def _runner(llm: LLM) -> Any:  # the in-process executor's runner
    return cast(Any, llm.llm_engine.engine_core.model_executor).model_runner


def _eager_fused(llm: LLM) -> FusedDecode:
    """The fused decoder of an eager engine (`enforce_eager=True`), built as a compiled
    engine builds it after its graphs (`_capture_cpu`): the reference steps then run the
    model eagerly and the engine compiles no graph (about 20-35 s an engine on the AVX2
    machine, cold). `test_fused_decode_matches_the_graphs_on_a_tiny_q4_1_llama` keeps the
    compiled engine's own fused decoder against its graphs."""
    runner = _runner(llm)
    assert runner.graphs is None and runner.fused_decode is None
    fused = FusedDecode.build(runner.model, runner.kv_caches, runner.dtype,
                              runner.kv_cache_groups, False, runner.attn_backend)
    assert fused is not None
    runner.fused_decode = fused
    return fused


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(GGUF path, tokenizer dir) of a tiny Llama with heads of 32 (the fused kernel's
    smallest) and a hidden size of 64 (a half quad of quant_gemv's layout)."""
    root = tmp_path_factory.mktemp("fused_decode")
    model_dir = make_tiny_model(str(root / "llama"), "llama", num_attention_heads=2,
                                num_key_value_heads=1, intermediate_size=160)
    path = str(root / "tiny-q4_1.gguf")
    _write_gguf(path, model_dir, "llama", layer_qtype="Q4_1")  # as the default model's file
    return path, model_dir


def _generate(llm: LLM, prompts: list[list[int]], fused: Any,
              runner_ups: list[list[dict[int, float]]] | None = None
              ) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and their logprobs with the runner's fused decoder set to `fused`
    (None: the graphs' or the eager model's path), from an empty prefix cache: the prompts
    together (their decode steps share rows), then the first prompt again (a prefix hit on
    its whole prompt). `runner_ups`, if given, gets each output's top two {token: logprob}
    a step."""
    _runner(llm).fused_decode = fused
    assert llm.llm_engine.reset_prefix_cache()
    results = []
    for batch in (prompts, prompts[:1]):
        for tokens, logprobs, tops in _greedy(llm, batch, _NEW_TOKENS):
            results.append((tokens, logprobs))
            if runner_ups is not None:
                runner_ups.append(tops)
    return results


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int
            ) -> list[tuple[list[int], torch.Tensor, list[dict[int, float]]]]:
    """Each prompt's greedy tokens, their logprobs and its top two {token: logprob} a step,
    the prompts in one `generate` call."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    results = []
    for out in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        tokens, steps = list(completion.token_ids), completion.logprobs
        results.append((tokens, torch.tensor([lp[t].logprob for lp, t in zip(steps, tokens)]),
                        [{t: lp.logprob for t, lp in step.items()} for step in steps]))
    return results


def _common_until_a_near_tie(tokens: list[int], tops: list[dict], ref_tokens: list[int],
                             ref_tops: list[dict], margin: float) -> int:
    """How many leading tokens two greedy runs share. Where they part, each run's own token
    and the other's must be its top two within `margin` (a near tie, which a difference
    of one int8 activation code may tip); anything else fails."""
    n = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
    if n < len(tokens):
        a, b = tokens[n], ref_tokens[n]
        for step, own, other in ((tops[n], a, b), (ref_tops[n], b, a)):
            assert other in step and step[own] - step[other] <= margin, (
                f"the runs part at token {n} ({a} against {b}) where it is no near tie: "
                f"{step}")
    return n


def _reference_along(llm: LLM, prompt: list[int], tokens: list[int], tops: list[dict],
                     ref: tuple[list[int], torch.Tensor], ref_tops: list[dict],
                     margin: float) -> tuple[torch.Tensor, int]:
    """The reference path's logprob of each of the fused run's `tokens` in the fused run's
    own context, and how many times the two runs parted. Where two greedy runs part at a
    near tie (`_common_until_a_near_tie`; anything else fails), the reference's logprob
    of the fused run's token is read from its top two, and the reference goes on from that
    token (a new request of the prompt and the fused run's tokens so far, the fused decoder
    set aside): every token is compared, however early a tie parts the runs."""
    _runner(llm).fused_decode = None
    ref_tokens, ref_logprobs = ref
    along: list[torch.Tensor] = []
    start = partings = 0
    while True:
        n = _common_until_a_near_tie(tokens[start:], tops[start:], ref_tokens, ref_tops,
                                     margin)
        along.append(ref_logprobs[:n])
        if start + n == len(tokens):
            return torch.cat(along), partings
        partings += 1
        along.append(torch.tensor([ref_tops[n][tokens[start + n]]]))
        start += n + 1
        if start == len(tokens):
            return torch.cat(along), partings
        ref_tokens, ref_logprobs, ref_tops = _greedy(llm, [prompt + tokens[:start]],
                                                     len(tokens) - start)[0]


def _assert_alone_equals_batched(llm: LLM, batched: tuple[list[int], torch.Tensor]) -> None:
    """The first prompt alone, from an empty prefix cache, through the runner's fused
    decoder: tokens and logprobs exactly `batched` (its output decoded beside the other
    prompts). Alone, a step has one row and the decoder splits its attention's heads over
    the threads; beside another request, each thread takes whole rows. A head's result
    does not depend on the split."""
    assert llm.llm_engine.reset_prefix_cache()
    tokens, logprobs, _ = _greedy(llm, _PROMPTS[:1], _NEW_TOKENS)[0]
    assert tokens == batched[0]
    assert torch.equal(logprobs, batched[1])


def _assert_fused_follows_the_eager_model(llm: LLM) -> None:
    """`llm`'s fused decode against its eager model on `_PROMPTS`: tokens identical up to a
    near tie (top two within 0.15 in both runs: the eager model then goes on from the fused
    run's token), every logprob within 0.15 of the eager model's in the same context, 1e-2
    on average; the prompts' outputs not all the same."""
    fused = _eager_fused(llm)
    ref_tops: list[list[dict[int, float]]] = []
    got_tops: list[list[dict[int, float]]] = []
    expected = _generate(llm, _PROMPTS, None, ref_tops)
    got = _generate(llm, _PROMPTS, fused, got_tops)
    assert fused.steps >= 2 * (_NEW_TOKENS - 1)
    gaps, partings = [], []
    for prompt, output, tops, ref, tops_ref in zip(_PROMPTS + _PROMPTS[:1], got, got_tops,
                                                   expected, ref_tops, strict=True):
        along, parted = _reference_along(llm, prompt, output[0], tops, ref, tops_ref,
                                         margin=0.15)
        gaps.append((output[1] - along).abs())
        partings.append(parted)
    gap = torch.cat(gaps)
    assert gap.max().item() <= 0.15, (partings, gaps)
    assert gap.mean().item() <= 1e-2, (partings, gaps)
    assert len({tuple(tokens) for tokens, _ in got}) > 1


@pytest.mark.slow
def test_fused_decode_matches_the_graphs_on_a_tiny_q4_1_llama(
        tiny_q4_1: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """float32, one engine: the fused decoder's steps against the graphs' (the same engine
    with its decoder set aside). Tokens identical; logprobs equal to 1e-4 at every step but
    isolated ones: the activations' int8 rounding turns last-bit differences (the norm's
    and SiLU's float32 arithmetic) into an occasional code one step apart, which moves that
    one step's logprobs (3.6e-3 seen; since prompts take quant_gemv too, 3.4e-3 and 1.04e-2
    at one step each of two outputs, every other step under 5e-5). A wrong rotary, cache
    slot, scale or residual moves every step after it, and the tokens."""
    path, model_dir = tiny_q4_1
    llm = LLM(path, tokenizer=model_dir, quantization="gguf", dtype="float32",
              max_model_len=128, block_size=16, enable_prefix_caching=True,
              kv_cache_memory_bytes=4 * 1024**2, compilation_config=_SIZES)
    runner = _runner(llm)
    fused = runner.fused_decode
    assert fused is not None
    expected = _generate(llm, _PROMPTS, None)
    assert fused.steps == 0
    got = _generate(llm, _PROMPTS, fused)
    # Every decode step ran fused: 4 requests batched together (at least 23 steps after
    # their first tokens), then the repeat's 23.
    assert fused.steps >= 2 * (_NEW_TOKENS - 1)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        off = (logprobs - ref_logprobs).abs() > 1e-4  # steps a flipped code moved
        assert int(off.sum()) <= 2 and not (off[1:] & off[:-1]).any()
        torch.testing.assert_close(logprobs, ref_logprobs, atol=0.05, rtol=0)
    assert len({tuple(tokens) for tokens, _ in got}) > 1  # the outputs are not degenerate
    # Where it does not apply, the reason says why.
    model, caches = runner.model, runner.kv_caches
    assert unsupported_reason(model, caches, torch.float32, lora=False) is None
    assert unsupported_reason(model, caches, torch.float32, lora=True) == "LoRA adapters"
    with monkeypatch.context() as patch:
        patch.setenv(ENV_SWITCH, "0")
        assert unsupported_reason(model, caches, torch.float32, lora=False) \
            == f"{ENV_SWITCH}=0"


@pytest.fixture(scope="module", params=["gemma3", "gemma2", "qwen3", "qwen3_moe", "qwen2_moe"])
def tiny_q4_k_m(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(GGUF path, tokenizer dir) of a tiny model of a family whose layers differ from
    Llama's, as a Q4_K_M file (Q4_K, Q6_K, Q5_0 and Q8_0 blocks, read in place by
    gguf_mm): Gemma 3 (four norms a layer with (1 + w) weights, q/k norms, tanh GELU,
    window layers on the local rotary table, each layer kind its own KV cache group),
    Gemma 2 (the attention soft-cap, one rotary table) and Qwen3 (q/k norms, Llama's
    RMSNorm), Qwen3-MoE (its experts' blocks, 8 experts top 2 renormalised, and a float32
    router, as llama.cpp's files keep it) and Qwen2-MoE (q/k/v biases, routing weights not
    renormalised, a shared expert behind its sigmoid gate). Rows of whole super-blocks:
    hidden 256, intermediate 512 (the experts' 256, the shared expert's 512), heads of 64."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"fused_{arch}")
    overrides: dict[str, Any] = {**FAMILIES[arch], "hidden_size": 256,
                                 "intermediate_size": 512, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 64}
    if arch.startswith("gemma"):
        overrides["query_pre_attn_scalar"] = 64
    experts = arch.endswith("_moe")
    if experts:
        overrides.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
    if arch == "qwen2_moe":
        overrides["shared_expert_intermediate_size"] = 512
    model_dir = make_tiny_model(str(root / arch), arch, **overrides)
    path = str(root / f"{arch}-q4_k_m.gguf")
    _write_gguf(path, model_dir, arch, layer_qtype=q4_k_m_type,
                expert_qtype=q4_k_m_type if experts else None)
    return path, model_dir


@pytest.mark.slow
def test_fused_decode_matches_the_eager_model_on_other_families(
        tiny_q4_k_m: tuple[str, str]) -> None:
    """As on the Q4_1 Llama: float32, one engine, the fused decoder's steps against the
    eager model's. Tokens identical up to a near tie (top two within 0.15 in both runs),
    where the eager model goes on from the fused run's token (`_reference_along`); every
    token's logprob within 0.15 of the eager model's in the same context, 1e-2 on average.
    The two paths
    share the block kernels; the float arithmetic around them differs (the fused SiLU and
    GELU's exp polynomial against torch's, a norm's sum): a last-bit
    difference there sometimes lands an int8 activation code one step apart, and in these
    tiny random models one such code moves the next logprob by up to 0.13 (seen:
    Qwen2-MoE's AVX2 form, 0.118 against the graphs and 0.110 against the eager model; the
    graphs' own eager and compiled forms differ by 0.087 on AVX-512), while most
    logprobs are equal to the bit (mean differences 0 to 4e-3, both forms). A wrong window,
    table, norm, bias or routing moves every logprob by tenths and changes the tokens. The
    prompts run past the windows (5 positions) and across KV blocks, so window layers read
    their groups' masked tables."""
    path, model_dir = tiny_q4_k_m
    llm = LLM(path, tokenizer=model_dir, quantization="gguf", dtype="float32",
              max_model_len=128, block_size=16, enable_prefix_caching=True,
              kv_cache_memory_bytes=8 * 1024**2, enforce_eager=True)
    # Seen: against the graphs, every token identical on AVX-512, and on a Zen 3 (AVX2)
    # Qwen3's first output parted at its last token; against the eager model on the Zen 3,
    # Qwen3-MoE's second output at its second (top two 0.015 apart in the fused run, 0.010
    # in the eager one). A wrong window or table moves every logprob after it by tenths.
    _assert_fused_follows_the_eager_model(llm)


@pytest.mark.slow
def test_fused_lookups_equal_the_model_ends(tiny_q4_k_m: tuple[str, str]) -> None:
    """The embedding lookup and the LM head inside the decoder's call (`set_embedding`,
    `set_head`) give exactly what the model's own ends give: the hidden states of token ids
    equal those of the rows `embed_tokens` looks up (Gemma's scaled), and the logits equal
    `compute_logits` of them, bit for bit. Gemma 2's final soft-cap keeps its head in
    torch (its tanh), so only its lookup is inside. A token id past the table is refused
    by name."""
    path, model_dir = tiny_q4_k_m
    llm = LLM(path, tokenizer=model_dir, quantization="gguf", dtype="float32",
              max_model_len=128, block_size=16, kv_cache_memory_bytes=8 * 1024**2,
              enforce_eager=True)
    fused = _eager_fused(llm)
    decoder, model = fused.decoder, _runner(llm).model
    assert decoder.has_embedding
    assert decoder.has_head == (getattr(model, "final_soft_cap", None) is None)
    ids = torch.tensor([3, 17], dtype=torch.int64)
    groups = decoder.num_kv_cache_groups
    step = (torch.tensor([0, 0]), [torch.tensor([[1], [2]], dtype=torch.int32)] * groups,
            torch.tensor([1, 1], dtype=torch.int32), [torch.tensor([16, 32])] * groups)
    (reference,) = decoder.forward(fused.spec.embed_tokens(ids), *step)
    if decoder.has_head:
        hidden, logits = decoder.forward(ids, *step, with_logits=True)
        assert torch.equal(logits, model.compute_logits(reference))
    else:
        (hidden,) = decoder.forward(ids, *step)
    assert torch.equal(hidden, reference)
    with pytest.raises(RuntimeError, match="token id 1000000 out of range"):
        decoder.forward(torch.tensor([1000000]), step[0][:1], [t[:1] for t in step[1]],
                        step[2][:1], [s[:1] for s in step[3]])


@pytest.mark.slow
def test_fused_decode_of_int8_layers_matches_the_eager_model(
        tiny_q4_1: tuple[str, str]) -> None:
    """`quantization="int8"` where its layers multiply by the native `int8_mm` (no VNNI):
    the fused decoder reads their tiles (`FusedWeight.int8`) and quantizes each row as
    `quantize_per_token` does (the division itself, not a reciprocal); float32, the tiny
    Llama's directory, against the eager model as on the other families (tokens identical
    up to a near tie, logprobs within 0.15, 1e-2 on average). A wrong scale, tile or
    row moves every logprob by tenths."""
    from vllm.model_executor.layers.quantization.int8 import native_int8_mm

    if native_int8_mm() is None:
        pytest.skip("int8 layers take torch's _int_mm here (int8 dot products, or no "
                    "int8_mm build): the fused decoder reads int8_mm's tiles only")
    _, model_dir = tiny_q4_1
    llm = LLM(model_dir, quantization="int8", dtype="float32", max_model_len=128,
              block_size=16, enable_prefix_caching=True, kv_cache_memory_bytes=4 * 1024**2,
              enforce_eager=True)
    _assert_fused_follows_the_eager_model(llm)


@pytest.mark.slow
def test_fused_decode_drift_on_the_default_model(default_model_path: str) -> None:
    """The default model's Q4_1 file in bfloat16, one engine, four requests decoding
    together, the fused decoder against the eager model. Not token-identical over long
    runs: the graphs' own eager and compiled forms differ as much (the int8 activations
    turn rounding differences into whole codes; on two prompts of 32 tokens, eager against
    compiled kept 6 and 31 tokens in float32, 16 and 8 in bfloat16, the fused path the
    same prefixes with smaller logprob gaps)."""
    llm = LLM(default_model_path, quantization="gguf", dtype="bfloat16", max_model_len=256,
              max_num_seqs=4, kv_cache_memory_bytes=32 * 1024**2, enforce_eager=True)
    fused = _eager_fused(llm)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in DRIFT_PROMPTS[:4]]  # 5 outputs with the repeat
    expected = _generate(llm, prompts, None)
    got = _generate(llm, prompts, fused)
    assert fused.steps >= 2 * (_NEW_TOKENS - 1)
    drift = measure_drift([(t, lp.tolist()) for t, lp in expected],
                          [(t, lp.tolist()) for t, lp in got], first_n=4)
    # Seen: agreement 0.8, mean common prefix 11.6 of 16, mean logprob gap 0.039.
    assert drift.agreement >= 0.6
    assert drift.mean_common_prefix >= 6
    assert drift.mean_logprob_diff <= 0.1


def test_token_rows_of_a_mixed_step() -> None:
    """Each token of a non-decode step attends through its request's block-table row (of
    each KV cache group) to itself and the keys before it."""
    fused = FusedDecode(None, cast(Any, None), block_size=4)
    commons = [CommonAttentionMetadata(
        query_start_loc=np.array([0, 1, 4], dtype=np.int32),
        seq_lens=np.array([7, 12], dtype=np.int32),
        num_computed_tokens=np.array([6, 9], dtype=np.int32),
        block_table=np.array(rows, dtype=np.int32),
        slot_mapping=np.array([18, 33, 34, 35], dtype=np.int64), num_actual_tokens=4)
        for rows in ([[3, 5, 0, 0], [8, 2, 9, 4]], [[1, 6, 0, 0], [7, 10, 11, 12]])]
    tables, lengths = fused._token_rows(commons)
    assert lengths.tolist() == [7, 10, 11, 12]
    assert lengths.dtype == torch.int32 and tables[0].dtype == tables[1].dtype == torch.int32
    assert tables[0].tolist() == [[3, 5, 0], [8, 2, 9], [8, 2, 9], [8, 2, 9]]  # 12 keys: 3 blocks
    assert tables[1].tolist() == [[1, 6, 0], [7, 10, 11], [7, 10, 11], [7, 10, 11]]


@pytest.mark.slow
def test_fused_verification_steps_equal_one_token_steps(
        tiny_q4_1: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """float32, one engine, greedy with up to 7 drafted tokens a step; two requests verify
    together in up to 16 rows (quant_gemv's rows in two passes, the vocabulary
    projection's too): verification steps run fused, and
    tokens and logprobs are exactly those of one-token fused steps. Every row is quantized,
    projected and attended on its own, so splitting a request's tokens over steps or rows
    changes no bit. The drafts come from an oracle (the plain run's tokens, every third
    one wrong): accepted runs, rejections and bonus tokens all happen. The runner builds
    the backend's attention metadata only for the steps the fused decoder does not take
    (prompts of more than 16 tokens). And the first prompt decoded alone gives exactly what
    it gave beside the other (`_assert_alone_equals_batched`: heads split over the threads
    against rows)."""
    path, model_dir = tiny_q4_1
    llm = LLM(path, tokenizer=model_dir, quantization="gguf", dtype="float32",
              max_model_len=128, block_size=16, enable_prefix_caching=True,
              kv_cache_memory_bytes=4 * 1024**2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 7,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4},
              enforce_eager=True)
    runner = _runner(llm)
    fused = _eager_fused(llm)
    ngram, runner.spec.proposer = runner.spec.proposer, NoDrafts()
    prompts = _PROMPTS[:2]
    expected = _generate(llm, prompts, fused)
    _assert_alone_equals_batched(llm, expected[0])
    runner.spec.proposer = OracleProposer(
        {tuple(p): tokens for p, (tokens, _) in zip(prompts, expected)}, 7)
    steps, tokens = fused.steps, fused.tokens
    backend, step_sizes = runner.attn_backend, []
    build_metadata, run_model = backend.build_metadata, runner._run_model
    monkeypatch.setattr(backend, "build_metadata", lambda *args, **kwargs: (
        step_sizes.append(-1), build_metadata(*args, **kwargs))[1])
    monkeypatch.setattr(runner, "_run_model", lambda model, inputs: (
        step_sizes.append(inputs.positions.shape[0]), run_model(model, inputs))[1])
    got = _generate(llm, prompts, fused)
    monkeypatch.undo()
    # Each step too large for the fused decoder, and only those, built metadata first.
    steps_run = [(n, previous == -1) for previous, n in zip([0, *step_sizes], step_sizes)
                 if n > 0]
    assert all(built == (not FusedDecode.takes(n)) for n, built in steps_run)
    assert step_sizes.count(-1) == sum(built for _, built in steps_run) > 0
    # Plain steps have at most 2 tokens (one a request): verification rows ran fused.
    assert fused.tokens - tokens > 2 * (fused.steps - steps)
    stats = llm.llm_engine.spec_decoding_stats
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for (tokens_, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens_ == ref_tokens
        assert torch.equal(logprobs, ref_logprobs)
    runner.spec.proposer = ngram
