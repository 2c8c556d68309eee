"""Attention backends chosen by name: the registry, a toy backend (`tests/toy_attention.py`)
registered from the test running models end to end (decoder-only and encoder/decoder), and
graph capture going through the toy's own hooks (CPU compiled graphs through
`build_metadata`; the CUDA graph path, run eagerly on CPU, through its graph hooks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.graph_doubles import EagerCudaGraphs
from tests.test_graph_capture import _llm, _runner
from tests.toy_attention import ToyBackend, ToyImpl
from vllm import LLM, SamplingParams
from vllm.config import InputKind
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention import backends
from vllm.v1.attention.backends import get_attn_backend, register_attn_backend
from vllm.v1.attention.backends.abstract import CommonAttentionMetadata
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend
from vllm.v1.worker.graph_capture import ANY

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

IDS = InputKind.TOKEN_IDS

PROMPTS = [
    "Hello world, this is",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a robot",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a cat",
    "A",
]


@pytest.fixture
def toy(monkeypatch) -> type[ToyBackend]:
    """`ToyBackend` registered as "toy" for one test (in a copy of the registry, which
    the test's end restores), its call counts zeroed."""
    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    register_attn_backend(ToyBackend)
    ToyBackend.calls.clear()
    return ToyBackend


def _params(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)


def _generate(llm: LLM, prompts=PROMPTS, params=None) -> list:
    params = params or [_params(6 + 2 * i) for i in range(len(prompts))]
    return llm.generate(prompts, params, use_tqdm=False)


def _assert_same(a: list, b: list) -> None:
    """Greedy tokens identical, logprobs within 1e-4 (the toy computes in float64)."""
    for x, y in zip(a, b, strict=True):
        x, y = x.outputs[0], y.outputs[0]
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.logprobs, y.logprobs, strict=True):
            assert lx.keys() == ly.keys()
            for token in lx:
                assert abs(lx[token].logprob - ly[token].logprob) < 1e-4


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list:
    """The default backend's outputs, eager."""
    return _generate(_llm(tiny_llama_dir, enforce_eager=True))


def test_backends_by_name(toy, monkeypatch) -> None:
    assert get_attn_backend("toy") is toy
    assert get_attn_backend() is get_attn_backend(None) is TorchSDPABackend
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "toy")
    assert get_attn_backend() is toy
    assert get_attn_backend("TORCH_SDPA") is TorchSDPABackend  # a name beats the env
    with pytest.raises(ValueError, match=r"Unknown attention backend 'nope'; "
                                         r"registered: TORCH_SDPA, toy\."):
        get_attn_backend("nope")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "nope")
    with pytest.raises(ValueError, match="Unknown attention backend 'nope'"):
        get_attn_backend()
    assert register_attn_backend(toy) is toy  # again: a no-op

    class Impostor(ToyBackend):
        pass

    with pytest.raises(ValueError, match="'toy' is taken by tests.toy_attention.ToyBackend"):
        register_attn_backend(Impostor)

    class Nameless(ToyBackend):
        name = ""

    with pytest.raises(ValueError, match="Nameless needs a non-empty `name`"):
        register_attn_backend(Nameless)


def test_unknown_backend_fails_at_start_up(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="Unknown attention backend 'toy'; registered: "
                                         "TORCH_SDPA"):
        _llm(tiny_llama_dir, attention_backend="toy")  # not registered outside `toy`


def test_toy_backend_runs_a_model_end_to_end(toy, tiny_llama_dir, reference,
                                             monkeypatch) -> None:
    """`attention_backend="toy"`, then `VLLM_ATTENTION_BACKEND=toy`: every attention layer
    runs the toy's impl, and greedy tokens equal the default backend's; again for a second
    batch of the same prompts, whose prefills start after prefix-cache hits."""
    for llm in (_llm(tiny_llama_dir, enforce_eager=True, attention_backend="toy"),
                _with_env(monkeypatch, tiny_llama_dir)):
        runner = _runner(llm)
        assert runner.attn_backend is toy
        layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
        assert layers and all(isinstance(layer.impl, ToyImpl) for layer in layers)
        toy.calls.clear()
        _assert_same(_generate(llm), reference)
        _assert_same(_generate(llm), reference)
        assert toy.calls["build_metadata"] > 0


def _with_env(monkeypatch, path: str) -> LLM:
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "toy")  # restored after the test
    return _llm(path, enforce_eager=True)


def test_toy_backend_in_compiled_cpu_graphs(toy, tiny_llama_dir, reference) -> None:
    """CPU graphs keep attention outside the compiled pieces: capture's dummy steps build
    the toy's metadata with `build_metadata` (sizes 1 and 2, then ANY) and never touch the
    CUDA hooks; replays equal the default backend's eager outputs."""
    llm = _llm(tiny_llama_dir, attention_backend="toy",
               compilation_config={"cudagraph_capture_sizes": [1, 2]})
    assert dict(toy.calls) == {"build_metadata": 3}
    runner = _runner(llm)
    _assert_same(_generate(llm), reference)
    assert runner.graphs.replays[(IDS, ANY)] > 0 and runner.graphs.replays[(IDS, 2)] > 0
    assert "init_graph_buffers" not in toy.calls and "prepare_replay" not in toy.calls


def test_cuda_graph_path_runs_through_the_toy_hooks(toy, tiny_llama_dir, reference) -> None:
    """The CUDA graph path on CPU (`EagerCudaGraphs`) with the toy backend: one
    `init_graph_buffers`, one `capture_metadata` per captured size, one `prepare_replay`
    per replay and no `build_metadata` for replayed steps; greedy tokens equal the default
    backend's."""
    llm = _llm(tiny_llama_dir, enforce_eager=True, attention_backend="toy")
    runner = _runner(llm)
    sizes = [1, 2, 4]
    graphs = EagerCudaGraphs(runner.model, sizes, False, runner.model_config.hidden_size,
                             runner.dtype, runner.device, runner.block_size,
                             runner.max_model_len, runner.attn_backend)
    graphs.capture(runner.kv_caches, set_forward_context)
    for kv_cache in runner.kv_caches:
        kv_cache.zero_()
    assert dict(toy.calls) == {"init_graph_buffers": 1, "capture_metadata": len(sizes)}
    runner.graphs = graphs
    toy.calls.clear()
    _assert_same(_generate(llm), reference)
    num_replays = sum(graphs.replays.values())
    assert graphs.replays[(IDS, 4)] > 0 and graphs.replays[(IDS, 1)] > 0
    assert toy.calls["prepare_replay"] == num_replays
    assert "capture_metadata" not in toy.calls and "init_graph_buffers" not in toy.calls


def test_toy_backend_runs_an_encoder_decoder_model(toy, tiny_bart_dir) -> None:
    """BART through the toy backend: encoder (bidirectional, no cache), decoder self- and
    cross-attention; greedy tokens equal the default backend's."""
    texts = ["Hello world, this is", "What is the capital of France?", "A"]
    params = [_params(6 + 2 * i) for i in range(len(texts))]
    ours = _llm(tiny_bart_dir, attention_backend="toy").generate(texts, params,
                                                                 use_tqdm=False)
    assert toy.calls["build_metadata"] > 0
    default = _llm(tiny_bart_dir).generate(texts, params, use_tqdm=False)
    _assert_same(ours, default)


def test_toy_graph_hooks_pad_with_the_null_block(toy) -> None:
    """A replay of 2 decodes in the graph of 4 rows: rows 2 and 3 become padding (slot 0,
    block 0, one key) whatever a 4-request step left there."""
    buffers = toy.init_graph_buffers(4, 3, 4, torch.device("cpu"))
    graph = toy.capture_metadata(buffers, 4)
    full = CommonAttentionMetadata(np.arange(5, dtype=np.int32),
                                   np.array([5, 6, 7, 8], dtype=np.int32),
                                   np.array([4, 5, 6, 7], dtype=np.int32),
                                   np.full((4, 3), 9, dtype=np.int32),
                                   np.array([40, 41, 42, 43]), 4)
    toy.prepare_replay(buffers, full, 4)
    step = CommonAttentionMetadata(np.arange(3, dtype=np.int32),
                                   np.array([3, 6], dtype=np.int32),
                                   np.array([2, 5], dtype=np.int32),
                                   np.array([[3, 0, 0], [5, 6, 0]], dtype=np.int32),
                                   np.array([14, 25]), 2)
    toy.prepare_replay(buffers, step, 4)
    assert graph.slot_mapping.tolist() == [14, 25, 0, 0]
    assert graph.block_table.tolist() == [[3, 0, 0], [5, 6, 0], [0, 0, 0], [0, 0, 0]]
    assert graph.key_limit.tolist() == [3, 6, 1, 1]
    eager = toy.build_metadata(step, 4, torch.device("cpu"))
    assert eager.key_limit.tolist() == [3, 6] and eager.block_table.tolist() == [[3, 0],
                                                                                [5, 6]]
