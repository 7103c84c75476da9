"""Clients that leave: a streamed or plain request is aborted at the next step, also during a long
prompt's prefill (whose steps are chunks of bounded work), and is counted and logged the same way on
both routes, its generated tokens included."""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import httpx
import pytest

from lora_runtime.core import Request
from tests.server.test_http_load import LONG, _metric, engine_is_idle, wait_until

# One worker per module under xdist: its live server is started once.
pytestmark = pytest.mark.xdist_group("test_abort")

DISCONNECTS = "lora_client_disconnects_total"
GENERATED = "lora_generated_tokens_total"


def send_and_keep_open(live, route: str, body: dict) -> socket.socket:
    """Send one request on a raw connection, which the caller closes to leave at any moment (an
    httpx stream cannot leave before the response headers arrive)."""
    request = httpx.Request("POST", live.prefix() + route, json=body, headers=live.headers())
    head = (f"POST {request.url.raw_path.decode()} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in request.headers.items() if k.lower() != "host")
            + "\r\n")
    connection = socket.create_connection((request.url.host, request.url.port))
    connection.sendall(head.encode() + request.read())
    return connection


def running_request(live, predicate: Callable[[Request], bool], timeout_s: float = 30) -> Request:
    """A running request of the engine for which `predicate` holds, once there is one."""
    scheduler = live.state.async_engine.engine.scheduler
    found: list[Request] = []

    def check() -> bool:
        found[:] = [r for r in list(scheduler.running) if predicate(r)]
        return bool(found)

    wait_until(check, timeout_s)
    return found[0]


def disconnect_logged(caplog: pytest.LogCaptureFixture, route: str, request_id: str) -> bool:
    return any("client disconnected" in record.getMessage() and route in record.getMessage()
               and request_id in record.getMessage() for record in caplog.records)


def test_stream_disconnect_is_counted_logged_and_its_tokens_kept(live, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="server.serving")
    disconnects, generated = _metric(live, DISCONNECTS), _metric(live, GENERATED)
    with httpx.stream("POST", live.prefix() + "/generate_stream", json=LONG, headers=live.headers(),
                      timeout=60) as response:
        data = (line for line in response.iter_lines() if line.startswith("data:"))
        num_received = sum(1 for _ in zip(range(3), data))
        request = running_request(live, lambda r: True)
    wait_until(lambda: _metric(live, DISCONNECTS) == disconnects + 1, 5)
    wait_until(lambda: engine_is_idle(live), 5)
    num_counted = _metric(live, GENERATED) - generated
    assert num_received == 3 and 3 <= num_counted <= len(request.output_token_ids) < 1500
    assert disconnect_logged(caplog, "/generate_stream", request.request_id)


def test_plain_disconnect_is_counted_logged_and_its_tokens_kept(live, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="server.serving")
    disconnects, generated = _metric(live, DISCONNECTS), _metric(live, GENERATED)
    with send_and_keep_open(live, "/generate", LONG):
        # A fourth token means the step that made the third one has been handed to the server.
        request = running_request(live, lambda r: len(r.output_token_ids) >= 4)
    wait_until(lambda: _metric(live, DISCONNECTS) == disconnects + 1, 5)
    wait_until(lambda: engine_is_idle(live), 5)
    num_counted = _metric(live, GENERATED) - generated
    assert 3 <= num_counted <= len(request.output_token_ids) < 1500
    assert disconnect_logged(caplog, "/generate", request.request_id)


@pytest.mark.parametrize("route", ["/generate_stream", "/generate"])
def test_disconnect_during_a_long_prefill_stops_it_at_the_next_chunk(live, route: str) -> None:
    """A client leaving mid-prefill: the step in flight ends, no further chunk runs (two at most,
    if the step boundary falls while the server notices), and the abort is counted."""
    config = live.state.async_engine.engine.config.scheduler
    body = {"inputs": " hello" * 2000, "parameters": {"max_new_tokens": 4}}
    disconnects = _metric(live, DISCONNECTS)
    with send_and_keep_open(live, route, body):
        request = running_request(live, lambda r: r.num_computed_tokens > 0)
        num_computed_at_close = request.num_computed_tokens
    wait_until(lambda: engine_is_idle(live), 5)
    # A chunk holds at most max_prefill_chunk_work tokens: each token is at least one unit of work.
    assert request.num_computed_tokens <= num_computed_at_close + 2 * config.max_prefill_chunk_work
    assert request.num_computed_tokens < request.num_prompt_tokens and not request.output_token_ids
    wait_until(lambda: _metric(live, DISCONNECTS) == disconnects + 1, 5)
