"""The service's database: one SQLAlchemy engine, a read and a write session factory, and the
declarative base of the service's own tables (`Base.metadata`).

SQLite (the default, in the data directory) runs with WAL, foreign keys on and `BEGIN IMMEDIATE`
for write transactions, so concurrent writers wait for the lock up front instead of failing on
upgrade. Other tables (the adapter registry) may use their own `DeclarativeBase`: pass its
metadata to `open_database(url, [RegistryBase.metadata])`, and use `database.sessions` /
`database.write()` for them too.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import Engine, MetaData, create_engine, event
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

_IMMEDIATE = "sqlite_begin_immediate"


class Base(DeclarativeBase):
    """Base of the server's own tables (tenants, tokens, deployments)."""


@dataclass(frozen=True, slots=True)
class Database:
    engine: Engine
    # Sessions for reads; `write()` for transactions that write.
    sessions: sessionmaker[Session]
    write_sessions: sessionmaker[Session]

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self.sessions() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session whose transaction starts `BEGIN IMMEDIATE` on SQLite; commits on success."""
        with self.write_sessions.begin() as session:
            yield session

    def dispose(self) -> None:
        self.engine.dispose()


def open_database(url: str, other_metadata: Iterable[MetaData] = ()) -> Database:
    """Connect to `url`, create the server's tables (and those of `other_metadata`, e.g. the adapter
    registry's) if missing, and return the session factories."""
    engine = create_engine(url, future=True)
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine)
    for metadata in (Base.metadata, *other_metadata):
        metadata.create_all(engine)
    write_engine = engine.execution_options(**{_IMMEDIATE: True})
    return Database(
        engine=engine,
        sessions=sessionmaker(engine, expire_on_commit=False),
        write_sessions=sessionmaker(write_engine, expire_on_commit=False),
    )


def _configure_sqlite(engine: Engine) -> None:
    # pysqlite's own transaction handling issues BEGIN lazily and never IMMEDIATE; turn it off and
    # emit BEGIN ourselves (the SQLAlchemy documentation's recipe for SQLite transactions).
    @event.listens_for(engine, "connect")
    def on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=5000")
        if engine.url.database not in (None, "", ":memory:"):
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def on_begin(connection) -> None:
        immediate = connection.get_execution_options().get(_IMMEDIATE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
