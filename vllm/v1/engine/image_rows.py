"""The engine core's image stage: before a request with images reaches the scheduler, its
placeholder runs get their rows from the vision encoder (run on the workers, one batch for
the requests that arrived since the last step), through an encoder cache keyed by each
image's content hash (or, for image embeddings, from the user). After this stage the
request is a mixed token/embeds prompt like any other (`prompt_token_ids` +
`prompt_is_token_ids` + `prompt_embeds`): the scheduler, KV cache, prefix cache (which hashes
rows by their bytes) and graphs see nothing new, and a preempted request keeps its rows (no
encoder rerun).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from vllm.v1.messages import EngineCoreRequest, ImageInput

logger = logging.getLogger(__name__)

# Default budget of the encoder cache (bytes of encoder output rows kept).
ENCODER_CACHE_BYTES = 256 * 1024**2
# Most images in one vision encoder call (bounds its activations).
MAX_ENCODER_BATCH = 32


class ImageRows:
    """Fills image requests' rows; owns the requests waiting for them and the encoder cache
    (LRU over content hashes, bounded by bytes; an output larger than the whole budget is
    used once and not kept).

    Requests that arrive between two engine steps wait here (`admit`); at the next step
    `fill_pending` runs the vision encoder once for all their missing images (at most
    `max_batch` per call), so the tower sees a batch, not one request at a time.

    Args:
        embed_images: pixel values [n, 3, H, W] -> rows [n, num_tokens, hidden] (the
            executor's `embed_images`: every worker runs the tower, rank 0's rows come back).
    """

    def __init__(self, embed_images: Callable[[torch.Tensor], torch.Tensor],
                 budget_bytes: int = ENCODER_CACHE_BYTES,
                 max_batch: int = MAX_ENCODER_BATCH) -> None:
        self.embed_images = embed_images
        self.budget_bytes = budget_bytes
        self.max_batch = max_batch
        self.pending: list[EngineCoreRequest] = []
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.cached_bytes = 0
        self.hits = 0
        self.misses = 0

    def admit(self, request: EngineCoreRequest) -> None:
        """Holds a request with images until the next `fill_pending`."""
        self.pending.append(request)

    def drop(self, request_ids: list[str]) -> None:
        """Forgets pending requests (aborted before their rows were computed)."""
        gone = set(request_ids)
        self.pending = [r for r in self.pending if r.request_id not in gone]

    def fill_pending(self) -> tuple[list[EngineCoreRequest], list[EngineCoreRequest]]:
        """Fills every pending request; returns (filled, failed). When the batch fails,
        each request is tried alone, so only the one whose image breaks the encoder fails."""
        requests, self.pending = self.pending, []
        try:
            self.fill(requests)
            return requests, []
        except Exception:
            logger.exception("The vision encoder failed on a batch of %d request(s).",
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
        """Sets each request's `prompt_embeds` to its images' rows in prompt order and drops
        the pixels (`mm_inputs`); the encoder runs once for the images none of them has
        cached. Nothing is set if it raises."""
        rows = self._rows([image for request in requests for image in request.mm_inputs or ()])
        for request in requests:
            images = request.mm_inputs
            assert images  # only requests with images come here
            request.prompt_embeds = torch.cat([rows[image.content_hash] for image in images])
            request.mm_inputs = None

    def _rows(self, images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Each distinct image's rows [num_tokens, hidden]: from the cache, else from one
        encoder call for all the missing ones."""
        rows: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, ImageInput] = {}
        for image in images:
            key = image.content_hash
            if key in rows or key in missing:
                continue
            if image.embeds is not None:  # precomputed by the user: no encoder, no cache
                rows[key] = image.embeds
                continue
            cached = self._cache.get(key)
            if cached is None:
                missing[key] = image
                continue
            self._cache.move_to_end(key)
            self.hits += 1
            rows[key] = cached
        todo = list(missing.items())
        for start in range(0, len(todo), self.max_batch):
            batch = todo[start:start + self.max_batch]
            pixels = torch.stack([image.pixel_values for _, image in batch
                                  if image.pixel_values is not None])
            out = self.embed_images(pixels)
            for i, (key, image) in enumerate(batch):
                if out[i].shape[0] != image.num_tokens:
                    raise RuntimeError(f"The vision encoder gave {out[i].shape[0]} rows for "
                                       f"an image of {image.num_tokens} positions.")
                rows[key] = out[i].clone()
                self._insert(key, rows[key])
            self.misses += len(batch)
        return rows

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
