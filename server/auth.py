"""Bearer-token authentication (docs/api.md section 7): the token names a tenant, and the path's tenant
must be that tenant. Messages never echo the token."""
from __future__ import annotations

from starlette.requests import HTTPConnection

from server.db import Database
from server.errors import forbidden, unauthenticated
from server.tenancy import tenant_of_token


def bearer_token(connection: HTTPConnection) -> str:
    """The token of the `Authorization: Bearer` header; 401 when missing or malformed."""
    header = connection.headers.get("authorization")
    if not header:
        raise unauthenticated("missing Authorization header")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise unauthenticated("Authorization header must be 'Bearer <token>'")
    return token


def authenticate(connection: HTTPConnection, database: Database) -> str:
    """The caller's tenant; 401 for an unknown token."""
    tenant = tenant_of_token(database, bearer_token(connection))
    if tenant is None:
        raise unauthenticated("unknown token")
    return tenant


def authorize_tenant(connection: HTTPConnection, database: Database, path_tenant: str) -> str:
    """The caller's tenant, which must be the tenant in the path (403 otherwise)."""
    tenant = authenticate(connection, database)
    if tenant != path_tenant:
        raise forbidden(f"token does not belong to tenant {path_tenant!r}")
    return tenant
