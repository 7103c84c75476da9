"""A real SIGTERM to `python -m server` with a stream in flight: while it drains, the server keeps
listening, so a new request gets 503 shutting_down with Retry-After and `/health` 503 saying
"draining" (not "connection refused"); the stream in flight finishes normally, then it exits."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from lora_runtime.embedded import ensure_embedded_model
from tests.server.test_http_errors import assert_error

REPO_ROOT = Path(__file__).resolve().parents[2]
# Long enough to still be running a second after the signal, short enough to end within the
# deadline on a loaded CPU (about 35 tokens/s alone on two cores).
NUM_STREAM_TOKENS = 300
# uvicorn's main loop looks for the exit every 0.1 s; without the drain it has closed its listening
# socket well within this.
SOCKET_CLOSE_WAIT_S = 1.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(data_dir: Path, port: int) -> subprocess.Popen:
    (data_dir / "no-demo-adapters").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    command = [sys.executable, "-m", "server", "--port", str(port), "--data-dir", str(data_dir),
               "--model", str(ensure_embedded_model()), "--dtype", "float32", "--shutdown-deadline", "120",
               "--demo-adapters", str(data_dir / "no-demo-adapters")]
    with (data_dir / "server.log").open("w") as log:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "server exited before it was healthy"
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def _stream_in_background(url: str, headers: dict[str, str]) -> tuple[threading.Thread, list[dict]]:
    """A stream that has produced its first event when this returns (so it is in flight)."""
    events: list[dict] = []
    first_event = threading.Event()

    def read() -> None:
        body = {"inputs": "Count:", "parameters": {"max_new_tokens": NUM_STREAM_TOKENS,
                                                   "ignore_eos_token": True}}
        with httpx.stream("POST", url, json=body, headers=headers, timeout=180) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    first_event.set()

    thread = threading.Thread(target=read)
    thread.start()
    assert first_event.wait(60), "the stream produced no event"
    return thread, events


def test_sigterm_keeps_listening_while_in_flight_work_finishes(tmp_path: Path) -> None:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = _start_server(tmp_path / "data", port)
    try:
        _wait_healthy(base_url, process, timeout_s=240)
        headers = {"Authorization": f"Bearer {(tmp_path / 'data' / 'demo-token').read_text().strip()}"}
        model_name = httpx.get(base_url + "/info", headers=headers).json()["base_models"][0]
        prefix = f"{base_url}/demo/deployments/v2/llms/{model_name}"
        reader, events = _stream_in_background(prefix + "/generate_stream", headers)

        process.send_signal(signal.SIGTERM)
        time.sleep(SOCKET_CLOSE_WAIT_S)
        refused = httpx.post(prefix + "/generate", headers=headers,
                             json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
        health = httpx.get(base_url + "/health")
        assert reader.is_alive(), "the stream ended before the drain was observed"

        assert_error(refused, 503, "shutting_down")
        assert_error(health, 503, "healthcheck", "draining")
        reader.join(150)
        assert len(events) == NUM_STREAM_TOKENS and events[-1]["generated_text"]
        assert not any("error" in event for event in events)
        # Idle once the stream ended: the server stops long before the 120 s deadline.
        assert process.wait(30) == -signal.SIGTERM
        assert refused.headers.get("retry-after") == "1"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
