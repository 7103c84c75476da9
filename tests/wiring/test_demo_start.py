"""`python -m server` on an empty data directory: the demo tenant gets every adapter directory of
`--demo-adapters` as repo `<name>` version 1 (others are skipped), the start prints a curl line
with `"adapter_id": "french/1"`, and that request works as printed."""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from lora_runtime.embedded import ensure_embedded_model
from tests.fixtures.adapters import make_lora_adapter
from tests.wiring.conftest import make_embedded_adapter

REPO_ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _demo_dir(root: Path) -> Path:
    demo = root / "demo_adapters"
    make_embedded_adapter(demo / "french", seed=5)
    shutil.copytree(demo / "french", demo / "shout")
    make_lora_adapter(demo / "other-model", seed=6)  # another base model: skipped, not fatal
    (demo / "data").mkdir()
    (demo / "data" / "french.jsonl").write_text("{}\n")  # not an adapter directory
    return demo


def _read_until(process: subprocess.Popen, marker: str, timeout_s: float) -> str:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        assert line or process.poll() is None, "server exited:\n" + "".join(lines)
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError("no announcement:\n" + "".join(lines))


def test_first_start_registers_demo_adapters_and_prints_a_working_curl(tmp_path: Path) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    command = [sys.executable, "-m", "server", "--port", str(port), "--data-dir", str(tmp_path / "data"),
               "--dtype", "float32", "--demo-adapters", str(_demo_dir(tmp_path)), "--adapter-pool-mib", "96",
               # The Hugging Face directory: the demo's registration is tested here, and the default
               # model's GGUF took a minute longer to load on a busy 2-core machine
               # (tests/engine/test_gguf_embedded.py serves that one).
               "--model", str(ensure_embedded_model())]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    try:
        announced = _read_until(process, '"adapter_id": "french/1"', timeout_s=240)
        assert "french/1, shout/1" in announced and "other-model" not in announced
        curl_line = announced.strip().splitlines()[-1]
        argv = shlex.split(curl_line.replace("$(cat ", "").replace("demo-token)", "demo-token"))
        body = argv[argv.index("-d") + 1]
        token = (tmp_path / "data" / "demo-token").read_text().strip()
        url = next(arg for arg in argv if arg.startswith("http://"))
        for _ in range(600):
            if process.poll() is None and _is_healthy(port):
                break
            time.sleep(0.1)
        response = httpx.post(url, content=body, timeout=120, headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        assert response.status_code == 200, response.text
        assert response.headers["x-adapter-id"] == "french/1"
        assert response.headers["x-adapter-source"] == "pbase"
        assert response.json()["generated_text"].strip(), "the printed example must produce text"
        runtime = httpx.get(f"http://127.0.0.1:{port}/info", headers={"Authorization": f"Bearer {token}"}).json()["runtime"]
        assert runtime["adapter_pool_bytes"] == 96 * 2**20
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def _is_healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
