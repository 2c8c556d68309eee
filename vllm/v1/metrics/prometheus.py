"""`PrometheusStatLogger`: serving metrics with vLLM's names, in a registry of its own."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm.v1.messages import SchedulerStats
from vllm.v1.metrics.stats import IterationStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
AUDIO_ENDPOINTS = ("transcriptions", "translations")


class _EngineMetrics:
    """One engine core's series of every engine metric (label `engine`, as vLLM's)."""

    def __init__(self, families: dict[str, Any], model_name: str, engine: int) -> None:
        label = (model_name, str(engine))
        self.running = families["running"].labels(*label)
        self.waiting = families["waiting"].labels(*label)
        self.kv_usage = families["kv_usage"].labels(*label)
        self.hit_rate = families["hit_rate"].labels(*label)
        self.prefix_queries = families["prefix_queries"].labels(*label)
        self.prefix_hits = families["prefix_hits"].labels(*label)
        self.preemptions = families["preemptions"].labels(*label)
        self.prompt_tokens = families["prompt_tokens"].labels(*label)
        self.generation_tokens = families["generation_tokens"].labels(*label)
        self.success = {r: families["success"].labels(*label, r) for r in FINISH_REASONS}
        self.ttft = families["ttft"].labels(*label)
        self.itl = families["itl"].labels(*label)
        self.e2e = families["e2e"].labels(*label)
        self.spec_drafts = families["spec_drafts"].labels(*label)
        self.spec_draft_tokens = families["spec_draft_tokens"].labels(*label)
        self.spec_accepted = families["spec_accepted"].labels(*label)
        self.spec_accepted_per_pos = [families["spec_accepted_per_pos"], label]
        # The core reports preemptions as a running total; the hit rate is since start.
        self.queries = self.hits = self.num_preemptions = 0


class PrometheusStatLogger:
    """Turns scheduler snapshots and iteration stats into Prometheus metrics.

    Every metric carries a `model_name` label; those of the engine cores also an `engine`
    label (the data-parallel index, "0" with one engine), so per-engine values sum to the
    server's totals. `render()` gives the text exposition format.
    """

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        reg, names = self.registry, ["model_name", "engine"]
        families: dict[str, Any] = {
            "running": Gauge("vllm:num_requests_running", "Requests in the running batch.",
                             names, registry=reg),
            "waiting": Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                             names, registry=reg),
            "kv_usage": Gauge("vllm:kv_cache_usage_perc",
                              "Fraction of KV cache blocks in use (1 = full).",
                              names, registry=reg),
            "hit_rate": Gauge("vllm:prefix_cache_hit_rate",
                              "Prefix-cache hits / queries, in tokens, since start.",
                              names, registry=reg),
            "prefix_queries": Counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.",
                                      names, registry=reg),
            "prefix_hits": Counter("vllm:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.",
                                   names, registry=reg),
            "preemptions": Counter("vllm:num_preemptions", "Requests preempted.",
                                   names, registry=reg),
            "prompt_tokens": Counter("vllm:prompt_tokens", "Prefilled prompt tokens.",
                                     names, registry=reg),
            "generation_tokens": Counter("vllm:generation_tokens", "Generated tokens.",
                                         names, registry=reg),
            "success": Counter("vllm:request_success", "Finished requests, by finish reason.",
                               [*names, "finished_reason"], registry=reg),
            "ttft": Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              names, buckets=_TTFT_BUCKETS, registry=reg),
            "itl": Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                             names, buckets=_ITL_BUCKETS, registry=reg),
            "e2e": Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.",
                             names, buckets=_E2E_BUCKETS, registry=reg),
            # Speculative decoding (prometheus_client adds the `_total` suffix).
            "spec_drafts": Counter("vllm:spec_decode_num_drafts",
                                   "Verifications of drafted tokens (a request's in a step).",
                                   names, registry=reg),
            "spec_draft_tokens": Counter("vllm:spec_decode_num_draft_tokens",
                                         "Drafted tokens verified.", names, registry=reg),
            "spec_accepted": Counter("vllm:spec_decode_num_accepted_tokens",
                                     "Drafted tokens accepted.", names, registry=reg),
            "spec_accepted_per_pos": Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Drafted tokens accepted, by draft position.",
                                             [*names, "position"], registry=reg),
        }
        self.engines = [_EngineMetrics(families, model_name, i) for i in range(num_engines)]
        self._add_audio_metrics(model_name)

    def _add_audio_metrics(self, model_name: str) -> None:
        """Per HTTP request of the audio endpoints; each 30 s window is also an engine
        request, counted (and its time to first token observed) by the metrics above."""
        reg = self.registry
        requests = Counter("vllm:audio_requests", "Audio endpoint requests, by endpoint and "
                           "outcome (success, error).", ["model_name", "endpoint", "status"],
                           registry=reg)
        self.audio_requests = {(e, s): requests.labels(model_name, e, s)
                               for e in AUDIO_ENDPOINTS for s in ("success", "error")}
        self.audio_seconds = Counter("vllm:audio_seconds_processed",
                                     "Seconds of audio transcribed or translated.",
                                     ["model_name"], registry=reg).labels(model_name)
        self.audio_latency = Histogram("vllm:audio_request_latency_seconds",
                                       "Audio requests, arrival to last byte of the answer.",
                                       ["model_name"], buckets=_E2E_BUCKETS,
                                       registry=reg).labels(model_name)

    def record_audio_request(self, endpoint: str, ok: bool, audio_seconds: float,
                             latency: float) -> None:
        self.audio_requests[endpoint, "success" if ok else "error"].inc()
        if ok:
            self.audio_seconds.inc(audio_seconds)
            self.audio_latency.observe(latency)

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_index: int = 0) -> None:
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats, self.engines[engine_index])
        if iteration_stats is not None:
            self._record_iteration(iteration_stats, self.engines[engine_index])

    @staticmethod
    def _record_scheduler(stats: SchedulerStats, series: _EngineMetrics) -> None:
        series.running.set(stats.num_running_reqs)
        series.waiting.set(stats.num_waiting_reqs)
        series.kv_usage.set(stats.kv_cache_usage)
        series.prefix_queries.inc(stats.prefix_cache_queries)
        series.prefix_hits.inc(stats.prefix_cache_hits)
        series.queries += stats.prefix_cache_queries
        series.hits += stats.prefix_cache_hits
        series.hit_rate.set(series.hits / series.queries if series.queries else 0.0)
        spec = stats.spec_decoding
        if spec is not None:
            series.spec_drafts.inc(spec.num_drafts)
            series.spec_draft_tokens.inc(spec.num_draft_tokens)
            series.spec_accepted.inc(spec.num_accepted_tokens)
            family, label = series.spec_accepted_per_pos
            for position, n in enumerate(spec.num_accepted_tokens_per_pos):
                family.labels(*label, str(position)).inc(n)
        if stats.num_preemptions > series.num_preemptions:
            series.preemptions.inc(stats.num_preemptions - series.num_preemptions)
            series.num_preemptions = stats.num_preemptions

    def _record_iteration(self, stats: IterationStats, series: _EngineMetrics) -> None:
        series.prompt_tokens.inc(stats.num_prompt_tokens)
        series.generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            series.ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            series.itl.observe(itl)
        for finished in stats.finished_requests:
            served = self.engines[finished.engine_index]
            served.success[finished.finish_reason].inc()
            served.e2e.observe(finished.e2e_latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
