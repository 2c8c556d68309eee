"""Speculative decoding: the ngram proposer and the rejection sampler exactly (and the
sampler's output distribution statistically), greedy outputs token-identical to plain
decoding end to end, and bad configurations refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.hf_reference import assert_identical_greedy, hf_greedy, load_hf_model
from tests.model_factory import make_tiny_model
from vllm import LLM, SamplingParams
from vllm.config import InputKind, SpeculativeConfig
from vllm.v1.sample.metadata import Penalties, SamplingMetadata
from vllm.v1.sample.sampler import inverse_cdf_sample, sampling_probs
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
from vllm.v1.spec_decode.rejection_sampler import (
    DraftLayout,
    RejectionSampler,
    expand_metadata,
    first_stops,
)
from vllm.v1.spec_decode.spec_runner import SpecDecodeRunner

# ---- the ngram proposer ----------------------------------------------------------------


def _propose(tokens, k=3, lo=1, hi=3, is_token=None):
    mask = None if is_token is None else np.array(is_token, dtype=bool)
    return NgramProposer(k, lo, hi).propose(np.array(tokens), mask)


def test_ngram_longest_suffix_match_wins_and_latest_occurrence():
    # Suffix [1 2 3] occurs at 0..2 (followed by 4 5 6); [2 3] alone also at 7..8 (then 9).
    assert _propose([1, 2, 3, 4, 5, 6, 2, 3, 9, 1, 2, 3]) == [4, 5, 6]
    # Only n <= 2 allowed: the latest [2 3] wins (followed by 9 1 2).
    assert _propose([1, 2, 3, 4, 5, 6, 2, 3, 9, 1, 2, 3], hi=2) == [9, 1, 2]
    # Fewer than k tokens follow the match: the drafts run into the suffix itself.
    assert _propose([7, 8, 7, 8], k=5) == [7, 8]
    assert _propose([1, 2, 3, 4, 1, 2, 3], k=2) == [4, 1]


def test_ngram_min_max_and_no_match():
    tokens = [5, 1, 2, 9, 1, 2, 7, 1, 2]
    assert _propose(tokens, lo=1, hi=3) == [7, 1, 2]  # [1 2] matched (n 2)
    assert _propose(tokens, lo=3, hi=3) == []  # [7 1 2] never occurred before
    assert _propose([1, 2, 3, 4]) == []
    assert _propose([4]) == []
    assert _propose([3, 3, 3], lo=1, hi=1, k=1) == [3]


def test_ngram_embeds_positions_never_match_nor_get_drafted():
    # Position 3 holds an embeds row (placeholder 0): [0 1 2] never matches a suffix...
    tokens, mask = [0, 1, 2, 0, 6, 0, 1, 2], [1, 1, 1, 0, 1, 0, 1, 1]
    assert _propose(tokens, lo=3, hi=3, is_token=mask) == []
    # ... and [1 2] at 1..2 is followed by the embeds position: no drafts from there.
    assert _propose(tokens, lo=2, hi=2, is_token=mask) == []
    mask = [1, 1, 1, 1, 0, 1, 1, 1]
    assert _propose(tokens, lo=2, hi=2, is_token=mask) == [0]  # cut before position 4
    # A suffix ending on an embeds position matches nothing.
    assert _propose([4, 4, 4], is_token=[1, 1, 0]) == []


def _reference_drafts(tokens, is_token, k, lo, hi):
    """The definition, by brute force: the largest n in [lo, hi] whose suffix n-gram (all
    tokens) ends earlier at some j <= L - 2 (all tokens there too), the latest such j;
    then up to k tokens after j, cut before any embeds position."""
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        suffix = list(range(length - n, length))
        if not all(is_token[p] for p in suffix):
            continue
        for end in range(length - 2, n - 2, -1):
            span = range(end - n + 1, end + 1)
            if all(is_token[p] for p in span) and \
                    [tokens[p] for p in span] == [tokens[p] for p in suffix]:
                drafts = []
                for p in range(end + 1, min(end + 1 + k, length)):
                    if not is_token[p]:
                        break
                    drafts.append(tokens[p])
                return drafts
    return []


def test_ngram_index_against_brute_force_as_tokens_arrive():
    """Random sequences over a 3-4 token alphabet (many repeats), some prompt positions
    embeds: an index extended chunk by chunk proposes what the brute force finds for every
    prefix, and so does a fresh NgramProposer."""
    rng = np.random.default_rng(0)
    for case in range(40):
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        tokens = rng.integers(0, int(rng.integers(3, 5)), 40).tolist()
        is_token = (rng.random(40) > (0.15 if case % 2 else 0.0)).tolist()
        proposer = NgramProposer(k, lo, hi)
        index = proposer.index()
        length = 0
        while length < 40:
            step = int(rng.integers(1, 6))
            chunk = range(length, min(40, length + step))
            index.extend([tokens[p] if is_token[p] else None for p in chunk])
            length = chunk.stop
            expected = _reference_drafts(tokens[:length], is_token[:length], k, lo, hi)
            assert index.propose(k) == expected, (case, length)
            assert proposer.propose(np.array(tokens[:length]),
                                    np.array(is_token[:length])) == expected


# ---- the rejection sampler ---------------------------------------------------------------


def _metadata(temperature: list[float], generators=None, **kwargs) -> SamplingMetadata:
    t = torch.tensor(temperature)
    fields = {"top_p": None, "top_k": None, "min_p": None, "penalties": None,
              "max_num_logprobs": None, **kwargs}
    return SamplingMetadata(temperature=t, all_greedy=bool((t == 0).all()),
                            all_random=bool((t > 0).all()), generators=generators or {},
                            min_tokens_blocked={}, **fields)


def _verify(logits, drafts, metadata, num_outputs=None, min_tokens=None, stop_ids=None):
    layout = DraftLayout.of(drafts)
    n = len(drafts)
    expanded = expand_metadata(metadata, layout, num_outputs or [0] * n, min_tokens or [0] * n,
                               stop_ids or [[] for _ in range(n)])
    return RejectionSampler()(logits, expanded, layout)


def test_layout_positions():
    layout = DraftLayout.of([[7, 8], [], [9]])
    assert layout.starts == [0, 3, 4, 6]
    assert layout.draft_tokens().tolist() == [7, 8, -1, -1, 9, -1]
    assert layout.num_drafts().tolist() == [2, 0, 1]
    rows, index = layout.positions()
    assert rows.tolist() == [0, 0, 0, 1, 2, 2] and index.tolist() == [0, 1, 2, 0, 0, 1]
    assert first_stops(np.array([0, 0, 1, 1, 0, 1], dtype=bool), layout.starts).tolist() \
        == [2, 3, 5]
    assert SpecDecodeRunner.logits_indices(np.array([0, 3, 6, 8]), np.array([0, 1, 2]),
                                           DraftLayout.of([[], [1, 2], [3]])).tolist() \
        == [2, 3, 4, 5, 6, 7]


def test_greedy_acceptance_against_a_reference_loop():
    """Random batches of rows with random drafts (often equal to the argmax): each row's
    emitted tokens are the drafts accepted one by one while they equal the argmax, then
    the argmax where it stopped; plain greedy metadata (not expanded) and expanded agree."""
    rng = np.random.default_rng(0)
    vocab = 5
    for _ in range(50):
        n = int(rng.integers(1, 5))
        drafts = [rng.integers(0, vocab, int(rng.integers(0, 5))).tolist() for _ in range(n)]
        num = sum(len(d) + 1 for d in drafts)
        argmax = rng.integers(0, vocab, num)
        start = 0
        for row in drafts:  # make acceptance likely: drafts copy the argmax, some changed
            cut = int(rng.integers(0, len(row) + 1))
            row[:cut] = argmax[start:start + cut].tolist()
            start += len(row) + 1
        logits = torch.zeros(num, vocab)
        logits[torch.arange(num), torch.from_numpy(argmax)] = 1.0
        expected, start = [], 0
        for row in drafts:
            accepted = 0
            while accepted < len(row) and row[accepted] == argmax[start + accepted]:
                accepted += 1
            expected.append([*row[:accepted], int(argmax[start + accepted])])
            start += len(row) + 1
        metadata = _metadata([0.0] * n)
        assert RejectionSampler()(logits, metadata, DraftLayout.of(drafts)).token_ids \
            == expected
        assert _verify(logits, drafts, metadata).token_ids == expected


def test_random_rows_against_a_reference_loop():
    """The vectorised rejection rule against a position-by-position loop over the same
    uniforms (seeded rows draw from their own generators, identically in both)."""
    vocab, drafts = 6, [[1, 4, 2], [], [3, 3], [0]]
    num = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(num, vocab, generator=torch.Generator().manual_seed(3)) * 2
    metadata = _metadata([0.7, 0.0, 1.3, 1.0])
    for seed in range(20):
        gens = {i: torch.Generator().manual_seed(seed * 10 + i) for i in (0, 2, 3)}
        metadata.generators = gens
        got = _verify(logits, drafts, metadata).token_ids
        gens = {i: torch.Generator().manual_seed(seed * 10 + i) for i in (0, 2, 3)}
        layout = DraftLayout.of(drafts)
        expected, start = [], 0
        for i, row in enumerate(drafts):
            positions = slice(start, start + len(row) + 1)
            start += len(row) + 1
            if i == 1:  # greedy
                target = logits[positions].argmax(-1).tolist()
                accepted = 0
                while accepted < len(row) and row[accepted] == target[accepted]:
                    accepted += 1
                expected.append([*row[:accepted], target[accepted]])
                continue
            temperature = torch.full((len(row) + 1,), metadata.temperature[i].item())
            p = sampling_probs(logits[positions], _metadata(temperature.tolist()))
            p = p / p.sum(-1, keepdim=True)
            u = [torch.rand(1, generator=gens[i]).item() for _ in range(len(row) + 1)]
            accepted = 0
            while accepted < len(row) and u[accepted] < p[accepted, row[accepted]].item():
                accepted += 1
            final = p[accepted].clone()
            if accepted < len(row):
                final[row[accepted]] = 0.0
            token = inverse_cdf_sample(final[None], torch.rand(1, generator=gens[i]))
            expected.append([*row[:accepted], int(token)])
        assert layout.starts[-1] == num
        assert got == expected, (seed, got, expected)


def test_greedy_accepts_while_drafts_equal_the_argmax():
    vocab = 6
    argmax = [5, 6 % vocab, 2, 4, 1, 3, 3]  # per position: rows of 4, 1 and 2 positions
    logits = torch.full((7, vocab), -1.0)
    logits[torch.arange(7), torch.tensor(argmax)] = 1.0
    drafts = [[5, 0, 4], [], [3]]  # row 0: 5, 0 accepted, 4 != 2 rejected; row 2: all
    out = _verify(logits, drafts, _metadata([0.0, 0.0, 0.0]))
    assert out.token_ids == [[5, 0, 2], [1], [3, 3]]
    # min_tokens blocks the stop id while the row (1 output so far) is below 3 tokens:
    # positions 0 and 1 of row 0 cannot pick 5 / 0 when those are stop ids.
    out = _verify(logits[:4], [[5, 0, 4]], _metadata([0.0]), num_outputs=[1], min_tokens=[3],
                  stop_ids=[[5]])
    assert out.token_ids[0][0] != 5 and len(out.token_ids[0]) == 1


def test_penalties_count_earlier_drafts_as_outputs():
    vocab = 4
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]] * 3)
    zeros = torch.zeros(1, vocab, dtype=torch.int32)
    penalties = Penalties(torch.tensor([0.5]), torch.zeros(1), torch.ones(1), zeros,
                          torch.zeros(1, vocab, dtype=torch.bool))
    metadata = _metadata([0.0])
    metadata.penalties = penalties
    # Position 0 picks 0 (2.0); after the accepted draft 0, token 0 scores 1.5 < 1.9.
    out = _verify(logits, [[0, 0]], metadata)
    assert out.token_ids == [[0, 1]]


def test_rejection_sampling_matches_plain_sampling():
    """N copies of one row with drafts [x0, x1] over a 5-token vocabulary: the first
    emitted token must follow p0 and, after x0, the second must follow p1 (the position's
    distribution with temperature and top-k applied). Bounds: 5 standard errors per token
    (a wrong rule, e.g. accepting drafts always, is off by hundreds)."""
    n, vocab, x0, x1 = 20000, 5, 1, 3
    base = torch.tensor([[0.5, 1.2, 0.1, -0.3, 0.9], [1.0, 0.2, -0.5, 0.8, 0.0],
                         [0.3, 0.3, 0.3, 0.3, 0.3]])
    logits = base.repeat(n, 1)
    metadata = _metadata([0.8] * n, top_k=torch.full((n,), 4, dtype=torch.int64))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = _verify(logits, [[x0, x1]] * n, metadata)
    p = sampling_probs(base, _metadata([0.8] * 3, top_k=torch.full((3,), 4,
                                                                     dtype=torch.int64)))
    p = p / p.sum(-1, keepdim=True)
    first = torch.tensor([tokens[0] for tokens in out.token_ids])
    second = torch.tensor([tokens[1] for tokens in out.token_ids if tokens[0] == x0])
    for sample, probs in ((first, p[0]), (second, p[1])):
        freq = torch.bincount(sample, minlength=vocab).float() / len(sample)
        sigma = (probs * (1 - probs) / len(sample)).sqrt()
        assert ((freq - probs).abs() <= 5 * sigma + 1e-9).all(), (freq, probs)
    # Rows that accepted both drafts emitted a bonus token from p2.
    assert any(len(tokens) == 3 for tokens in out.token_ids)


def test_seeded_rows_repeat():
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))

    def run():
        gen = torch.Generator().manual_seed(42)
        return _verify(logits, [[2, 5, 1]], _metadata([1.0], generators={0: gen})).token_ids

    assert run() == run()


# ---- configuration ----------------------------------------------------------------------


def test_config_rules():
    cfg = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 4})
    assert cfg is not None and (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    cfg = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2})
    assert cfg is not None and (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    bad = [
        ({"method": "eagle", "num_speculative_tokens": 3}, "Unknown speculative_config method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram"}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) must be <= prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
         "prompt_lookup_min must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1},
         "Unknown speculative_config keys"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_user(value)


def test_k_out_of_range_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="num_speculative_tokens=8 is out of range"):
        LLM(tiny_llama_dir, max_num_batched_tokens=8, max_model_len=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 8})


# ---- end to end ----------------------------------------------------------------------------

MAX_TOKENS = 16
PROMPTS = [
    "Hello world, this is",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was",
    "A",
    "What is the capital of France? The capital of France is",
]


class OracleProposer:
    """Drafts the reference continuation, every third draft corrupted: accepted runs,
    rejections and bonus tokens all happen on a random tiny model."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], k: int) -> None:
        self.refs, self.k = refs, k
        self.calls = 0

    def propose_rows(self, batch, rows, scheduler_output):
        drafts = {}
        for row in rows:
            state = batch.state(row)
            ref = self.refs.get(tuple(state.prompt_token_ids))
            if ref is None:
                continue
            done = len(state.output_token_ids)
            self.calls += 1
            drafts[row] = [t if (done + j) % 3 else (t + 1) % 700
                           for j, t in enumerate(ref[done:done + self.k])]
        return drafts


class NoDrafts:
    def propose_rows(self, batch, rows, scheduler_output):
        return {}


def _ids(output) -> list[int]:
    assert output.prompt_token_ids is not None
    return output.prompt_token_ids


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                             "logprobs": 2, **kwargs})


@pytest.mark.slow
def test_ngram_greedy_identical_with_chunks_preemption_prefix_hits_embeds_graphs(
        tiny_llama_dir):
    """One engine: 8-token chunks, 23 blocks of 4 for 4 growing requests (preemptions),
    the prompts twice (prefix hits), then as prompt embeds, graphs on. First the ngram
    proposer, then an oracle proposer whose drafts are mostly right."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=8, num_gpu_blocks_override=23, enable_prompt_embeds=True,
              compilation_config={"cudagraph_capture_sizes": [4]},
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    engine = llm.llm_engine
    runner = engine.engine_core.model_executor.model_runner  # type: ignore[attr-defined]
    scheduler = engine.engine_core.scheduler
    first = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    hf = load_hf_model(tiny_llama_dir)
    refs = [hf_greedy(hf, out.prompt_token_ids, MAX_TOKENS) for out in first]
    assert_identical_greedy(first, refs)
    assert scheduler.num_preemptions > 0
    stats = engine.spec_decoding_stats
    assert stats is not None and stats.num_drafts > 0  # the ngram proposer drafted

    runner.spec.proposer = oracle = OracleProposer(
        {tuple(_ids(o)): r.token_ids for o, r in zip(first, refs)}, 3)
    before = stats.num_accepted_tokens
    again = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert any(o.num_cached_tokens > 0 for o in again)
    assert_identical_greedy(again, refs)
    assert oracle.calls > 0 and stats.num_accepted_tokens > before

    embeds = [{"prompt_embeds": hf.get_input_embeddings()(torch.tensor(_ids(o))).detach()}
              for o in first[:2]]
    oracle.refs = {(0,) * len(_ids(o)): r.token_ids
                   for o, r in zip(first[:2], refs[:2])}
    assert_identical_greedy(llm.generate(embeds, _greedy(), use_tqdm=False), refs[:2])
    assert InputKind.TOKEN_IDS in {kind for kind, _ in runner.graphs.replays}  # verifications

    # Stop conditions cut inside an accepted run: max_tokens, and a stop id.
    short = llm.generate(PROMPTS[1], _greedy(max_tokens=5), use_tqdm=False)[0]
    assert short.outputs[0].token_ids == refs[1].token_ids[:5]
    stop_at = refs[1].token_ids[6]
    stopped = llm.generate(PROMPTS[1], _greedy(stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert stopped.outputs[0].token_ids == refs[1].token_ids[:refs[1].token_ids.index(stop_at)
                                                             + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    # A stop string completed inside an accepted run: the same tokens, text and logprobs as
    # plain decoding (the same engine without drafts).
    stop_str = llm.get_tokenizer().decode(refs[1].token_ids[5:7]).strip()
    params = _greedy(stop=[stop_str])
    with_drafts = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    runner.spec.proposer = NoDrafts()
    plain = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    runner.spec.proposer = oracle
    assert plain.finish_reason == "stop" and len(plain.token_ids) < MAX_TOKENS
    assert (with_drafts.token_ids, with_drafts.text) == (plain.token_ids, plain.text)
    assert with_drafts.logprobs is not None and len(with_drafts.logprobs) == len(plain.token_ids)

    metrics = {m.name: m for m in llm.get_metrics()}
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value  # type: ignore[attr-defined]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value  # type: ignore[attr-defined]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values  # type: ignore[attr-defined]
    assert 0 < accepted < drafted and sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)

    # Random sampling with a seed runs through verification and repeats itself.
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS,
                            ignore_eos=True, logprobs=1)
    a, b = (llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == MAX_TOKENS
    assert a.logprobs is not None and len(a.logprobs) == MAX_TOKENS
    assert all(t in lp for t, lp in zip(a.token_ids, a.logprobs))


# ---- the draft model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, str]:
    """Tiny drafters beside the tiny Llama: another random one with its vocabulary (one
    layer), one of another hidden size, one of another vocabulary size."""
    root = tmp_path_factory.mktemp("drafters")
    return {
        "random": make_tiny_model(str(root / "random"), "llama", seed=3, num_hidden_layers=1),
        "narrow": make_tiny_model(str(root / "narrow"), "llama", seed=4, hidden_size=32,
                                  intermediate_size=64),
        "vocab": _with_vocab_size(make_tiny_model(str(root / "vocab"), "llama", seed=5), 800),
    }


def _with_vocab_size(path: str, vocab_size: int) -> str:
    """The config claims another vocabulary size (refused before any weight is read)."""
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["vocab_size"] = vocab_size
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.slow
def test_draft_model_greedy_identical(tiny_llama_dir, drafters):
    """The target itself as drafter accepts every draft; a random drafter with the same
    vocabulary mostly not. Both give transformers' greedy tokens, with chunked prefill,
    preemptions, prefix hits and prompt embeds (the drafter reads the same rows); the
    second with graphs (the drafter's too)."""
    hf = load_hf_model(tiny_llama_dir)
    for drafter, all_accepted in ((tiny_llama_dir, True), (drafters["random"], False)):
        graphs = {} if all_accepted else {"cudagraph_capture_sizes": [4]}
        llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=64, block_size=4,
                  max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=19,
                  enable_prompt_embeds=True, enforce_eager=all_accepted,
                  compilation_config=graphs or None,
                  speculative_config={"method": "draft_model", "model": drafter,
                                      "num_speculative_tokens": 3})
        first = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
        refs = [hf_greedy(hf, _ids(out), MAX_TOKENS) for out in first]
        assert_identical_greedy(first, refs)
        if all_accepted:  # (the slow machine's budget: these once)
            again = llm.generate(PROMPTS[1:2], _greedy(), use_tqdm=False)
            assert again[0].num_cached_tokens > 0
            assert_identical_greedy(again, refs[1:2])
            embeds = [{"prompt_embeds": hf.get_input_embeddings()(torch.tensor(_ids(first[3])))
                       .detach()}]
            assert_identical_greedy(llm.generate(embeds, _greedy(), use_tqdm=False), refs[3:])
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        stats = llm.llm_engine.spec_decoding_stats
        assert stats is not None and stats.num_draft_tokens > 0
        assert (stats.num_accepted_tokens == stats.num_draft_tokens) == all_accepted
        proposer = llm.llm_engine.engine_core.model_executor.model_runner.spec.proposer  # type: ignore[attr-defined]
        assert (proposer.graphs is None) == all_accepted
        if proposer.graphs is not None:
            assert proposer.graphs.replays[(InputKind.TOKEN_IDS, 4)] > 0


def test_bad_drafters_are_refused(tiny_llama_dir, drafters):
    def build(drafter, **kwargs):
        LLM(tiny_llama_dir, max_model_len=64, enforce_eager=True,
            speculative_config={"method": "draft_model", "model": drafter,
                                "num_speculative_tokens": 2}, **kwargs)

    with pytest.raises(ValueError, match="vocabulary of 800 tokens.*share the target's"):
        build(drafters["vocab"])
    with pytest.raises(ValueError, match="cannot read prompt embeds: its hidden size is 32"):
        build(drafters["narrow"], enable_prompt_embeds=True)


@pytest.mark.slow
def test_structured_outputs_verify_drafts_against_the_grammar(tiny_llama_dir):
    """Drafts the grammar forbids are dropped before verification; each verified position
    is masked by the grammar after the drafts before it; outputs equal plain decoding's."""
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=(
        StructuredOutputsParams(regex=r"(the quick brown fox ){3}[a-z ]{0,30}")))
    prompts = PROMPTS[:2]
    plain = LLM(tiny_llama_dir, dtype="float32", enforce_eager=True, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    spec = LLM(tiny_llama_dir, dtype="float32", enforce_eager=True, max_model_len=128,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    outputs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].text.startswith("the quick brown fox " * 3) for o in outputs)
    stats = spec.llm_engine.spec_decoding_stats
    assert stats is not None and stats.num_accepted_tokens > 0


def test_serve_flag_and_prometheus_counters(tiny_llama_dir):
    from vllm.entrypoints.openai.serve_args import engine_args_from_namespace, make_parser
    from vllm.v1.engine import SchedulerStats
    from vllm.v1.metrics.prometheus import PrometheusStatLogger
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    args = make_parser().parse_args([tiny_llama_dir, "--speculative-config",
                                     '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine_args_from_namespace(args).speculative_config == {
        "method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SystemExit):
        make_parser().parse_args([tiny_llama_dir, "--speculative-config", "[1]"])

    stats = SpecDecodingStats.new(3)
    stats.observe(3, 2)
    stats.observe(2, 0)
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(spec_decoding=stats), None)
    text = logger.render().decode()
    for line in ('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 2.0',
                 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 5.0',
                 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 2.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",'
                 'position="1"} 1.0'):
        assert line in text, line
    assert stats.acceptance_rate == 2 / 5 and stats.mean_acceptance_length == 2.0


@pytest.mark.slow
def test_default_model_copy_prompt_identical(default_model_path):
    """The default model answering from a passage in its prompt: prompt lookup drafts most
    of the answer, and greedy outputs (float32) equal plain decoding's."""
    passage = ("The lighthouse on Merrow Point was built in 1871 by the engineer Clara Voss. "
               "It stands thirty-two metres tall and was automated in 1989. ")
    prompt = [{"role": "user", "content": f"{passage}\nRepeat the text above exactly."}]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    spec = LLM(default_model_path, dtype="float32", quantization="none", enforce_eager=True,
               max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    runner = spec.llm_engine.engine_core.model_executor.model_runner  # type: ignore[attr-defined]
    ngram, runner.spec.proposer = runner.spec.proposer, NoDrafts()  # plain decoding first
    expected = spec.chat(prompt, params, use_tqdm=False)[0].outputs[0]
    stats = spec.llm_engine.spec_decoding_stats
    assert stats is not None and stats.num_drafts == 0
    runner.spec.proposer = ngram
    got = spec.chat(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert expected.logprobs is not None and got.logprobs is not None
    for ours, theirs, token in zip(got.logprobs, expected.logprobs, got.token_ids):
        assert abs(ours[token].logprob - theirs[token].logprob) < 1e-4
    assert stats.num_accepted_tokens >= 8
