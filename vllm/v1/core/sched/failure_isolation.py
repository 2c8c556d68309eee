"""`FailureIsolation`: whom a failed step blames, and the suspects run alone until cleared."""

from __future__ import annotations

from vllm.v1.request import Request

# Failures in a row, of lone requests or of batches that no lone run explains, after which
# the engine stops trusting itself.
MAX_CONSECUTIVE_FAILURES = 3


class EngineStepError(RuntimeError):
    """A step failed in a way no single request explains: the engine cannot go on."""


class FailureIsolation:
    """Decides whom a step whose execution raised is blamed on.

    A step of one request convicts it. The requests of a failed batch become suspects:
    each is then scheduled alone (`next_suspect`, oldest suspicion first) until it samples
    a token (`cleared`) or fails alone (convicted). Failures that repeat end the engine.

    Owns only the suspects' ids and the counts of failures in a row; the scheduler undoes
    the step and ends or requeues the requests.

    Example: batch [a, b, c] fails -> suspects [a, b, c]; a runs alone and samples ->
    suspects [b, c]; b fails alone -> `blame(["b"])` returns "b", suspects [c].
    """

    def __init__(self) -> None:
        self.suspects: list[str] = []  # in the order they came under suspicion
        self.lone_failures = 0  # lone requests failed in a row
        self.unexplained_failures = 0  # batches failed since the last batch that ran

    def step_ran(self, num_scheduled: int) -> None:
        """A step of `num_scheduled` requests executed: no lone request failed in a row,
        and a batch that ran ends the run of unexplained batch failures."""
        self.lone_failures = 0
        if num_scheduled > 1:
            self.unexplained_failures = 0

    def cleared(self, req_id: str) -> None:
        """`req_id` sampled a token (or was convicted): it is no longer a suspect."""
        if req_id in self.suspects:
            self.suspects.remove(req_id)

    def next_suspect(self, requests: dict[str, Request]) -> str | None:
        """The suspect to run alone this step, dropping those that finished meanwhile
        (`requests`: the scheduler's live requests, read only)."""
        while self.suspects:
            request = requests.get(self.suspects[0])
            if request is not None and not request.is_finished():
                return request.request_id
            self.suspects.pop(0)
        return None

    def blame(self, req_ids: list[str]) -> str | None:
        """Counts a failed step of the requests `req_ids` (in scheduling order).

        Returns:
            The lone request to convict, or None for a batch: its requests are now
            suspects (the caller sends them back to waiting).

        Raises:
            EngineStepError: no request was scheduled, or the failure repeats:
                MAX_CONSECUTIVE_FAILURES lone requests failing in a row, or as many failed
                batches with no batch running in between.
        """
        if not req_ids:
            raise EngineStepError("A step with no scheduled request failed.")
        if len(req_ids) == 1:
            self.lone_failures += 1
            self.unexplained_failures = 0
            if self.lone_failures >= MAX_CONSECUTIVE_FAILURES:
                raise EngineStepError(f"{self.lone_failures} requests in a row failed alone.")
            self.cleared(req_ids[0])
            return req_ids[0]
        self.unexplained_failures += 1
        if self.unexplained_failures >= MAX_CONSECUTIVE_FAILURES:
            raise EngineStepError(f"{self.unexplained_failures} batches failed in a row, "
                                  "yet no request fails alone.")
        self.suspects += [r for r in req_ids if r not in self.suspects]
        return None
