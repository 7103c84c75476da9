"""Tenants, their bearer tokens and deployments: tables and the operations on them.

Tokens are 256-bit random secrets shown once; only their SHA-256 is stored (a fast hash suffices
for secrets of this entropy) and compared in constant time. Tokens never reach a log.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import DateTime, ForeignKey, String, select
from sqlalchemy.orm import Mapped, mapped_column

from server.db import Base, Database

TOKEN_PREFIX = "lrs_"
_TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def _now() -> datetime:
    return datetime.now(timezone.utc)


class TenantRow(Base):
    __tablename__ = "tenants"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class TokenRow(Base):
    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name", ondelete="CASCADE"), index=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class DeploymentRow(Base):
    """A name requests address. `tenant` None: shared by every tenant (named after its model)."""

    __tablename__ = "deployments"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant: Mapped[str | None] = mapped_column(ForeignKey("tenants.name", ondelete="CASCADE"))
    base_model: Mapped[str] = mapped_column(String(256))


@dataclass(frozen=True, slots=True)
class Deployment:
    name: str
    tenant: str | None
    base_model: str

    @property
    def is_shared(self) -> bool:
        return self.tenant is None


def _token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_tenant(database: Database, name: str) -> None:
    """Create tenant `name` if it does not exist yet."""
    if not _TENANT_NAME.match(name):
        raise ValueError(f"tenant name {name!r} must match {_TENANT_NAME.pattern}")
    with database.write() as session:
        if session.get(TenantRow, name) is None:
            session.add(TenantRow(name=name))


def list_tenants(database: Database) -> list[str]:
    with database.read() as session:
        return list(session.scalars(select(TenantRow.name).order_by(TenantRow.name)))


def create_token(database: Database, tenant: str) -> str:
    """A new token for an existing tenant; the caller shows it once, it is not stored in clear."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with database.write() as session:
        if session.get(TenantRow, tenant) is None:
            raise KeyError(f"no tenant {tenant!r}")
        session.add(TokenRow(tenant=tenant, token_sha256=_token_digest(token)))
    return token


def tenant_of_token(database: Database, token: str) -> str | None:
    """The tenant that owns `token`, or None when it is unknown."""
    digest = _token_digest(token)
    with database.read() as session:
        row = session.scalars(select(TokenRow).where(TokenRow.token_sha256 == digest)).first()
    if row is None or not hmac.compare_digest(row.token_sha256, digest):
        return None
    return row.tenant


def put_deployment(database: Database, deployment: Deployment) -> None:
    """Create or update a deployment (its tenant, if any, is created when missing)."""
    if deployment.tenant is not None:
        create_tenant(database, deployment.tenant)
    with database.write() as session:
        row = session.get(DeploymentRow, deployment.name) or DeploymentRow(name=deployment.name)
        row.tenant, row.base_model = deployment.tenant, deployment.base_model
        session.add(row)


def get_deployment(database: Database, name: str) -> Deployment | None:
    with database.read() as session:
        row = session.get(DeploymentRow, name)
    return None if row is None else Deployment(row.name, row.tenant, row.base_model)


def visible_deployments(database: Database, tenant: str) -> list[Deployment]:
    """Shared deployments and the tenant's own private ones."""
    with database.read() as session:
        rows = session.scalars(select(DeploymentRow).order_by(DeploymentRow.name))
        return [Deployment(r.name, r.tenant, r.base_model) for r in rows
                if r.tenant is None or r.tenant == tenant]


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """What is kept of a token: never the secret, only its id, tenant and creation time."""

    id: int
    tenant: str
    created_at: datetime


def list_tokens(database: Database, tenant: str | None = None) -> list[TokenInfo]:
    """The tokens of `tenant` (every tenant's when None), oldest first."""
    query = select(TokenRow).order_by(TokenRow.id)
    if tenant is not None:
        query = query.where(TokenRow.tenant == tenant)
    with database.read() as session:
        return [TokenInfo(row.id, row.tenant, row.created_at) for row in session.scalars(query)]


def revoke_token(database: Database, token_id: int | None = None, token: str | None = None) -> TokenInfo | None:
    """Delete the token with id `token_id`, or the one whose secret is `token`; None when unknown.
    It stops authenticating at once: every request reads the table."""
    column, value = (TokenRow.id, token_id) if token is None else (TokenRow.token_sha256, _token_digest(token))
    with database.write() as session:
        row = session.scalars(select(TokenRow).where(column == value)).first()
        if row is None:
            return None
        session.delete(row)
        return TokenInfo(row.id, row.tenant, row.created_at)


def delete_tenant(database: Database, name: str) -> bool:
    """Delete tenant `name` with its tokens and private deployments (the foreign keys cascade);
    False when there is no such tenant. Its registry repos are the caller's to check first."""
    with database.write() as session:
        row = session.get(TenantRow, name)
        if row is None:
            return False
        session.delete(row)
        return True
