"""Exact tests of the `Sampler`: greedy, top-k/top-p/min-p, seeds, penalties, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.core_factories import HIDDEN, make_model_runner, make_params
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.sample.metadata import Penalties, SamplingMetadata
from vllm.v1.sample.sampler import (
    Sampler,
    apply_penalties,
    apply_top_k_top_p,
    draw_uniforms,
    gather_logprobs,
    greedy_tokens,
    inverse_cdf_sample,
)

VOCAB = 32


def metadata(n: int, *, temperature: float | list[float] = 1.0,
             top_k: list[int] | None = None, top_p: list[float] | None = None,
             min_p: list[float] | None = None, seeds: dict[int, int] | None = None,
             min_tokens_blocked: dict[int, list[int]] | None = None,
             max_num_logprobs: int | None = None) -> SamplingMetadata:
    temps = torch.tensor(temperature if isinstance(temperature, list) else [temperature] * n,
                         dtype=torch.float32)
    greedy = temps < 1e-5
    return SamplingMetadata(
        temperature=temps,
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        top_p=torch.tensor(top_p, dtype=torch.float32) if top_p is not None else None,
        top_k=torch.tensor(top_k, dtype=torch.int64) if top_k is not None else None,
        min_p=torch.tensor(min_p, dtype=torch.float32) if min_p is not None else None,
        generators={row: torch.Generator().manual_seed(seed)
                    for row, seed in (seeds or {}).items()},
        penalties=None,
        min_tokens_blocked=min_tokens_blocked or {},
        max_num_logprobs=max_num_logprobs,
    )


def random_logits(n: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def inverse_cdf(logits: torch.Tensor, temperature: float, seed: int) -> int:
    """The reference draw: u ~ U[0, 1) from the seed (one number), then the first token
    whose cumulative probability under softmax(logits / T) exceeds u."""
    probs = torch.softmax(logits / temperature, dim=-1)
    u = torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()
    cdf = probs.cumsum(dim=-1)
    return int((cdf > u * cdf[-1]).nonzero()[0])


sampler = Sampler()


# ---- greedy and filters --------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = random_logits(4)
    out = sampler(logits, metadata(4, temperature=0.0))
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_greedy_rows_in_a_random_batch_are_argmax() -> None:
    logits = random_logits(4, seed=1)
    md = metadata(4, temperature=[0.0, 1.0, 0.0, 1.0], seeds={1: 3, 3: 4})
    out = sampler(logits, md).sampled_token_ids.tolist()
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert out[1] == inverse_cdf(logits[1], 1.0, 3)
    assert out[3] == inverse_cdf(logits[3], 1.0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 5, 16, 33, 49152])
def test_greedy_tokens_match_torch_argmax(dtype, vocab) -> None:
    """The native row argmax (on CPU) answers as torch.argmax: the first of tied maxima,
    the first NaN of a row that has one, -inf rows; vocabularies shorter than a vector
    and with a vector tail; rows of a strided view."""
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(8, vocab + 3, generator=gen) * 3).to(dtype)
    logits[1] = logits[1].round().clamp(-2, 2)  # many ties at the maximum
    logits[2, -1] = logits[2, 0] = logits[2].max() + 1  # tie: first index wins
    logits[7, vocab] = logits[7, 1] = logits[7].max() + 1  # the same, inside the view
    logits[3] = float("-inf")
    logits[4, vocab // 2] = float("nan")
    logits[5, -1] = float("nan")
    logits[5, 0] = float("nan")
    logits[6] = 0.0
    view = logits[:, 1:vocab + 1]  # rows vocab long, a row stride of vocab + 3
    expected = view.float().argmax(dim=-1)
    assert greedy_tokens(view).tolist() == expected.tolist()
    assert greedy_tokens(logits).tolist() == logits.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_top_k_one_is_greedy(seed: int) -> None:
    logits = random_logits(3, seed=seed)
    out = sampler(logits, metadata(3, temperature=1.5, top_k=[1, 1, 1],
                                   seeds={0: seed, 1: seed + 10, 2: seed + 20}))
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_tiny_top_p_is_greedy(seed: int) -> None:
    logits = random_logits(3, seed=seed)
    out = sampler(logits, metadata(3, temperature=1.5, top_p=[1e-6] * 3,
                                   seeds={0: seed, 1: seed + 10, 2: seed + 20}))
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_apply_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.5, -1.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 3]), None)
    inf = float("-inf")
    assert out.tolist() == [[inf, 4.0, 3.0, inf], [0.5, inf, 2.0, 0.0]]


def test_apply_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    out = apply_top_k_top_p(logits, None, torch.tensor([0.75, 0.85, 1.0]))
    kept = (out > float("-inf")).tolist()
    assert kept == [[True, True, False, False],  # 0.5 + 0.3 >= 0.75
                    [True, True, True, False],  # 0.5 + 0.3 < 0.85 <= 0.95
                    [True, True, True, True]]
    assert torch.equal(out[0, :2], logits[0, :2])  # kept logits are unchanged


def test_top_k_and_top_p_disabled_is_identity() -> None:
    logits = random_logits(2)
    assert apply_top_k_top_p(logits, None, None) is logits


def draw_many(logits_row: torch.Tensor, n: int, **kwargs) -> set[int]:
    """Tokens drawn from `n` rows of the same logits, each with its own seed."""
    logits = logits_row.expand(n, -1).contiguous()
    md = metadata(n, seeds={i: i for i in range(n)}, **kwargs)
    return set(sampler(logits, md).sampled_token_ids.tolist())


def test_min_p_drops_tokens_below_min_p_times_the_top_probability() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert draw_many(row, 400) == {0, 1, 2, 3}  # every token does come up without min_p
    assert draw_many(row, 400, min_p=[0.5] * 400) == {0, 1}  # 0.15 < 0.25 <= 0.3
    assert draw_many(row, 400, min_p=[0.2] * 400) == {0, 1, 2}  # 0.05 < 0.1 <= 0.15
    assert draw_many(row, 400, min_p=[0.7] * 400) == {0}  # 0.3 < 0.35


def test_top_k_sampling_draws_only_from_the_top_k() -> None:
    row = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    assert draw_many(row, 400, top_k=[2] * 400) == {1, 3}


# ---- seeds ---------------------------------------------------------------------------------


def test_seeded_row_matches_the_reference_draw() -> None:
    logits = random_logits(1, seed=5)
    for temperature in (0.5, 1.0, 2.0):
        out = sampler(logits, metadata(1, temperature=temperature, seeds={0: 1234}))
        assert out.sampled_token_ids.tolist() == [inverse_cdf(logits[0], temperature,
                                                                   1234)]


def test_seeded_rows_reproduce_independent_of_batch_composition() -> None:
    flat = torch.zeros(VOCAB)  # uniform: the draw is decided by the seed alone
    steps = 6

    def run(batch_rows: int, row: int, extra_seeds: dict[int, int]) -> list[int]:
        md = metadata(batch_rows, seeds={row: 99, **extra_seeds})
        tokens = []
        for _ in range(steps):  # the generators carry over from step to step
            out = sampler(flat.expand(batch_rows, -1).contiguous(), md)
            tokens.append(int(out.sampled_token_ids[row]))
        return tokens

    alone = run(1, 0, {})
    assert len(set(alone)) > 1  # the seed's stream really varies over steps
    assert run(3, 1, {}) == alone  # unseeded neighbours
    assert run(4, 3, {0: 5, 1: 6}) == alone  # seeded neighbours
    assert run(2, 0, {1: 99}) == alone  # a neighbour with the same seed
    assert run(2, 1, {0: 99}) == alone


def test_inverse_cdf_picks_with_fixed_uniforms() -> None:
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]] * 5)
    u = torch.tensor([0.0, 0.1, 0.2, 0.95, 0.7])
    # cdf [0.2, 0.2, 0.7, 1.0]: the zero-probability token 1 is never picked.
    assert inverse_cdf_sample(probs, u).tolist() == [0, 0, 2, 3, 3]


def test_inverse_cdf_renormalises_filtered_rows_and_never_picks_zeroed_tail() -> None:
    probs = torch.tensor([[0.0, 0.3, 0.1, 0.0], [0.5, 0.0, 0.0, 0.0]])
    # Row 0 totals 0.4: u 0.5 -> 0.2 -> token 1; u just below 1 -> token 2, never 3.
    assert inverse_cdf_sample(probs, torch.tensor([0.5, 0.0])).tolist() == [1, 0]
    almost_one = torch.tensor([1 - 2**-24, 1 - 2**-24])
    assert inverse_cdf_sample(probs, almost_one).tolist() == [2, 0]


def test_draw_uniforms_one_per_row_from_each_seeded_generator() -> None:
    generators = {1: torch.Generator().manual_seed(7), 3: torch.Generator().manual_seed(8)}
    torch.manual_seed(0)
    u = draw_uniforms(4, generators)
    torch.manual_seed(0)
    unseeded = torch.rand(2)
    assert u[[0, 2]].tolist() == unseeded.tolist()
    assert u[1].item() == torch.rand(1, generator=torch.Generator().manual_seed(7)).item()
    assert u[3].item() == torch.rand(1, generator=torch.Generator().manual_seed(8)).item()
    reference = torch.Generator().manual_seed(7)
    torch.rand(1, generator=reference)
    assert draw_uniforms(1, {0: generators[1]}).item() == torch.rand(1, generator=reference).item()


def test_greedy_on_bfloat16_logits_is_their_argmax() -> None:
    logits = random_logits(3).to(torch.bfloat16)
    out = sampler(logits, metadata(3, temperature=0.0))
    assert out.sampled_token_ids.tolist() == logits.float().argmax(dim=-1).tolist()
    with_logprobs = sampler(logits, metadata(3, temperature=0.0, max_num_logprobs=1))
    assert with_logprobs.sampled_token_ids.tolist() == out.sampled_token_ids.tolist()
    assert with_logprobs.logprobs.logprobs[0][0] == pytest.approx(
        torch.log_softmax(logits.float(), dim=-1)[0].max().item())


def test_unseeded_rows_follow_the_global_generator() -> None:
    logits = torch.zeros(8, VOCAB)
    torch.manual_seed(0)
    first = sampler(logits, metadata(8)).sampled_token_ids.tolist()
    torch.manual_seed(0)
    assert sampler(logits, metadata(8)).sampled_token_ids.tolist() == first


# ---- min_tokens ----------------------------------------------------------------------------


def test_min_tokens_blocks_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0], [0.0, 5.0, 4.0, 3.0]])
    md = metadata(2, temperature=0.0, min_tokens_blocked={0: [1, 2]})
    assert sampler(logits, md).sampled_token_ids.tolist() == [3, 1]
    assert logits[0].tolist() == [0.0, 5.0, 4.0, 3.0]  # the caller's logits are untouched


def test_allowed_token_ids_restrict_greedy_random_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0], [0.0, 5.0, 4.0, 3.0]])
    md = metadata(2, temperature=0.0)
    md.allowed_token_ids = {0: torch.tensor([0, 3])}
    assert sampler(logits, md).sampled_token_ids.tolist() == [3, 1]
    assert logits[0].tolist() == [0.0, 5.0, 4.0, 3.0]  # the caller's logits are untouched
    # Sampled rows only ever draw allowed ids; logprobs stay those of the raw logits.
    md = metadata(2, temperature=1.0, seeds={0: 1, 1: 2}, max_num_logprobs=1)
    md.allowed_token_ids = {0: torch.tensor([0, 2]), 1: torch.tensor([3])}
    for _ in range(20):
        out = sampler(logits, md)
        row0, row1 = out.sampled_token_ids.tolist()
        assert row0 in (0, 2) and row1 == 3
    assert out.logprobs is not None
    raw = torch.log_softmax(logits[1], dim=-1)
    assert out.logprobs.token_ids[1] == [3, 1]
    assert out.logprobs.logprobs[1] == pytest.approx([raw[3].item(), raw[1].item()])


# ---- penalties ------------------------------------------------------------------------------


def make_penalties(rep: list[float], freq: list[float], pres: list[float],
                   counts: list[list[int]], prompt: list[list[bool]]) -> Penalties:
    return Penalties(presence=torch.tensor(pres), frequency=torch.tensor(freq),
                     repetition=torch.tensor(rep),
                     output_token_counts=torch.tensor(counts, dtype=torch.int32),
                     prompt_token_mask=torch.tensor(prompt))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 4.0]])
    # Token 0 and 1 in the prompt, 2 and 3 in the output, 4 never seen.
    penalties = make_penalties([2.0], [0.0], [0.0], [[0, 0, 1, 3, 0]],
                               [[True, True, False, False, False]])
    assert apply_penalties(logits, penalties).tolist() == [[1.0, -4.0, 1.5, -2.0, 4.0]]


def test_frequency_penalty_subtracts_count_times_penalty_on_outputs_only() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 4.0]])
    penalties = make_penalties([1.0], [0.5], [0.0], [[0, 0, 1, 3, 0]],
                               [[True, True, False, False, False]])
    assert apply_penalties(logits, penalties).tolist() == [[2.0, -2.0, 2.5, -2.5, 4.0]]


def test_presence_penalty_subtracts_once_per_output_token() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 4.0]])
    penalties = make_penalties([1.0], [0.0], [0.25], [[0, 0, 1, 3, 0]],
                               [[True, True, False, False, False]])
    assert apply_penalties(logits, penalties).tolist() == [[2.0, -2.0, 2.75, -1.25, 4.0]]


def test_all_penalties_per_row() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0], [2.0, -2.0, 3.0, -1.0]])
    penalties = make_penalties([2.0, 1.0], [0.5, 0.0], [0.25, 1.0],
                               [[0, 2, 1, 0], [0, 0, 0, 2]],
                               [[True, False, False, False], [False, False, False, False]])
    # Row 0: token 0 prompt -> 1.0; token 1 (count 2) -> -4 - 1.0 - 0.25; token 2
    # (count 1) -> 1.5 - 0.5 - 0.25; token 3 unseen. Row 1: presence only on token 3.
    assert apply_penalties(logits, penalties).tolist() == [[1.0, -5.25, 0.75, -1.0],
                                                           [2.0, -2.0, 3.0, -2.0]]


def test_penalties_change_the_greedy_choice_but_not_the_logprobs() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]])
    md = metadata(1, temperature=0.0, max_num_logprobs=0)
    md.penalties = make_penalties([2.0], [0.0], [0.0], [[1, 0, 0, 0]],
                                  [[False, False, False, False]])
    out = sampler(logits, md)
    assert out.sampled_token_ids.tolist() == [1]  # 3.0 / 2 = 1.5 < 2.0
    expected = torch.log_softmax(logits, dim=-1)[0, 1].item()
    assert out.logprobs.logprobs == [[pytest.approx(expected)]]
    assert out.logprobs.ranks == [2]


# ---- logprobs ------------------------------------------------------------------------------


def test_logprobs_of_the_sampled_token_and_the_top_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    lp = torch.log_softmax(logits, dim=-1)
    sampled = torch.tensor([2, 3])
    out = gather_logprobs(lp, sampled, k=2)
    assert out.token_ids == [[2, 1, 2], [3, 2, 3]]
    assert out.ranks == [2, 2]
    assert out.logprobs[0] == pytest.approx([lp[0, 2].item(), lp[0, 1].item(),
                                             lp[0, 2].item()])
    assert out.logprobs[1] == pytest.approx([lp[1, 3].item(), lp[1, 2].item(),
                                             lp[1, 3].item()])


def test_logprobs_with_k_zero_hold_only_the_sampled_token() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = gather_logprobs(torch.log_softmax(logits, dim=-1), torch.tensor([0]), k=0)
    assert out.token_ids == [[0]]
    assert out.ranks == [3]
    expected = 1.0 - math.log(sum(math.exp(x) for x in (1.0, 3.0, 2.0, 0.0)))
    assert out.logprobs == [[pytest.approx(expected)]]


def test_sampler_logprobs_rank_of_greedy_token_is_one() -> None:
    logits = random_logits(3, seed=7)
    out = sampler(logits, metadata(3, temperature=0.0, max_num_logprobs=3))
    assert out.logprobs.ranks == [1, 1, 1]
    top = torch.log_softmax(logits, dim=-1).topk(3, dim=-1)
    for row in range(3):
        assert out.logprobs.token_ids[row] == [int(logits[row].argmax()),
                                               *top.indices[row].tolist()]
        assert out.logprobs.logprobs[row][1:] == pytest.approx(top.values[row].tolist())


def test_sampler_logprobs_are_of_raw_logits_not_temperature_scaled() -> None:
    logits = random_logits(1, seed=8)
    out = sampler(logits, metadata(1, temperature=0.5, seeds={0: 3}, max_num_logprobs=0))
    token = out.sampled_token_ids.item()
    assert token == inverse_cdf(logits[0], 0.5, 3)
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert out.logprobs.logprobs == [[pytest.approx(raw[token].item())]]
    assert out.logprobs.ranks == [int((raw > raw[token]).sum()) + 1]


# ---- the runner's sampling metadata ----------------------------------------------------------


def test_runner_sampling_metadata_from_the_batch() -> None:
    vocab = 20
    runner = make_model_runner(block_size=4, max_model_len=16, vocab_size=vocab)
    a = NewRequestData(
        req_id="a", prompt_token_ids=[1, 3, 3], prompt_embeds=None, output_token_ids=[5, 5, 3],
        sampling_params=make_params(temperature=1.0, top_k=4, seed=11, min_tokens=5,
                                    stop_token_ids=[7], repetition_penalty=1.5,
                                    frequency_penalty=0.5, presence_penalty=0.25),
        block_ids=[1, 2], num_computed_tokens=5)
    # An embeds prompt: its placeholder ids (0) are not prompt tokens for the penalties.
    e = NewRequestData(
        req_id="e", prompt_token_ids=[0, 0], prompt_embeds=torch.zeros(2, HIDDEN),
        output_token_ids=[4], sampling_params=make_params(temperature=0.0,
                                                          allowed_token_ids=[4, 9]),
        block_ids=[3], num_computed_tokens=2)
    out = SchedulerOutput(scheduled_new_reqs=[a, e], scheduled_cached_reqs=CachedRequestData(),
                          num_scheduled_tokens={"a": 1, "e": 1}, total_num_scheduled_tokens=2,
                          finished_req_ids=[])
    runner._update_states(out)
    md = runner._sampling_metadata(np.array([0, 1]))
    assert md.temperature.tolist() == [1.0, 0.0]
    assert (md.all_greedy, md.all_random) == (False, False)
    assert md.top_k.tolist() == [4, vocab]
    assert md.top_p is None and md.min_p is None
    assert list(md.generators) == [0]
    assert md.generators[0] is runner.requests["a"].generator
    assert md.min_tokens_blocked == {0: [7, 2]}  # stop ids, then eos
    assert list(md.allowed_token_ids) == [1] and md.allowed_token_ids[1].tolist() == [4, 9]
    assert md.max_num_logprobs is None
    counts = torch.zeros(2, vocab, dtype=torch.int32)
    counts[0, 5], counts[0, 3], counts[1, 4] = 2, 1, 1
    penalties = md.penalties
    assert penalties is not None
    assert torch.equal(penalties.output_token_counts, counts)
    mask = torch.zeros(2, vocab, dtype=torch.bool)
    mask[0, 1] = mask[0, 3] = True
    assert torch.equal(penalties.prompt_token_mask, mask)
    assert penalties.repetition.tolist() == [1.5, 1.0]
    assert penalties.frequency.tolist() == [0.5, 0.0]
    assert penalties.presence.tolist() == [0.25, 0.0]


def test_runner_caches_sampling_tensors_while_the_batch_is_unchanged() -> None:
    runner = make_model_runner(block_size=4, max_model_len=16)
    a = NewRequestData(req_id="a", prompt_token_ids=[1, 2], prompt_embeds=None,
                       output_token_ids=[], sampling_params=make_params(temperature=0.5),
                       block_ids=[1], num_computed_tokens=0)
    b = NewRequestData(req_id="b", prompt_token_ids=[3], prompt_embeds=None,
                       output_token_ids=[], sampling_params=make_params(temperature=0.0),
                       block_ids=[2], num_computed_tokens=0)
    runner._update_states(SchedulerOutput(
        scheduled_new_reqs=[a, b], scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"a": 2, "b": 1}, total_num_scheduled_tokens=3,
        finished_req_ids=[]))
    first = runner._sampling_metadata(np.array([0, 1]))
    again = runner._sampling_metadata(np.array([0, 1]))
    assert again.temperature is first.temperature
    assert runner.sampling_inputs.num_rebuilds == 1
    only_b = runner._sampling_metadata(np.array([1]))  # a chunked prefill does not sample
    assert only_b.temperature.tolist() == [0.0] and only_b.all_greedy
    assert runner.sampling_inputs.num_rebuilds == 2


def test_runner_sampling_metadata_without_penalties_or_filters() -> None:
    runner = make_model_runner(block_size=4, max_model_len=16)
    a = NewRequestData(req_id="a", prompt_token_ids=[1, 2], prompt_embeds=None,
                       output_token_ids=[], sampling_params=make_params(temperature=0.0,
                                                                       logprobs=3),
                       block_ids=[1], num_computed_tokens=0)
    out = SchedulerOutput(scheduled_new_reqs=[a], scheduled_cached_reqs=CachedRequestData(),
                          num_scheduled_tokens={"a": 2}, total_num_scheduled_tokens=2,
                          finished_req_ids=[])
    runner._update_states(out)
    md = runner._sampling_metadata(np.array([0]))
    assert (md.all_greedy, md.all_random) == (True, False)
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.penalties is None
    assert md.generators == {} and md.min_tokens_blocked == {} and md.allowed_token_ids == {}
    assert md.max_num_logprobs == 3


# ---- SamplingParams ---------------------------------------------------------------------------


def test_sampling_params_normalise_stop_and_top_k() -> None:
    params = SamplingParams(stop="###", top_k=-1, stop_token_ids=None)
    assert params.stop == ["###"]
    assert params.top_k == 0
    assert params.stop_token_ids == []
    assert SamplingParams().stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize(("field", "value"), [
    ("n", 0), ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1),
    ("stop", [""]), ("stop_token_ids", [-1]), ("allowed_token_ids", []),
    ("allowed_token_ids", [3, -1]),
])
def test_sampling_params_reject_invalid_values_naming_the_field(field: str,
                                                                value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_sampling_params_min_tokens_cannot_exceed_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens=2"):
        SamplingParams(min_tokens=3, max_tokens=2)
    assert SamplingParams(min_tokens=3, max_tokens=None).min_tokens == 3


def test_sampling_params_clone_copies_lists() -> None:
    params = SamplingParams(stop=["x"], stop_token_ids=[5], seed=3)
    params.all_stop_token_ids = [9]
    copy = params.clone()
    assert copy == params
    copy.stop.append("y")
    copy.stop_token_ids.append(6)
    copy.all_stop_token_ids.append(10)
    assert (params.stop, params.stop_token_ids, params.all_stop_token_ids) == (["x"], [5], [9])
