"""The decoder families beyond Llama (Qwen3, Mistral, Phi-3, OLMo-2, Granite), each a tiny
random model from its transformers config with a rope scaling, against transformers in
float32: greedy tokens identical and logprobs within 1e-4, for a batch of different
lengths under chunked prefill and preemption, again on prefix-cache hits, with prompt
embeds, all from one engine per family with captured graphs (steps of up to 4 tokens
replay a graph, both the ids and the embeds set; larger chunks run eagerly)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.hf_reference import assert_identical_greedy, hf_greedy, load_hf_model
from tests.model_factory import make_tiny_model
from vllm import LLM, SamplingParams
from vllm.config import InputKind
from vllm.model_executor.models.registry import resolve_model_cls
from vllm.v1.executor.uniproc import UniProcExecutor

MAX_TOKENS = 20
# Prompts of 2 to 24 tokens: within the length the length-dependent ropes (dynamic,
# longrope) were trained for, so that transformers rotates each prompt token as this
# engine does (see rotary_embedding.py); decoding then runs past it.
PROMPTS = [
    "Hello world, this is",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was",
    "A",
    "What is the capital of France? The capital of France is",
]
TRAINED = 32

# family -> (tiny model overrides: a rope scaling each, the architecture's rope_type)
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"max_position_embeddings": TRAINED,
              "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
    "mistral": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
    "phi3": {"max_position_embeddings": 4 * TRAINED, "original_max_position_embeddings": TRAINED,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                 "short_factor": [1.0, 1.2, 1.5, 2.0],
                                 "long_factor": [2.0, 3.0, 5.0, 8.0]}},
    "olmo2": {"max_position_embeddings": 4 * TRAINED,
              "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                  "original_max_position_embeddings": TRAINED}},
    "granite": {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": TRAINED}},
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {arch: make_tiny_model(str(root / arch), arch, **overrides)
            for arch, overrides in FAMILIES.items()}


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2,
                          **kwargs)


def _check(outputs, refs) -> None:
    assert_identical_greedy(outputs, refs)


@pytest.mark.parametrize("arch", list(FAMILIES))
@pytest.mark.slow
def test_family_matches_transformers(arch, family_dirs):
    path = family_dirs[arch]
    # 8-token chunks; 22 blocks of 4 tokens for 4 requests that grow to ~11 blocks each.
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=8, num_gpu_blocks_override=23,
              enable_prompt_embeds=True, compilation_config={"cudagraph_capture_sizes": [4]})
    executor = llm.llm_engine.engine_core.model_executor
    assert isinstance(executor, UniProcExecutor)
    graphs = executor.model_runner.graphs
    assert graphs is not None
    scheduler = llm.llm_engine.engine_core.scheduler
    first = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    hf = load_hf_model(path)
    refs = [hf_greedy(hf, out.prompt_token_ids, MAX_TOKENS) for out in first]
    assert max(len(o.prompt_token_ids or []) for o in first) > 8  # chunked
    assert scheduler.num_preemptions > 0
    _check(first, refs)

    again = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert any(o.num_cached_tokens > 0 for o in again)
    _check(again, refs)

    embeds = [{"prompt_embeds": hf.get_input_embeddings()(torch.tensor(o.prompt_token_ids))
               .detach()} for o in first[:2]]
    _check(llm.generate(embeds, _greedy(), use_tqdm=False), refs[:2])
    assert {kind for kind, _ in graphs.replays} == {InputKind.TOKEN_IDS, InputKind.EMBEDS}
    # No step can exceed the budget of 8 tokens, so no graph for larger steps was compiled.
    assert graphs.captured == {(InputKind.TOKEN_IDS, 4), (InputKind.EMBEDS, 4)}


def test_registry_is_lazy_and_names_what_it_supports():
    assert resolve_model_cls("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    assert resolve_model_cls("MistralForCausalLM").__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported.*"
                                         r"Qwen3ForCausalLM, Phi3ForCausalLM"):
        resolve_model_cls("GPT2LMHeadModel")
