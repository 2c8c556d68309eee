"""Exact tests of sliding-window KV cache accounting: which blocks a request holds as it
decodes (block by block), that a freed window block is never read again, prefix hits with
a window, two block groups for models interleaving window and global layers, and the
groups a model config gives."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from tests.core_factories import make_scheduler_request
from vllm.transformers_utils.config import layer_sliding_windows
from vllm.v1.core.kv_cache_groups import (
    KVCacheGroupSpec,
    blocks_needed,
    make_kv_cache_groups,
    window_start_block,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request
from vllm.v1.worker.block_table import BlockTable

BLOCK_SIZE = 4
WINDOW = 5  # a query at p sees keys p-4 .. p
WINDOW_ONLY = [KVCacheGroupSpec((0, 1), WINDOW)]
FULL_AND_WINDOW = [KVCacheGroupSpec((1,), None), KVCacheGroupSpec((0,), WINDOW)]


def req(request_id: str, tokens: list[int], **kwargs) -> Request:
    return make_scheduler_request(request_id, tokens, block_size=BLOCK_SIZE, max_model_len=128,
                                  **kwargs)


def manager(groups: list[KVCacheGroupSpec], num_blocks: int = 16,
            enable_caching: bool = False) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching, groups)


def prefill(kv: KVCacheManager, request: Request) -> list[int]:
    hits, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in new]


def decode(kv: KVCacheManager, request: Request) -> list[int]:
    request.append_output_token_ids([7])
    new = kv.allocate_slots(request, 1)
    assert new is not None
    request.num_computed_tokens += 1
    return [b.block_id for b in new]


def test_window_start_block_and_needed_blocks() -> None:
    # Position 8 with window 5 reads keys 4..8: blocks 1 and 2.
    assert [window_start_block(p, WINDOW, BLOCK_SIZE) for p in range(4, 14)] == \
        [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert window_start_block(100, None, BLOCK_SIZE) == 0
    # 8k tokens, block 16, window 512, one-token steps: 512 full blocks vs 33 window blocks.
    full, window = KVCacheGroupSpec((0,), None), KVCacheGroupSpec((1,), 512)
    assert blocks_needed(8192, [full], 16, 1) == 512
    assert blocks_needed(8192, [window], 16, 1) == 33
    assert blocks_needed(8192, [full, window], 16, 1) == 545
    assert blocks_needed(20, [window], 16, 1) == 2  # never more than the sequence's


def test_a_decoding_window_request_holds_only_its_window_blocks() -> None:
    kv = manager(WINDOW_ONLY)
    a = req("a", [11, 12, 13, 14, 15, 16])  # positions 0..5: blocks 1, 2
    assert prefill(kv, a) == [1, 2]
    held = []
    for _ in range(10):  # positions 6..15
        decode(kv, a)
        held.append(kv.get_block_ids("a"))
    assert held == [
        [1, 2],  # 6: keys 2..6
        [1, 2],  # 7: keys 3..7
        [0, 2, 3],  # 8: keys 4..8, block 1 (positions 0..3) freed, block 3 opened
        [0, 2, 3],
        [0, 2, 3],
        [0, 2, 3],  # 11: keys 7..11
        [0, 0, 3, 4],  # 12: keys 8..12; block 2 freed (1 and 2 wait at the queue's tail)
        [0, 0, 3, 4],
        [0, 0, 3, 4],
        [0, 0, 3, 4],
    ]
    # Never more than two real blocks: the window (5 keys) spans at most 2 blocks here.
    assert kv.block_pool.get_num_free_blocks() == 15 - 2
    kv.free(a)
    assert kv.block_pool.get_num_free_blocks() == 15


def test_full_and_window_groups_interleave_and_only_the_window_group_shrinks() -> None:
    kv = manager(FULL_AND_WINDOW)
    a = req("a", [11, 12, 13, 14, 15, 16])
    # Logical block 0: full 1, window 2; logical block 1: full 3, window 4.
    assert prefill(kv, a) == [1, 2, 3, 4]
    assert decode(kv, a) == [] and decode(kv, a) == []  # positions 6, 7
    assert decode(kv, a) == [5, 6]  # position 8: logical block 2 (window block 2 freed)
    assert kv.get_block_ids("a") == [1, 0, 3, 4, 5, 6]
    assert kv.get_group_block_ids("a", 0) == [1, 3, 5]
    assert kv.get_group_block_ids("a", 1) == [0, 4, 6]
    assert [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()][-1] == 2
    kv.free(a)  # tail first, the null block skipped
    assert kv.block_pool.get_num_free_blocks() == 15
    assert [b.ref_cnt for b in kv.block_pool.blocks[1:7]] == [0] * 6


def test_a_freed_window_block_is_never_read_again() -> None:
    kv = manager(WINDOW_ONLY, num_blocks=4)  # 3 usable blocks
    a = req("a", list(range(20, 28)))  # 8 tokens: blocks 1, 2
    assert prefill(kv, a) == [1, 2]
    for _ in range(5):  # to position 12: keys 8..12; blocks 1 and 2 out of the window
        decode(kv, a)
    assert kv.get_block_ids("a") == [0, 0, 3, 1]  # block 1 came back from the pool
    b = req("b", [5, 6, 7])
    assert prefill(kv, b) == [2]  # b now owns a's old block 2
    # The runner's table still lists a's old ids; the window view hides them.
    table = BlockTable(2, 32, BLOCK_SIZE)
    table.add_row([1, 2, 3], 0)  # what the runner was sent before the frees
    table.append_row([1], 0)
    table.add_row([2], 1)
    rows = table.group_tables(2, np.array([12, 3]), [WINDOW])[0]
    assert rows[0, :4].tolist() == [0, 0, 3, 1]
    assert rows[1, :1].tolist() == [2]


def test_window_mask_example() -> None:
    """`group_tables`' docstring example: row 0 reads keys from position 6 (block 1)."""
    table = BlockTable(2, 12, BLOCK_SIZE)
    table.add_row([1, 2, 3], 0)
    table.add_row([4, 5], 1)
    assert table.group_tables(2, np.array([10, 3]), [WINDOW]).tolist() == [
        [[0, 2, 3], [4, 5, 0]]]


def test_group_block_tables_and_slot_mapping() -> None:
    table = BlockTable(2, 16, BLOCK_SIZE, num_groups=2)
    table.add_row([5, 6, 7, 8], 0)  # logical 0: (5, 6), logical 1: (7, 8)
    assert table.group_table(1, 0).tolist() == [[5, 7, 0, 0]]
    assert table.group_table(1, 1).tolist() == [[6, 8, 0, 0]]
    req_indices, positions = np.array([0, 0]), np.array([3, 4])
    assert table.group_tables(1).tolist() == [[[5, 7, 0, 0]], [[6, 8, 0, 0]]]
    assert table.compute_slot_mappings(req_indices, positions).tolist() == [[23, 28], [27, 32]]


@pytest.mark.parametrize("groups", [1, 3])
def test_every_group_at_once_equals_each_group_masked_alone(groups: int) -> None:
    """A step's tables and slots of all groups at once (`group_tables` with the groups'
    windows, one mask per distinct window; `compute_slot_mappings`) equal each group's
    table and slots worked out row by row here, and the live table is left as it was."""
    rng = np.random.default_rng(groups)
    table = BlockTable(3, 64, BLOCK_SIZE, num_groups=groups)
    for row, blocks in enumerate((12, 7, 3)):
        table.add_row(rng.integers(1, 50, size=blocks * groups).tolist(), row)
    before = table.table.copy()
    windows = [WINDOW, None, WINDOW][:groups]
    num_computed = np.array([45, 20, 9])
    got = table.group_tables(3, num_computed, windows)
    for g, window in enumerate(windows):
        want = table.group_table(3, g).copy()
        for r in range(3):  # blocks wholly before the keys from num_computed - window + 1
            if window is not None:
                want[r, :max(num_computed[r] - window + 1, 0) // BLOCK_SIZE] = 0
        assert got[g].tolist() == want.tolist()
    assert got[0].tolist() != table.group_table(3, 0).tolist()  # the mask hid something
    assert np.array_equal(table.table, before)
    req_indices, positions = np.array([0, 1, 1, 2]), np.array([45, 20, 21, 9])
    slots = table.compute_slot_mappings(req_indices, positions)
    for g in range(groups):
        assert slots[g].tolist() == [
            int(table.group_table(3, g)[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
            for r, p in zip(req_indices, positions)]


def test_prefix_hit_needs_only_the_window_blocks_of_the_hit_point() -> None:
    prompt = list(range(40, 53))  # 13 tokens: full blocks 0..2 cached after the prefill
    for groups, expected in ((WINDOW_ONLY, ([0, 0, 3], 12)), (None, ([], 0))):
        kv = manager(groups or [KVCacheGroupSpec((0,), None)], num_blocks=8,
                     enable_caching=True)
        assert prefill(kv, req("a", prompt)) == [1, 2, 3, 4]
        kv.free(req("a", prompt))
        # Blocks 0 and 1 (ids 1, 2) leave the cache; block 2 (id 3) stays.
        kv.block_pool.uncache_blocks([kv.block_pool.blocks[1], kv.block_pool.blocks[2]])
        hits, num_hit = kv.get_computed_blocks(req("b", prompt + [1, 2, 3]))
        # Window: a hit of 12 tokens reads keys 8..12 from position 12: block 2 alone.
        # Full attention needs block 0 first: no hit.
        assert ([b.block_id for b in hits], num_hit) == expected


def test_a_hit_with_the_window_block_evicted_is_shorter() -> None:
    kv = manager(WINDOW_ONLY, num_blocks=8, enable_caching=True)
    prompt = list(range(40, 57))  # 17 tokens: full blocks 0..3 cached
    assert prefill(kv, req("a", prompt)) == [1, 2, 3, 4, 5]
    kv.free(req("a", prompt))
    kv.block_pool.uncache_blocks([kv.block_pool.blocks[4]])  # logical block 3
    hits, num_hit = kv.get_computed_blocks(req("b", prompt + [1]))
    # A 16-token hit would read block 3 (keys 12..16), evicted; a 12-token hit reads
    # block 2 alone (keys 8..12).
    assert ([b.block_id for b in hits], num_hit) == ([0, 0, 3], 12)


def test_prefix_hit_with_full_and_window_groups() -> None:
    kv = manager(FULL_AND_WINDOW, num_blocks=16, enable_caching=True)
    prompt = list(range(40, 53))  # 13 tokens
    a = req("a", prompt)
    assert prefill(kv, a) == [1, 2, 3, 4, 5, 6, 7, 8]
    kv.free(a)
    b = req("b", prompt + [9])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    # Full group: logical 0..2 (ids 1, 3, 5); window group: logical 2 only (id 6).
    assert [x.block_id for x in hits] == [1, 0, 3, 0, 5, 6]
    new = kv.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit)
    # From the queue's head (9..15, then a's blocks tail first: 8, 7, 4, 2 left).
    assert new is not None and [x.block_id for x in new] == [9, 10]
    assert kv.get_block_ids("b") == [1, 0, 3, 0, 5, 6, 9, 10]
    # The window group's blocks of logical 0, 1 (ids 2, 4) stay free and cached.
    assert kv.block_pool.blocks[2].ref_cnt == 0 and kv.block_pool.blocks[2].block_hash


def test_preemption_frees_every_group() -> None:
    kv = manager(FULL_AND_WINDOW)
    a = req("a", list(range(10, 19)))
    prefill(kv, a)
    for _ in range(4):
        decode(kv, a)
    kv.free(a)
    assert kv.block_pool.get_num_free_blocks() == 15
    assert "a" not in kv.req_to_blocks


def test_requests_returning_hidden_states_keep_their_window_blocks() -> None:
    kv = manager(WINDOW_ONLY)
    a = req("a", list(range(10, 18)), return_hidden_states=True)
    prefill(kv, a)
    for _ in range(6):
        decode(kv, a)
    assert kv.get_block_ids("a") == [1, 2, 3, 4]


def test_groups_from_configs() -> None:
    gemma2 = transformers.Gemma2Config(num_hidden_layers=4, sliding_window=8)
    windows = layer_sliding_windows(gemma2, 4)
    assert windows == [8, None, 8, None]
    assert make_kv_cache_groups(windows) == [KVCacheGroupSpec((1, 3), None),
                                             KVCacheGroupSpec((0, 2), 8)]
    gemma3 = transformers.Gemma3TextConfig(num_hidden_layers=8, sliding_window=16)
    groups = make_kv_cache_groups(layer_sliding_windows(gemma3, 8))
    # Layer 5 is global (pattern 6); seven window layers in groups of one.
    assert groups[0] == KVCacheGroupSpec((5,), None)
    assert [g.layer_indices for g in groups[1:]] == [(0,), (1,), (2,), (3,), (4,), (6,), (7,)]
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=32)
    assert make_kv_cache_groups(layer_sliding_windows(mistral, 3)) == [
        KVCacheGroupSpec((0, 1, 2), 32)]
    llama = transformers.LlamaConfig(num_hidden_layers=2)
    assert make_kv_cache_groups(layer_sliding_windows(llama, 2)) == [
        KVCacheGroupSpec((0, 1), None)]
    with pytest.raises(ValueError, match="layer_types has 4 entries for 3 layers"):
        layer_sliding_windows(gemma2, 3)
