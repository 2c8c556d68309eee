"""Data-parallel routing: which of N engine cores gets a request.

Prefix affinity bounded by load. The API process cannot see the engines' prefix caches,
so it remembers, per engine, the chained hashes of the full prompt blocks it sent there
(a bounded LRU, as large as an engine's KV cache): an engine that prefilled a block
probably still caches it. A request's score on an engine is how many of its leading blocks
that engine has seen. Load is the engine's requests in flight from this server.

    candidates = live engines with load <= min_load + slack,
                 slack = max(MIN_SLACK, ceil(SLACK_FRACTION * min_load))
    winner     = the candidate with the most matched blocks;
                 ties -> the least loaded, then the lowest index

Example (2 engines, slack max(4, 25%)): loads [10, 3], matched [6, 0]: min load 3, slack 4,
so engine 0 (10 > 7) is too busy and engine 1 wins. Loads [6, 3]: both are candidates and
engine 0 wins on its 6 matched blocks. No match anywhere: the least loaded engine.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from vllm.v1.core.kv_cache_utils import block_inputs
from vllm.v1.engine import EngineCoreRequest

# At most this many leading blocks of a prompt are hashed for routing (longer shared
# prefixes all look alike past it, which is fine for choosing an engine).
MAX_ROUTED_BLOCKS = 128
MIN_SLACK = 4
SLACK_FRACTION = 0.25


def prefix_block_hashes(request: EngineCoreRequest, block_size: int,
                        max_blocks: int = MAX_ROUTED_BLOCKS) -> list[int]:
    """Chained hashes of the request's full prompt blocks, as the engine's prefix cache
    would key them: token ids, and for blocks with embedded positions the positions' kinds
    and the bytes of their rows; the chain starts from the cache salt, the encoder input's
    hash and the LoRA adapter (requests with different salts, encoder inputs or adapters
    never share blocks). In-process `hash()`: only this process compares them.

    Example: block_size 4, 10 prompt tokens -> 2 hashes (the last 2 tokens fill no block).
    """
    encoder_hash = request.encoder_input.content_hash if request.encoder_input else None
    lora = request.lora_request
    # Images (rows not computed yet): their content hashes stand for their rows.
    images = tuple((i.offset, i.content_hash) for i in request.mm_inputs or ())
    parent = hash((request.cache_salt, encoder_hash, images,
                   None if lora is None else (lora.lora_int_id, lora.lora_path)))
    num_blocks = min(request.num_prompt_tokens // block_size, max_blocks)
    layout = request.embeds_layout
    ids = request.prompt_token_ids
    if ids is None:  # an embeds-only prompt: its positions hold placeholders
        ids = [0] * request.num_prompt_tokens
    hashes = []
    for k in range(num_blocks):
        block_ids, rows, mask = block_inputs(ids, request.prompt_embeds, layout,
                                             k * block_size, (k + 1) * block_size)
        block: object = tuple(block_ids)
        if rows is not None:
            assert mask is not None  # rows come with their positions
            block = (block, mask.tobytes(), _row_bytes(rows))
        parent = hash((parent, block))
        hashes.append(parent)
    return hashes


def _row_bytes(embeds: torch.Tensor) -> bytes:
    """The raw bytes of embeds rows (any dtype, bfloat16 included)."""
    flat = embeds.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


class PrefixAffinityRouter:
    """Chooses an engine for each request and remembers which prefixes went where.

    Args:
        num_engines: engine cores behind this server.
        capacity_blocks: block hashes remembered per engine (its KV cache's block count:
            it cannot cache more); the least recently routed are forgotten first.
    """

    def __init__(self, num_engines: int, capacity_blocks: int,
                 min_slack: int = MIN_SLACK, slack_fraction: float = SLACK_FRACTION) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self.min_slack = min_slack
        self.slack_fraction = slack_fraction
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]

    def matched_blocks(self, engine: int, hashes: list[int]) -> int:
        """Leading blocks of `hashes` routed to `engine` before (and not yet forgotten)."""
        seen = self._seen[engine]
        for k, block_hash in enumerate(hashes):
            if block_hash not in seen:
                return k
        return len(hashes)

    def choose(self, hashes: list[int], loads: list[int], alive: list[bool]) -> int:
        """The engine for a request with these prefix hashes, given each engine's load
        (requests in flight) and liveness; raises ValueError if none is alive."""
        live = [e for e in range(len(loads)) if alive[e]]
        if not live:
            raise ValueError("No engine core is alive.")
        min_load = min(loads[e] for e in live)
        slack = max(self.min_slack, math.ceil(self.slack_fraction * min_load))
        candidates = [e for e in live if loads[e] <= min_load + slack]
        return min(candidates,
                   key=lambda e: (-self.matched_blocks(e, hashes), loads[e], e))

    def record(self, engine: int, hashes: list[int]) -> None:
        """`engine` got a request with these prefix hashes: they become its most recent."""
        seen = self._seen[engine]
        for block_hash in hashes:
            seen[block_hash] = None
            seen.move_to_end(block_hash)
        while len(seen) > self.capacity_blocks:
            seen.popitem(last=False)

    def forget(self, engine: int | None = None) -> None:
        """Drops what `engine` (None: every engine) was sent: it died or reset its cache."""
        for index, seen in enumerate(self._seen):
            if engine is None or index == engine:
                seen.clear()
