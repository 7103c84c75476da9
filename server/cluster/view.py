"""The cluster as the ingress sees it: `GET /cluster` (each replica's queues, KV usage and the
adapters its host cache holds) and per-replica Prometheus series on `/metrics`
(`lora_replica_<stat>{replica}`, one per numeric field of the engine's stats), both from the
replicas' latest reports. A replica's adapters are shown as `/metrics` shows adapter series: a
tenant sees its own (docs/api.md section 1)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from fastapi import APIRouter, FastAPI, Request
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel

from server.adapter_metrics import adapter_name, is_visible, owner_of
from server.auth import authenticate
from server.cluster.remote import RemoteEngine
from server.cluster.wire import ReplicaReport
from server.routes.openapi import error_responses
from server.routes.service import metrics_viewer
from server.state import server_state


class ReplicaView(BaseModel):
    replica_id: str
    report_age_s: float
    num_running: int
    num_waiting: int
    kv_cache_usage_ratio: float
    num_finished_requests: int
    num_generated_tokens: int
    adapters: list[str]  # in its host cache, least recently used first


class ClusterView(BaseModel):
    replicas: list[ReplicaView]


def install(app: FastAPI, engine: RemoteEngine) -> None:
    """`GET /cluster` and the per-replica series, on the ingress's app over `engine`'s reports."""
    router = APIRouter(tags=["service"])

    @router.get("/cluster", response_model=ClusterView, responses=error_responses(401, 403))
    async def cluster(request: Request) -> ClusterView:
        state = server_state(request)
        viewer = metrics_viewer(authenticate(request, state.database), state.config.metrics_tenant)
        return cluster_view(engine.reports(), viewer)

    app.include_router(router)
    app.state.server.metrics.registry.register(ReplicaCollector(engine.reports))


def cluster_view(reports: tuple[ReplicaReport, ...], viewer: str | None) -> ClusterView:
    return ClusterView(replicas=[
        ReplicaView(replica_id=report.replica_id, report_age_s=round(report.age_s, 3),
                    num_running=report.stats.num_running, num_waiting=report.stats.num_waiting,
                    kv_cache_usage_ratio=report.stats.kv_cache_usage_ratio,
                    num_finished_requests=report.stats.num_finished_requests,
                    num_generated_tokens=report.stats.num_generated_tokens,
                    adapters=[adapter_name(key) for key in report.cached_adapters
                              if is_visible(owner_of(key), viewer)])
        for report in reports])


class ReplicaCollector(Collector):
    """`lora_replica_<field>{replica}` for every numeric field of each live replica's stats."""

    def __init__(self, read_reports: Callable[[], tuple[ReplicaReport, ...]]) -> None:
        self._read_reports = read_reports

    def collect(self) -> Iterator[Metric]:
        reports = self._read_reports()
        if not reports:
            return
        for field in dataclasses.fields(reports[0].stats):
            if field.type not in ("int", "float"):
                continue
            family = GaugeMetricFamily(f"lora_replica_{field.name}", f"engine stats of each replica: {field.name}",
                                       labels=["replica"])
            for report in reports:
                family.add_metric([report.replica_id], float(getattr(report.stats, field.name)))
            yield family
