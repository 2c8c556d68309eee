"""The data-parallel router: prefix hashes and the prefix-vs-load rule, exactly."""

from __future__ import annotations

import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EncoderInput, EngineCoreRequest
from vllm.v1.engine.dp_router import PrefixAffinityRouter, prefix_block_hashes

ALIVE2 = [True, True]


def _request(ids: list[int] | None = None, embeds: torch.Tensor | None = None,
             salt: str | None = None, encoder: bytes | None = None) -> EngineCoreRequest:
    encoder_input = (EncoderInput([1, 2], None, 2, encoder) if encoder is not None else None)
    return EngineCoreRequest("r", ids, embeds, SamplingParams(), None,
                             encoder_input=encoder_input, cache_salt=salt)


def test_hashes_cover_full_blocks_and_chain() -> None:
    a = prefix_block_hashes(_request(list(range(10))), block_size=4)
    assert len(a) == 2  # 10 tokens: two full blocks of 4
    b = prefix_block_hashes(_request([*range(8), 99, 98, 97, 96]), block_size=4)
    assert b[:2] == a and len(b) == 3  # same first 8 tokens, one more block
    c = prefix_block_hashes(_request([0, 1, 2, 3, 9, 9, 9, 9]), block_size=4)
    assert c[0] == a[0] and c[1] != a[1]
    d = prefix_block_hashes(_request([9, 1, 2, 3, 4, 5, 6, 7]), block_size=4)
    assert d[1] != a[1]  # chained: a different first block changes every later hash
    assert prefix_block_hashes(_request(list(range(10))), 4, max_blocks=1) == a[:1]
    assert prefix_block_hashes(_request([1, 2, 3]), 4) == []


def test_salt_encoder_and_embeds_hashes() -> None:
    ids = list(range(8))
    plain = prefix_block_hashes(_request(ids), 4)
    assert prefix_block_hashes(_request(ids, salt="t1"), 4)[0] != plain[0]
    assert prefix_block_hashes(_request(ids, encoder=b"x"), 4)[0] != plain[0]
    rows = torch.randn(9, 3, dtype=torch.bfloat16)
    e = prefix_block_hashes(_request(embeds=rows), 4)
    assert len(e) == 2
    assert prefix_block_hashes(_request(embeds=rows[:8].clone()), 4) == e
    changed = rows.clone()
    changed[5, 0] += 1
    f = prefix_block_hashes(_request(embeds=changed), 4)
    assert f[0] == e[0] and f[1] != e[1]


def test_no_match_goes_to_least_loaded_then_lowest_index() -> None:
    router = PrefixAffinityRouter(3, capacity_blocks=100)
    assert router.choose([1, 2], [2, 1, 1], [True] * 3) == 1
    assert router.choose([1, 2], [0, 0, 0], [True] * 3) == 0
    assert router.choose([], [3, 0, 5], [True] * 3) == 1


def test_prefix_wins_within_slack_and_loses_beyond() -> None:
    router = PrefixAffinityRouter(2, capacity_blocks=100)  # slack max(4, 25% of min)
    router.record(0, [11, 12, 13])
    assert router.matched_blocks(0, [11, 12, 99]) == 2
    assert router.matched_blocks(1, [11, 12, 99]) == 0
    assert router.choose([11, 12], [4, 0], ALIVE2) == 0  # 4 <= 0 + 4
    assert router.choose([11, 12], [5, 0], ALIVE2) == 1  # 5 > 0 + 4
    assert router.choose([11, 12], [50, 40], ALIVE2) == 0  # slack ceil(0.25 * 40) = 10
    assert router.choose([11, 12], [51, 40], ALIVE2) == 1


def test_longest_match_among_candidates_then_load() -> None:
    router = PrefixAffinityRouter(3, capacity_blocks=100)
    router.record(0, [1, 2, 3])
    router.record(1, [1, 2])
    router.record(2, [1])
    assert router.choose([1, 2, 3], [0, 0, 0], [True] * 3) == 0
    # Engine 0 is too busy: the next best match among the candidates, not the idlest.
    assert router.choose([1, 2, 3], [9, 1, 0], [True] * 3) == 1
    router.record(2, [1, 2])
    assert router.choose([1, 2], [5, 3, 2], [True] * 3) == 2  # equal match: less load


def test_dead_engines_are_never_chosen() -> None:
    router = PrefixAffinityRouter(2, capacity_blocks=100)
    router.record(0, [1, 2])
    assert router.choose([1, 2], [0, 9], [False, True]) == 1
    try:
        router.choose([1], [0, 0], [False, False])
    except ValueError as e:
        assert "alive" in str(e)
    else:
        raise AssertionError("no live engine must raise")


def test_lru_capacity_and_forget() -> None:
    router = PrefixAffinityRouter(2, capacity_blocks=3)
    router.record(0, [1, 2, 3])
    router.record(0, [1])  # touched: now the most recent
    router.record(0, [4])  # evicts 2, the least recently routed
    assert router.matched_blocks(0, [1]) == 1
    assert router.matched_blocks(0, [1, 2]) == 1
    assert router.matched_blocks(0, [4]) == 1
    router.record(1, [7])
    router.forget(0)
    assert router.matched_blocks(0, [1]) == 0 and router.matched_blocks(1, [7]) == 1
    router.forget()
    assert router.matched_blocks(1, [7]) == 0
