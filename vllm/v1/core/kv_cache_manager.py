"""`KVCacheManager`: which blocks each request holds, prefix-cache lookups, allocation."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found

    def reset(self) -> PrefixCacheStats:
        stats = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return stats


class KVCacheManager:
    """Owns the mapping request -> blocks on top of a `BlockPool`.

    The scheduler asks it for prefix hits when a request is first scheduled and for slots
    for every chunk it schedules; blocks go back to the pool (tail blocks first, so they
    are evicted first) when a request finishes or is preempted.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`, in whole blocks.

        At least the last token is always left to compute, since its logits are needed.

        Returns:
            (hit blocks, number of tokens they cover)
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one scheduled request's lookup (failed allocations are not counted)."""
        if self.enable_caching:
            self.prefix_cache_stats.queries += num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Makes room for `num_new_tokens` more tokens of `request`.

        Args:
            new_computed_blocks: prefix-hit blocks from `get_computed_blocks` (first schedule).
            num_new_computed_tokens: tokens those blocks cover.

        Returns:
            The newly allocated blocks, or None (and nothing changed) if the pool is short.
        """
        new_computed_blocks = new_computed_blocks or []
        held = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(held) - len(new_computed_blocks))
        # Hit blocks sitting in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not held:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        held.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        held.extend(new_blocks)
        if self.enable_caching:
            num_cached = self.num_cached_blocks.get(request.request_id,
                                                    len(new_computed_blocks))
            num_full = min((num_computed + num_new_tokens) // self.block_size,
                           len(request.block_hashes))
            self.block_pool.cache_full_blocks(held, request.block_hashes, num_cached, num_full)
            self.num_cached_blocks[request.request_id] = max(num_cached, num_full)
        return new_blocks

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_cache_stats.reset()
