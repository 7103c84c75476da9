"""Registry tables: repos per tenant, numbered versions, numbered checkpoints, upload sessions.

The tables have their own `DeclarativeBase`; run `RegistryBase.metadata.create_all(engine)` on the
same engine as the tenant tables. The tenant is a plain string column so the registry needs nothing
from the tenants module.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import Boolean, DateTime, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def as_utc(moment: dt.datetime) -> dt.datetime:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


def new_uuid() -> str:
    return uuid.uuid4().hex


class RegistryBase(DeclarativeBase):
    pass


class AdapterRepo(RegistryBase):
    __tablename__ = "adapter_repos"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_adapter_repos_tenant_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(32), default=new_uuid, unique=True)
    tenant_id: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(String(96))
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
    created_by: Mapped[str] = mapped_column(String(128))
    # The last version number handed out. Incremented by an UPDATE in the transaction that inserts
    # the version: the row lock serializes concurrent uploads, a rollback returns the number.
    last_version: Mapped[int] = mapped_column(Integer, default=0)

    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="repo", order_by="AdapterVersion.number", cascade="all, delete-orphan"
    )


class AdapterVersion(RegistryBase):
    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("repo_id", "number", name="uq_adapter_versions_repo_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    repo_id: Mapped[int] = mapped_column(ForeignKey("adapter_repos.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    # Blobs live under `adapters/<blob_id>/`; a random id so blobs can be written before the number exists.
    blob_id: Mapped[str] = mapped_column(String(32), default=new_uuid, unique=True)
    base_model: Mapped[str] = mapped_column(String(256), default="")
    description: Mapped[str] = mapped_column(Text, default="")
    archived: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
    created_by: Mapped[str] = mapped_column(String(128))

    repo: Mapped[AdapterRepo] = relationship(back_populates="versions")
    checkpoints: Mapped[list[AdapterCheckpoint]] = relationship(
        back_populates="version", order_by="AdapterCheckpoint.number", cascade="all, delete-orphan"
    )


class AdapterCheckpoint(RegistryBase):
    __tablename__ = "adapter_checkpoints"
    __table_args__ = (UniqueConstraint("version_id", "number", name="uq_adapter_checkpoints_version_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("adapter_versions.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)

    version: Mapped[AdapterVersion] = relationship(back_populates="checkpoints")


class UploadSession(RegistryBase):
    """Step 1 of an upload opens one; step 3 claims it (`open` -> `finishing` -> `done`)."""

    __tablename__ = "adapter_upload_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(128), index=True)
    repo_name: Mapped[str] = mapped_column(String(96))
    description: Mapped[str] = mapped_column(Text, default="")
    created_by: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    state: Mapped[str] = mapped_column(String(16), default="open")
