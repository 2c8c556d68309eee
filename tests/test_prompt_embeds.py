"""Prompt embeddings through the whole engine: equivalence with token prompts and with
transformers, mixing, chunking, preemption, prefix caching, errors and memory."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.hf_reference import hf_greedy, load_hf_model
from vllm import LLM, SamplingParams
from vllm.config import InputKind

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello world, this is",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot "
    "who lived in a quiet village by the sea, and every morning it walked to the market.",
    "What is the capital of France? The capital of France is",
    "A",
]


def _llm(path: str, **kwargs) -> LLM:
    """Eager unless a test asks for graphs: batching policies, chunks, preemption and the
    prefix cache are the scheduler's and the input batch's. The module's engine runs the
    graphs (ids and embeds sets) against transformers; replay against eager is
    tests/test_graph_capture.py's subject."""
    kwargs.setdefault("enforce_eager", True)
    kwargs.setdefault("kv_cache_memory_bytes", 16 * 1024**2)
    kwargs.setdefault("max_model_len", 512)
    return LLM(path, dtype="float32", enable_prompt_embeds=True, **kwargs)


def _greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _embed(path: str, ids: list[int]) -> torch.Tensor:
    return load_hf_model(path).get_input_embeddings()(torch.tensor(ids)).detach()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return _llm(tiny_llama_dir, enforce_eager=False)


@pytest.fixture(scope="module")
def token_ids(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_embeds_equal_token_ids_and_transformers(llm, tiny_llama_dir, token_ids):
    embeds = [{"prompt_embeds": _embed(tiny_llama_dir, ids)} for ids in token_ids]
    by_ids = llm.generate([{"prompt_token_ids": ids} for ids in token_ids], _greedy(),
                          use_tqdm=False)
    by_embeds = llm.generate(embeds, _greedy(logprobs=2), use_tqdm=False)
    assert _tokens(by_embeds) == _tokens(by_ids)
    model = load_hf_model(tiny_llama_dir)
    for ids, out in zip(token_ids, by_embeds):
        ref = hf_greedy(model, None, 16, inputs_embeds=_embed(tiny_llama_dir, ids))
        assert out.outputs[0].token_ids == ref.token_ids
        ours = torch.tensor([lp[t].logprob for lp, t in
                             zip(out.outputs[0].logprobs, out.outputs[0].token_ids)])
        theirs = ref.logprobs.gather(1, torch.tensor(ref.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert out.prompt is None and out.prompt_token_ids is None
        assert out.num_prompt_tokens == len(ids)


def test_embeds_output_fields_and_3d_input(llm, tiny_llama_dir, token_ids):
    e = _embed(tiny_llama_dir, token_ids[0])
    flat, batched = llm.generate([{"prompt_embeds": e}, {"prompt_embeds": e[None].double()}],
                                 _greedy(), use_tqdm=False)
    assert flat.outputs[0].token_ids == batched.outputs[0].token_ids
    assert flat.outputs[0].text == llm.get_tokenizer().decode(flat.outputs[0].token_ids)


@pytest.mark.parametrize("policy", ["mixed", "separate"])
def test_mixed_batch_equals_each_alone(tiny_llama_dir, token_ids, policy):
    llm = _llm(tiny_llama_dir, prompt_embeds_batching=policy, max_num_batched_tokens=32)
    prompts = []
    for i, ids in enumerate(token_ids):
        prompts.append({"prompt_embeds": _embed(tiny_llama_dir, ids)} if i % 2 else
                       {"prompt_token_ids": ids})
        prompts.append({"prompt_token_ids": ids} if i % 2 else
                       {"prompt_embeds": _embed(tiny_llama_dir, ids)})
    together = llm.generate(prompts, _greedy(), use_tqdm=False)
    alone = [llm.generate(p, _greedy(), use_tqdm=False)[0] for p in prompts]
    assert _tokens(together) == _tokens(alone)
    # Both kinds of the same prompt give the same tokens.
    assert _tokens(together)[0::2] == _tokens(together)[1::2]


def test_separate_policy_never_mixes_kinds(tiny_llama_dir, token_ids):
    llm = _llm(tiny_llama_dir, prompt_embeds_batching="separate")
    engine = llm.llm_engine
    core = engine.engine_core
    kinds_per_step = []
    original = core.model_executor.execute_model

    def spy(scheduler_output):
        reqs = core.scheduler.requests
        kinds_per_step.append({reqs[r].prompt_kind for r in
                               scheduler_output.num_scheduled_tokens if r in reqs})
        return original(scheduler_output)

    core.model_executor.execute_model = spy
    prompts = [{"prompt_embeds": _embed(tiny_llama_dir, ids)} for ids in token_ids]
    prompts += [{"prompt_token_ids": ids} for ids in token_ids]
    llm.generate(prompts, _greedy(), use_tqdm=False)
    assert all(len(kinds) <= 1 for kinds in kinds_per_step)
    assert {InputKind.TOKEN_IDS} in kinds_per_step
    assert {InputKind.EMBEDS} in kinds_per_step


def test_chunked_prefill_of_long_embeds(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=2)
    ids = llm.get_tokenizer().encode(" ".join(PROMPTS * 2))
    assert len(ids) > 40
    ref = hf_greedy(load_hf_model(tiny_llama_dir), ids, 12)
    out = llm.generate({"prompt_embeds": _embed(tiny_llama_dir, ids)}, _greedy(12),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref.token_ids


def test_preemption_of_embeds_requests(tiny_llama_dir, token_ids):
    llm = _llm(tiny_llama_dir, num_gpu_blocks_override=11, block_size=16, max_model_len=144,
               enable_prefix_caching=False)
    prompts = [{"prompt_embeds": _embed(tiny_llama_dir, ids)} for ids in token_ids]
    outputs = llm.generate(prompts, _greedy(40), use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    model = load_hf_model(tiny_llama_dir)
    assert _tokens(outputs) == [hf_greedy(model, ids, 40).token_ids for ids in token_ids]


def test_prefix_cache_hits_for_embeds(tiny_llama_dir, token_ids):
    llm = _llm(tiny_llama_dir, block_size=4)
    ids = token_ids[1]
    n = len(ids)
    e = _embed(tiny_llama_dir, ids)
    first = llm.generate({"prompt_embeds": e}, _greedy(4), use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": e.clone()}, _greedy(4), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (n - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # A change in row 9 (block 2) misses from that block on.
    changed = e.clone()
    changed[9] += 1.0
    partial = llm.generate({"prompt_embeds": changed}, _greedy(4), use_tqdm=False)[0]
    assert partial.num_cached_tokens == 8
    # Token prompts never hit embeds blocks, even with the same content.
    as_tokens = llm.generate({"prompt_token_ids": ids}, _greedy(4), use_tqdm=False)[0]
    assert as_tokens.num_cached_tokens == 0
    assert as_tokens.outputs[0].token_ids == first.outputs[0].token_ids


def test_sampling_features_with_embeds(llm, tiny_llama_dir, token_ids):
    e = {"prompt_embeds": _embed(tiny_llama_dir, token_ids[2])}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, n=3)
    a = llm.generate(e, seeded, use_tqdm=False)[0]
    b = llm.generate(e, seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    greedy = llm.generate(e, _greedy(12), use_tqdm=False)[0].outputs[0]
    stop = greedy.text[3:6]
    stopped = llm.generate(e, _greedy(12, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == greedy.text[:greedy.text.index(stop)]
    penalized = llm.generate(e, _greedy(12, repetition_penalty=5.0), use_tqdm=False)
    assert len(set(penalized[0].outputs[0].token_ids)) == 12  # no repeats allowed to win
    stop_id = greedy.token_ids[4]
    by_id = llm.generate(e, SamplingParams(temperature=0, max_tokens=12,
                                            stop_token_ids=[stop_id]), use_tqdm=False)
    assert by_id[0].outputs[0].token_ids[-1] == stop_id
    assert by_id[0].outputs[0].stop_reason == stop_id


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(2, 3, 64), "2-D"),
    (torch.zeros(64), "2-D"),
    (torch.zeros(4, 65), "hidden size"),
    (torch.zeros(4, 64, dtype=torch.int64), "floating"),
    (torch.zeros(0, 64), "empty"),
    (torch.zeros(600, 64), "maximum model length"),
    (torch.full((3, 64), float("nan")), "non-finite"),
    ("not a tensor", "torch.Tensor"),
])
def test_bad_embeds_are_rejected_cleanly(llm, bad, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt": "fine"}, {"prompt_embeds": bad}], _greedy(), use_tqdm=False)
    _assert_engine_empty(llm)
    assert llm.generate("still works", _greedy(4), use_tqdm=False)[0].outputs[0].token_ids


def test_prompt_logprobs_and_disabled_flag(llm, tiny_llama_dir):
    e = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate({"prompt_embeds": e}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    plain = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 * 1024**2,
                max_model_len=256, enforce_eager=True)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        plain.generate({"prompt_embeds": e}, use_tqdm=False)


def _assert_engine_empty(llm: LLM) -> None:
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.model_executor.model_runner
    assert not core.scheduler.requests and not core.scheduler.has_unfinished_requests()
    assert not engine.output_processor.request_states
    assert not core.has_requests()
    assert not runner.requests
    assert all(s is None for s in runner.input_batch.req_states)


def test_no_embeds_retained_after_many_requests(llm, tiny_llama_dir, token_ids):
    embeds = [_embed(tiny_llama_dir, ids) for ids in token_ids]

    def run(rounds: int) -> None:
        for _ in range(rounds):
            prompts = [{"prompt_embeds": e.clone()} for e in embeds * 25]
            llm.generate(prompts, _greedy(2), use_tqdm=False)

    run(1)
    _assert_engine_empty(llm)
    gc.collect()
    before = sum(1 for o in gc.get_objects() if torch.is_tensor(o))
    run(3)  # 300 more embeds requests
    _assert_engine_empty(llm)
    gc.collect()
    after = sum(1 for o in gc.get_objects() if torch.is_tensor(o))
    assert after <= before


def test_finished_request_leaves_no_embeds_behind(llm, tiny_llama_dir):
    """Once a request has finished and the engine is empty, no tensor of its prompt embeds
    is alive (the cached sampling inputs of its last step held its state)."""
    rows = 23  # a shape no other tensor of the engine has
    prompt = {"prompt_embeds": _embed(tiny_llama_dir, list(range(100, 100 + rows)))}
    hidden = prompt["prompt_embeds"].shape[1]
    llm.generate([prompt], _greedy(2), use_tqdm=False)
    del prompt
    _assert_engine_empty(llm)
    gc.collect()
    assert not [o for o in gc.get_objects()
                if torch.is_tensor(o) and tuple(o.shape) == (rows, hidden)]


def test_default_model_embeds_match(default_model_path):
    # Graphs for its two rows only (a decode step of 2; prefills run the ANY graphs): the
    # default model's ids and embeds sets, without compiling sizes no step here takes.
    llm = LLM(default_model_path, dtype="float32", quantization="none", max_model_len=512,
              enable_prompt_embeds=True, kv_cache_memory_bytes=32 * 1024**2,
              compilation_config={"cudagraph_capture_sizes": [2]})
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
               for q in ["What is the capital of France?", "Name a fruit."]]
    ids = [tok.encode(p) for p in prompts]
    model = load_hf_model(default_model_path)
    embeds = [model.get_input_embeddings()(torch.tensor(i)).detach() for i in ids]
    by_ids = llm.generate([{"prompt_token_ids": i} for i in ids], _greedy(12), use_tqdm=False)
    by_embeds = llm.generate([{"prompt_embeds": e} for e in embeds], _greedy(12),
                             use_tqdm=False)
    assert _tokens(by_embeds) == _tokens(by_ids)
    for e, out in zip(embeds, by_embeds):
        assert out.outputs[0].token_ids == hf_greedy(model, None, 12, inputs_embeds=e).token_ids
