"""`SpanReservation`: a bidirectional media run that found too little budget gets it reserved."""

from __future__ import annotations

from vllm.config import InputKind
from vllm.v1.request import Request


class SpanReservation:
    """Keeps a request whose next chunk must hold a whole bidirectional media run (Gemma 3's
    image: S positions computed in one step) from waiting forever behind decodes.

    Running requests take the step's budget first (oldest first), then waiting ones; under
    decode load the budget left may stay below S every step. The first request found in
    that state is recorded (`blocked`); the next step reserves S tokens for it (`take`):
    every other request sees the budget less S until it is scheduled. Reservations are
    made at most every other step, so a decode the reservation leaves out this step runs
    first in the next one (never stalled two steps in a row), and a run that fits only an
    empty step (S = max_num_batched_tokens) is still served. One run is recorded at a time;
    a second starved one is recorded once the first is served.

    Example: budget 8, three requests decoding, C's next chunk a run of 6 positions.
    Step 1: 3 decodes, 5 left < 6: C blocked, recorded. Step 2: 6 reserved for C: two
    decodes (the oldest), then C's 6 (the third decode waits). Step 3: no reservation:
    the three decodes first.
    """

    def __init__(self, max_num_batched_tokens: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.req_id: str | None = None  # the starved request, if any
        self.num_tokens = 0  # its run's positions
        self.reserved_last_step = False

    def blocked(self, request: Request, position: int) -> None:
        """`request`'s chunk from `position` came out empty: if a run starts there (one
        that fits a whole step) and no other request is recorded, records it."""
        span = request.span_at(position)
        if self.req_id is None and 0 < span <= self.max_num_batched_tokens:
            self.req_id, self.num_tokens = request.request_id, span

    def served(self, req_id: str) -> None:
        """A request got tokens scheduled: if it is the recorded one, its run is taken."""
        if req_id == self.req_id:
            self.req_id = None

    def take(self, requests: dict[str, Request], kind: InputKind | None,
             suspect: str | None) -> tuple[str | None, int]:
        """The request to reserve for this step and how many tokens: (None, 0) where none
        is recorded (or it is gone), the last step reserved, or this step cannot schedule
        it (a suspect's step, or a step of the other prompt kind)."""
        req_id = self.req_id
        if req_id is not None and req_id not in requests:
            req_id = self.req_id = None  # finished or aborted meanwhile
        if (req_id is None or self.reserved_last_step or suspect is not None
                or (kind is not None and requests[req_id].prompt_kind is not kind)):
            self.reserved_last_step = False
            return None, 0
        self.reserved_last_step = True
        return req_id, self.num_tokens
