"""Exact tests of the free-block queue, the block pool and chained block hashing."""

from __future__ import annotations

import pytest
import torch

from tests.core_factories import make_scheduler_request
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block,
    make_block_hasher,
)


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# ---- FreeKVCacheBlockQueue ---------------------------------------------------------------


def test_queue_keeps_insertion_order_and_pops_from_head() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 4
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3]
    assert queue.popleft().block_id == 0
    assert queue.popleft().block_id == 1
    assert queue.num_free_blocks == 2
    assert ids(queue.get_all_free_blocks()) == [2, 3]


def test_queue_remove_from_middle_relinks_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    assert queue.num_free_blocks == 4
    # Removing both ends works the same way.
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    assert queue.num_free_blocks == 2


def test_queue_append_goes_to_tail() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    first = queue.popleft()
    queue.append(first)
    assert ids(queue.get_all_free_blocks()) == [1, 2, 0]
    extra = [KVCacheBlock(7), KVCacheBlock(5)]
    queue.extend(extra)
    assert ids(queue.get_all_free_blocks()) == [1, 2, 0, 7, 5]
    assert queue.num_free_blocks == 5


def test_queue_popleft_on_empty_raises() -> None:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(0)])
    queue.popleft()
    assert queue.num_free_blocks == 0
    assert queue.get_all_free_blocks() == []
    with pytest.raises(ValueError, match="No free blocks"):
        queue.popleft()


# ---- BlockPool: allocation, null block, LRU --------------------------------------------


def test_pool_needs_two_blocks() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1, enable_caching=True)


def test_null_block_is_block_zero_and_never_handed_out() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0
    assert pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    assert free_ids(pool) == [1, 2, 3, 4]
    blocks = pool.get_new_blocks(4)
    assert ids(blocks) == [1, 2, 3, 4]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1, 1]
    assert pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [1, 2, 3, 4]
    assert 0 not in free_ids(pool)


def test_freeing_the_null_block_does_not_queue_it() -> None:
    pool = BlockPool(3, enable_caching=True)
    pool.touch([pool.null_block])  # e.g. padding a table: only its count moves
    pool.free_blocks([pool.null_block])
    assert free_ids(pool) == [1, 2]
    assert pool.get_num_free_blocks() == 2


def test_get_new_blocks_failure_changes_nothing() -> None:
    pool = BlockPool(4, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [1, 2, 3]


def test_freed_blocks_are_reused_in_lru_order() -> None:
    pool = BlockPool(7, enable_caching=False)
    a = pool.get_new_blocks(2)  # [1, 2]
    b = pool.get_new_blocks(2)  # [3, 4]
    assert ids(a) == [1, 2] and ids(b) == [3, 4]
    pool.free_blocks(b)
    pool.free_blocks(a)
    # Never-used blocks 5, 6 first, then in the order they were freed.
    assert free_ids(pool) == [5, 6, 3, 4, 1, 2]
    assert ids(pool.get_new_blocks(3)) == [5, 6, 3]
    assert free_ids(pool) == [4, 1, 2]


def test_free_order_is_the_given_order() -> None:
    pool = BlockPool(5, enable_caching=False)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 2, 1]
    assert ids(pool.get_new_blocks(1)) == [4]


def test_usage() -> None:
    pool = BlockPool(5, enable_caching=False)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(1)
    assert pool.get_usage() == 0.25
    pool.get_new_blocks(3)
    assert pool.get_usage() == 1.0
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.75


# ---- BlockPool: ref counts and the prefix cache ------------------------------------------


def test_shared_block_returns_to_queue_only_at_zero_refs() -> None:
    pool = BlockPool(4, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert free_ids(pool) == [2, 3]
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert free_ids(pool) == [2, 3, 1]


def test_cache_full_blocks_registers_only_the_requested_range() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    hashes = [b"h0", b"h1", b"h2", b"h3"]
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=1, num_full_blocks=3)
    assert pool.get_cached_block(b"h0") is None
    assert pool.get_cached_block(b"h1") is blocks[1]
    assert pool.get_cached_block(b"h2") is blocks[2]
    assert pool.get_cached_block(b"h3") is None
    assert [b.block_hash for b in blocks] == [None, b"h1", b"h2", None]


def test_cache_full_blocks_keeps_the_first_block_of_a_hash() -> None:
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [b"same"], 0, 1)
    pool.cache_full_blocks([second], [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is first
    assert second.block_hash is None


def test_cache_full_blocks_is_a_no_op_without_caching() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    assert pool.cached_block_hash_to_block == {}
    assert [b.block_hash for b in blocks] == [None, None]


def test_freed_cached_block_stays_findable_until_handed_out_again() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)  # blocks 1, 2
    pool.cache_full_blocks([a, b], [b"a", b"b"], 0, 2)
    pool.free_blocks([b, a])
    assert free_ids(pool) == [3, 2, 1]
    assert pool.get_cached_block(b"a") is a and pool.get_cached_block(b"b") is b
    # Block 3 is handed out first: no eviction yet.
    assert ids(pool.get_new_blocks(1)) == [3]
    assert pool.get_cached_block(b"b") is b
    # Block 2 is next: handing it out evicts hash b"b"; b"a" survives.
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(b"b") is None
    assert b.block_hash is None
    assert pool.get_cached_block(b"a") is a


def test_touch_pulls_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    pool.cache_full_blocks(blocks, [b"x", b"y", b"z"], 0, 3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 2, 1]
    hit = pool.get_cached_block(b"y")
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [4, 3, 1]
    assert pool.get_num_free_blocks() == 3
    # Touching a block already in use only counts the reference.
    pool.touch([hit])
    assert hit.ref_cnt == 2
    assert free_ids(pool) == [4, 3, 1]


def test_reset_prefix_cache() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    assert pool.reset_prefix_cache() is False  # blocks in use
    assert pool.get_cached_block(b"a") is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert [b.block_hash for b in pool.blocks] == [None, None, None, None]
    assert free_ids(pool) == [3, 1, 2]


# ---- hashing -----------------------------------------------------------------------------


def test_hash_block_is_deterministic_and_chained() -> None:
    h0 = hash_block(None, [1, 2, 3, 4])
    assert h0 == hash_block(None, [1, 2, 3, 4])
    assert len(h0) == 32
    assert hash_block(None, [1, 2, 3, 5]) != h0
    h1 = hash_block(h0, [5, 6, 7, 8])
    assert h1 == hash_block(h0, [5, 6, 7, 8])
    # Same tokens, different parent: a different block.
    assert hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8]) != h1
    assert hash_block(None, [5, 6, 7, 8]) != h1


def test_hash_block_tokens_never_collide_with_embeds() -> None:
    # All-zero rows whose bytes equal those of the token ids would still differ by tag.
    rows = torch.zeros(4, 2, dtype=torch.float32)  # 32 bytes of zeros
    zeros_as_tokens = hash_block(None, [0, 0, 0, 0])  # 32 bytes of zeros as well
    assert hash_block(None, [], rows) != zeros_as_tokens
    assert hash_block(None, [], rows) == hash_block(None, [], rows.clone())
    changed = rows.clone()
    changed[3, 1] = 1e-3
    assert hash_block(None, [], changed) != hash_block(None, [], rows)
    # Embeds rows followed by real tokens: both parts count.
    head = rows[:2]
    assert hash_block(None, [7, 8], head) != hash_block(None, [7, 9], head)


def test_block_hasher_hashes_full_blocks_only_and_chains() -> None:
    request = make_scheduler_request("r", list(range(10, 21)), block_size=4)  # 11 tokens
    h0 = hash_block(None, [10, 11, 12, 13])
    h1 = hash_block(h0, [14, 15, 16, 17])
    assert request.block_hashes == [h0, h1]
    # Tokens 18, 19, 20 plus one output fill block 2; the hasher then adds exactly one hash.
    request.append_output_token_ids([99])
    h2 = hash_block(h1, [18, 19, 20, 99])
    assert request.block_hashes == [h0, h1, h2]
    request.append_output_token_ids([5, 6, 7])
    assert request.block_hashes == [h0, h1, h2]
    hasher = make_block_hasher(4)
    assert hasher(request) == []  # nothing new to hash


def test_block_hasher_for_embeds_prompt_uses_rows_then_output_tokens() -> None:
    embeds = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3)
    request = make_scheduler_request("e", prompt_embeds=embeds, block_size=4)
    e0 = hash_block(None, [], embeds[0:4])
    assert request.block_hashes == [e0]
    # Block 1 = embeds rows 4, 5 followed by output tokens 30, 31.
    request.append_output_token_ids([30, 31])
    assert request.block_hashes == [e0, hash_block(e0, [30, 31], embeds[4:6])]
    # The placeholder token ids of a token prompt give different hashes.
    tokens = make_scheduler_request("t", [0] * 6, block_size=4)
    assert tokens.block_hashes[0] != e0


def test_cache_full_blocks_moves_a_hash_from_a_free_copy_to_the_live_block() -> None:
    # A free cached copy (a hit another KV cache group made unusable) gives its hash to the
    # block just computed, so evicting the copy later does not lose the hash.
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [b"same"], 0, 1)
    pool.free_blocks([first])
    pool.cache_full_blocks([second], [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is second
    assert first.block_hash is None and second.block_hash == b"same"
    pool.get_new_blocks(1)  # hands out block 3, the queue's head
    assert pool.get_new_blocks(1) == [first]  # evicting the old copy keeps the hash
    assert pool.get_cached_block(b"same") is second
