"""The service's database: SQLite settings, write transactions, tokens stored hashed, tenancy."""
from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from server.launch import ensure_demo_tenant
from server.db import open_database
from server.deployments import read_deployments_file, register_deployments, resolve_deployment
from server.errors import ApiError
from server.tenancy import Deployment, TokenRow, create_tenant, create_token, list_tenants, tenant_of_token


@pytest.fixture()
def database(tmp_path: Path):
    database = open_database(f"sqlite:///{tmp_path / 'state.db'}")
    yield database
    database.dispose()


def test_sqlite_runs_with_wal_and_foreign_keys(database) -> None:
    with database.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    with pytest.raises(Exception, match="FOREIGN KEY"):
        with database.write() as session:
            session.add(TokenRow(tenant="nobody", token_sha256="0" * 64))


def test_write_transaction_takes_the_write_lock_up_front(database, tmp_path: Path) -> None:
    # BEGIN IMMEDIATE holds the RESERVED lock before any statement: another writer is refused.
    other = sqlite3.connect(tmp_path / "state.db", timeout=0, isolation_level=None)
    with database.write() as session:
        session.execute(text("SELECT 1"))
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
    other.execute("BEGIN IMMEDIATE")
    other.execute("ROLLBACK")
    other.close()


def test_tokens_are_random_stored_hashed_and_map_to_their_tenant(database, tmp_path: Path) -> None:
    create_tenant(database, "acme")
    create_tenant(database, "zeta")
    first, second = create_token(database, "acme"), create_token(database, "zeta")
    assert first != second and len(first) > 40
    assert tenant_of_token(database, first) == "acme"
    assert tenant_of_token(database, second) == "zeta"
    assert tenant_of_token(database, first[:-1]) is None
    database.dispose()
    raw = (tmp_path / "state.db").read_bytes() + _wal_bytes(tmp_path)
    assert first.encode() not in raw
    assert hashlib.sha256(first.encode()).hexdigest().encode() in raw


def _wal_bytes(tmp_path: Path) -> bytes:
    wal = tmp_path / "state.db-wal"
    return wal.read_bytes() if wal.exists() else b""


def test_token_for_unknown_tenant_is_refused(database) -> None:
    with pytest.raises(KeyError):
        create_token(database, "ghost")


def test_deployments_shared_private_unknown_and_foreign(database, tmp_path: Path) -> None:
    file = tmp_path / "deployments.toml"
    file.write_text('[[deployment]]\nname = "acme-support"\ntenant = "acme"\nbase_model = "m1"\n')
    register_deployments(database, ["m1"], read_deployments_file(file))
    create_tenant(database, "zeta")
    assert resolve_deployment(database, "zeta", "m1").is_shared
    assert resolve_deployment(database, "acme", "acme-support").tenant == "acme"
    with pytest.raises(ApiError) as refused:
        resolve_deployment(database, "zeta", "acme-support")
    assert (refused.value.status_code, refused.value.error_type) == (403, "forbidden")
    with pytest.raises(ApiError) as unknown:
        resolve_deployment(database, "zeta", "nope")
    assert (unknown.value.status_code, unknown.value.error_type) == (404, "not_found")


def test_private_deployment_on_a_model_not_loaded_is_refused(database) -> None:
    with pytest.raises(ValueError, match="not loaded"):
        register_deployments(database, ["m1"], [Deployment("x", "acme", "m2")])


def test_first_start_creates_demo_tenant_and_token_file_once(database, tmp_path: Path) -> None:
    token = ensure_demo_tenant(database, tmp_path)
    assert token is not None
    assert (tmp_path / "demo-token").read_text().strip() == token
    assert (tmp_path / "demo-token").stat().st_mode & 0o077 == 0
    assert tenant_of_token(database, token) == "demo"
    assert ensure_demo_tenant(database, tmp_path) is None
    assert list_tenants(database) == ["demo"]


def test_cli_creates_tokens_and_lists_tenants(tmp_path: Path) -> None:
    def run(*args: str) -> str:
        command = [sys.executable, "-m", "server", "--data-dir", str(tmp_path), *args]
        return subprocess.run(command, check=True, capture_output=True, text=True).stdout

    token = run("tokens", "create", "--tenant", "acme").strip()
    assert run("tenants", "list").split() == ["acme"]
    database = open_database(f"sqlite:///{tmp_path / 'state.db'}")
    assert tenant_of_token(database, token) == "acme"
    database.dispose()


def test_other_tables_are_created_on_the_same_database(tmp_path: Path) -> None:
    class OtherBase(DeclarativeBase):
        pass

    class Thing(OtherBase):
        __tablename__ = "things"
        id: Mapped[int] = mapped_column(primary_key=True)

    database = open_database(f"sqlite:///{tmp_path / 'state.db'}", [OtherBase.metadata])
    assert {"tenants", "api_tokens", "deployments", "things"} <= set(inspect(database.engine).get_table_names())
    with database.write() as session:
        session.add(Thing(id=1))
    with database.read() as session:
        assert session.get(Thing, 1) is not None
    database.dispose()


def test_tenancy_on_postgresql_through_database_url(postgres_url: str, tmp_path: Path) -> None:
    environment = {**os.environ, "DATABASE_URL": postgres_url}
    command = [sys.executable, "-m", "server", "--data-dir", str(tmp_path), "tokens", "create",
               "--tenant", "acme"]
    token = subprocess.run(command, check=True, capture_output=True, text=True, env=environment).stdout.strip()
    assert not (tmp_path / "state.db").exists()
    database = open_database(postgres_url)
    try:
        assert tenant_of_token(database, token) == "acme"
        register_deployments(database, ["m1"], [Deployment("acme-support", "acme", "m1")])
        assert resolve_deployment(database, "acme", "acme-support").tenant == "acme"
        with pytest.raises(Exception, match="foreign key"):
            with database.write() as session:
                session.add(TokenRow(tenant="nobody", token_sha256="1" * 64))
    finally:
        database.dispose()


def test_the_command_line_imports_no_engine_before_it_serves() -> None:
    """`python -m server tokens create` / `tenants list` answer at once: torch is imported only by
    the code that starts an engine."""
    import subprocess
    import sys

    check = "import sys, server.__main__, server.launch; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], check=False).returncode == 0
