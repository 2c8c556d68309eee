"""The server-wide cap on decoded `prompt_embeds` bytes held by requests in flight (the
decoding itself is `vllm.entrypoints.embeds_codec`)."""

from __future__ import annotations


class EmbedsBytesInFlight:
    """The bytes of `prompt_embeds` that requests in flight hold, under a server-wide cap.

    A request reserves its bytes before decoding and gives them back when it ends (its
    response sent, its stream closed, or its client gone), so memory stays bounded however
    many embeds requests arrive at once; a request that does not fit now is refused with a
    503 and Retry-After rather than queued.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def reserve(self, num_bytes: int) -> EmbedsLease | None:
        """A lease on `num_bytes`, or None when they do not fit now."""
        if self.used + num_bytes > self.limit:
            return None
        self.used += num_bytes
        return EmbedsLease(self, num_bytes)


class EmbedsLease:
    def __init__(self, pool: EmbedsBytesInFlight, num_bytes: int) -> None:
        self.pool = pool
        self.num_bytes = num_bytes

    def grow(self, num_bytes: int) -> bool:
        """Takes `num_bytes` more (decoding found the tensor larger); False if over cap."""
        if self.pool.used + num_bytes > self.pool.limit:
            return False
        self.pool.used += num_bytes
        self.num_bytes += num_bytes
        return True

    def release(self) -> None:
        """Gives the bytes back; later calls do nothing."""
        self.pool.used -= self.num_bytes
        self.num_bytes = 0
