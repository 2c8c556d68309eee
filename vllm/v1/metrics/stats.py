"""Per-iteration serving stats computed in the API process from engine-core outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.messages import EngineCoreOutputs


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float  # seconds from arrival to the last output
    num_prompt_tokens: int
    num_generation_tokens: int
    engine_index: int = 0  # the data-parallel engine core that served it


@dataclass(slots=True)
class IterationStats:
    """What one batch of engine-core outputs added: token counts and latencies (seconds).
    Token counts and latencies are of the engine that sent the outputs; each finished
    request names its own engine (requests ended here may come from several)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(slots=True)
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    engine_index: int
    num_generation_tokens: int = 0
    last_token_time: float | None = None


class RequestStatsTracker:
    """Remembers arrival and last-token times of live engine-core requests.

    Timestamps are `time.monotonic()` (the same clock as `EngineCoreRequest.arrival_time`).
    Tokens of requests no longer tracked (aborted here, still finishing a step in the core)
    still count as generated: the engine did that work.
    """

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}

    def add(self, request_id: str, arrival_time: float, num_prompt_tokens: int,
            engine_index: int = 0) -> None:
        self._requests[request_id] = _RequestTimes(arrival_time, num_prompt_tokens,
                                                   engine_index)

    def update(self, outputs: EngineCoreOutputs, now: float) -> IterationStats:
        stats = IterationStats()
        for out in outputs.outputs:
            stats.num_generation_tokens += len(out.new_token_ids)
            times = self._requests.get(out.request_id)
            if times is None:
                continue
            if out.new_token_ids:
                if times.last_token_time is None:
                    stats.num_prompt_tokens += times.num_prompt_tokens
                    stats.time_to_first_tokens.append(now - times.arrival_time)
                else:
                    stats.inter_token_latencies.append(now - times.last_token_time)
                times.last_token_time = now
                times.num_generation_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                stats.finished_requests.append(self._finish(out.request_id, str(out.finish_reason),
                                                            now))
        return stats

    def end(self, request_ids: list[str], reason: str, now: float) -> IterationStats:
        """Stats for requests ended in the API process: "abort" (client gone, user abort),
        "stop" (a stop string matched) or "error" (their engine core died)."""
        stats = IterationStats()
        for request_id in request_ids:
            if request_id in self._requests:
                stats.finished_requests.append(self._finish(request_id, reason, now))
        return stats

    def _finish(self, request_id: str, reason: str, now: float) -> FinishedRequestStats:
        times = self._requests.pop(request_id)
        return FinishedRequestStats(reason, now - times.arrival_time, times.num_prompt_tokens,
                                    times.num_generation_tokens, times.engine_index)
