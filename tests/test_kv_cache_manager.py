"""Exact tests of `KVCacheManager`: allocation, prefix hits, sharing, freeing, eviction."""

from __future__ import annotations

import torch

from tests.core_factories import make_scheduler_request
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request

BLOCK_SIZE = 4


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def schedule_prompt(manager: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """What the scheduler does for a waiting request: look up hits, allocate the rest,
    mark the prompt computed. Returns (new block ids, number of hit tokens)."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in new], num_hit


def decode_one(manager: KVCacheManager, request: Request, token: int) -> list[int]:
    """One decode step: the sampled token joins the request and gets a slot."""
    request.append_output_token_ids([token])
    new = manager.allocate_slots(request, 1)
    assert new is not None
    request.num_computed_tokens += 1
    return [b.block_id for b in new]


def make_manager(num_blocks: int = 16, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)


def req(request_id: str, tokens: list[int], **kwargs) -> Request:
    return make_scheduler_request(request_id, tokens, block_size=BLOCK_SIZE, **kwargs)


# ---- allocation ----------------------------------------------------------------------


def test_prompt_gets_ceil_blocks_sequentially_from_one() -> None:
    manager = make_manager()
    a = req("a", list(range(100, 109)))  # 9 tokens -> 3 blocks
    assert schedule_prompt(manager, a) == ([1, 2, 3], 0)
    b = req("b", list(range(200, 204)))  # 4 tokens -> 1 block
    assert schedule_prompt(manager, b) == ([4], 0)
    assert manager.get_block_ids("a") == [1, 2, 3]
    assert manager.get_block_ids("b") == [4]
    assert manager.get_block_ids("unknown") == []
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(6)] == [0, 1, 1, 1, 1, 0]


def test_decode_allocates_a_block_only_when_crossing_a_boundary() -> None:
    manager = make_manager()
    a = req("a", [1, 2, 3, 4, 5, 6])  # positions 0..5 in blocks 1, 2
    assert schedule_prompt(manager, a) == ([1, 2], 0)
    assert decode_one(manager, a, 50) == []  # position 6
    assert decode_one(manager, a, 51) == []  # position 7
    assert decode_one(manager, a, 52) == [3]  # position 8 opens block 3
    assert decode_one(manager, a, 53) == []
    assert manager.get_block_ids("a") == [1, 2, 3]


def test_chunked_prefill_allocates_per_chunk() -> None:
    manager = make_manager()
    a = req("a", list(range(1, 12)))  # 11 tokens
    assert [b.block_id for b in manager.allocate_slots(a, 5)] == [1, 2]
    a.num_computed_tokens = 5
    assert [b.block_id for b in manager.allocate_slots(a, 3)] == []
    a.num_computed_tokens = 8
    assert [b.block_id for b in manager.allocate_slots(a, 3)] == [3]
    assert manager.get_block_ids("a") == [1, 2, 3]


def test_allocation_failure_changes_nothing() -> None:
    manager = make_manager(num_blocks=4)  # 3 usable blocks
    a = req("a", list(range(1, 9)))
    assert schedule_prompt(manager, a) == ([1, 2], 0)
    b = req("b", list(range(20, 28)))  # needs 2 blocks, 1 free
    assert manager.allocate_slots(b, 8) is None
    assert "b" not in manager.req_to_blocks
    assert free_ids(manager) == [3]
    # A running request that cannot grow keeps what it had.
    assert manager.allocate_slots(a, 8) is None
    assert manager.get_block_ids("a") == [1, 2]
    assert free_ids(manager) == [3]


def test_free_returns_tail_blocks_first_so_they_are_evicted_first() -> None:
    manager = make_manager(num_blocks=5)  # blocks 1..4
    a = req("a", list(range(1, 13)))  # 12 tokens -> blocks 1, 2, 3
    assert schedule_prompt(manager, a) == ([1, 2, 3], 0)
    manager.free(a)
    assert free_ids(manager) == [4, 3, 2, 1]
    assert manager.get_block_ids("a") == []
    # A new request takes the never-used block 4, then a's tail block 3 (evicting it)
    # before a's head blocks.
    b = req("b", list(range(50, 58)))
    assert schedule_prompt(manager, b) == ([4, 3], 0)
    assert manager.block_pool.get_cached_block(a.block_hashes[2]) is None
    assert manager.block_pool.get_cached_block(a.block_hashes[1]).block_id == 2
    assert manager.block_pool.get_cached_block(a.block_hashes[0]).block_id == 1


def test_usage_follows_allocation() -> None:
    manager = make_manager(num_blocks=5)
    a = req("a", list(range(1, 9)))
    schedule_prompt(manager, a)
    assert manager.usage == 0.5
    manager.free(a)
    assert manager.usage == 0.0


# ---- prefix hits ---------------------------------------------------------------------------


def test_prefix_hit_shares_blocks_and_counts_refs() -> None:
    manager = make_manager()
    prompt = list(range(1, 10))  # 9 tokens: 2 full blocks + 1 token
    a = req("a", prompt)
    assert schedule_prompt(manager, a) == ([1, 2, 3], 0)
    b = req("b", prompt)
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2]
    assert num_hit == 8
    new = manager.allocate_slots(b, 1, hits, num_hit)
    assert [blk.block_id for blk in new] == [4]
    assert manager.get_block_ids("b") == [1, 2, 4]
    pool = manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    manager.free(a)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert 1 not in free_ids(manager) and 2 not in free_ids(manager)
    manager.free(b)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [0, 0, 0, 0]
    # a freed [3, 2, 1] but 2 and 1 were still held by b; b then freed [4, 2, 1].
    assert free_ids(manager)[-4:] == [3, 4, 2, 1]


def test_last_token_is_always_recomputed() -> None:
    manager = make_manager()
    prompt = list(range(1, 9))  # exactly 2 full blocks
    a = req("a", prompt)
    schedule_prompt(manager, a)
    b = req("b", prompt)
    hits, num_hit = manager.get_computed_blocks(b)
    # Block 2 is cached too, but a full hit would leave no token to compute logits from.
    assert [blk.block_id for blk in hits] == [1]
    assert num_hit == 4
    assert [blk.block_id for blk in manager.allocate_slots(b, 4, hits, num_hit)] == [3]
    assert manager.get_block_ids("b") == [1, 3]


def test_hashes_are_chained_so_a_changed_block_misses_from_there_on() -> None:
    manager = make_manager()
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    schedule_prompt(manager, a)
    # Second block differs: only the first block hits.
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13])
    assert manager.get_computed_blocks(b)[1] == 4
    # First block differs: nothing hits, although blocks 2 and 3 hold the same tokens.
    c = req("c", [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert manager.get_computed_blocks(c) == ([], 0)


def test_hit_on_a_freed_block_pulls_it_out_of_the_free_queue() -> None:
    manager = make_manager(num_blocks=6)  # blocks 1..5
    prompt = list(range(1, 10))
    a = req("a", prompt)
    schedule_prompt(manager, a)  # 1, 2, 3
    manager.free(a)
    assert free_ids(manager) == [4, 5, 3, 2, 1]
    b = req("b", prompt)
    assert schedule_prompt(manager, b) == ([4], 8)
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert free_ids(manager) == [5, 3]


def test_hit_blocks_in_the_free_queue_are_not_counted_as_allocatable() -> None:
    manager = make_manager(num_blocks=4)  # blocks 1..3
    a = req("a", list(range(1, 10)))  # 9 tokens: blocks 1, 2, 3
    schedule_prompt(manager, a)
    manager.free(a)
    assert free_ids(manager) == [3, 2, 1]
    # b hits blocks 1, 2 (both free) and needs 3 more blocks for 12 more tokens; only
    # block 3 would be left once the hits are taken, so the allocation must fail.
    b = req("b", list(range(1, 9)) + list(range(50, 63)))
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2] and num_hit == 8
    assert manager.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit) is None
    assert free_ids(manager) == [3, 2, 1]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [0, 0, 0]
    # One block more is fine: exactly the free block 3 is used.
    c = req("c", list(range(1, 9)) + [70, 71, 72])
    hits, num_hit = manager.get_computed_blocks(c)
    assert [blk.block_id for blk in manager.allocate_slots(c, 3, hits, num_hit)] == [3]
    assert manager.get_block_ids("c") == [1, 2, 3]
    assert free_ids(manager) == []


def test_decoded_blocks_become_cached_too() -> None:
    manager = make_manager()
    a = req("a", [1, 2, 3, 4, 5, 6])
    schedule_prompt(manager, a)  # blocks 1, 2
    decode_one(manager, a, 7)
    decode_one(manager, a, 8)  # block 2 now holds [5, 6, 7, 8] and is full
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2] and num_hit == 8


def test_evicted_block_no_longer_hits() -> None:
    manager = make_manager(num_blocks=4)  # blocks 1..3
    a = req("a", [1, 2, 3, 4, 5])
    schedule_prompt(manager, a)  # blocks 1, 2
    manager.free(a)
    assert free_ids(manager) == [3, 2, 1]
    filler = req("f", list(range(100, 112)))  # takes 3, 2, 1: every cached block evicted
    assert schedule_prompt(manager, filler) == ([3, 2, 1], 0)
    manager.free(filler)
    assert manager.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == ([], 0)


def test_no_caching_means_no_hits() -> None:
    manager = make_manager(enable_caching=False)
    a = req("a", list(range(1, 10)))
    schedule_prompt(manager, a)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(req("b", list(range(1, 10)))) == ([], 0)


def test_prefix_cache_stats_count_recorded_lookups() -> None:
    manager = make_manager()
    manager.record_prefix_lookup(9, 8)
    manager.record_prefix_lookup(5, 0)
    stats = manager.make_prefix_cache_stats()
    assert (stats.queries, stats.hits) == (14, 8)
    stats = manager.make_prefix_cache_stats()
    assert (stats.queries, stats.hits) == (0, 0)


def test_reset_prefix_cache_only_when_idle() -> None:
    manager = make_manager()
    a = req("a", list(range(1, 10)))
    schedule_prompt(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(req("b", list(range(1, 10)))) == ([], 0)


# ---- prompt embeds ---------------------------------------------------------------------


def embeds(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, 8, generator=torch.Generator().manual_seed(seed))


def embeds_req(request_id: str, rows: torch.Tensor) -> Request:
    return make_scheduler_request(request_id, prompt_embeds=rows, block_size=BLOCK_SIZE)


def test_same_embeds_hit() -> None:
    manager = make_manager()
    rows = embeds(9)
    schedule_prompt(manager, embeds_req("a", rows))
    hits, num_hit = manager.get_computed_blocks(embeds_req("b", rows.clone()))
    assert [blk.block_id for blk in hits] == [1, 2] and num_hit == 8


def test_changed_embeds_row_misses_from_its_block_on() -> None:
    manager = make_manager()
    rows = embeds(13)
    schedule_prompt(manager, embeds_req("a", rows))  # blocks 1, 2, 3 full + 1 token
    changed = rows.clone()
    changed[5, 3] += 1.0  # block 1 (rows 4..7)
    hits, num_hit = manager.get_computed_blocks(embeds_req("b", changed))
    assert [blk.block_id for blk in hits] == [1] and num_hit == 4
    changed = rows.clone()
    changed[0, 0] += 1.0  # block 0: nothing after it can hit either
    assert manager.get_computed_blocks(embeds_req("c", changed)) == ([], 0)


def test_token_prompt_never_hits_embeds_blocks_and_vice_versa() -> None:
    manager = make_manager()
    rows = torch.zeros(9, 8)
    schedule_prompt(manager, embeds_req("e", rows))  # placeholder ids are 0 too
    assert manager.get_computed_blocks(req("t", [0] * 9)) == ([], 0)
    schedule_prompt(manager, req("t2", [0] * 9))
    hits, num_hit = manager.get_computed_blocks(embeds_req("e2", rows.clone()))
    assert [blk.block_id for blk in hits] == [1, 2] and num_hit == 8
    hits, num_hit = manager.get_computed_blocks(req("t3", [0] * 9))
    assert [blk.block_id for blk in hits] == [4, 5] and num_hit == 8
