"""The media stage: a request with images or audio waits here until the scheduler picks it
within its per-step encoder budget; then its placeholder runs get their rows from the model's
encoder (the vision tower, or the audio tower; run on the workers, one batch per modality for
the requests picked in that step), through an encoder cache keyed by each item's content hash
(or, for image embeddings, from the user). After this stage the request is a mixed
token/embeds prompt like any other (`prompt_token_ids` + `prompt_is_token_ids` +
`prompt_embeds`): the scheduler, KV cache, prefix cache (which hashes rows by their bytes)
and graphs see nothing new; chunks and preemptions reuse the rows (no encoder rerun).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from vllm.v1.messages import EngineCoreRequest, MediaInput

logger = logging.getLogger(__name__)

# Default budget of the encoder cache (bytes of encoder output rows kept).
ENCODER_CACHE_BYTES = 256 * 1024**2
# Most items in one encoder call (bounds its activations).
MAX_ENCODER_BATCH = 32


class MediaRows:
    """Fills media requests' rows; owns the requests waiting for them and the encoder cache
    (LRU over content hashes, bounded by bytes; an output larger than the whole budget is
    used once and not kept).

    Requests wait here (`admit`) until the scheduler picks those that fit its step's encoder
    budget (`encoder_cost`, `take`); the encoder then runs once per modality for all their
    missing items (at most `max_batch` per call), so the tower sees a batch, not one
    request at a time.

    Args:
        embed: (modality, each item's `data`) -> each item's rows [num_tokens, hidden] (the
            executor's `embed_media`: every worker runs the tower, rank 0's rows come back).
    """

    def __init__(self, embed: Callable[[str, list[torch.Tensor]], list[torch.Tensor]],
                 budget_bytes: int = ENCODER_CACHE_BYTES,
                 max_batch: int = MAX_ENCODER_BATCH) -> None:
        self.embed = embed
        self.budget_bytes = budget_bytes
        self.max_batch = max_batch
        self.pending: list[EngineCoreRequest] = []
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.cached_bytes = 0
        self.hits = 0
        self.misses = 0

    def admit(self, request: EngineCoreRequest) -> None:
        """Holds a request with media until the scheduler picks it (`take`)."""
        self.pending.append(request)

    def holds(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in self.pending)

    def drop(self, request_ids: list[str]) -> None:
        """Forgets pending requests (aborted before their rows were computed)."""
        gone = set(request_ids)
        self.pending = [r for r in self.pending if r.request_id not in gone]

    def encoder_cost(self, request: EngineCoreRequest, seen: set[bytes]) -> int:
        """Encoder input tokens `request` adds to a step whose other items are `seen`
        (content hashes, updated here): its items neither cached nor already in the step.
        A cache hit, a repeat and user-given embeddings cost nothing.

        Example: items A (576 positions, cached), B (576) and B again, with `seen` = {}:
        576, and `seen` becomes {A, B}; a second request of A and B then costs 0."""
        cost = 0
        for item in request.mm_inputs or ():
            key = item.content_hash
            if key in seen:
                continue
            seen.add(key)
            if item.embeds is None and key not in self._cache:
                cost += item.num_tokens
        return cost

    def take(self, requests: list[EngineCoreRequest]
             ) -> tuple[list[EngineCoreRequest], list[EngineCoreRequest]]:
        """Fills `requests` (pending ones, in one encoder batch per modality) and stops
        holding them; returns (filled, failed). When the batch fails, each request is
        tried alone, so only the one whose item breaks the encoder fails."""
        taken = {id(r) for r in requests}
        self.pending = [r for r in self.pending if id(r) not in taken]
        try:
            self.fill(requests)
            return requests, []
        except Exception:
            logger.exception("The media encoder failed on a batch of %d request(s).",
                             len(requests))
        if len(requests) == 1:
            return [], requests
        filled, failed = [], []
        for request in requests:
            try:
                self.fill([request])
                filled.append(request)
            except Exception:
                failed.append(request)
        return filled, failed

    def fill(self, requests: list[EngineCoreRequest]) -> None:
        """Sets each request's `prompt_embeds` to its items' rows in prompt order and drops
        the inputs (`mm_inputs`); the encoder runs once for the items none of them has
        cached. Nothing is set if it raises."""
        rows = self._rows([item for request in requests for item in request.mm_inputs or ()])
        for request in requests:
            items = request.mm_inputs
            assert items  # only requests with media come here
            request.prompt_embeds = torch.cat([rows[item.content_hash] for item in items])
            request.mm_inputs = None

    def _rows(self, items: list[MediaInput]) -> dict[bytes, torch.Tensor]:
        """Each distinct item's rows [num_tokens, hidden]: from the cache, else from one
        encoder call per modality (and `max_batch` items) for the missing ones."""
        rows: dict[bytes, torch.Tensor] = {}
        missing: dict[str, dict[bytes, MediaInput]] = {}  # modality -> key -> item
        for item in items:
            key = item.content_hash
            if key in rows or any(key in group for group in missing.values()):
                continue
            if item.embeds is not None:  # precomputed by the user: no encoder, no cache
                rows[key] = item.embeds
                continue
            cached = self._cache.get(key)
            if cached is None:
                missing.setdefault(item.modality, {})[key] = item
                continue
            self._cache.move_to_end(key)
            self.hits += 1
            rows[key] = cached
        for modality, group in missing.items():
            todo = list(group.items())
            for start in range(0, len(todo), self.max_batch):
                self._encode(modality, todo[start:start + self.max_batch], rows)
        return rows

    def _encode(self, modality: str, batch: list[tuple[bytes, MediaInput]],
                rows: dict[bytes, torch.Tensor]) -> None:
        """One encoder call: the batch's rows into `rows` and the cache."""
        data = [item.data for _, item in batch if item.data is not None]
        out = self.embed(modality, data)
        if len(out) != len(batch):
            raise RuntimeError(f"The {modality} encoder gave rows for {len(out)} items of "
                               f"{len(batch)}.")
        for (key, item), item_rows in zip(batch, out, strict=True):
            if item_rows.shape[0] != item.num_tokens:
                raise RuntimeError(f"The {modality} encoder gave {item_rows.shape[0]} rows "
                                   f"for an item of {item.num_tokens} positions.")
            rows[key] = item_rows.clone()
            self._insert(key, rows[key])
        self.misses += len(batch)

    def _insert(self, key: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.budget_bytes:
            return
        while self.cached_bytes + size > self.budget_bytes:
            _, old = self._cache.popitem(last=False)
            self.cached_bytes -= old.numel() * old.element_size()
        self._cache[key] = rows
        self.cached_bytes += size

    def stats(self) -> dict[str, int]:
        return {"encoder_cache_hits": self.hits, "encoder_cache_misses": self.misses,
                "encoder_cache_entries": len(self._cache),
                "encoder_cache_bytes": self.cached_bytes}
