"""Service-wide routes: `/health` (no token), `/info` and `/metrics`."""
from __future__ import annotations

import importlib.metadata
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from lora_runtime.api import EngineInfo
from server.auth import authenticate
from server.errors import error_body, forbidden
from server.metrics import CONTENT_TYPE
from server.routes.openapi import error_responses
from server.state import server_state
from server.tenancy import visible_deployments

logger = logging.getLogger(__name__)
router = APIRouter(tags=["service"])


class DeploymentInfo(BaseModel):
    name: str
    base_model: str
    shared: bool


class Limits(BaseModel):
    max_in_flight: int
    max_body_bytes: int
    max_input_length: int
    max_total_tokens: int
    max_new_tokens: int
    max_stop_sequences: int
    max_best_of: int


class MemoryBudget(BaseModel):
    """The engine's host memory budget, made at start (lora_runtime/memory_budget.py), in bytes."""

    weights_bytes: int
    kv_cache_bytes: int
    adapter_pool_bytes: int  # the device pool and the host cache of adapters, both ceilings
    overhead_bytes: int  # the runtime, a step's activations, the rotary tables
    total_bytes: int
    available_bytes: int  # the memory available to the process when the budget was made


class Runtime(BaseModel):
    """How the engine computes: its dtype (resolved when configured "auto"), kernel backend, compute
    threads and the CPUs they run on; the memory of its adapter tiers."""

    dtype: str
    kernel_backend: str  # "cpu/<instruction-set form>", "torch" or "triton"
    threads: int
    adapter_pool_bytes: int  # the device pages adapters are served from (pages of 16 rank rows)
    adapter_host_cache_bytes: int
    # The CPUs of the engine's loop and compute threads, and of the service's own threads (the same
    # list where they share); null where this process does not place them (a cluster's ingress).
    engine_cpus: list[int] | None = None
    service_cpus: list[int] | None = None
    memory_budget: MemoryBudget | None = None  # null on CUDA, where the device's free memory sizes the cache


class Info(BaseModel):
    version: str
    tenant: str
    base_models: list[str]
    deployments: list[DeploymentInfo]
    limits: Limits
    runtime: Runtime


class Health(BaseModel):
    status: str


def _version() -> str:
    try:
        return importlib.metadata.version("lora-serve")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


@router.get("/health", response_model=Health, responses=error_responses(503))
async def health(request: Request) -> Response:
    """200 while new work is accepted; 503 when the engine is not running, or while draining (so
    that a load balancer stops sending work before the listening socket closes)."""
    state = server_state(request)
    if state.admission.is_draining:
        return JSONResponse(error_body("healthcheck", "draining: the server is shutting down"), 503)
    if not state.async_engine.is_running:
        return JSONResponse(error_body("healthcheck", "engine is not ready"), 503)
    return JSONResponse({"status": "ok"})


@router.get("/info", response_model=Info, responses=error_responses(401))
async def info(request: Request) -> Info:
    state = server_state(request)
    tenant = authenticate(request, state.database)
    config, engine = state.config, state.engine_info
    context, engine_limits = engine.max_model_len, engine.config.limits
    limits = Limits(
        max_in_flight=config.max_in_flight, max_body_bytes=config.max_body_bytes,
        max_input_length=engine_limits.max_input_length or context - 1, max_total_tokens=context,
        max_new_tokens=min(context - 1, config.max_new_tokens_limit or context),
        max_stop_sequences=engine_limits.max_stop_sequences, max_best_of=engine_limits.max_best_of)
    deployments = [DeploymentInfo(name=d.name, base_model=d.base_model, shared=d.is_shared)
                   for d in visible_deployments(state.database, tenant)]
    adapters = engine.config.adapters
    placement = state.placement
    runtime = Runtime(dtype=engine.dtype_name, kernel_backend=engine.kernel_backend, threads=engine.num_threads,
                      adapter_pool_bytes=adapters.device_pool_bytes, adapter_host_cache_bytes=adapters.host_cache_bytes,
                      engine_cpus=list(placement.engine_cpus) if placement else None,
                      service_cpus=list(placement.service_cpus) if placement else None,
                      memory_budget=_memory_budget(engine))
    return Info(version=_version(), tenant=tenant, base_models=[state.model_name],
                deployments=deployments, limits=limits, runtime=runtime)


def _memory_budget(engine: EngineInfo) -> MemoryBudget | None:
    budget = engine.memory_budget
    if budget is None:
        return None
    return MemoryBudget(weights_bytes=budget.weights_bytes, kv_cache_bytes=budget.kv_cache_bytes,
                        adapter_pool_bytes=budget.adapter_pool_bytes, overhead_bytes=budget.overhead_bytes,
                        total_bytes=budget.total_bytes, available_bytes=budget.available_bytes)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text format"},
                       **error_responses(401),
                       403: {**error_responses(403)[403], "description": "not the metrics tenant"}})
async def metrics(request: Request) -> Response:
    state = server_state(request)
    viewer = metrics_viewer(authenticate(request, state.database), state.config.metrics_tenant)
    return Response(state.metrics.render(viewer), media_type=CONTENT_TYPE)


def metrics_viewer(tenant: str, metrics_tenant: str | None) -> str | None:
    """Whose adapters' series the caller sees (None: all). With no metrics tenant configured, every
    tenant reads /metrics and sees its own: adapter ids name private adapters. With one, only it reads."""
    if metrics_tenant is None:
        return tenant
    if tenant != metrics_tenant:
        raise forbidden("only the metrics tenant's tokens may read /metrics")
    return None
