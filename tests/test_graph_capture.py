"""Captured graphs (`graph_capture`): replay equals eager execution, the embeds set exists
only with prompt embeds enabled, token-only steps replay the ids set, padding, steps larger
than every static size (the CPU's `ANY` graphs), and the knobs (`enforce_eager`,
`compilation_config`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.graph_doubles import EagerCudaGraphs
from tests.hf_reference import load_hf_model
from vllm import LLM, SamplingParams
from vllm.config import CompilationConfig, InputKind
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backends import torch_sdpa
from vllm.v1.attention.backends.abstract import CommonAttentionMetadata
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from vllm.v1.worker.graph_capture import (
    ANY,
    ANY_MIN_TOKENS,
    default_capture_sizes,
)

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

IDS, EMBEDS = InputKind.TOKEN_IDS, InputKind.EMBEDS
SIZES = [1, 2, 4, 8]

PROMPTS = [
    "Hello world, this is",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a robot",
    "What is the capital of France? The capital of France is",
    "A",
    "One two three four five six seven",
]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory_bytes=16 * 1024**2, max_model_len=256,
               **kwargs)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.model_executor.model_runner


def _params(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)


def _embed(path: str, ids: list[int]) -> torch.Tensor:
    return load_hf_model(path).get_input_embeddings()(torch.tensor(ids)).detach()


@pytest.fixture(scope="module")
def eager(tiny_llama_dir) -> LLM:
    return _llm(tiny_llama_dir, enable_prompt_embeds=True, enforce_eager=True)


@pytest.fixture(scope="module")
def graphs(tiny_llama_dir) -> LLM:
    return _llm(tiny_llama_dir, enable_prompt_embeds=True,
                compilation_config={"cudagraph_capture_sizes": SIZES})


@pytest.fixture(scope="module")
def prompts(eager, tiny_llama_dir) -> list[dict]:
    """Token prompts and the same prompts as embeds, interleaved."""
    tok = eager.get_tokenizer()
    out = []
    for i, text in enumerate(PROMPTS):
        ids = tok.encode(text)
        out.append({"prompt_embeds": _embed(tiny_llama_dir, ids)} if i % 2
                   else {"prompt_token_ids": ids})
    return out


def _assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        x, y = x.outputs[0], y.outputs[0]
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.logprobs, y.logprobs, strict=True):
            assert lx.keys() == ly.keys()
            for token in lx:
                assert abs(lx[token].logprob - ly[token].logprob) < 1e-5


def test_capture_sizes_and_sets(graphs, tiny_llama_dir) -> None:
    runner = _runner(graphs)
    assert runner.graphs.sizes == SIZES
    assert runner.graphs.captured == {(kind, s) for kind in (IDS, EMBEDS)
                                      for s in SIZES + [ANY]}
    no_embeds = _llm(tiny_llama_dir, compilation_config={"cudagraph_capture_sizes": [1, 4]})
    # No embeds set.
    assert _runner(no_embeds).graphs.captured == {(IDS, 1), (IDS, 4), (IDS, ANY)}
    assert EMBEDS not in _runner(no_embeds).graphs.inputs
    for knobs in ({"enforce_eager": True}, {"compilation_config": 0},
                  {"compilation_config": {"level": 0}}):
        assert _runner(_llm(tiny_llama_dir, **knobs)).graphs is None


def test_replay_equals_eager_mixed_ids_and_embeds(graphs, eager, prompts) -> None:
    """Five requests: the prefill step (> 8 tokens, embeds rows) runs the embeds set's ANY
    graph unpadded, decode steps of 5 tokens pad to 8, then 4, 2, 1 as requests finish
    (different max_tokens)."""
    runner = _runner(graphs)
    runner.graphs.replays.clear()
    params = [_params(6 + 3 * i) for i in range(len(prompts))]
    _assert_same(graphs.generate(prompts, params, use_tqdm=False),
                 eager.generate(prompts, params, use_tqdm=False))
    replays = runner.graphs.replays
    # Decode steps carry real ids only (generated tokens), embeds prompts included.
    assert {kind for kind, size in replays if size != ANY} == {IDS}
    assert replays[(IDS, 8)] > 0 and replays[(IDS, 1)] > 0
    assert replays[(EMBEDS, ANY)] == 1 and replays[(IDS, ANY)] == 0


def test_large_steps_run_the_any_graphs(graphs, eager, prompts) -> None:
    """Steps larger than every static size run the ANY graph of the set matching their
    inputs, at their own size: token prefills of several requests (ids set), and embeds
    prefills (embeds set)."""
    runner = _runner(graphs)
    token_prompts = prompts[0::2]
    graphs.llm_engine.reset_prefix_cache()  # whole prefills, not earlier tests' hits
    runner.graphs.replays.clear()
    _assert_same(graphs.generate(token_prompts, _params(), use_tqdm=False),
                 eager.generate(token_prompts, _params(), use_tqdm=False))
    assert runner.graphs.replays[(IDS, ANY)] == 1 and runner.graphs.replays[(EMBEDS, ANY)] == 0
    # Embeds prompts longer than 8 rows, one at a time.
    embeds_prompts = [p for p in prompts[1::2] if p["prompt_embeds"].shape[0] > SIZES[-1]]
    assert embeds_prompts
    for prompt in embeds_prompts:
        graphs.llm_engine.reset_prefix_cache()
        runner.graphs.replays.clear()
        _assert_same(graphs.generate([prompt], _params(4), use_tqdm=False),
                     eager.generate([prompt], _params(4), use_tqdm=False))
        assert runner.graphs.replays[(EMBEDS, ANY)] == 1
        assert runner.graphs.replays[(IDS, 1)] == 3


def test_token_only_steps_replay_the_ids_set(graphs, eager, prompts) -> None:
    token_prompts = prompts[0::2]
    runner = _runner(graphs)
    runner.graphs.replays.clear()
    _assert_same(graphs.generate(token_prompts, _params(), use_tqdm=False),
                 eager.generate(token_prompts, _params(), use_tqdm=False))
    kinds = {kind for kind, _ in runner.graphs.replays}
    assert kinds == {IDS}  # the prefill (ANY) too
    assert runner.graphs.replays[(IDS, 4)] > 0  # three decodes padded to four


def test_short_embeds_prefill_replays_the_embeds_set(graphs, eager, prompts,
                                                      tiny_llama_dir) -> None:
    """Two embeds prompts of 3 rows: their prefill step (6 tokens, embeds rows) replays
    the embeds set at size 8; their decode steps the ids set at size 2."""
    tok = eager.get_tokenizer()
    short = [{"prompt_embeds": _embed(tiny_llama_dir, tok.encode(text)[:3])}
             for text in PROMPTS[:2]]
    runner = _runner(graphs)
    runner.graphs.replays.clear()
    _assert_same(graphs.generate(short, _params(), use_tqdm=False),
                 eager.generate(short, _params(), use_tqdm=False))
    assert runner.graphs.replays[(EMBEDS, 8)] == 1
    assert runner.graphs.replays[(IDS, 2)] == 11
    runner.graphs.replays.clear()
    long = [{"prompt_token_ids": tok.encode(" ".join(PROMPTS))}]
    assert len(long[0]["prompt_token_ids"]) > ANY_MIN_TOKENS
    _assert_same(graphs.generate(long, _params(), use_tqdm=False),
                 eager.generate(long, _params(), use_tqdm=False))
    # A token prompt: its prefill (ANY, > ANY_MIN_TOKENS tokens) and decodes replay the ids
    # set only.
    assert set(runner.graphs.replays) == {(IDS, ANY), (IDS, 1)}


def test_steps_up_to_any_min_tokens_without_a_static_size_run_eagerly(eager,
                                                                     tiny_llama_dir) -> None:
    """With sizes [1], a prefill of at most ANY_MIN_TOKENS tokens runs eagerly (layers may
    switch kernels by row count up to there, which a graph of symbolic size would have to
    guard); a longer one runs the ANY graph, compiled past ANY_MIN_TOKENS."""
    llm = _llm(tiny_llama_dir, compilation_config={"cudagraph_capture_sizes": [1]})
    runner = _runner(llm)
    tok = eager.get_tokenizer()
    long = {"prompt_token_ids": tok.encode(" ".join(PROMPTS))}
    short = {"prompt_token_ids": long["prompt_token_ids"][:ANY_MIN_TOKENS]}
    assert len(long["prompt_token_ids"]) > ANY_MIN_TOKENS
    for prompt, replays in ((short, {(IDS, 1): 4}), (long, {(IDS, ANY): 1, (IDS, 1): 4})):
        runner.graphs.replays.clear()
        _assert_same(llm.generate([prompt], _params(5), use_tqdm=False),
                     eager.generate([prompt], _params(5), use_tqdm=False))
        assert dict(runner.graphs.replays) == replays


def test_hidden_state_rows_through_graphs_match_eager(tiny_llama_dir, prompts) -> None:
    """Returned hidden states (stage outputs) written by graph replays: the same tokens,
    and rows equal to eager's up to float32 reassociation in the fused reductions."""
    kwargs = dict(enable_prompt_embeds=True, enable_return_hidden_states=True)
    graph_llm = _llm(tiny_llama_dir, compilation_config={"cudagraph_capture_sizes": SIZES},
                     **kwargs)
    eager_llm = _llm(tiny_llama_dir, enforce_eager=True, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                            return_hidden_states=True)
    graph_out = graph_llm.generate(prompts, params, use_tqdm=False)
    eager_out = eager_llm.generate(prompts, params, use_tqdm=False)
    assert _runner(graph_llm).graphs.replays
    for g, e in zip(graph_out, eager_out, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        torch.testing.assert_close(g.hidden_states, e.hidden_states, atol=1e-4, rtol=1e-4)


def test_default_capture_sizes() -> None:
    assert default_capture_sizes(2048, 64, "cpu") == [1, 2, 4, 8, 16]
    assert default_capture_sizes(2048, 12, "cpu") == [1, 2, 4, 8, 12]
    assert default_capture_sizes(2048, 3, "cpu") == [1, 2, 3]
    assert default_capture_sizes(4, 64, "cpu") == [1, 2, 4]
    assert default_capture_sizes(2048, 32, "cuda") == [1, 2, 4, 8, 16, 24, 32]


def test_compilation_config_from_user() -> None:
    assert CompilationConfig.from_user(None) == CompilationConfig()
    assert CompilationConfig.from_user(0).level == 0
    assert CompilationConfig.from_user({"cudagraph_capture_sizes": [4, 1]}
                                       ).cudagraph_capture_sizes == (4, 1)
    with pytest.raises(ValueError, match="Unknown compilation_config keys"):
        CompilationConfig.from_user({"sizes": [1]})
    with pytest.raises(ValueError, match="positive integers"):
        CompilationConfig.from_user({"cudagraph_capture_sizes": [0]})
    with pytest.raises(ValueError, match="must be a dict"):
        CompilationConfig.from_user("fast")


# ---- CUDA graphs' data path, on CPU ------------------------------------------------


def test_cuda_graph_buffers_and_metadata_equal_eager(tiny_llama_dir, eager, prompts,
                                                     monkeypatch) -> None:
    """What a CUDA graph replay computes from, run eagerly on CPU: decode steps staged into
    the padded buffers by the backend's `prepare_replay` and read through the metadata
    captured once per size (the torch gather path: the native kernels are CPU-only) give
    eager's greedy tokens and logprobs; ids steps and embeds steps (one-row embeds
    prompts) alike."""
    monkeypatch.setattr(torch_sdpa, "_native_ops", lambda device: None)  # CUDA's path
    # The module's eager engine built its native decode metadata (reused per batch size)
    # before the kernels went away under it: it builds each step's again.
    _runner(eager).step_inputs._decode_metadata.clear()
    llm = _llm(tiny_llama_dir, enable_prompt_embeds=True, enforce_eager=True)
    runner = _runner(llm)
    model_config = runner.model_config
    runner.graphs = EagerCudaGraphs(runner.model, SIZES, True, model_config.hidden_size,
                                    runner.dtype, runner.device, runner.block_size,
                                    runner.max_model_len, runner.attn_backend)
    runner.graphs.capture(runner.kv_caches, set_forward_context)
    for kv_cache in runner.kv_caches:  # as capture_model does after the capture forwards
        kv_cache.zero_()
    tok = eager.get_tokenizer()
    one_row = [{"prompt_embeds": _embed(tiny_llama_dir, tok.encode(text)[:1])}
               for text in PROMPTS[:2]]
    for batch in (prompts, one_row):
        params = [_params(6 + 3 * i) for i in range(len(batch))]
        _assert_same(llm.generate(batch, params, use_tqdm=False),
                     eager.generate(batch, params, use_tqdm=False))
    replays = runner.graphs.replays
    assert replays[(IDS, 8)] > 0 and replays[(IDS, 1)] > 0  # 5 requests padded to 8
    assert replays[(EMBEDS, 2)] == 1  # the two one-row embeds prefills


def test_torch_sdpa_graph_hooks_stage_the_eager_metadata(monkeypatch) -> None:
    """The CUDA path's attention buffers, built on CPU through the backend's hooks: the
    metadata captured for 4 rows (views of the buffers) holds, after `prepare_replay` of a
    3-request decode step, eager `build_metadata`'s slot mapping, block table and key mask
    in its first rows (zero-padded past the step's widest sequence) and a padding row at
    the null block, whatever an earlier replay staged; attention through it equals eager
    attention on the real rows."""
    monkeypatch.setattr(torch_sdpa, "_native_ops", lambda device: None)  # CUDA's path
    block_size, max_blocks, cpu = 4, 8, torch.device("cpu")
    backend = TorchSDPABackend
    buffers = backend.init_graph_buffers(8, max_blocks, block_size, cpu)
    graph = backend.capture_metadata(buffers, 4)
    assert isinstance(graph, TorchSDPAMetadata)
    assert graph.decode_only and graph.num_actual_tokens == 4 and not graph.prefills
    # At capture every row is padding: the eager metadata of 4 padding decodes, widened.
    padding = backend.build_metadata(CommonAttentionMetadata.padding_decodes(4), block_size,
                                     cpu)
    _assert_graph_rows_equal(graph, padding, rows=4)

    def decode_step(seq_lens: list[int], block_ids: list[list[int]]):
        table = np.zeros((len(seq_lens), max_blocks), dtype=np.int32)
        for row, ids in enumerate(block_ids):
            table[row, :len(ids)] = ids
        pos = np.array(seq_lens) - 1  # each request's one token
        return CommonAttentionMetadata(
            query_start_loc=np.arange(len(seq_lens) + 1, dtype=np.int32),
            seq_lens=np.array(seq_lens, dtype=np.int32),
            num_computed_tokens=pos.astype(np.int32),
            block_table=table,
            slot_mapping=(table[np.arange(len(pos)), pos // block_size].astype(np.int64)
                          * block_size + pos % block_size),
            num_actual_tokens=len(seq_lens))

    # An earlier 4-request step fills every row; then 3 requests of 3, 9 and 18 tokens:
    # slots 7*4+2=30, 5*4+0=20, 8*4+1=33; eager tables are cdiv(18, 4) = 5 blocks wide.
    backend.prepare_replay(buffers, decode_step([30, 30, 30, 30], [list(range(1, 9))] * 4), 4)
    step = decode_step([3, 9, 18], [[7], [2, 11, 5], [1, 3, 4, 6, 8]])
    assert step.slot_mapping.tolist() == [30, 20, 33]
    backend.prepare_replay(buffers, step, 4)
    eager = backend.build_metadata(step, block_size, cpu)
    _assert_graph_rows_equal(graph, eager, rows=3)
    assert graph.slot_mapping[3] == 0 and not graph.decode_block_table[3].any()
    assert graph.decode_mask[3].flatten().nonzero().flatten().tolist() == [0]

    heads, kv_heads, head_size = 4, 2, 8
    impl = backend.make_impl(heads, head_size, kv_heads, head_size**-0.5)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 16, block_size, kv_heads, head_size, generator=gen)
    q = torch.randn(4, heads, head_size, generator=gen)
    k, v = (torch.randn(4, kv_heads, head_size, generator=gen) for _ in range(2))
    out_graph = impl.forward(q, k, v, cache.clone(), graph)
    out_eager = impl.forward(q[:3], k[:3], v[:3], cache.clone(), eager)
    torch.testing.assert_close(out_graph[:3], out_eager)


def _assert_graph_rows_equal(graph: TorchSDPAMetadata, eager: TorchSDPAMetadata,
                             rows: int) -> None:
    """The first `rows` of graph metadata equal the eager decode metadata, which is as wide
    as the step's longest sequence; the graph's columns past it are zero / masked."""
    assert eager.decode_only and eager.decode_block_table is not None
    assert eager.decode_mask is not None
    assert graph.decode_block_table is not None and graph.decode_mask is not None
    width = eager.decode_block_table.shape[1]
    keys = eager.decode_mask.shape[-1]
    assert torch.equal(graph.slot_mapping[:rows], eager.slot_mapping)
    assert torch.equal(graph.decode_block_table[:rows, :width], eager.decode_block_table)
    assert not graph.decode_block_table[:rows, width:].any()
    assert torch.equal(graph.decode_mask[:rows, ..., :keys], eager.decode_mask)
    assert not graph.decode_mask[:rows, ..., keys:].any()


# ---- CUDA graphs: only where CUDA is present (never on CPU CI) ----------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_graph_replay_equals_eager(tiny_llama_dir) -> None:
    """Decode-only steps replay CUDA graphs (ids set; embeds set only with the flag);
    greedy tokens identical to eager, logprobs within 1e-5, float32."""
    common = dict(device="cuda", enable_prompt_embeds=True)
    eager_llm = _llm(tiny_llama_dir, enforce_eager=True, **common)
    graph_llm = _llm(tiny_llama_dir, compilation_config={"cudagraph_capture_sizes": SIZES},
                     **common)
    runner = _runner(graph_llm)
    assert set(runner.graphs.captured) == {(k, s) for k in (IDS, EMBEDS) for s in SIZES}
    tok = eager_llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(t)} for t in PROMPTS]
    params = [_params(6 + 3 * i) for i in range(len(prompts))]
    _assert_same(graph_llm.generate(prompts, params, use_tqdm=False),
                 eager_llm.generate(prompts, params, use_tqdm=False))
    assert runner.graphs.replays[(IDS, 8)] > 0 and runner.graphs.replays[(IDS, 1)] > 0
    no_embeds = _llm(tiny_llama_dir, device="cuda",
                     compilation_config={"cudagraph_capture_sizes": [1, 2]})
    assert set(_runner(no_embeds).graphs.captured) == {(IDS, 1), (IDS, 2)}


def test_mixed_prompt_steps_pick_the_set_by_their_rows(graphs, eager, tiny_llama_dir
                                                       ) -> None:
    """A mixed prompt's prefill (rows and ids) replays the embeds set; its prefix-cache hit
    leaves a step of text positions only, which replays the ids set; decodes are ids."""
    runner = _runner(graphs)
    rows = _embed(tiny_llama_dir, [5, 6, 7])
    prompt = {"prompt_segments": [rows, " ".join(PROMPTS)]}
    graphs.llm_engine.reset_prefix_cache()
    runner.graphs.replays.clear()
    first = graphs.generate(prompt, _params(4), use_tqdm=False)
    _assert_same(first, eager.generate(prompt, _params(4), use_tqdm=False))
    assert runner.graphs.replays == {(EMBEDS, ANY): 1, (IDS, 1): 3}
    runner.graphs.replays.clear()
    again = graphs.generate(prompt, _params(4), use_tqdm=False)
    assert again[0].num_cached_tokens >= 16 and first[0].num_prompt_tokens > 16 + 8
    _assert_same(again, first)
    assert {kind for kind, _ in runner.graphs.replays} == {IDS}  # the tail prefill too
    assert sum(runner.graphs.replays.values()) == 4 and runner.graphs.replays[(IDS, 1)] == 3
