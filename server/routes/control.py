"""The control-plane routes about the caller and deployments, shaped like the Predibase REST paths
the `predibase` SDK calls (docs/api.md section 1): `GET /users/current`, `GET /v2/deployments/{name}`.
Tokens belong to tenants, so the "user" is the tenant itself."""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from server.auth import authenticate
from server.deployments import resolve_deployment
from server.routes.openapi import error_responses
from server.state import server_state

router = APIRouter(tags=["control"])
# Stable ids derived from names, so they survive restarts without being stored.
_NAMESPACE = uuid.UUID("5f1c2a52-8a61-4c43-9d0e-5b0f3f1f7a10")


class Subscription(BaseModel):
    id: str
    tier: str
    isTrial: bool
    expiration: str | None
    daysRemainingInPlan: int | None
    active: bool


class TenantInfo(BaseModel):
    name: str
    shortCode: str
    subscription: Subscription


class CurrentUser(BaseModel):
    id: int
    username: str
    uuid: str
    tenant: TenantInfo


class DeploymentModel(BaseModel):
    name: str
    maxInputLength: int


class DeploymentDetail(BaseModel):
    name: str
    uuid: str
    description: str
    type: str
    status: str
    model: DeploymentModel
    accelerator: dict[str, str]
    currentReplicas: int
    config: dict[str, object] = Field(default_factory=dict)
    usesGuaranteedCapacity: bool


class DeploymentEnvelope(BaseModel):
    data: DeploymentDetail


def _stable_uuid(kind: str, name: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, f"{kind}:{name}"))


@router.get("/users/current", response_model=CurrentUser, responses=error_responses(401))
async def current_user(request: Request) -> CurrentUser:
    tenant = authenticate(request, server_state(request).database)
    subscription = Subscription(id=_stable_uuid("subscription", tenant), tier="self-hosted",
                                isTrial=False, expiration=None, daysRemainingInPlan=None, active=True)
    return CurrentUser(id=0, username=tenant, uuid=_stable_uuid("user", tenant),
                       tenant=TenantInfo(name=tenant, shortCode=tenant, subscription=subscription))


@router.get("/v2/deployments/{name}", response_model=DeploymentEnvelope,
            responses=error_responses(401, 403, 404))
async def deployment_detail(request: Request, name: str) -> DeploymentEnvelope:
    state = server_state(request)
    deployment = resolve_deployment(state.database, authenticate(request, state.database), name)
    engine = state.engine_info
    max_input = engine.config.limits.max_input_length or engine.max_model_len - 1
    detail = DeploymentDetail(
        name=deployment.name, uuid=_stable_uuid("deployment", deployment.name),
        description=f"{deployment.base_model} ({'shared' if deployment.is_shared else 'private'})",
        type="shared" if deployment.is_shared else "private", status="ready",
        model=DeploymentModel(name=deployment.base_model, maxInputLength=max_input),
        accelerator={"id": engine.config.device}, currentReplicas=1,
        usesGuaranteedCapacity=False)
    return DeploymentEnvelope(data=detail)
