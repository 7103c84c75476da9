"""Under load and on failure: 429 past the in-flight bound, 413 for big bodies, client disconnects
free the engine's blocks at once, and metrics show it."""
from __future__ import annotations

import pytest

import asyncio
import contextlib
import socket
import time

import httpx

from tests.server.test_http_errors import assert_error

# One worker per module under xdist: its live server is started once.
pytestmark = pytest.mark.xdist_group("test_http_load")


def wait_until(predicate, timeout_s: float) -> float:
    """Seconds until `predicate()` held; fails after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - start


def engine_is_idle(live) -> bool:
    stats = live.state.async_engine.stats()
    return (stats.num_running == 0 and stats.num_waiting == 0
            and stats.num_free_blocks == stats.num_total_blocks)


def engine_is_running(live) -> bool:
    return live.state.async_engine.stats().num_running > 0


LONG = {"inputs": "Count:", "parameters": {"max_new_tokens": 1500, "ignore_eos_token": True}}


@contextlib.contextmanager
def server_full(live):
    """Every admission slot held by a long stream until the block ends; then waits for the engine
    to be idle again."""
    readers = []  # kept referenced: a collected line iterator closes its connection
    with contextlib.ExitStack() as held, httpx.Client(timeout=60) as http:
        for _ in range(live.state.config.max_in_flight):
            response = held.enter_context(http.stream("POST", live.prefix() + "/generate_stream",
                                                      json=LONG, headers=live.headers()))
            readers.append(response.iter_lines())
            assert next(readers[-1]).startswith("data:")
        assert live.state.admission.num_in_flight == live.state.config.max_in_flight
        yield
    wait_until(lambda: engine_is_idle(live), 10)


def test_burst_past_the_bound_gets_429_at_once(live) -> None:
    async def one(client: httpx.AsyncClient) -> tuple[int, str | None, float]:
        start = time.monotonic()
        response = await client.post(live.prefix() + "/generate", headers=live.headers(), json={
            "inputs": "Tell me a story", "parameters": {"max_new_tokens": 24, "ignore_eos_token": True}})
        return response.status_code, response.headers.get("retry-after"), time.monotonic() - start

    async def burst() -> list[tuple[int, str | None, float]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=20)) as client:
            return await asyncio.gather(*(one(client) for _ in range(12)))

    results = asyncio.run(burst())
    statuses = sorted(status for status, _, _ in results)
    assert set(statuses) == {200, 429} and statuses.count(200) >= 4, statuses
    slowest_ok = max(elapsed for status, _, elapsed in results if status == 200)
    for status, retry_after, elapsed in results:
        if status == 429:
            assert retry_after == "1" and elapsed < slowest_ok / 2
    wait_until(lambda: engine_is_idle(live), 10)


def test_stream_disconnect_aborts_and_frees_blocks(live) -> None:
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", live.prefix() + "/generate_stream", json=LONG,
                           headers=live.headers()) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data:")
            assert engine_is_running(live)
    # 1500 tokens take tens of seconds; the abort must be immediate.
    assert wait_until(lambda: engine_is_idle(live), 5) < 5
    assert live.state.admission.num_in_flight == 0


def test_non_stream_disconnect_aborts_and_frees_blocks(live) -> None:
    body = httpx.Request("POST", live.prefix() + "/generate", json=LONG, headers=live.headers())
    raw = (f"POST {body.url.raw_path.decode()} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
           + "".join(f"{k}: {v}\r\n" for k, v in body.headers.items() if k.lower() != "host")
           + "\r\n").encode() + body.read()
    before = _metric(live, "lora_client_disconnects_total")
    with socket.create_connection((body.url.host, body.url.port)) as connection:
        connection.sendall(raw)
        wait_until(lambda: engine_is_running(live), 10)
    assert wait_until(lambda: engine_is_idle(live), 5) < 5
    wait_until(lambda: _metric(live, "lora_client_disconnects_total") == before + 1, 5)
    assert live.state.admission.num_in_flight == 0


def _metric(live, name: str) -> float:
    text = httpx.get(live.base_url + "/metrics", headers=live.headers()).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_body_over_the_limit_is_413_before_it_is_read(live) -> None:
    big = {"inputs": "x" * (20 * 1024)}
    response = httpx.post(live.prefix() + "/generate", json=big, headers=live.headers())
    assert_error(response, 413, "payload_too_large")

    def chunks():  # no Content-Length: refused once the limit is passed
        for _ in range(64):
            yield b"x" * 1024

    response = httpx.post(live.prefix() + "/generate", content=chunks(),
                          headers={**live.headers(), "Content-Type": "application/json"})
    assert_error(response, 413, "payload_too_large")


def test_metrics_report_requests_tokens_and_engine_figures(live) -> None:
    response = httpx.post(live.prefix() + "/generate", headers=live.headers(),
                          json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}}, timeout=60)
    assert response.status_code == 200
    text = httpx.get(live.base_url + "/metrics", headers=live.headers()).text
    assert 'lora_requests_total{route="generate",status="200"}' in text
    generated = _metric(live, "lora_generated_tokens_total")
    assert generated >= 3
    streamed = httpx.post(live.prefix() + "/generate_stream", headers=live.headers(),
                          json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}}, timeout=60)
    assert streamed.status_code == 200
    assert _metric(live, "lora_generated_tokens_total") == generated + 3
    stats = live.state.async_engine.stats()
    assert _metric(live, "lora_engine_num_total_blocks") == stats.num_total_blocks
    assert "lora_time_to_first_token_seconds_bucket" in text
    assert _metric(live, "lora_requests_in_flight") == 0
