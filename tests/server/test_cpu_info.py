"""`python -m server` as a user starts it, under `taskset`: the engine's compute threads and CPUs
come from the process's affinity mask, are logged at start, and `/info` shows them; on fewer than
`MIN_CORES_FOR_A_SERVICE_CORE` physical cores the engine and the service share every CPU (the
placement on larger machines: tests/server/test_cpu_placement.py, over fake topologies)."""
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_token(process: subprocess.Popen, port: int, token_file: Path, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "server exited:\n" + process.stderr.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return token_file.read_text().strip()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not start")


def test_a_server_pinned_to_one_cpu_computes_there_with_one_thread_and_says_so(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "OMP_NUM_THREADS")}
    command = ["taskset", "-c", str(cpu), sys.executable, "-m", "server", "--port", str(port),
               "--data-dir", str(tmp_path / "data"), "--model", str(ensure_embedded_model()), "--dtype", "float32",
               "--demo-adapters", str(tmp_path / "none")]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    try:
        token = _wait_for_token(process, port, tmp_path / "data" / "demo-token")
        info = httpx.get(f"http://127.0.0.1:{port}/info", headers={"Authorization": f"Bearer {token}"}).json()
    finally:
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=60)
    runtime = info["runtime"]
    assert (runtime["threads"], runtime["engine_cpus"], runtime["service_cpus"]) == (1, [cpu], [cpu])
    assert f"engine: 1 compute threads on CPUs {cpu}; the service's threads on the same CPUs" in log
