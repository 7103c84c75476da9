"""Repo and version records: the service functions behind the `/v2/repos` routes.

Every function takes the caller's tenant and only ever sees that tenant's rows, so another tenant's
repo is simply not found. Results are frozen snapshots, detached from the session.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, selectinload

from lora_runtime.api import ValidationError
from server.registry.errors import RepoExistsError, RepoNotFoundError, VersionNotFoundError
from server.registry.models import AdapterCheckpoint, AdapterRepo, AdapterVersion, as_utc

REPO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_LOCK_RETRIES = 8

SessionFactory = Callable[[], Session]


@dataclass(frozen=True, slots=True)
class VersionInfo:
    repo: str
    tag: int
    archived: bool
    base_model: str
    description: str
    created_at: dt.datetime
    created_by: str
    checkpoints: tuple[int, ...]
    blob_id: str

    def to_api(self) -> dict[str, object]:
        """The version object of docs/api.md section 1 (`adapterPath` is the adapter id to generate with)."""
        return {
            "repo": self.repo,
            "tag": self.tag,
            "archived": self.archived,
            "baseModel": self.base_model,
            "adapterPath": f"{self.repo}/{self.tag}",
            "description": self.description,
            "createdAt": self.created_at.isoformat(),
            "createdBy": self.created_by,
            "checkpoints": list(self.checkpoints),
            # The predibase SDK's `adapters.get` waits on any other status (a fine-tuning job).
            "status": "completed",
        }


@dataclass(frozen=True, slots=True)
class RepoInfo:
    uuid: str
    name: str
    description: str
    created_at: dt.datetime
    created_by: str
    versions: tuple[VersionInfo, ...]

    def to_api(self) -> dict[str, object]:
        return {
            "uuid": self.uuid,
            "name": self.name,
            "description": self.description,
            "createdAt": self.created_at.isoformat(),
            "createdBy": self.created_by,
            "versions": [
                {
                    k: v
                    for k, v in version.to_api().items()
                    if k in ("tag", "createdAt", "createdBy", "baseModel", "archived")
                }
                for version in self.versions
            ],
        }


def check_repo_name(name: str) -> str:
    if not isinstance(name, str) or not REPO_NAME.fullmatch(name) or ".." in name:
        raise ValidationError("name", "a repo name is 1-96 letters, digits, '.', '_' or '-', starting alphanumeric")
    return name


@contextmanager
def _transaction(sessions: SessionFactory) -> Iterator[Session]:
    with sessions() as session, session.begin():
        yield session


def create_repo(
    sessions: SessionFactory, tenant_id: str, name: str, created_by: str, description: str = "", exists_ok: bool = False
) -> RepoInfo:
    """Creates a repo; an existing one is returned when `exists_ok`, else RepoExistsError."""
    check_repo_name(name)
    try:
        with _transaction(sessions) as session:
            session.add(AdapterRepo(tenant_id=tenant_id, name=name, description=description, created_by=created_by))
    except IntegrityError:
        if not exists_ok:
            raise RepoExistsError(f"repo {name!r} already exists") from None
    return get_repo(sessions, tenant_id, name)


def get_repo(sessions: SessionFactory, tenant_id: str, name: str) -> RepoInfo:
    with sessions() as session:
        return _repo_info(_load_repo(session, tenant_id, name))


def list_repos(sessions: SessionFactory, tenant_id: str, limit: int = 100) -> list[RepoInfo]:
    with sessions() as session:
        query = (
            select(AdapterRepo)
            .where(AdapterRepo.tenant_id == tenant_id)
            .order_by(AdapterRepo.created_at.desc(), AdapterRepo.id.desc())
            .limit(max(1, min(limit, 1000)))
            .options(selectinload(AdapterRepo.versions).selectinload(AdapterVersion.checkpoints))
        )
        return [_repo_info(repo) for repo in session.scalars(query)]


def delete_repo(sessions: SessionFactory, tenant_id: str, name: str) -> list[str]:
    """Deletes a repo and its versions; returns the versions' blob ids for the caller to remove."""
    with _transaction(sessions) as session:
        repo = _load_repo(session, tenant_id, check_repo_name(name))
        blob_ids = [version.blob_id for version in repo.versions]
        session.delete(repo)
    return blob_ids


def get_version(sessions: SessionFactory, tenant_id: str, repo: str, tag: int) -> VersionInfo:
    with sessions() as session:
        return _version_info(_load_version(session, tenant_id, repo, tag), repo)


def set_archived(sessions: SessionFactory, tenant_id: str, repo: str, tag: int, archived: bool) -> VersionInfo:
    with _transaction(sessions) as session:
        version = _load_version(session, tenant_id, repo, tag)
        version.archived = archived
        session.flush()
        return _version_info(version, repo)


def delete_version(sessions: SessionFactory, tenant_id: str, repo: str, tag: int) -> str:
    """Deletes one version (its number is never reused); returns its blob id for the caller to remove."""
    with _transaction(sessions) as session:
        version = _load_version(session, tenant_id, repo, tag)
        blob_id = version.blob_id
        session.delete(version)
    return blob_id


def add_version(
    sessions: SessionFactory,
    tenant_id: str,
    repo: str,
    created_by: str,
    blob_id: str,
    base_model: str,
    checkpoints: tuple[int, ...] = (),
    description: str = "",
) -> VersionInfo:
    """Records a new version with the repo's next number, creating the repo if missing.

    Concurrent calls get distinct consecutive numbers: the number is taken by an UPDATE of the repo
    row (a row lock on PostgreSQL, the write lock on SQLite) in the transaction that inserts the
    version, and a transaction that found the database locked is retried from the start.
    """
    repo_id = _load_repo_id(sessions, tenant_id, repo, created_by)
    for attempt in range(_LOCK_RETRIES):
        try:
            with _transaction(sessions) as session:
                # The UPDATE is the transaction's first statement, so SQLite takes its write lock at once.
                number = session.execute(
                    update(AdapterRepo)
                    .where(AdapterRepo.id == repo_id)
                    .values(last_version=AdapterRepo.last_version + 1)
                    .returning(AdapterRepo.last_version)
                ).scalar_one()
                version = AdapterVersion(
                    repo_id=repo_id,
                    number=number,
                    blob_id=blob_id,
                    base_model=base_model,
                    description=description,
                    created_by=created_by,
                    checkpoints=[AdapterCheckpoint(number=n) for n in sorted(checkpoints)],
                )
                session.add(version)
                session.flush()
                return _version_info(version, repo)
        except OperationalError:
            if attempt == _LOCK_RETRIES - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable: the last attempt returns or raises")


def _load_repo_id(sessions: SessionFactory, tenant_id: str, name: str, created_by: str) -> int:
    create_repo(sessions, tenant_id, name, created_by, exists_ok=True)
    with sessions() as session:
        return session.scalars(
            select(AdapterRepo.id).where(AdapterRepo.tenant_id == tenant_id, AdapterRepo.name == name)
        ).one()


def _load_repo(session: Session, tenant_id: str, name: str) -> AdapterRepo:
    repo = session.scalars(
        select(AdapterRepo)
        .where(AdapterRepo.tenant_id == tenant_id, AdapterRepo.name == name)
        .options(selectinload(AdapterRepo.versions).selectinload(AdapterVersion.checkpoints))
    ).one_or_none()
    if repo is None:
        raise RepoNotFoundError(f"repo {name!r} not found")
    return repo


def _load_version(session: Session, tenant_id: str, repo: str, tag: int) -> AdapterVersion:
    version = session.scalars(
        select(AdapterVersion)
        .join(AdapterRepo)
        .where(AdapterRepo.tenant_id == tenant_id, AdapterRepo.name == repo, AdapterVersion.number == tag)
        .options(selectinload(AdapterVersion.checkpoints))
    ).one_or_none()
    if version is None:
        raise VersionNotFoundError(f"version {repo}/{tag} not found")
    return version


def _version_info(version: AdapterVersion, repo: str) -> VersionInfo:
    return VersionInfo(
        repo=repo,
        tag=version.number,
        archived=version.archived,
        base_model=version.base_model,
        description=version.description,
        created_at=as_utc(version.created_at),
        created_by=version.created_by,
        checkpoints=tuple(c.number for c in version.checkpoints),
        blob_id=version.blob_id,
    )


def _repo_info(repo: AdapterRepo) -> RepoInfo:
    return RepoInfo(
        uuid=repo.uuid,
        name=repo.name,
        description=repo.description,
        created_at=as_utc(repo.created_at),
        created_by=repo.created_by,
        versions=tuple(_version_info(v, repo.name) for v in repo.versions),
    )
