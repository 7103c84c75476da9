"""Prometheus metrics: requests, tokens and latencies observed by the HTTP layer, on the server's own
registry; and, read at each scrape, every numeric field of the engine's `stats()` (queue, KV blocks,
adapter tiers) as a `lora_engine_*` gauge, and the series that name adapters (`server.adapter_metrics`),
filtered for the reader."""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lora_runtime.api import AdapterRequest, EngineStats
from server.adapter_metrics import AdapterCounters, lora_requests_info

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _engine_gauges(stats: EngineStats) -> Iterator[GaugeMetricFamily]:
    """One gauge per numeric field of the engine's stats."""
    for field in dataclasses.fields(stats):
        value = getattr(stats, field.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield GaugeMetricFamily(f"lora_engine_{field.name}", f"engine stats: {field.name}",
                                    value=float(value))


class _Scrape(Collector):
    """One scrape's engine figures, read once, and the adapter series `viewer` sees (None: all)."""

    def __init__(self, stats: EngineStats | None, counters: AdapterCounters, viewer: str | None) -> None:
        self._stats = stats
        self._counters = counters
        self._viewer = viewer

    def collect(self) -> Iterator[Metric]:
        if self._stats is not None:  # None until the engine has started
            yield from _engine_gauges(self._stats)
            yield lora_requests_info(self._stats, self._viewer)
        yield from self._counters.families(self._viewer)


class ServerMetrics:
    def __init__(self, read_stats: Callable[[], EngineStats | None], read_in_flight: Callable[[], int],
                 max_adapter_series: int) -> None:
        self._read_stats = read_stats
        self._adapter_counters = AdapterCounters(max_adapter_series)
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

    def observe_adapter_request(self, adapter: AdapterRequest | None, num_generated_tokens: int) -> None:
        """A request of `adapter` (None: the base model) finished, or was aborted because its client
        left: counted in its adapter's series with the tokens the engine generated for it."""
        self._adapter_counters.observe(adapter, num_generated_tokens)

    def render(self, viewer: str | None) -> bytes:
        """The exposition for one reader: the series naming adapters are those `viewer`'s tenant
        sees (docs/api.md section 1), every one when `viewer` is None."""
        scrape = _Scrape(self._read_stats(), self._adapter_counters, viewer)
        return generate_latest(self.registry) + generate_latest(scrape)


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsListener:
    """`GET /metrics` on a port of its own, every series, no token: for scrapers on the operator's
    network that cannot send one (the Gateway API inference extension's endpoint picker). A plain
    stdlib server in a thread, so that a slow scraper never holds the serving event loop."""

    def __init__(self, metrics: ServerMetrics, host: str, port: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = metrics.render(None)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass  # one line per scrape would drown the server's log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
