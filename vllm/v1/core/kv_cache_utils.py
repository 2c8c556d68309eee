"""KV cache blocks, the free-block queue and chained block hashing for prefix caching."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.v1.messages import EmbedsLayout
    from vllm.v1.request import Request

BlockHash = bytes


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of the paged KV cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix cache
    # Links of the free queue; None when the block is not in it (or at an end).
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, in eviction order (head evicted first).

    Removing a block from the middle is O(1): a prefix hit on a free cached block takes it
    back out of the queue without a scan.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("No free blocks available.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def extend(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


def hash_block(parent: BlockHash | None, token_ids: list[int],
               embeds_rows: torch.Tensor | None = None,
               is_token: np.ndarray | None = None,
               mrope_positions: np.ndarray | None = None) -> BlockHash:
    """Hash of one full block, chained to its parent's hash.

    A block of real tokens is hashed by its ids. A block with positions from prompt embeds
    is hashed by its per-position kinds (`is_token`; None: the rows come first, then the
    tokens), the bytes of its rows (already in the model dtype) and the ids of its token
    positions, so two blocks agree only if they agree position by position. The leading
    tag keeps token blocks and embeds blocks from ever colliding. An M-RoPE request's
    block also hashes its rotary positions (`mrope_block_positions`): they follow each
    image's grid, which the rows alone do not fix (the same image_embeds with another grid
    put the same rows, and the text after them, at other positions).
    """
    h = hashlib.sha256(parent or b"")
    if mrope_positions is not None:
        h.update(b"R" + np.ascontiguousarray(mrope_positions, dtype=np.int64).tobytes())
    if embeds_rows is not None:
        if is_token is None:
            is_token = np.arange(len(embeds_rows) + len(token_ids)) >= len(embeds_rows)
        h.update(b"E")
        h.update(np.packbits(is_token).tobytes() + len(is_token).to_bytes(4, "little"))
        h.update(embeds_rows.contiguous().view(torch.uint8).numpy().tobytes())
    else:
        h.update(b"T")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def block_inputs(token_ids: list[int], embeds: torch.Tensor | None,
                 layout: EmbedsLayout | None, start: int, end: int
                 ) -> tuple[list[int], torch.Tensor | None, np.ndarray | None]:
    """The inputs of positions [start, end) as `hash_block` takes them: the ids of the
    token positions, and (if any position reads embeds) the rows and the block's is_token.

    Example: is_token [T, F, F, T] + one generated token, ids [5, 0, 0, 7, 9], block [2, 5)
    -> ids [7, 9], rows embeds[1:2], is_token [F, T, T].
    """
    if layout is None or start >= len(layout.is_token):
        return token_ids[start:end], None, None
    mask = layout.block_mask(start, end)
    if mask.all():
        return token_ids[start:end], None, None
    assert embeds is not None  # a layout comes with rows
    first, last = layout.rows(start, end)
    ids = [t for t, real in zip(token_ids[start:end], mask.tolist(), strict=True) if real]
    return ids, embeds[first:last], mask


def mrope_block_positions(table: torch.Tensor, delta: int, start: int, end: int
                          ) -> np.ndarray | None:
    """[3, end - start] int64 M-RoPE positions of the block [start, end) of a request whose
    prompt's table is `table` ([3, num_prompt_tokens]): a prompt position's column, a later
    position p at p + delta in all three rows (`mrope_delta(table)`, as the runner's
    `mrope_step_positions`). None where every position p is at p in all three rows (text
    before the first image): such a block is any prompt's block.

    Example: t [0 1 2 2 2 2 2 2 5], h [0 1 2 2 2 3 3 3 5], w [0 1 2 3 4 2 3 4 5] (delta
    -3), block [6, 10) -> t [2 2 5 6], h [3 3 5 6], w [3 4 5 6]; block [0, 2) -> None.
    """
    plain = np.arange(start, end, dtype=np.int64)
    num_prompt = table.shape[1]
    out = np.repeat(plain[None] + delta, 3, axis=0)
    prompt_end = min(end, num_prompt)
    if start < prompt_end:
        out[:, :prompt_end - start] = table[:, start:prompt_end].numpy()
    return None if (out == plain).all() else out


def cross_block_hashes(encoder_hash: bytes, num_blocks: int) -> list[BlockHash]:
    """Hashes of the cross-attention blocks of one encoder input: block i holds K/V rows
    [i * block_size, (i + 1) * block_size) of that input's encoder output. The tag keeps
    them apart from self-attention blocks, whose chains start from the same `encoder_hash`.
    """
    return [hashlib.sha256(b"X" + encoder_hash + i.to_bytes(4, "little")).digest()
            for i in range(num_blocks)]


def chain_start(request: Request) -> BlockHash | None:
    """The parent of a request's first block: the encoder input's hash (encoder/decoder
    models), the cache salt and the LoRA adapter (its id, path and files' fingerprint: K/V
    computed through one adapter is never another's, nor that of the same adapter's files
    rewritten and read again), or None for an unsalted base-model decoder request."""
    parent = request.encoder_input.content_hash if request.encoder_input is not None else None
    if request.cache_salt is not None:
        salt = request.cache_salt.encode()
        parent = hashlib.sha256(b"S" + len(salt).to_bytes(8, "little") + salt
                                + (parent or b"")).digest()
    lora = request.lora_request
    if lora is not None:
        path = lora.lora_path.encode()
        parent = hashlib.sha256(b"L" + lora.lora_int_id.to_bytes(8, "little")
                                + len(path).to_bytes(8, "little") + path
                                + len(request.lora_fingerprint).to_bytes(1, "little")
                                + request.lora_fingerprint + (parent or b"")).digest()
    return parent


def make_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """Returns a function giving the hashes of a request's not yet hashed full blocks.

    For encoder/decoder models the chain starts from the encoder input's hash, so that the
    same decoder prompt over two different encoder inputs never shares KV. A request's
    `cache_salt` is mixed into the chain's start, hence into every block hash: requests with
    different salts never share a block (nor can time each other's prefix hits).
    """

    def hasher(request: Request) -> list[BlockHash]:
        start_block = len(request.block_hashes)
        num_full_blocks = request.num_tokens // block_size
        if request.block_hashes:
            parent = request.block_hashes[-1]
        else:
            parent = chain_start(request)
        new_hashes = []
        for i in range(start_block, num_full_blocks):
            ids, rows, mask = block_inputs(request.all_token_ids, request.prompt_embeds,
                                           request.embeds_layout, i * block_size,
                                           (i + 1) * block_size)
            positions = (None if request.mrope_positions is None else
                         mrope_block_positions(request.mrope_positions, request.mrope_delta,
                                               i * block_size, (i + 1) * block_size))
            parent = hash_block(parent, ids, rows, mask, positions)
            new_hashes.append(parent)
        return new_hashes

    return hasher
