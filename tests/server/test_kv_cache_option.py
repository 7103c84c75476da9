"""`python -m server --kv-cache-mib N`, started as a user starts it: the KV cache the engine serves with
is N MiB, the budget is logged at start and `/info` shows it, its parts adding up to its total."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from lora_runtime.embedded import ensure_embedded_model

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(process: subprocess.Popen, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server never became healthy")


def test_kv_cache_mib_sizes_the_cache_and_info_shows_the_budget(tmp_path: Path) -> None:
    port, log = _free_port(), tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    command = [sys.executable, "-m", "server", "--port", str(port), "--data-dir", str(tmp_path / "data"),
               "--model", str(ensure_embedded_model()), "--dtype", "float32", "--kv-cache-mib", "48",
               "--adapter-pool-mib", "96", "--adapter-host-cache-mib", "16", "--demo-adapters", str(tmp_path / "none")]
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(process, port, timeout_s=240)
        token = (tmp_path / "data" / "demo-token").read_text().strip()
        info = httpx.get(f"http://127.0.0.1:{port}/info", headers={"Authorization": f"Bearer {token}"}).json()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    budget = info["runtime"]["memory_budget"]
    assert budget["kv_cache_bytes"] == 48 * MIB
    assert budget["adapter_pool_bytes"] == (96 + 16) * MIB
    parts = ("weights_bytes", "kv_cache_bytes", "adapter_pool_bytes", "overhead_bytes")
    assert sum(budget[name] for name in parts) == budget["total_bytes"]
    assert budget["weights_bytes"] > 100 * MIB  # the embedded 135M model in float32: ~540 MB
    assert "memory budget: weights" in log.read_text() and "KV cache 48 MiB" in log.read_text()
