"""The engine core's image stage: before a request with images reaches the scheduler, its
placeholder runs get their rows from the vision encoder (run on the workers), through an
encoder cache keyed by each image's content hash. After this stage the request is a mixed
token/embeds prompt like any other (`prompt_token_ids` + `prompt_is_token_ids` +
`prompt_embeds`): the scheduler, KV cache, prefix cache (which hashes rows by their bytes) and
graphs see nothing new, and a preempted request keeps its rows (no encoder rerun).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from vllm.v1.messages import EngineCoreRequest, ImageInput

# Default budget of the encoder cache (bytes of encoder output rows kept).
ENCODER_CACHE_BYTES = 256 * 1024**2


class ImageRows:
    """Fills image requests' rows; owns the encoder cache (LRU over content hashes, bounded
    by bytes; an output larger than the whole budget is used once and not kept).

    Args:
        embed_images: pixel values [n, 3, H, W] -> rows [n, num_tokens, hidden] (the
            executor's `embed_images`: every worker runs the tower, rank 0's rows come back).
    """

    def __init__(self, embed_images: Callable[[torch.Tensor], torch.Tensor],
                 budget_bytes: int = ENCODER_CACHE_BYTES) -> None:
        self.embed_images = embed_images
        self.budget_bytes = budget_bytes
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.cached_bytes = 0
        self.hits = 0
        self.misses = 0

    def fill(self, request: EngineCoreRequest) -> None:
        """Sets `request.prompt_embeds` to its images' rows in prompt order and drops the
        pixels (`mm_inputs`)."""
        images = request.mm_inputs
        assert images  # only requests with images come here
        rows = self._rows(images)
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
        if missing:
            self.misses += len(missing)
            pixels = torch.stack([image.pixel_values for image in missing.values()
                                  if image.pixel_values is not None])
            out = self.embed_images(pixels)
            for i, (key, image) in enumerate(missing.items()):
                if out[i].shape[0] != image.num_tokens:
                    raise RuntimeError(f"The vision encoder gave {out[i].shape[0]} rows for "
                                       f"an image of {image.num_tokens} positions.")
                rows[key] = out[i].clone()
                self._insert(key, rows[key])
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
