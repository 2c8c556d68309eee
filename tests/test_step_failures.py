"""A step that raises fails the request to blame, not the engine (offline `LLM`).

The runner's test hook (`VLLM_TEST_FAIL_ON_TOKEN_ID`) raises on any step whose inputs hold
the marked token, after the step's state updates and before the forward pass, so the KV
blocks of the step are never written: a request recomputed on top of them (a prefix-cache
hit on a block registered before the failure) would come out wrong.
"""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.v1.core.sched.scheduler import EngineStepError

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

MARK = 7  # the token id that makes a step fail
# Three blocks of 16 tokens each, none of them MARK.
GOOD = [[(11 * i + 3 * j) % 90 + 10 for j in range(40)] for i in range(3)]
BAD = [10, 20, MARK, 30] * 5


@pytest.fixture()
def llm(tiny_qwen2_dir: str, monkeypatch: pytest.MonkeyPatch) -> LLM:
    monkeypatch.setenv("VLLM_TEST_FAIL_ON_TOKEN_ID", str(MARK))
    return LLM(tiny_qwen2_dir, dtype="float32", kv_cache_memory_bytes=8 * 2**20,
               max_model_len=256, seed=0, enforce_eager=True)


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens),
                        use_tqdm=False)


def test_bad_request_fails_alone(llm: LLM) -> None:
    expected = [o.outputs[0].token_ids for o in generate(llm, GOOD)]
    assert llm.llm_engine.reset_prefix_cache()
    # The bad prompt shares a batch with the good ones: the batch fails, each request is
    # then run alone, and only the bad one is failed.
    outputs = generate(llm, [GOOD[0], BAD, GOOD[1], GOOD[2]])
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length",
                                                             "length"]
    assert outputs[1].outputs[0].token_ids == []
    assert [o.outputs[0].token_ids for o in outputs[::2]] == expected[:2]
    assert outputs[3].outputs[0].token_ids == expected[2]
    core = llm.llm_engine.engine_core
    assert core.scheduler.failure_isolation.suspects == [] and not core.scheduler.requests
    assert core.scheduler.kv_cache_manager.usage == 0.0
    runner = core.model_executor.model_runner
    assert not runner.requests and runner.input_batch.num_reqs == 0
    # The engine serves on: a new request (with a prefix hit) and a lone bad one.
    again = generate(llm, [GOOD[1], BAD])
    assert again[0].outputs[0].token_ids == expected[1]
    assert again[0].num_cached_tokens == 32
    assert again[1].outputs[0].finish_reason == "error"


def test_repeated_failures_end_the_engine(llm: LLM) -> None:
    with pytest.raises(EngineStepError, match="in a row"):
        generate(llm, [BAD, [MARK] * 20, [MARK, 10] * 10, [MARK, 11] * 10])
