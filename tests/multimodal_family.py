"""What the end-to-end test modules of the multimodal families (LLaVA, Gemma 3, Qwen2-Audio,
Qwen2-VL) share: greedy sampling, the three module fixtures (the tiny random checkpoint,
transformers' reference on it, one engine every test reads), transformers' greedy
`generate` (the references' own processors make its inputs), and the check under preemption
and with compiled graphs.

A family's module declares its fixtures in one line:

    model_dir, hf, llm = family_fixtures("tiny_llava_dir", load_reference,
                                         max_model_len=256, max_num_batched_tokens=24)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch

from vllm import LLM, SamplingParams

MAX_TOKENS = 8
# The module engine's settings (a family adds its own): float32 to equal transformers,
# eager, 16 MiB of KV in blocks of 16, chunked prefill and the prefix cache on.
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 16 * 1024**2,
    "block_size": 16, "enable_chunked_prefill": True, "enable_prefix_caching": True}


class FromFixture(NamedTuple):
    """An engine argument that is another module fixture's value (a directory)."""

    name: str


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@torch.inference_mode()
def hf_generate(model: Any, inputs: Any, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of transformers' `generate` on a processor's `inputs`
    (exactly `max_tokens`, EOS ignored as the engine's requests ignore it)."""
    out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


def engine_state(llm: LLM) -> dict:
    return llm.llm_engine.engine_core.get_state()


def family_fixtures(checkpoint: str, load_reference: Callable[[str], Any],
                    **engine_args: Any) -> tuple[Any, Any, Any]:
    """Module fixtures `model_dir` (the session's tiny checkpoint, the fixture named
    `checkpoint` in conftest.py), `hf` (`load_reference(model_dir)`) and `llm` (an engine on
    it: `ENGINE_DEFAULTS`, then `engine_args`, a `FromFixture` one read from that fixture),
    the last two built once a module; assign them to those three names."""

    @pytest.fixture(scope="module", name="model_dir")
    def model_dir_fixture(request: pytest.FixtureRequest) -> str:
        return request.getfixturevalue(checkpoint)

    @pytest.fixture(scope="module", name="hf")
    def hf_fixture(model_dir: str) -> Any:
        return load_reference(model_dir)

    @pytest.fixture(scope="module", name="llm")
    def llm_fixture(model_dir: str, request: pytest.FixtureRequest) -> Iterator[LLM]:
        args = {key: request.getfixturevalue(value.name) if isinstance(value, FromFixture)
                else value for key, value in {**ENGINE_DEFAULTS, **engine_args}.items()}
        engine = LLM(model_dir, **args)
        yield engine
        engine.shutdown()

    return model_dir_fixture, hf_fixture, llm_fixture


def check_preemption_and_graphs(model_dir: str, prompts: list[dict],
                                expected: list[list[int]], num_blocks: int,
                                max_model_len: int = 96, **engine_args: Any) -> Any:
    """`prompts` give `expected` greedy tokens (as many as each list holds) on an engine of
    `num_blocks` KV blocks of 8 (prefix cache off), where requests are preempted, then on an
    engine with compiled graphs (one static size, 4: decode steps of fewer rows pad to it);
    both of `max_model_len`, `engine_args` go to both. Returns the graphs engine's runner,
    for the family's checks of what its graphs replayed."""
    params = greedy(len(expected[0]))
    assert all(len(tokens) == len(expected[0]) for tokens in expected)
    small = LLM(model_dir, dtype="float32", max_model_len=max_model_len, enforce_eager=True,
                num_gpu_blocks_override=num_blocks, block_size=8, enable_prefix_caching=False,
                **engine_args)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    small.shutdown()
    graphs = LLM(model_dir, dtype="float32", max_model_len=max_model_len,
                 kv_cache_memory_bytes=16 * 1024**2,
                 compilation_config={"cudagraph_capture_sizes": [4]}, **engine_args)
    outputs = graphs.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    executor: Any = graphs.llm_engine.engine_core.model_executor  # uni: the runner in process
    graphs.shutdown()
    return executor.model_runner
