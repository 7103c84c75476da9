"""Prometheus metrics on the server's own registry: requests, tokens and latencies observed by the
HTTP layer, plus every numeric field of the engine's `stats()` (queue, KV blocks, adapter cache)
exported as a gauge when scraped."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineStatsCollector(Collector):
    """Reads the engine's stats dataclass at scrape time; one gauge per numeric field."""

    def __init__(self, read_stats: Callable[[], object]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._read_stats()
        if stats is None:
            return
        for field in dataclasses.fields(stats):
            value = getattr(stats, field.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield GaugeMetricFamily(f"lora_engine_{field.name}", f"engine stats: {field.name}",
                                        value=float(value))


class ServerMetrics:
    def __init__(self, read_stats: Callable[[], object], read_in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lora_requests", "HTTP inference requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.prompt_tokens = Counter("lora_prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.generated_tokens = Counter("lora_generated_tokens",
                                        "generated tokens, of finished requests and of those their "
                                        "client left", registry=self.registry)
        self.disconnects = Counter("lora_client_disconnects", "requests aborted by their client",
                                   registry=self.registry)
        self.request_seconds = Histogram("lora_request_duration_seconds", "request latency",
                                         buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.first_token_seconds = Histogram("lora_time_to_first_token_seconds", "time to first token",
                                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.per_token_seconds = Histogram("lora_time_per_output_token_seconds",
                                           "decode time per output token after the first",
                                           buckets=_LATENCY_BUCKETS, registry=self.registry)
        in_flight = Gauge("lora_requests_in_flight", "requests admitted and not finished",
                          registry=self.registry)
        in_flight.set_function(read_in_flight)
        self.registry.register(_EngineStatsCollector(read_stats))

    def observe_finished(self, num_prompt: int, num_generated: int, total_s: float,
                         first_token_s: float | None) -> None:
        self.prompt_tokens.inc(num_prompt)
        self.generated_tokens.inc(num_generated)
        self.request_seconds.observe(total_s)
        if first_token_s is not None:
            self.first_token_seconds.observe(first_token_s)
            if num_generated > 1:
                self.per_token_seconds.observe((total_s - first_token_s) / (num_generated - 1))

    def observe_disconnect(self, num_generated: int) -> None:
        """A request aborted because its client left: the engine did generate its tokens."""
        self.disconnects.inc()
        self.generated_tokens.inc(num_generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)
