"""`KVCacheManager`: which blocks each request holds, prefix-cache lookups, allocation."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, cross_block_hashes
from vllm.v1.request import Request


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

    Encoder/decoder requests also hold a cross-attention block list from the same pool:
    `cdiv(num_encoder_tokens, block_size)` blocks, taken together with the first decoder
    blocks (all or nothing), written once by the encoder pass and read-only after. With
    prefix caching they are registered under the encoder input's hash, so a later request
    with the same encoder input shares them (and skips the encoder). A request holds
    exactly |cross blocks| + |self blocks| blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_cross_blocks: dict[str, list[KVCacheBlock]] = {}
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

    def get_cached_cross_blocks(self, request: Request) -> list[KVCacheBlock] | None:
        """The cached cross-attention blocks of `request`'s encoder input, if every one of
        them is still cached (a partial hit needs the encoder anyway); None on a miss."""
        if not self.enable_caching or request.encoder_input is None:
            return None
        hashes = cross_block_hashes(request.encoder_input.content_hash,
                                    cdiv(request.num_encoder_tokens, self.block_size))
        blocks = []
        for block_hash in hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one scheduled request's lookup (failed allocations are not counted)."""
        if self.enable_caching:
            self.prefix_cache_stats.queries += num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0,
                       cross_hit_blocks: list[KVCacheBlock] | None = None
                       ) -> list[KVCacheBlock] | None:
        """Makes room for `num_new_tokens` more tokens of `request`.

        Args:
            new_computed_blocks: prefix-hit blocks from `get_computed_blocks` (first schedule).
            num_new_computed_tokens: tokens those blocks cover.
            cross_hit_blocks: cached cross-attention blocks from `get_cached_cross_blocks`;
                an encoder/decoder request without cross blocks gets new ones otherwise.

        Returns:
            The newly allocated self-attention blocks, or None (and nothing changed) if the
            pool is short.
        """
        new_computed_blocks = new_computed_blocks or []
        held = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(held) - len(new_computed_blocks))
        needs_cross = (request.encoder_input is not None
                       and request.request_id not in self.req_to_cross_blocks)
        cross_hits = (cross_hit_blocks or []) if needs_cross else []
        num_new_cross = (cdiv(request.num_encoder_tokens, self.block_size)
                         if needs_cross and not cross_hits else 0)
        # Hit blocks sitting in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for b in (*new_computed_blocks, *cross_hits)
                                 if b.ref_cnt == 0)
        if (num_new_blocks + num_new_cross
                > self.block_pool.get_num_free_blocks() - num_evictable_hits):
            if not held:
                del self.req_to_blocks[request.request_id]
            return None
        # Hits are taken out of the free queue before any new block is popped from it.
        self.block_pool.touch(new_computed_blocks)
        if needs_cross:
            self._allocate_cross_blocks(request, cross_hits, num_new_cross)
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

    def _allocate_cross_blocks(self, request: Request, hits: list[KVCacheBlock],
                               num_new: int) -> None:
        if hits:
            self.block_pool.touch(hits)
            self.req_to_cross_blocks[request.request_id] = list(hits)
            return
        blocks = self.block_pool.get_new_blocks(num_new)
        self.req_to_cross_blocks[request.request_id] = blocks
        if self.enable_caching:
            # Registered now, before the encoder pass of this step writes them: nothing
            # reads them before that pass, which runs ahead of the decoder forward.
            assert request.encoder_input is not None
            hashes = cross_block_hashes(request.encoder_input.content_hash, num_new)
            self.block_pool.cache_full_blocks(blocks, hashes, 0, num_new)

    def free(self, request: Request) -> None:
        """Gives back every block of `request`: self-attention blocks tail first, then its
        cross blocks, so that an encoder output (costly to recompute, and useless once
        partly evicted) stays cached longest."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.block_pool.free_blocks(self.req_to_cross_blocks.pop(request.request_id, []))
        self.num_cached_blocks.pop(request.request_id, None)

    def uncache_uncomputed(self, request: Request, num_computed_before: int,
                           encoder_ran: bool) -> None:
        """After a failed step: blocks that step was to fill (from position
        `num_computed_before` on) and, if its encoder ran, the request's cross blocks, leave
        the prefix cache, so no later request reuses K/V that was never written."""
        first = num_computed_before // self.block_size
        self.block_pool.uncache_blocks(self.req_to_blocks.get(request.request_id, [])[first:])
        if encoder_ran:
            self.block_pool.uncache_blocks(self.req_to_cross_blocks.get(request.request_id, []))
        self.num_cached_blocks.pop(request.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_cross_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_cross_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_cache_stats.reset()
