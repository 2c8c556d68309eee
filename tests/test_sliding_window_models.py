"""Gemma 2, Gemma 3 and windowed Mistral end to end against transformers (float32: greedy
tokens identical, logprobs within 1e-4), with sliding windows shorter than the prompts, under
chunked prefill, preemption, prefix hits, prompt embeds and graphs (steps of up to 4 tokens
replay a graph, both the ids and the embeds set), several features per LLM construction;
Gemma 2 and 3 in int8 on two ranks equal one and stay close to float transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.hf_reference import (
    assert_close_greedy,
    assert_identical_greedy,
    hf_greedy,
    load_hf_model,
)
from tests.model_factory import make_tiny_model
from tests.test_tensor_parallel import _assert_same, _run_both
from vllm import LLM, SamplingParams
from vllm.config import InputKind
from vllm.v1.executor.uniproc import UniProcExecutor

WINDOW = 8
PROMPTS = [
    "Hello world, this is",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot "
    "who lived in a quiet village by the sea.",
    "A",
    "What is the capital of France? The capital of France is",
]
MAX_TOKENS = 20
GEMMA_COMMON: dict[str, Any] = dict(num_hidden_layers=4, sliding_window=WINDOW, head_dim=16,
                    query_pre_attn_scalar=24)
GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention"]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("gemma2")), "gemma2",
                           attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                           **GEMMA_COMMON)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
    return make_tiny_model(str(tmp_path_factory.mktemp("gemma3")), "gemma3",
                           rope_parameters=rope, layer_types=GEMMA3_LAYERS, **GEMMA_COMMON)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("mistral")), "mistral",
                           sliding_window=WINDOW)


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def _check(outputs, path: str, max_tokens: int = MAX_TOKENS) -> None:
    model = load_hf_model(path)
    assert_identical_greedy(outputs, [hf_greedy(model, out.prompt_token_ids, max_tokens)
                                      for out in outputs])


def _embeds(path: str, token_ids: list[int] | None) -> torch.Tensor:
    """What a Gemma embedding lookup gives (scaled), as prompt embeds."""
    with torch.no_grad():
        return load_hf_model(path).get_input_embeddings()(torch.tensor(token_ids)).clone()


def _replayed_kinds(llm: LLM) -> set[InputKind]:
    executor = llm.llm_engine.engine_core.model_executor
    assert isinstance(executor, UniProcExecutor)
    graphs = executor.model_runner.graphs
    assert graphs is not None
    return {kind for kind, _ in graphs.replays}


# arch -> (blocks of 4 tokens in the pool, the KV cache groups: layers and window). One
# 128-token request needs every full group's 32 blocks + at most 5 blocks per window group
# (+ the null block); four requests of up to ~55 tokens cannot all hold theirs, so the
# scheduler preempts.
GEMMAS: dict[str, tuple[int, list[tuple[tuple[int, ...], int | None]]]] = {
    "gemma2": (39, [((1, 3), None), ((0, 2), WINDOW)]),
    # Gemma 3: the global layer 2, then the window layers one per group.
    "gemma3": (49, [((2,), None), ((0,), WINDOW), ((1,), WINDOW), ((3,), WINDOW)]),
}


@pytest.mark.parametrize("arch", list(GEMMAS))
@pytest.mark.slow
def test_gemma_chunked_prefill_preemption_prefix_hits_embeds_and_graphs(arch, request):
    path = request.getfixturevalue(f"{arch}_dir")
    num_blocks, groups = GEMMAS[arch]
    llm = LLM(path, dtype="float32", block_size=4, max_model_len=128,
              num_gpu_blocks_override=num_blocks, max_num_batched_tokens=8, max_num_seqs=4,
              enable_prompt_embeds=True, compilation_config={"cudagraph_capture_sizes": [4]})
    scheduler = llm.llm_engine.engine_core.scheduler
    assert [(g.layer_indices, g.sliding_window)
            for g in scheduler.kv_cache_manager.groups] == groups
    first = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert max(len(o.prompt_token_ids or []) for o in first) > 3 * WINDOW
    assert scheduler.num_preemptions > 0
    _check(first, path)
    # The small pool evicted the first run's blocks: run once to cache, then hit.
    llm.generate(PROMPTS[1:2], _greedy(), use_tqdm=False)
    again = llm.generate(PROMPTS[1:2], _greedy(), use_tqdm=False)
    assert again[0].num_cached_tokens == (len(first[1].prompt_token_ids or []) - 1) // 4 * 4
    assert again[0].outputs[0].token_ids == first[1].outputs[0].token_ids
    # Prompt 3 in chunks of 8 and 5 rows (eager), then prompt 2 ("A", 2 rows) alone: a step
    # of 2 embeds rows replays the embeds graph.
    for i in (3, 2):
        rows = _embeds(path, first[i].prompt_token_ids)
        embeds = llm.generate([{"prompt_embeds": rows}], _greedy(), use_tqdm=False)
        assert embeds[0].outputs[0].token_ids == first[i].outputs[0].token_ids
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1
    assert _replayed_kinds(llm) == {InputKind.TOKEN_IDS, InputKind.EMBEDS}


@pytest.mark.slow  # an engine: left out of `make test-fast`
def test_mistral_window_with_chunked_prefill_and_graphs(mistral_dir):
    llm = LLM(mistral_dir, dtype="float32", block_size=4, max_model_len=128,
              kv_cache_memory_bytes=4 * 1024**2, max_num_batched_tokens=8,
              compilation_config={"cudagraph_capture_sizes": [4]})
    manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert [g.sliding_window for g in manager.groups] == [WINDOW]
    outputs = llm.generate(PROMPTS, _greedy(32), use_tqdm=False)
    _check(outputs, mistral_dir, 32)
    assert _replayed_kinds(llm) == {InputKind.TOKEN_IDS}



@pytest.mark.slow
def test_gemma_int8_two_ranks_equal_one_and_stay_close(tmp_path):
    """A Gemma 3 with Gemma 2's soft-caps (one model file serves both), in int8: 2 ranks
    (one KV head each, four KV cache groups, the vocabulary split) give 1 rank's tokens and
    logprobs; the int8 tokens follow float transformers' until a near-tie flips."""
    path = make_tiny_model(str(tmp_path / "gemma3"), "gemma3", attn_logit_softcapping=20.0,
                           final_logit_softcapping=15.0, layer_types=GEMMA3_LAYERS,
                           **GEMMA_COMMON)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    ones, twos = _run_both(path, PROMPTS, greedy, enforce_eager=True, quantization="int8",
                           max_num_batched_tokens=16)
    _assert_same(ones, twos)
    model = load_hf_model(path)
    common = 0
    for out in ones:
        completion = out.outputs[0]
        ref = hf_greedy(model, out.prompt_token_ids, 10)
        assert_close_greedy(completion.token_ids, completion.logprobs, ref, k=5)
        common += next((i for i, (a, b) in enumerate(zip(completion.token_ids,
                                                         ref.token_ids)) if a != b), 10)
    assert common >= 15  # of 40 tokens (20 measured)
