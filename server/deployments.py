"""Deployments: one shared deployment per loaded base model, named after it, and private ones (a
name, a tenant, a base model) read from a TOML file:

    [[deployment]]
    name = "acme-support"
    tenant = "acme"
    base_model = "smollm2-135m-instruct"
"""
from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path

from server.db import Database
from server.errors import forbidden, not_found
from server.tenancy import Deployment, get_deployment, put_deployment


def read_deployments_file(path: Path) -> list[Deployment]:
    """Private deployments listed in `path`; raises ValueError on a malformed entry."""
    with path.open("rb") as handle:
        document = tomllib.load(handle)
    deployments = []
    for index, entry in enumerate(document.get("deployment", [])):
        missing = [key for key in ("name", "tenant", "base_model") if not isinstance(entry.get(key), str)]
        if missing:
            raise ValueError(f"{path}: deployment #{index} lacks string field(s) {', '.join(missing)}")
        deployments.append(Deployment(entry["name"], entry["tenant"], entry["base_model"]))
    return deployments


def register_deployments(
    database: Database, model_names: Iterable[str], private: Iterable[Deployment]
) -> None:
    """Store the shared deployment of each loaded model and the private ones (on known models)."""
    loaded = set(model_names)
    for name in sorted(loaded):
        put_deployment(database, Deployment(name, None, name))
    for deployment in private:
        if deployment.base_model not in loaded:
            raise ValueError(f"deployment {deployment.name!r}: base model {deployment.base_model!r} "
                             f"is not loaded (loaded: {', '.join(sorted(loaded))})")
        if deployment.name in loaded:
            raise ValueError(f"deployment {deployment.name!r} would hide the shared deployment")
        put_deployment(database, deployment)


def resolve_deployment(database: Database, tenant: str, name: str) -> Deployment:
    """The deployment `name` as seen by `tenant`: 404 when unknown, 403 when another tenant's."""
    deployment = get_deployment(database, name)
    if deployment is None:
        raise not_found(f"deployment {name!r} not found")
    if not deployment.is_shared and deployment.tenant != tenant:
        raise forbidden(f"deployment {name!r} belongs to another tenant")
    return deployment
