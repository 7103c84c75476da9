"""Server lifecycle: SSE keep-alives during silence; graceful shutdown (new requests get 503
shutting_down, in-flight ones finish within the deadline, past it they are cancelled and freed)."""
from __future__ import annotations

import pytest

import json
import threading
import time

import httpx

from tests.server.live import start_live_server
from tests.server.test_http_errors import assert_error
from tests.server.test_http_load import engine_is_running, wait_until

# One worker per module under xdist: its live server is started once.
pytestmark = pytest.mark.xdist_group("test_lifecycle")


def stream_in_background(live, max_new_tokens: int) -> tuple[threading.Thread, list[dict]]:
    events: list[dict] = []

    def read() -> None:
        body = {"inputs": "Count:", "parameters": {"max_new_tokens": max_new_tokens,
                                                   "ignore_eos_token": True}}
        try:
            with httpx.stream("POST", live.prefix() + "/generate_stream", json=body,
                              headers=live.headers(), timeout=120) as response:
                events.extend(json.loads(line[5:]) for line in response.iter_lines()
                              if line.startswith("data:"))
        except httpx.HTTPError:
            events.append({"transport_error": True})

    thread = threading.Thread(target=read)
    thread.start()
    wait_until(lambda: engine_is_running(live), 30)
    return thread, events


def engine_is_empty(engine) -> bool:
    return (not engine.has_unfinished_requests()
            and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks)


def test_drain_refuses_new_requests_and_finishes_those_in_flight(engine, tmp_path) -> None:
    live = start_live_server(engine, tmp_path, shutdown_deadline_s=60)
    reader, events = stream_in_background(live, 40)
    live.state.admission.begin_draining()  # what the exit signal does first
    refused = httpx.post(live.prefix() + "/generate", headers=live.headers(),
                         json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert_error(refused, 503, "shutting_down")
    assert_error(httpx.get(live.base_url + "/health"), 503, "healthcheck")
    live.stop()
    reader.join(30)
    assert len(events) == 40 and events[-1]["details"] is None and events[-1]["generated_text"]
    assert engine_is_empty(engine)


def test_requests_past_the_deadline_end_with_an_error_event_and_are_freed(engine, tmp_path) -> None:
    live = start_live_server(engine, tmp_path, shutdown_deadline_s=1)
    reader, events = stream_in_background(live, 1500)
    started = time.monotonic()
    live.stop(timeout_s=30)
    assert time.monotonic() - started < 15
    reader.join(30)
    assert not reader.is_alive()
    assert not any(event.get("generated_text") for event in events)
    assert events[-1]["error_type"] == "incomplete_generation" and "token" not in events[-1]
    assert engine_is_empty(engine)


def test_silence_gets_keepalive_comments_between_events(engine, tmp_path) -> None:
    live = start_live_server(engine, tmp_path, keepalive_s=0.005)
    try:
        with httpx.stream("POST", live.prefix() + "/generate_stream", headers=live.headers(), timeout=60,
                          json={"inputs": "Count:", "parameters": {"max_new_tokens": 6}}) as response:
            raw = response.read()
    finally:
        live.stop()
    blocks = raw[:-2].split(b"\n\n")
    assert b":" in blocks, "no keep-alive comment was sent"
    events = [json.loads(block[5:]) for block in blocks if block != b":"]
    assert all(block == b":" or block.startswith(b"data:") for block in blocks)
    assert len(events) == 6 and events[-1]["generated_text"] is not None
