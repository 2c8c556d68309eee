"""The model's own sampling defaults (vLLM's `generation_config`): generation_config.json's
temperature, top_p, top_k, min_p and repetition_penalty fill what a request leaves unset,
offline and in the server's requests; a request's own values win; "vllm" ignores the file."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from vllm import LLM, SamplingParams
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.transformers_utils.config import get_generation_defaults

DEFAULTS = {"temperature": 0.0, "top_p": 0.8, "top_k": 5, "min_p": 0.05,
            "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gen") / "model")
    shutil.copytree(tiny_llama_dir, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({**DEFAULTS, "bos_token_id": 1, "eos_token_id": 2, "do_sample": True,
                   "max_length": 20}, f)
    return path


def test_defaults_read_from_the_file_or_ignored(model_dir, tiny_llama_dir, tmp_path):
    assert get_generation_defaults(model_dir, "auto") == DEFAULTS
    assert get_generation_defaults(model_dir, "vllm") == {}
    assert get_generation_defaults(str(tmp_path), "auto") == {}  # no file
    assert get_generation_defaults(tiny_llama_dir, model_dir) == DEFAULTS  # a folder
    with pytest.raises(ValueError, match="'auto', 'vllm' or a folder.*'nowhere'"):
        get_generation_defaults(model_dir, "nowhere")


@pytest.mark.slow
def test_offline_requests_without_params_take_the_models_defaults(model_dir):
    llm = LLM(model_dir, dtype="float32", max_model_len=128, enforce_eager=True,
              kv_cache_memory_bytes=4 * 1024**2)
    defaults = llm.get_default_sampling_params()
    assert {k: getattr(defaults, k) for k in DEFAULTS} == DEFAULTS
    prompt = "Hello world, this is"
    # Greedy (the file's temperature 0) with its repetition penalty: the same tokens as
    # asking for them explicitly.
    implicit = llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
    explicit = llm.generate(prompt, SamplingParams(max_tokens=16, **DEFAULTS),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert implicit == explicit and len(implicit) == 16
    llm.llm_engine.engine_core.shutdown()
    plain = LLM(model_dir, dtype="float32", max_model_len=128, enforce_eager=True,
                kv_cache_memory_bytes=4 * 1024**2, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_server_requests_fill_only_unset_fields():
    completion = CompletionRequest(prompt="hi", temperature=0.7, top_k=0)
    params = completion.to_sampling_params(16, None, defaults=DEFAULTS)
    assert (params.temperature, params.top_k) == (0.7, 0)  # the request's own values
    assert (params.top_p, params.min_p, params.repetition_penalty) == (0.8, 0.05, 1.3)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = chat.to_sampling_params(16, None, defaults=DEFAULTS)
    assert {k: getattr(params, k) for k in DEFAULTS} == DEFAULTS
    params = chat.to_sampling_params(16, None)  # "vllm": SamplingParams' own
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
