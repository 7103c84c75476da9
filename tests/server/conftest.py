"""Fixtures of the server tests: the embedded model's Hugging Face directory loaded once (float32), a live server per module."""
from __future__ import annotations

import pytest

from tests.fixtures.postgres import find_postgres_bin_dir, start_postgres
from tests.server.live import LiveServer, start_live_server


@pytest.fixture(scope="session")
def engine():
    from lora_runtime import Engine, EngineConfig
    from lora_runtime.embedded import ensure_embedded_model

    # The Hugging Face directory that the tests' transformers oracles load (the default model, its GGUF
    # served as it is, is tested in tests/engine/test_default_model.py).
    return Engine.from_config(EngineConfig(model=str(ensure_embedded_model()), dtype="float32"))


@pytest.fixture(scope="module")
def live(engine, tmp_path_factory) -> LiveServer:
    """A server with small limits that the tests drive past: 4 in flight, 16 KiB bodies."""
    server = start_live_server(engine, tmp_path_factory.mktemp("live"), max_in_flight=4,
                               max_body_bytes=16 * 1024)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def postgres_url():
    """A throw-away PostgreSQL cluster's SQLAlchemy URL (the `DATABASE_URL` case)."""
    bin_dir = find_postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) are not installed; run scripts/ensure_postgres.sh")
    server = start_postgres(bin_dir)
    yield server.url
    server.stop()
