"""KV cache groups: which attention layers share a block table, and what a window drops.

A model whose layers all attend to every earlier token has one group. Sliding-window layers
(Mistral, and Gemma 2/3 interleaving window and global layers) see only the last `window`
positions, so the blocks before that can go back to the pool as a request decodes; layers
of different kinds therefore keep separate block lists (vLLM's hybrid KV cache idea).

Every group holds the same number of layers (`group_size`), and layer j of each group uses
the same KV cache tensor ("slot" j): a block id names a block of every slot tensor, and
belongs to one group at a time. One block pool then serves all groups, and a block costs
`group_size` layers of K/V whatever its group.

    Gemma 2, 4 layers [window, full, window, full] -> group_size 2:
        group 0 (full)   layers (1, 3)   slots (0, 1)
        group 1 (window) layers (0, 2)   slots (0, 1)
    26 layers, 4 full and 22 window (Gemma 3 1B) -> group_size 4: one full group and six
    window groups (the last holds 2 layers), 7 block ids per 16 positions early on.

A request's blocks are one flat list, interleaved by group: logical block i (positions
[i * block_size, (i + 1) * block_size)) of group g sits at index i * num_groups + g. Every
group covers the same positions, so the flat list grows by `num_groups` ids per logical
block; a window group's blocks that fall out of the window become the null block.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    layer_indices: tuple[int, ...]  # attention layers whose K/V its blocks hold
    sliding_window: int | None  # positions a query sees, itself included; None: all


def make_kv_cache_groups(windows: list[int | None]) -> list[KVCacheGroupSpec]:
    """Groups of `group_size` layers (the fewest layers of one window kind), full
    attention first, each kind's layers in order. One kind: a single group of every layer.
    """
    if not windows:
        return [KVCacheGroupSpec((), None)]
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        return [KVCacheGroupSpec(tuple(range(len(windows))), windows[0])]
    group_size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full attention first
    return [KVCacheGroupSpec(tuple(kinds[w][i:i + group_size]), w)
            for w in order for i in range(0, len(kinds[w]), group_size)]


def group_size(groups: list[KVCacheGroupSpec]) -> int:
    """Layers per group: the KV cache tensors a block id indexes."""
    return max(len(g.layer_indices) for g in groups)


def layer_slots(groups: list[KVCacheGroupSpec]) -> dict[int, tuple[int, int]]:
    """layer -> (its group, its KV cache tensor)."""
    return {layer: (g, slot) for g, group in enumerate(groups)
            for slot, layer in enumerate(group.layer_indices)}


def window_start_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first logical block a step starting at position `num_computed` still reads.

    A query at position p sees keys (p - window, p]; the step's first query is at
    `num_computed`, so blocks wholly before position num_computed - window + 1 are out.
    e.g. window 5, block size 4, num_computed 10: keys from position 6 on -> block 1;
    blocks [0, 1) can be freed.
    """
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def blocks_needed(num_tokens: int, groups: list[KVCacheGroupSpec], block_size: int,
                  max_step_tokens: int) -> int:
    """Blocks one request of `num_tokens` tokens holds at most, over all groups. A window
    group holds the blocks from its window's start to the step's last token: a step of up
    to `max_step_tokens` tokens after `window - 1` earlier keys.
    e.g. window 5, block size 4, one-token steps: at most (4 + 1 - 1) // 4 + 2 = 3 blocks.
    """
    total_blocks = -(-num_tokens // block_size)
    need = 0
    for group in groups:
        window = group.sliding_window
        need += total_blocks if window is None else min(
            total_blocks, (window - 1 + max_step_tokens - 1) // block_size + 2)
    return need
