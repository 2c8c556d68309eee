"""End-to-end parity with Hugging Face transformers: greedy tokens identical in float32,
logprobs close, under chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from tests.hf_reference import assert_close_greedy, hf_greedy, load_hf_model
from vllm import LLM, SamplingParams

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello world, this is",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot "
    "who lived in a quiet village by the sea, and every morning it walked to the market.",
    "A",
    "What is the capital of France? The capital of France is",
    "She ordered a café au lait and a croissant; 日本語 🙂",
]
MAX_TOKENS = 24


def _tiny_llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 16 * 1024**2)
    kwargs.setdefault("max_model_len", 512)
    return LLM(path, dtype="float32", **kwargs)


def _greedy(max_tokens: int = MAX_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=logprobs)


def _references(path: str, token_ids: list[list[int]], max_tokens: int = MAX_TOKENS):
    model = load_hf_model(path)
    return [hf_greedy(model, ids, max_tokens) for ids in token_ids]


def _check_identical(outputs, refs, logprobs_atol: float | None = None) -> None:
    for out, ref in zip(outputs, refs):
        completion = out.outputs[0]
        assert completion.token_ids == ref.token_ids, out.prompt
        if logprobs_atol is not None:
            ours = torch.tensor([lp[t].logprob for lp, t in
                                 zip(completion.logprobs, completion.token_ids)])
            theirs = ref.logprobs.gather(1, torch.tensor(ref.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(ours, theirs, atol=logprobs_atol, rtol=0)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama_tied_dir"])
def test_tiny_models_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    # The prompts prefill in one step (the ANY graphs) and decode together, 5 rows padded to
    # 8: the graphs the default sizes would compile and never replay here are left out.
    llm = _tiny_llm(path, compilation_config={"cudagraph_capture_sizes": [8]})
    outputs = llm.generate(PROMPTS, _greedy(logprobs=3), use_tqdm=False)
    refs = _references(path, [o.prompt_token_ids for o in outputs])
    _check_identical(outputs, refs, logprobs_atol=1e-4)
    for out in outputs:
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].logprobs) == MAX_TOKENS
        assert all(len(lp) >= 3 for lp in out.outputs[0].logprobs)


def test_chunked_prefill_matches(tiny_llama_dir):
    llm = _tiny_llm(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=4)
    outputs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    refs = _references(tiny_llama_dir, [o.prompt_token_ids for o in outputs])
    assert max(len(o.prompt_token_ids) for o in outputs) > 8  # really chunked
    _check_identical(outputs, refs)


def test_preemption_keeps_outputs_identical(tiny_qwen2_dir):
    # 12 usable blocks of 16 tokens for 5 requests of up to ~60 tokens: they cannot all
    # hold their KV at once, so the scheduler must preempt and recompute.
    llm = _tiny_llm(tiny_qwen2_dir, num_gpu_blocks_override=13, block_size=16,
                    max_model_len=160, enable_prefix_caching=False)
    outputs = llm.generate(PROMPTS, _greedy(max_tokens=40), use_tqdm=False)
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.num_preemptions > 0
    refs = _references(tiny_qwen2_dir, [o.prompt_token_ids for o in outputs], 40)
    _check_identical(outputs, refs)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 12


def test_prefix_cache_hits_match(tiny_llama_dir):
    llm = _tiny_llm(tiny_llama_dir, block_size=4)
    prefix = PROMPTS[1]
    prompts = [prefix + " and then", prefix + " but later"]
    first = llm.generate(prompts, _greedy(), use_tqdm=False)
    second = llm.generate(prompts, _greedy(), use_tqdm=False)
    refs = _references(tiny_llama_dir, [o.prompt_token_ids for o in first])
    _check_identical(first, refs)
    _check_identical(second, refs)
    # The shared prefix is found in the second run; the whole prompt but its last token
    # (rounded down to blocks) in the repeat.
    for out in second:
        n = len(out.prompt_token_ids)
        assert out.num_cached_tokens == (n - 1) // 4 * 4
    assert first[0].num_cached_tokens == 0


def test_mixed_lengths_large_batch_match(tiny_llama_dir):
    prompts = [" ".join(["word"] * n) for n in (1, 7, 33, 70, 3, 120, 15, 2)]
    llm = _tiny_llm(tiny_llama_dir, max_num_batched_tokens=64, max_num_seqs=3)
    outputs = llm.generate(prompts, _greedy(max_tokens=12), use_tqdm=False)
    _check_identical(outputs, _references(tiny_llama_dir, [o.prompt_token_ids for o in outputs],
                                          12))


@pytest.fixture(scope="module")
def default_prompts(default_model_path):
    from vllm.transformers_utils.tokenizer import get_tokenizer

    tok = get_tokenizer(default_model_path)
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three colors.", "Explain in detail how a bicycle works, step by step, "
                 "including the chain, the gears and the brakes."]
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                    add_generation_prompt=True) for q in questions]


def test_default_model_float32_identical(default_model_path, default_prompts):
    # Chunked prefill (48 tokens a step: mixed steps take the ANY graphs), then decode
    # steps of the 4 rows: the one static size compiled.
    llm = LLM(default_model_path, dtype="float32", quantization="none", max_model_len=1024,
              kv_cache_memory_bytes=64 * 1024**2, max_num_batched_tokens=48,
              compilation_config={"cudagraph_capture_sizes": [4]})
    outputs = llm.generate(default_prompts, _greedy(max_tokens=16), use_tqdm=False)
    refs = _references(default_model_path, [o.prompt_token_ids for o in outputs], 16)
    _check_identical(outputs, refs)


def test_default_model_bfloat16_close(default_model_path, default_prompts):
    # One prefill step (ANY graphs), then decode steps of the 4 rows: the one static size.
    llm = LLM(default_model_path, dtype="bfloat16", quantization="none", max_model_len=1024,
              kv_cache_memory_bytes=64 * 1024**2,
              compilation_config={"cudagraph_capture_sizes": [4]})
    outputs = llm.generate(default_prompts, _greedy(max_tokens=16, logprobs=5), use_tqdm=False)
    model = load_hf_model(default_model_path, torch.bfloat16)
    for out in outputs:
        ref = hf_greedy(model, out.prompt_token_ids, 16)
        assert_close_greedy(out.outputs[0].token_ids, out.outputs[0].logprobs, ref)
