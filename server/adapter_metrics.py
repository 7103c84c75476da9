"""The metrics that name adapters, rendered per scrape for one reader: `lora_requests_info`, the shape
of vLLM's `vllm:lora_requests_info` that routers' LoRA affinity reads (the Gateway API inference
extension's endpoint picker, llm-d), and per-adapter request and generated-token counters.

An adapter is named by its identity (`AdapterRef.identity`): the id its clients send (`adapter_id`:
`repo/1`, `org/name`, `s3://bucket/prefix`), what an OpenAI `model` field carries, so that a router
matches it against the requests it routes, in one spelling per adapter (`./tiny` and `tiny/../tiny`
are the local adapter `tiny`, `bucket/prefix/` is `s3://bucket/prefix`).

A name can give away a tenant's private adapter (pbase repos are per tenant; a hub adapter read with a
caller's token is keyed by that credential), so every series belongs to the tenant of its adapter's
key (`AdapterKey.scope`), or to every reader when the key has neither tenant nor credential; a reader
sees its own tenant's series and those, and `viewer=None` sees them all.
"""
from __future__ import annotations

import ast
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lora_runtime.api import AdapterKey, AdapterRequest, EngineStats

# The series of a tenant's adapters past its first `max_adapters`: no pbase, hub or s3 id starts
# with "(" (their patterns start with a letter or digit).
OVERFLOW_ADAPTER = "(other)"
BASE_MODEL = ""  # the adapter label of requests without an adapter

_Series = tuple[str | None, str]  # (owner: a tenant, None for every reader; the adapter's name)


def adapter_name(key: AdapterKey) -> str:
    """The adapter's identity, as clients send it; a merge is `merge(a/1+b/2)`, its ids without their
    weights. Commas, which separate names in `lora_requests_info`, are percent-encoded (of all ids,
    only a local path can hold one)."""
    name = _merge_name(key.adapter_id) if key.source == "merge" else key.adapter_id
    return name.replace(",", "%2C")


def _merge_name(described: str) -> str:
    # A merge's key holds the repr of (ids, weights, strategy, density, sign method)
    # (`AdapterRequest.key`); its ids passed the id patterns, so they hold no "+" nor ",".
    ids = ast.literal_eval(described)[0]
    return f"merge({'+'.join(ids)})"


def owner_of(key: AdapterKey) -> str | None:
    """The tenant whose series this adapter's are; None (every reader's) without tenant nor credential."""
    return key.scope if key.scope or key.credential else None


def is_visible(owner: str | None, viewer: str | None) -> bool:
    return viewer is None or owner is None or owner == viewer


def lora_requests_info(stats: EngineStats, viewer: str | None) -> GaugeMetricFamily:
    """vLLM's one series: the names of the adapters of the running and of the waiting requests
    (comma-separated, sorted, those `viewer` sees) and `max_lora`, the adapters sure to fit in the
    device pool at once. Its value is the time now: routers take the series with the largest."""
    family = GaugeMetricFamily("lora_requests_info", "adapters of the running and waiting requests",
                               labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    family.add_metric([_names(stats.running_adapters, viewer), _names(stats.waiting_adapters, viewer),
                       str(stats.max_resident_adapters)], time.time())
    return family


def _names(keys: Iterable[AdapterKey], viewer: str | None) -> str:
    return ",".join(sorted({adapter_name(key) for key in keys if is_visible(owner_of(key), viewer)}))


@dataclass(slots=True)
class _Counts:
    num_requests: int = 0
    num_generated_tokens: int = 0


class AdapterCounters:
    """Requests and generated tokens per adapter, with bounded cardinality per tenant: each tenant's
    first `max_adapters` distinct adapters get their own series, and each later one is counted in its
    tenant's `(other)` series, so one tenant's many adapters never push another's into `(other)`. A
    scrape thus holds at most `max_adapters` adapter series per tenant (tenants are the operator's),
    one `(other)` per tenant that overflowed, and the base model's. Thread-safe."""

    def __init__(self, max_adapters: int) -> None:
        self.max_adapters = max_adapters
        self._counts: dict[_Series, _Counts] = {}
        # Per owner, the adapters with their own series: at most max_adapters each.
        self._named: dict[str | None, set[str]] = {}
        self._lock = threading.Lock()

    def observe(self, adapter: AdapterRequest | None, num_generated_tokens: int) -> None:
        with self._lock:
            series = self._series(adapter)
            counts = self._counts.setdefault(series, _Counts())
            counts.num_requests += 1
            counts.num_generated_tokens += num_generated_tokens

    def _series(self, adapter: AdapterRequest | None) -> _Series:
        if adapter is None:
            return None, BASE_MODEL
        key = adapter.key
        owner, name = owner_of(key), adapter_name(key)
        named = self._named.setdefault(owner, set())
        if name not in named and len(named) >= self.max_adapters:
            return owner, OVERFLOW_ADAPTER
        named.add(name)
        return owner, name

    def families(self, viewer: str | None) -> list[CounterMetricFamily]:
        """`lora_adapter_requests_total` and `lora_adapter_generated_tokens_total`, labelled by
        `tenant` (the owner; "" for series every reader sees) and `adapter`, as `viewer` sees them."""
        labels = ["tenant", "adapter"]
        requests = CounterMetricFamily("lora_adapter_requests", "finished and client-aborted requests "
                                       "by adapter", labels=labels)
        tokens = CounterMetricFamily("lora_adapter_generated_tokens", "generated tokens of those "
                                     "requests by adapter", labels=labels)
        with self._lock:
            for (owner, name), counts in self._counts.items():
                if is_visible(owner, viewer):
                    requests.add_metric([owner or "", name], counts.num_requests)
                    tokens.add_metric([owner or "", name], counts.num_generated_tokens)
        return [requests, tokens]
