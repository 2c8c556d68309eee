"""Prompts mixing token ids and embeddings rows (`prompt_segments`): block hashes position
by position, the runner's is_token mask, and parity with transformers fed the same
`inputs_embeds` (text positions from its embedding table) under chunked prefill,
preemption and prefix hits, batched with token-only and embeds-only requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.core_factories import make_params, make_scheduler_request
from tests.hf_reference import hf_greedy, load_hf_model
from vllm import LLM, SamplingParams
from vllm.v1.core.kv_cache_utils import block_inputs, hash_block
from vllm.v1.engine import EmbedsLayout
from vllm.v1.request import Request
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch

TEXTS = ["Describe: ", " in one line.", "The quick brown fox jumps over the lazy dog. Once",
         " upon a time there was a little robot"]


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 16 * 1024**2)
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("enforce_eager", True)  # graphs: tests/test_graph_capture.py
    return LLM(path, dtype="float32", enable_prompt_embeds=True, **kwargs)


def _greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def _rows(n: int, seed: int, hidden: int) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05


# ---- exact units -----------------------------------------------------------------------


def test_embeds_layout_rows_and_block_inputs() -> None:
    layout = EmbedsLayout(np.array([True, False, False, True, False]))
    assert layout.rows_before.tolist() == [0, 0, 1, 2, 2, 3]
    assert layout.rows(1, 4) == (0, 2) and layout.rows(3, 9) == (2, 3)
    assert layout.row_index(np.array([1, 2, 4])).tolist() == [0, 1, 2]
    assert layout.block_mask(3, 7).tolist() == [True, False, True, True]
    rows = torch.arange(3 * 2, dtype=torch.float32).reshape(3, 2)
    ids = [5, 0, 0, 7, 0, 9, 11]  # prompt of 5, then generated 9, 11
    got_ids, got_rows, mask = block_inputs(ids, rows, layout, 2, 6)
    assert got_ids == [7, 9] and mask is not None
    assert mask.tolist() == [False, True, False, True]
    assert got_rows is not None and torch.equal(got_rows, rows[1:3])
    # A block past the prompt, or of text positions only, is a token block.
    assert block_inputs(ids, rows, layout, 5, 7) == ([9, 11], None, None)
    assert block_inputs(ids, rows, EmbedsLayout(np.ones(4, dtype=bool)), 0, 4) == \
        ([5, 0, 0, 7], None, None)


def test_mixed_block_hashes_agree_only_position_by_position() -> None:
    rows = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)

    def mixed(req_id: str, ids: list[int], mask: list[bool], embeds: torch.Tensor
              ) -> Request:
        return make_scheduler_request(req_id, ids, prompt_embeds=embeds,
                                      prompt_is_token_ids=torch.tensor(mask))

    # Prompt: 4 text ids, then rows 0..1 between texts, then rows 2..3 (block size 4).
    ids = [10, 11, 12, 13, 20, 0, 0, 21, 0, 0, 22, 23]
    mask = [True] * 5 + [False] * 2 + [True] + [False] * 2 + [True] * 2
    a = mixed("a", ids, mask, rows)
    h0 = hash_block(None, [10, 11, 12, 13])
    h1 = hash_block(h0, [20, 21], rows[0:2], np.array([True, False, False, True]))
    h2 = hash_block(h1, [22, 23], rows[2:4], np.array([False, False, True, True]))
    assert a.block_hashes == [h0, h1, h2]
    # The text block is a text prompt's block: they share it.
    assert make_scheduler_request("t", [10, 11, 12, 13, 1]).block_hashes == [h0]
    # Same rows and ids, rows moved by one position: the second block differs.
    moved = [True] * 5 + [True, False, False] + [False] * 2 + [True] * 2
    b = mixed("b", [10, 11, 12, 13, 20, 21, 0, 0, 0, 0, 22, 23], moved, rows)
    assert b.block_hashes[0] == h0 and b.block_hashes[1] != h1
    # One changed row value: the block holding it and all later ones differ.
    changed = rows.clone()
    changed[2, 0] += 1e-3
    c = mixed("c", ids, mask, changed)
    assert c.block_hashes[:2] == [h0, h1] and c.block_hashes[2] != h2
    # Embeds-only blocks hash as rows-then-tokens, as before mixed prompts existed.
    e = make_scheduler_request("e", prompt_embeds=rows)
    assert e.block_hashes == [hash_block(None, [], rows)]
    # Output tokens finishing a mixed block extend the chain like any token.
    d = mixed("d", ids[:10], mask[:10], rows)
    assert d.block_hashes == [h0, h1]
    d.append_output_token_ids([22, 23])
    assert d.block_hashes == [h0, h1, h2]


def test_input_batch_is_token_mask_from_the_request() -> None:
    batch = InputBatch(2, 16, block_size=4, vocab_size=50)
    layout = EmbedsLayout(np.array([True, False, False, True]))
    state = CachedRequestState(req_id="m", prompt_token_ids=[5, 0, 0, 7],
                               prompt_embeds=torch.zeros(2, 3), sampling_params=make_params(),
                               generator=None, block_ids=[1], num_computed_tokens=0,
                               output_token_ids=[9], embeds_layout=layout)
    row = batch.add_request(state)
    assert batch.is_token_ids[row, :6].tolist() == [True, False, False, True, True, False]
    assert batch.token_ids_cpu[row, :5].tolist() == [5, 0, 0, 7, 9]
    # Embeds-only states without a layout get an all-rows one.
    only = CachedRequestState(req_id="e", prompt_token_ids=[0, 0], prompt_embeds=torch.zeros(
        2, 3), sampling_params=make_params(), generator=None, block_ids=[2],
        num_computed_tokens=0)
    assert batch.is_token_ids[batch.add_request(only), :3].tolist() == [False, False, False]


# ---- end to end against transformers ----------------------------------------------------


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def cases(hf, tiny_llama_dir):
    """(prompt, inputs_embeds transformers sees): mixed, embeds-only and token-only."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    table = hf.get_input_embeddings()
    hidden = hf.config.hidden_size
    bos = tok.encode("a")[:-1]

    def text(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False)

    def look_up(ids: list[int]) -> torch.Tensor:
        return table(torch.tensor(ids, dtype=torch.long)).detach()

    e1, e2, e3 = _rows(3, 1, hidden), _rows(7, 2, hidden), _rows(20, 3, hidden)
    out = [
        ({"prompt_segments": [TEXTS[0], e1, TEXTS[1]]},
         torch.cat([look_up(bos + text(TEXTS[0])), e1, look_up(text(TEXTS[1]))])),
        # Two parts, a token-id segment, no BOS; text then rows at the end.
        ({"prompt_segments": [[7, 8, 9], e2, TEXTS[2], e1], "add_special_tokens": False},
         torch.cat([look_up([7, 8, 9]), e2, look_up(text(TEXTS[2])), e1])),
        ({"prompt_segments": [e3, TEXTS[3], e2, TEXTS[2]]},
         torch.cat([look_up(bos), e3, look_up(text(TEXTS[3])), e2, look_up(text(TEXTS[2]))])),
        ({"prompt_embeds": e3}, e3),
        ({"prompt_token_ids": tok.encode(TEXTS[2])}, look_up(tok.encode(TEXTS[2]))),
        ({"prompt_segments": [TEXTS[3]]}, look_up(bos + text(TEXTS[3]))),
    ]
    return out


def _check(outputs, cases, hf, max_tokens: int = 10) -> None:
    for out, (_, inputs_embeds) in zip(outputs, cases, strict=True):
        assert out.num_prompt_tokens == inputs_embeds.shape[0]
        ref = hf_greedy(hf, None, max_tokens, inputs_embeds=inputs_embeds)
        got = out.outputs[0]
        assert got.token_ids == ref.token_ids
        ours = torch.tensor([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)])
        theirs = ref.logprobs.gather(1, torch.tensor(ref.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.slow  # an engine: left out of `make test-fast`
@pytest.mark.parametrize("policy", ["mixed", "separate"])
def test_mixed_prompts_equal_transformers_chunked_and_batched(tiny_llama_dir, hf, cases,
                                                               policy):
    """Chunks of 8 tokens: the mixed prompts' chunks fall across text and rows."""
    llm = _llm(tiny_llama_dir, prompt_embeds_batching=policy, max_num_batched_tokens=8,
               block_size=4)
    prompts = [p for p, _ in cases]
    _check(llm.generate(prompts, _greedy(), use_tqdm=False), cases, hf)
    if policy == "separate":
        return
    # Prefix hits: the same mixed prompt again hits every full block but the last token's;
    # a text prompt sharing the leading text hits its text blocks; one changed row misses
    # from its block on.
    prompt, inputs_embeds = cases[2]
    again = llm.generate(prompt, _greedy(), use_tqdm=False)[0]
    n = inputs_embeds.shape[0]
    assert again.num_cached_tokens == (n - 1) // 4 * 4
    _check([again], [cases[2]], hf)
    segments = list(prompt["prompt_segments"])
    segments[2] = segments[2].clone()
    segments[2][5] += 0.5  # position 1 + 20 + len(text 3) + 5
    changed = llm.generate({"prompt_segments": segments}, _greedy(), use_tqdm=False)[0]
    assert changed.num_cached_tokens == (1 + 20 + len(_ids(llm, TEXTS[3])) + 5) // 4 * 4
    text_first = {"prompt_segments": [TEXTS[2] + TEXTS[3], _rows(4, 9, hf.config.hidden_size)]}
    llm.generate({"prompt": TEXTS[2] + TEXTS[3]}, _greedy(2), use_tqdm=False)
    hit = llm.generate(text_first, _greedy(2), use_tqdm=False)[0]
    assert hit.num_cached_tokens == (1 + len(_ids(llm, TEXTS[2] + TEXTS[3]))) // 4 * 4


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


@pytest.mark.slow  # an engine: left out of `make test-fast`
def test_mixed_prompts_under_preemption(tiny_llama_dir, hf, cases):
    llm = _llm(tiny_llama_dir, num_gpu_blocks_override=14, block_size=8, max_model_len=96,
               enable_prefix_caching=False)
    outputs = llm.generate([p for p, _ in cases], _greedy(40), use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    _check(outputs, cases, hf, 40)


@pytest.mark.slow  # an engine: left out of `make test-fast`
def test_bad_segments_are_rejected(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, max_model_len=32)
    hidden = load_hf_model(tiny_llama_dir).config.hidden_size
    bad = [
        ({"prompt_segments": []}, "non-empty list"),
        ({"prompt_segments": ["a", 3]}, "prompt_segments[1] must be"),
        ({"prompt_segments": ["a", torch.zeros(2, hidden + 1)]}, "hidden size"),
        ({"prompt_segments": ["a", torch.zeros(2, hidden, dtype=torch.int32)]}, "floating"),
        ({"prompt_segments": ["a"], "prompt": "b"}, "cannot also carry prompt"),
        ({"prompt_segments": ["a", [10**6]]}, "out of the vocabulary"),
        ({"prompt_segments": ["a", torch.zeros(31, hidden), "b c d"]}, "longer than"),
    ]
    for prompt, message in bad:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            llm.generate(prompt, _greedy(), use_tqdm=False)
    off = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=4 * 1024**2,
              max_model_len=32, enforce_eager=True)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        off.generate({"prompt_segments": ["a", torch.zeros(2, hidden)]}, _greedy(),
                     use_tqdm=False)
    # Text-only segments need no embeds support.
    assert off.generate({"prompt_segments": ["a", [10]]}, _greedy(2), use_tqdm=False)


def test_router_hashes_mixed_prompts_position_by_position() -> None:
    from tests.core_factories import make_request
    from vllm.v1.engine.dp_router import prefix_block_hashes

    rows = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 3)
    mask = torch.tensor([True] * 4 + [False, True, False, True])
    ids = [1, 2, 3, 4, 0, 5, 0, 6]
    mixed = prefix_block_hashes(make_request("m", ids, prompt_embeds=rows,
                                             prompt_is_token_ids=mask), 4)
    text = prefix_block_hashes(make_request("t", [1, 2, 3, 4, 9, 9, 9, 9]), 4)
    assert mixed[0] == text[0] and mixed[1] != text[1]
    changed = rows.clone()
    changed[1, 2] += 1
    other = prefix_block_hashes(make_request("c", ids, prompt_embeds=changed,
                                             prompt_is_token_ids=mask), 4)
    assert other[0] == mixed[0] and other[1] != mixed[1]
    assert prefix_block_hashes(make_request("m2", ids, prompt_embeds=rows.clone(),
                                            prompt_is_token_ids=mask.clone()), 4) == mixed
