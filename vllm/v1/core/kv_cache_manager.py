"""`KVCacheManager`: which blocks each request holds, prefix-cache lookups, allocation."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_groups import KVCacheGroupSpec, window_start_block
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock, cross_block_hashes
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

    Models with sliding-window layers keep several KV cache groups (`kv_cache_groups`): a
    request's blocks are one list interleaved by group (logical block i of group g at
    index i * num_groups + g), and the blocks of a window group that no later query can
    see (`window_start_block`) go back to the pool as the request advances, their places
    taken by the null block. Blocks leave tail first; a cached block stays findable until
    the pool hands it out again. A request that asks for its hidden states keeps all its
    blocks (its stage-output rows live in them). Prefix caching: each group's blocks are
    cached under the block hash tagged with the group; a hit of h blocks needs every full
    group's blocks [0, h) and each window group's blocks from the window start of position
    h * block_size up to h, the rest of the window group's hit being null blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 kv_cache_groups: list[KVCacheGroupSpec] | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = kv_cache_groups or [KVCacheGroupSpec((), None)]
        self.num_groups = len(self.groups)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_cross_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`, in whole blocks (interleaved by group;
        null blocks where a window group needs none).

        At least the last token is always left to compute, since its logits are needed. A
        hit that would end inside a bidirectional span of the request ends before the span's
        block (e.g. block size 4, span [6, 14), 3 blocks cached: 1 block, 4 tokens).

        Returns:
            (hit blocks, number of tokens they cover)
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = min((request.num_tokens - 1) // self.block_size,
                             len(request.block_hashes))
        cached = [[self.block_pool.get_cached_block(_group_hash(h, g))
                   for h in request.block_hashes[:max_hit_blocks]]
                  for g in range(self.num_groups)]
        num_hit = max_hit_blocks
        # A hit never ends inside a bidirectional span: the span is computed whole.
        while num_hit > 0 and (request.splits_span(num_hit * self.block_size) or not all(
                self._group_hit(g, cached[g], num_hit) for g in range(self.num_groups))):
            num_hit -= 1
        blocks = []
        for i in range(num_hit):
            for g in range(self.num_groups):
                block = cached[g][i]
                blocks.append(block if block is not None and i >= self._first_needed(g, num_hit)
                              else self.block_pool.null_block)
        return blocks, num_hit * self.block_size

    def _first_needed(self, group: int, num_hit_blocks: int) -> int:
        return window_start_block(num_hit_blocks * self.block_size,
                                  self.groups[group].sliding_window, self.block_size)

    def _group_hit(self, group: int, cached: list[KVCacheBlock | None], num_hit: int) -> bool:
        """Whether group `group` has what a hit of `num_hit` blocks reads."""
        return all(b is not None for b in cached[self._first_needed(group, num_hit):num_hit])

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
        if self.num_groups > 1 or self.groups[0].sliding_window is not None:
            self._free_out_of_window(request, held, num_computed)
        num_required = cdiv(num_computed + num_new_tokens, self.block_size) * self.num_groups
        num_new_blocks = max(0, num_required - len(held) - len(new_computed_blocks))
        needs_cross = (request.encoder_input is not None
                       and request.request_id not in self.req_to_cross_blocks)
        cross_hits = (cross_hit_blocks or []) if needs_cross else []
        num_new_cross = (cdiv(request.num_encoder_tokens, self.block_size)
                         if needs_cross and not cross_hits else 0)
        # Hit blocks sitting in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for b in (*new_computed_blocks, *cross_hits)
                                 if b.ref_cnt == 0 and not b.is_null)
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
                                                    len(new_computed_blocks) // self.num_groups)
            num_full = min((num_computed + num_new_tokens) // self.block_size,
                           len(request.block_hashes))
            new_hashes = request.block_hashes[num_cached:num_full]
            for g in range(self.num_groups):
                blocks = held[g::self.num_groups][num_cached:num_full]
                self.block_pool.cache_full_blocks(
                    blocks, [_group_hash(h, g) for h in new_hashes], 0, len(blocks))
            self.num_cached_blocks[request.request_id] = max(num_cached, num_full)
        return new_blocks

    def _free_out_of_window(self, request: Request, held: list[KVCacheBlock],
                            num_computed: int) -> None:
        """Gives back the window groups' blocks that no query from position `num_computed`
        on reads (newest first, so the older stay cached longer), null blocks in their
        place. A request returning its hidden states keeps them (its rows live there)."""
        if request.sampling_params.return_hidden_states:
            return
        null = self.block_pool.null_block
        for g, group in enumerate(self.groups):
            first = window_start_block(num_computed, group.sliding_window, self.block_size)
            # A window group's null blocks are a prefix of its list (freed front first, hits
            # null before the window), so walking back from the window's start to the
            # first null block finds just the newly out-of-window blocks.
            out = []
            i = min(first, cdiv(len(held) - g, self.num_groups)) - 1
            while i >= 0 and not held[i * self.num_groups + g].is_null:
                out.append(i * self.num_groups + g)
                i -= 1
            self.block_pool.free_blocks(held[j] for j in out)  # newest first
            for j in out:
                held[j] = null

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
        self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)
        self.block_pool.free_blocks(self.req_to_cross_blocks.pop(request.request_id, []))
        self.num_cached_blocks.pop(request.request_id, None)

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Gives `child` (a beam forked from `parent`, the same tokens, as many computed)
        the parent's blocks: full blocks shared (one more reference each), the partly
        filled last block of each group copied into a new block, cross blocks shared.

        Example (block size 4, parent computed 10 tokens in blocks [5, 6, 7]): the child
        holds [5, 6, 9] with 5 and 6 referenced twice, and (7, 9) is to be copied.

        Returns:
            (source, destination) block ids the runner copies before the next forward; None
            (nothing changed) if the parent holds no blocks or the pool has no free block
            for the copies: the child then starts from scratch (prefix hits still apply).
        """
        held = self.req_to_blocks.get(parent.request_id)
        if not held:
            return None
        num_full = parent.num_computed_tokens // self.block_size * self.num_groups
        shared, partial = held[:num_full], [b for b in held[num_full:] if not b.is_null]
        if len(partial) > self.block_pool.get_num_free_blocks():
            return None
        self.block_pool.touch(shared)
        copies = self.block_pool.get_new_blocks(len(partial))
        self.req_to_blocks[child.request_id] = [*shared, *copies]
        cross = self.req_to_cross_blocks.get(parent.request_id)
        if cross is not None:
            self.block_pool.touch(cross)
            self.req_to_cross_blocks[child.request_id] = list(cross)
        if parent.request_id in self.num_cached_blocks:
            self.num_cached_blocks[child.request_id] = min(
                self.num_cached_blocks[parent.request_id], num_full // self.num_groups)
        return [(src.block_id, dst.block_id) for src, dst in zip(partial, copies)]

    def uncache_uncomputed(self, request: Request, num_computed_before: int,
                           encoder_ran: bool) -> None:
        """After a failed step: blocks that step was to fill (from position
        `num_computed_before` on) and, if its encoder ran, the request's cross blocks, leave
        the prefix cache, so no later request reuses K/V that was never written."""
        first = num_computed_before // self.block_size * self.num_groups
        self.block_pool.uncache_blocks(self.req_to_blocks.get(request.request_id, [])[first:])
        if encoder_ran:
            self.block_pool.uncache_blocks(self.req_to_cross_blocks.get(request.request_id, []))
        self.num_cached_blocks.pop(request.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Interleaved by group (see the class docstring)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_group_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """One group's blocks in position order (null blocks as 0)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])[group::self.num_groups]]

    def get_cross_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_cross_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_cache_stats.reset()


def _group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a group's block: group 0 keeps the block hash itself."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")
