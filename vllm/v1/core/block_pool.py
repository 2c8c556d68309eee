"""`BlockPool`: every KV cache block, their ref counts, the free queue and the prefix cache."""

from __future__ import annotations

from collections.abc import Iterable

from vllm.v1.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """Hands out and takes back KV cache blocks.

    Block 0 is the null block: never handed out, it pads block tables. A freed block whose
    contents are cached (it has a hash) stays findable by hash until it is handed out again,
    which evicts it; freed blocks are handed out in LRU order (head of the free queue first).
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Registers blocks[num_cached_blocks:num_full_blocks] under their hashes."""
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks[num_cached_blocks:num_full_blocks],
                                     block_hashes[num_cached_blocks:num_full_blocks]):
            if block.block_hash is not None or block.is_null:
                continue  # a prefix hit (already cached), or a window's dropped block
            cached = self.cached_block_hash_to_block.get(block_hash)
            if cached is not None:
                if cached.ref_cnt > 0:
                    continue  # another request computed the same block first; keep that one
                # A free copy (a hit that was not taken: e.g. another KV cache group missed
                # at that point): the live block takes its place, so the hash survives the
                # free copy's eviction.
                self._evict(cached)
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes blocks out of the prefix cache (their contents cannot be trusted: the
        step that was to compute them failed). They stay allocated to their holders."""
        for block in blocks:
            if block.block_hash is not None \
                    and self.cached_block_hash_to_block.get(block.block_hash) is block:
                self._evict(block)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool.")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-hit blocks, pulling free ones out of the queue (the
        null block, which pads a window group's hit, is nobody's)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference; blocks reaching zero join the queue's tail in this order."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False  # blocks still in use
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)
